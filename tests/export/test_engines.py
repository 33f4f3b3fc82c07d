"""Each engine constraint (DESIGN.md section 6), violated, gives its message; takeable settings give none."""

import pytest

from ssmquant.calibrate import Setting
from ssmquant.export import TARGETS, UnknownTargetError, check_target, takeable_by_any, violations


def rules(target, name, kind="mamba2", draft=None):
    return {r: m for r, m in violations(target, Setting.parse(name), kind, draft)}


@pytest.mark.parametrize(
    "target, name",
    [
        ("vllm", "fp16@conventional"),
        ("vllm", "int8@replay16"),
        ("vllm", "fp8_e4m3@replay8"),
        ("vllm", "bf16@replay32"),  # float replay runs on vLLM's Triton backend
        ("vllm", "fp16:sr@replay16"),
        ("trtllm", "bf16@conventional"),
        ("trtllm", "fp16:sr@replay16"),
        ("flashinfer", "fp8_e4m3:sr@replay16"),
        ("flashinfer", "int8@spec16x4"),
        ("flashinfer", "fp32@conventional"),
    ],
)
def test_takeable_settings(target, name):
    assert violations(target, Setting.parse(name), "mamba2") == []


@pytest.mark.parametrize("target", TARGETS)
def test_no_engine_takes_nvfp4_static_scales_or_grouped_scales(target):
    assert "no engine stores NVFP4 SSM state" in rules(target, "nvfp4@replay16")["nvfp4"]
    assert (
        "no engine takes static (calibrated) SSM-state scales" in rules(target, "int8:static[mse]@replay16")["static"]
    )
    assert "FlashInfer's state_scale is one FP32 scale per row" in rules(target, "int8:head@replay16")["granularity"]


def test_trtllm_has_no_knob_for_8bit_state():
    m = rules("trtllm", "int8@replay16")["dtype"]
    assert "no config knob" in m and "auto, float32, float16, bfloat16" in m


@pytest.mark.parametrize("target", ["vllm", "flashinfer"])
def test_8bit_state_only_through_flashinfer_replayssm(target):
    m = rules(target, "fp8_e4m3@conventional")["8bit_replay"]
    assert "only in FlashInfer's ReplaySSM kernel" in m
    if target == "vllm":
        assert "--mamba-backend flashinfer --use-replayssm" in m


@pytest.mark.parametrize("target, name", [("flashinfer", "fp16@replay32"), ("vllm", "int8@replay32")])
def test_flashinfer_buffer_length_at_most_16(target, name):
    assert "FlashInfer buffer length must be <= 16" in rules(target, name)["buffer_len"]


def test_trtllm_replay_history_fixed_at_16():
    assert "fixed at 16 tokens" in rules("trtllm", "fp16@replay8")["buffer_len"]
    assert "buffer_len" not in rules("trtllm", "fp16@replay16")


@pytest.mark.parametrize("target", ["vllm", "flashinfer"])
def test_speculative_replay_needs_room_for_the_drafts(target):
    m = rules(target, "fp16@replay4", draft=4)["spec_buffer"]
    assert m == "speculative replay needs buffer length >= 1 + draft tokens: L=4, T=4"
    assert "spec_buffer" not in rules(target, "fp16@replay8", draft=4)
    assert "spec_buffer" not in rules(target, "fp16@spec8x4")  # the scheme's own drafts fit
    assert "L=8, T=8" in rules(target, "fp16@spec8x4", draft=8)["spec_buffer"]  # deployment drafts override


def test_trtllm_speculative_replay_with_fixed_history():
    assert "L=16, T=16" in rules("trtllm", "fp16@replay16", draft=16)["spec_buffer"]


@pytest.mark.parametrize("target, knob", [("trtllm", "mamba_ssm_stochastic_rounding"), ("vllm", "stochastic-rounding")])
def test_stochastic_rounding_needs_fp16_state(target, knob):
    m = rules(target, "bf16:sr@conventional")["sr"]
    assert "only when writing an fp16 SSM state" in m and knob in m
    assert "sr" not in rules(target, "fp16:sr@conventional")


def test_gdn_layers():
    assert "Mamba-2 kernels" in rules("flashinfer", "fp16@conventional", kind="gdn")["layer_kind"]
    assert "ReplaySSM covers Mamba-2 layers only" in rules("vllm", "fp16@replay16", kind="gdn")["layer_kind"]
    assert "dtype" in rules("vllm", "int8@replay16", kind="gdn")
    assert violations("vllm", Setting.parse("bf16@conventional"), "gdn") == []
    assert takeable_by_any(Setting.parse("fp16@conventional"), "gdn")
    assert not takeable_by_any(Setting.parse("int8@replay16"), "gdn")


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(
        UnknownTargetError, match="unknown export target 'sglang'; known targets: vllm, trtllm, flashinfer"
    ):
        check_target("sglang")


# --- Kimi Delta Attention (GLM-5.3-Flash, Kimi-Linear, Kimi-K3) ----------------------------------------


@pytest.mark.parametrize(
    "target, name",
    [
        ("vllm", "fp32@conventional"),
        ("vllm", "fp32@spec5x4:fp32"),  # RecoverSSM: a window of 1 + draft tokens, u recorded in FP32
        ("trtllm", "fp32@conventional"),
        ("flashinfer", "bf16@conventional"),
        ("flashinfer", "bf16@spec16x4"),
    ],
)
def test_kda_takeable_settings(target, name):
    assert violations(target, Setting.parse(name), "kda") == []


@pytest.mark.parametrize(
    "target, name, needle",
    [
        ("vllm", "bf16@conventional", "vLLM keeps KDA state in fp32 only (MambaStateDtypeCalculator.kda_state_dtype"),
        ("trtllm", "bf16@conventional", "TensorRT-LLM keeps KDA state in fp32 only"),
        ("flashinfer", "fp32@conventional", "FlashInfer keeps KDA state in bf16 only"),
    ],
)
def test_kda_state_dtype_of_each_engine(target, name, needle):
    assert needle in rules(target, name, "kda")["dtype"]


def test_kda_replay_is_speculative_recoverssm_in_vllm_only():
    assert "RecoverSSM" in rules("vllm", "fp32@replay16:fp32", "kda")["layer_kind"]
    assert "spec5x4" in rules("vllm", "fp32@spec8x4:fp32", "kda")["layer_kind"]
    assert "records u_t in FP32" in rules("vllm", "fp32@spec5x4", "kda")["layer_kind"]
    assert "deferred state promotion" in rules("trtllm", "fp32@spec5x4:fp32", "kda")["layer_kind"]
    assert "kda_wy_output_only only" in rules("flashinfer", "bf16@replay16", "kda")["layer_kind"]
    assert not takeable_by_any(Setting.parse("fp8_e4m3@replay16"), "kda")
