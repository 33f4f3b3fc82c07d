"""SGLang as an export target: its rules per layer kind (facts sglang.*, read in the sglang 0.5.23 wheel) and the
files the export writes for it."""

import json

import pytest

from ssmquant.calibrate import Setting, write_recipe
from ssmquant.engines.facts import FACTS
from ssmquant.export import ExportError, Target, engine_bytes, export, runtime, violations
from ssmquant.export.profile import target_profile
from ssmquant.kinds import LayerDims

from ..calibrate.helpers import tiny_calibration

NANO = LayerDims("mamba2", 64, 64, 128, 8)
QWEN = LayerDims("gdn", 32, 128, 128, 16)
GLM = LayerDims("kda", 64, 128, 128, 64)


def sglang(dims, drafts=None, gpu=90):
    return Target.make("sglang", None, gpu, drafts, dims)


def rules(t, name, kind):
    return {v.rule: v for v in violations(t, Setting.parse(name), kind)}


def test_sglang_stores_float_states_only_and_names_its_flag():
    """sglang.state_dtype: `--mamba-ssm-dtype` choices=["float32", "bfloat16", "float16"]."""
    for kind, dims in (("mamba2", NANO), ("gdn", QWEN), ("kda", GLM)):
        for enc in ("fp32", "bf16", "fp16"):
            assert rules(sglang(dims), f"{enc}@conventional", kind) == {}
        found = rules(sglang(dims), "int8@conventional", kind)
        assert found["dtype"].fact == "sglang.state_dtype" and "no int8 live SSM state" in found["dtype"].message
        assert "stores no NVFP4" in rules(sglang(dims), "nvfp4@conventional", kind)["nvfp4"].message


def test_sglang_rounds_stochastically_into_fp16_mamba2_state_only():
    """sglang.sr ("requires --mamba-ssm-dtype float16"), sglang.sr_mamba_only; the export runs Mamba-2 on the
    FlashInfer backend, which needs no SM 10.x for stochastic rounding (sglang.sr_triton_sm100 is Triton's)."""
    assert rules(sglang(NANO), "fp16:sr@conventional", "mamba2") == {}
    assert rules(sglang(NANO), "bf16:sr@conventional", "mamba2")["sr"].fact == "sglang.sr"
    assert (
        "requires --mamba-ssm-dtype float16, got 'bfloat16'."
        in rules(sglang(NANO), "bf16:sr@conventional", "mamba2")["sr"].message
    )
    assert rules(sglang(QWEN), "fp16:sr@conventional", "gdn")["sr"].fact == "sglang.sr_mamba_only"
    assert rules(sglang(NANO, gpu=75), "fp16@conventional", "mamba2")["gpu"].fact == "flashinfer.sm80"


def test_sglang_replays_gdn_and_kda_with_a_ring_in_the_state_dtype_and_not_mamba2():
    """sglang.linear_replayssm: --enable-linear-replayssm, L = --linear-replayssm-cache-len, the ring in the SSM
    dtype, GDN / KDA only."""
    assert rules(sglang(NANO), "bf16@replay16", "mamba2")["layer_kind"].fact == "sglang.linear_replayssm"
    for kind, dims in (("gdn", QWEN), ("kda", GLM)):
        assert rules(sglang(dims), "bf16@replay16", kind) == {}  # a bf16 ring, as measured
        assert rules(sglang(dims), "fp32@replay16:fp32", kind) == {}
        assert "buffer_dtype" in rules(sglang(dims), "fp32@replay16", kind)  # measured with a bf16 ring
        rt = runtime(sglang(dims), Setting.parse("bf16@replay8"), kind)
        assert rt.backend == "triton.replayssm" and rt.window == rt.ring_rows == 8
        assert "scheme" in rules(sglang(dims, drafts=3), "bf16@replay16", kind)  # drafts: the fold-every-commit verify


def test_sglang_speculative_verify_folds_into_a_float32_checkpoint():
    """sglang.linear_replayssm_spec: a float32 state; KDA's ring a power of two >= 2 x the verify window;
    sglang.spec_states: no intermediate states under it, 1 + drafts of them (plus the live one) without it."""
    t = sglang(QWEN, drafts=3)
    assert rules(t, "fp32@spec16x3", "gdn") == {}
    assert rules(t, "bf16@spec16x3", "gdn")["dtype"].fact == "sglang.linear_replayssm_spec"
    rt = runtime(t, Setting.parse("fp32@spec16x3"), "gdn")
    assert rt.backend == "triton.replayssm_spec" and rt.state_copies == 1
    conv = runtime(t, Setting.parse("fp32@conventional"), "gdn")
    assert conv.state_copies == 2 + 3 and "sglang.spec_states" in conv.facts
    per_state = QWEN.heads * QWEN.rows * QWEN.state_dim * 4
    assert engine_bytes(t, Setting.parse("fp32@conventional"), "gdn", QWEN, conv)["state"] == 5 * per_state
    assert rules(sglang(GLM, drafts=3), "fp32@spec4x3", "kda")["spec_buffer"].fact == "sglang.linear_replayssm_spec"
    assert rules(sglang(GLM, drafts=3), "fp32@spec12x3", "kda")["spec_buffer"]  # not a power of two
    assert rules(sglang(GLM, drafts=3), "fp32@spec16x3", "kda") == {}


def test_sglang_mamba2_runs_the_flashinfer_kernel_the_profile_emulates():
    """sglang.mamba_backend: the export pins --mamba-backend flashinfer, FlashInfer's selective_state_update, which
    the sglang profile computes as the flashinfer profile does; GDN / KDA on SGLang's Triton decode: the sglang
    profile too (fla's fused recurrent arithmetic, the ideal recurrence)."""

    class Plan:
        target = "sglang"

    plan = Plan()
    plan.setting = Setting.parse("bf16@conventional")
    plan.runtime = runtime(sglang(NANO), plan.setting, "mamba2")
    assert target_profile(plan, "mamba2", (64, 64, 128)) == ("sglang", "")
    plan.runtime = runtime(sglang(QWEN), plan.setting, "gdn")
    assert target_profile(plan, "gdn", (32, 128, 128)) == ("sglang", "")


@pytest.fixture(scope="module")
def gdn_recipe(tmp_path_factory):
    r = tiny_calibration("gdn", budget=0.05, candidates=["fp16", "bf16"], schemes=["conventional", "replay8"],
                         calibration=["none"], engine_fallbacks=[], rows=128, state=128)  # fmt: skip
    return write_recipe(r, tmp_path_factory.mktemp("sglang") / "recipe")


def test_sglang_export_writes_the_server_command(gdn_recipe, tmp_path):
    res = export(gdn_recipe, "sglang", tmp_path / "out", gpu="sm90")
    assert sorted(res.files) == ["EXPORT.md", "export_report.json", "sglang_flags.txt", "sglang_serve.sh"]
    sh = (res.out_dir / "sglang_serve.sh").read_text()
    dtype = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[res.plan.setting.encoding]
    assert 'python -m sglang.launch_server --model-path "${MODEL:?set MODEL to the checkpoint}"' in sh
    assert f"--mamba-ssm-dtype {dtype}" in sh and "--linear-attn-decode-backend triton" in sh
    flags = (res.out_dir / "sglang_flags.txt").read_text().split()
    if res.plan.setting.scheme_kind == "replay":
        assert "--enable-linear-replayssm" in flags and flags[flags.index("--linear-replayssm-cache-len") + 1] == "8"
    md = (res.out_dir / "EXPORT.md").read_text()
    assert "SGLANG_MAMBA_SSM_DTYPE" in md and "Checked for **SGLang 0.5.23 on sm90**" in md
    report = json.loads((res.out_dir / "export_report.json").read_text())
    assert report["engine_bytes_per_sequence"]["state_copies"] == 1
    assert FACTS["sglang.state_dtype"].says in md and FACTS["sglang.dtype_order"].says in md


def test_sglang_export_with_drafts_writes_the_speculative_flags(tmp_path):
    r = tiny_calibration("gdn", budget=1.0, candidates=["fp32"], schemes=["spec16x3"], calibration=["none"],
                         engine_fallbacks=[], rows=128, state=128)  # fmt: skip
    rec = write_recipe(r, tmp_path / "recipe")
    with pytest.raises(ExportError, match="pass --speculative-method \\(mtp, ngram, eagle, eagle3, draft_model\\)"):
        export(rec, "sglang", tmp_path / "a", gpu="sm90")
    res = export(rec, "sglang", tmp_path / "b", gpu="sm90", speculative_method="mtp")
    flags = (res.out_dir / "sglang_flags.txt").read_text().split()
    assert "--enable-linear-replayssm-spec" in flags and "--mamba-ssm-dtype" in flags
    pairs = dict(zip(flags[::1], flags[1::1]))
    assert pairs["--speculative-algorithm"] == "NEXTN" and pairs["--speculative-num-steps"] == "3"
    assert pairs["--speculative-eagle-topk"] == "1" and pairs["--speculative-num-draft-tokens"] == "4"


def test_sglang_replay_and_ngram_exports_carry_the_flags_sglang_resolves_them_with(tmp_path):
    """sglang.linear_replayssm: ReplaySSM needs --mamba-radix-cache-strategy no_buffer, which needs the overlap
    schedule off (auto resolves to extra_buffer under the default overlap schedule); sglang.spec_algorithm: NGRAM
    takes its tree breadth from --speculative-ngram-max-bfs-breadth, 1 for a chain. (SGLang's own hooks judge the
    same flags in tests/export/test_sglang_oracle.py.)"""
    r = tiny_calibration("gdn", budget=1.0, candidates=["bf16"], schemes=["replay8"], calibration=["none"],
                         engine_fallbacks=[], rows=128, state=128)  # fmt: skip
    res = export(write_recipe(r, tmp_path / "replay"), "sglang", tmp_path / "a", gpu="sm90")
    flags = (res.out_dir / "sglang_flags.txt").read_text().split()
    assert (
        flags[flags.index("--mamba-radix-cache-strategy") + 1] == "no_buffer" and "--disable-overlap-schedule" in flags
    )
    r = tiny_calibration("gdn", budget=1.0, candidates=["fp32"], schemes=["spec16x3"], calibration=["none"],
                         engine_fallbacks=[], rows=128, state=128)  # fmt: skip
    res = export(write_recipe(r, tmp_path / "spec"), "sglang", tmp_path / "b", gpu="sm90", speculative_method="ngram")
    flags = (res.out_dir / "sglang_flags.txt").read_text().split()
    assert flags[flags.index("--speculative-algorithm") + 1] == "NGRAM"
    assert flags[flags.index("--speculative-ngram-max-bfs-breadth") + 1] == "1"
