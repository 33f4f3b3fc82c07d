"""Engine rules: each test names the engine fact it encodes (facts.py cites where it was read).

The fixes of issue 13 are marked "fix N". Layer sizes are Nemotron-3-Nano's (64 heads x 64 x 128, 8 groups)
unless a test is about sizes.
"""

import pytest

from ssmquant.calibrate import Setting
from ssmquant.engines.facts import DEFAULT_VERSION, VLLM_PR_BUILD, parse_gpu, resolve_gpu
from ssmquant.export import (
    FACTS,
    TARGETS,
    VERSIONS,
    EngineVersionError,
    Target,
    UnknownTargetError,
    check_target,
    deployments,
    describe_deployments,
    engine_bytes,
    runtime,
    takeable_by_any,
    violations,
)
from ssmquant.kinds import LayerDims

NANO = LayerDims("mamba2", 64, 64, 128, 8)
QWEN = LayerDims("gdn", 32, 128, 128, 16)


def target(engine, version=None, gpu=90, drafts=None, dims=NANO):
    return Target.make(engine, version, gpu, drafts, dims)


def rules(tgt, name, kind="mamba2"):
    return {v.rule: v.message for v in violations(tgt, Setting.parse(name), kind)}


def ok(tgt, name, kind="mamba2"):
    return violations(tgt, Setting.parse(name), kind) == []


# -- facts as data ---------------------------------------------------------------------------------------
def test_every_fact_has_a_source_and_a_range_inside_the_versions_read():
    for f in FACTS.values():
        assert f.engine in TARGETS and f.sources and f.says
        order = VERSIONS[f.engine]
        assert f.since is None or f.since in order, f.id
        assert f.until is None or f.until in order, f.id
        assert any(f.holds(v) for v in order), f.id  # a fact that holds nowhere is dead data
        assert f.cite().startswith("[") and f.sources[0].repo in f.cite()


def test_versions_default_to_the_newest_release_never_to_a_build():
    assert DEFAULT_VERSION["vllm"] == "0.34.0" and VERSIONS["vllm"][-1] == VLLM_PR_BUILD
    assert target("vllm").version == "0.34.0" and target("vllm").build is None
    assert "#52962" in target("vllm", VLLM_PR_BUILD).build.label("vllm")
    with pytest.raises(EngineVersionError, match=r"vLLM version '0.25.1' is not covered.*accepted: 0.25.0, 0.26.0"):
        target("vllm", "0.25.1")


def test_gpu_is_a_compute_capability():
    assert parse_gpu("sm90") == 90 and parse_gpu("sm_100a") == 100 and parse_gpu("SM120") == 120
    with pytest.raises(EngineVersionError, match="unknown GPU 'h100'; give its compute capability as smXY"):
        parse_gpu("h100")
    cc, note = resolve_gpu(None)
    assert (note is None) or (cc == 90 and "checked for sm90" in note) or note.startswith("checked for the local GPU")


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(UnknownTargetError, match="unknown export target 'tgi'; known targets: vllm, trtllm, flashinfer, sglang"):
        check_target("tgi")


@pytest.mark.parametrize("engine", TARGETS)
def test_no_engine_takes_nvfp4_static_scales_or_grouped_scales(engine):
    t = target(engine, VLLM_PR_BUILD if engine == "vllm" else None)
    assert "stores no NVFP4 SSM state" in rules(t, "nvfp4@replay16")["nvfp4"]
    assert "takes no static (calibrated) SSM-state scales" in rules(t, "int8:static[mse]@replay16")["static"]
    if engine in ("vllm", "flashinfer"):  # TensorRT-LLM and SGLang refuse the 8-bit dtype itself
        assert "one FP32 value per row" in rules(t, "int8:head@replay16")["granularity"]
    else:
        assert "int8" in rules(t, "int8:head@replay16")["dtype"]


# -- fix 1: TensorRT-LLM replay ---------------------------------------------------------------------------
def test_fix1_trtllm_replays_only_with_speculative_decoding():
    """trtllm.replay_spec_only: "Replay kernel requires speculative decoding; using non-replay path"."""
    m = rules(target("trtllm"), "fp16@replay16")["scheme"]
    assert "Replay kernel requires speculative decoding; using non-replay path" in m
    assert ok(target("trtllm"), "fp16@conventional")


def test_fix1_trtllm_replay_history_is_max_16_or_tokens_per_step():
    """trtllm.replay_history: history = max(16, 1 + draft tokens), so the draft count is not capped at 15."""
    assert ok(target("trtllm"), "fp16@spec16x4")
    assert ok(target("trtllm"), "fp16@spec21x20")  # 20 drafts: history 21
    m = rules(target("trtllm", drafts=20), "fp16@spec16x3")["buffer_len"]  # the deployment drafts 20
    assert "max(16, 1 + 20) = 21 tokens; the setting uses L=16" in m
    assert "max(16, 1 + 3) = 16" in rules(target("trtllm", drafts=3), "fp16@replay8")["buffer_len"]


def test_fix1_trtllm_only_zero_disables_replay():
    """trtllm.replay_gates: TRTLLM_USE_MAMBA_REPLAY defaults to "1"; conventional under drafts needs "0"."""
    conv = Setting.parse("bf16@conventional")
    assert runtime(target("trtllm", drafts=3), conv, "mamba2").env == {"TRTLLM_USE_MAMBA_REPLAY": "0"}
    assert runtime(target("trtllm"), conv, "mamba2").env == {}  # no drafts: replay never runs
    rt = runtime(target("trtllm"), Setting.parse("bf16@spec16x3"), "mamba2")
    assert rt.env == {"TRTLLM_USE_MAMBA_REPLAY": "1"} and (rt.window, rt.ring_rows, rt.tokens) == (16, 32, 4)
    # GDN replay is opt-in ("TRTLLM_USE_GDN_REPLAY=1 enables it; unset means off", issue 26.6): nothing to turn off
    gdn = runtime(target("trtllm", drafts=2, dims=QWEN), conv, "gdn")
    assert gdn.env == {} and "opt-in" in FACTS["trtllm.gdn_replay"].says


def test_fix1_trtllm_fp16_stochastic_rounding_keeps_replay_only_on_sm100_to_119():
    """trtllm.replay_sr_sm: "Replay kernel Philox requires 100 <= sm < 120"; sm80 is the replay floor."""
    name = "fp16:sr@spec16x3"
    assert "turns replay off for float16 + stochastic rounding" in rules(target("trtllm", gpu=90), name)["gpu"]
    assert ok(target("trtllm", gpu=100), name) and ok(target("trtllm", gpu=103), name)
    assert "gpu" in rules(target("trtllm", gpu=120), name)
    assert ok(target("trtllm", gpu=90), "fp16:sr@conventional")
    assert "replays on SM >= 80 only" in rules(target("trtllm", gpu=75), "bf16@spec16x3")["gpu"]


def test_trtllm_gdn_replay_is_exported_behind_its_variable():
    """trtllm.gdn_replay (TensorRT-LLM main 3f4f808 fla/cache_manager.py, replay.py): GDN MTP replay with
    TRTLLM_USE_GDN_REPLAY=1, speculative decoding only, at most 8 tokens per step, the 16-token history and
    flush rule of the Mamba-2 replay (trtllm.replay_history), SM >= 80; a conventional GDN export leaves it unset."""
    t = target("trtllm", dims=QWEN)
    assert ok(t, "bf16@spec16x3", "gdn")
    rt = runtime(t, Setting.parse("bf16@spec16x3"), "gdn")
    assert (rt.backend, rt.window, rt.ring_rows, rt.env) == ("replay", 16, 32, {"TRTLLM_USE_GDN_REPLAY": "1"})
    assert rt.facts[:2] == ["trtllm.gdn_replay", "trtllm.replay_history"]
    assert runtime(t, Setting.parse("bf16@conventional"), "gdn").env == {}
    assert "requires speculative decoding" in rules(target("trtllm", drafts=0, dims=QWEN), "bf16@replay16", "gdn")["scheme"]
    assert "at most 8 tokens per step, not 1 + 8" in rules(target("trtllm", drafts=8, dims=QWEN), "bf16@replay16", "gdn")["draft_tokens"]
    assert "max(16, 1 + 3) = 16" in rules(target("trtllm", drafts=3, dims=QWEN), "bf16@replay8", "gdn")["buffer_len"]
    assert "SM >= 80" in rules(target("trtllm", gpu=75, dims=QWEN), "bf16@spec16x3", "gdn")["gpu"]


def test_trtllm_has_no_knob_for_8bit_state_and_rounds_only_fp16():
    """trtllm.state_dtype / trtllm.sr: Literal["auto", "float16", "bfloat16", "float32"]; SR float16 only."""
    m = rules(target("trtllm"), "int8@spec16x3")["dtype"]
    assert 'Literal["auto", "float16", "bfloat16", "float32"]' in m
    assert "Only applicable with float16 cache dtype" in rules(target("trtllm"), "bf16:sr@conventional")["sr"]


# -- fix 2: vLLM 8-bit state ------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.25.0", "0.30.0", "0.33.0"])
def test_fix2_vllm_releases_reject_8bit_state_at_argument_parsing(version):
    """vllm.state_dtype: MambaDType = auto|float32|float16|bfloat16; int8 fails argument parsing."""
    r = rules(target("vllm", version), "fp8_e4m3@replay16")
    assert "invalid choice: 'fp8_e4m3' (choose from 'auto', 'bfloat16', 'float16', 'float32')" in r["dtype"]
    assert f"--engine-version {VLLM_PR_BUILD}" in r["unreleased"] and "#52962" in r["unreleased"]


def test_fix2_vllm_pr_build_takes_8bit_only_under_flashinfer_replay():
    """vllm.pr_8bit: INT8 / FP8 E4M3 under FlashInfer ReplaySSM only (open PR #52962)."""
    t = target("vllm", VLLM_PR_BUILD)
    assert ok(t, "int8@replay16") and ok(t, "fp8_e4m3:sr@replay16")
    assert runtime(t, Setting.parse("int8@replay16"), "mamba2").backend == "flashinfer"
    assert "only under FlashInfer ReplaySSM" in rules(t, "int8@conventional")["8bit_replay"]
    assert "describes no stochastic rounding for int8" not in rules(t, "int8:sr@replay16")["sr"]
    assert "Preserve stochastic rounding for FP8" in rules(t, "int8:sr@replay16")["sr"]
    assert "head_dim 64 and d_state 128 only" in rules(target("vllm", VLLM_PR_BUILD, dims=LayerDims("mamba2", 8, 8, 32, 1)), "int8@replay16")["shape"]


def test_fix2_vllm_flashinfer_replay_backend_from_0_30_triton_only_before():
    """vllm.replay_triton_only (0.27.0 to 0.29.0) and vllm.replay_flags (none before 0.27.0)."""
    s = Setting.parse("bf16@replay16")
    assert runtime(target("vllm", "0.29.0"), s, "mamba2").backend == "triton"
    rt = runtime(target("vllm", "0.30.0"), s, "mamba2")
    assert rt.backend == "flashinfer" and rt.prefix_caching is False and rt.ring_rows == 17
    assert "has no ReplaySSM" in rules(target("vllm", "0.26.0"), "bf16@replay16")["scheme"]


def test_vllm_triton_replay_needs_model_runner_v1_from_0_30():
    """vllm.triton_replay_v1: "Triton ReplaySSM requires Model Runner V1" while V2 is the default."""
    rt = runtime(target("vllm", "0.33.0"), Setting.parse("bf16@replay32"), "mamba2")
    assert rt.backend == "triton" and rt.env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and rt.ring_rows == 32
    assert runtime(target("vllm", "0.29.0"), Setting.parse("bf16@replay32"), "mamba2").env == {}


# -- fix 3: vLLM stochastic rounding on Triton needs compute capability 10.x --------------------------------
def test_fix3_vllm_triton_stochastic_rounding_needs_sm10x():
    """vllm.sr_triton_sm10x: "with triton backend requires compute capability 10.0"; FlashInfer has no such check."""
    s = Setting.parse("fp16:sr@conventional")
    assert runtime(target("vllm", gpu=90), s, "mamba2").backend == "flashinfer"
    assert runtime(target("vllm", gpu=100), s, "mamba2").backend == "triton"
    assert runtime(target("vllm", gpu=90), Setting.parse("fp16:sr@replay16"), "mamba2").backend == "flashinfer"
    # before 0.30.0 ReplaySSM is Triton-only, so SR replay needs an SM 10.x GPU
    assert "needs an SM 10.x GPU, not sm90" in rules(target("vllm", "0.29.0", gpu=90), "fp16:sr@replay16")["gpu"]
    assert ok(target("vllm", "0.29.0", gpu=100), "fp16:sr@replay16")
    assert "requires the SSM cache to be float16" in rules(target("vllm"), "bf16:sr@conventional")["sr"]


# -- fix 4: vLLM ReplaySSM with speculative decoding ---------------------------------------------------------
def test_fix4_vllm_speculative_replay_refused_before_0_32():
    """vllm.spec_refused_027 / vllm.spec_refused_029: refused until 0.31.0 ("RecoverSSM is only supported ...")."""
    assert "does not support speculative decoding" in rules(target("vllm", "0.28.0", drafts=3), "bf16@replay16")["scheme"]
    assert "RecoverSSM is only supported for Kimi-K3 KDA" in rules(target("vllm", "0.31.0", drafts=3), "bf16@spec16x3")["scheme"]


def test_fix4_vllm_speculative_replay_from_0_32_on_flashinfer():
    """vllm.spec_fi: FlashInfer backend, --replayssm-buffer-len >= 1 + num_speculative_tokens, no prefix caching."""
    t = target("vllm", "0.32.0", drafts=3)
    assert ok(t, "bf16@spec16x3")
    rt = runtime(t, Setting.parse("bf16@spec16x3"), "mamba2")
    assert rt.backend == "flashinfer" and rt.prefix_caching is False and rt.ring_rows == 16 + 1 + 3
    m = rules(target("vllm", drafts=4), "bf16@replay4")["spec_buffer"]
    assert m.startswith("speculative replay needs buffer length >= 1 + draft tokens: L=4, T=4")
    assert "<= 16" in rules(target("vllm", drafts=3), "bf16@replay32")["buffer_len"]


def test_a_refusal_quotes_the_rule_it_breaks():
    """L = 32 with drafts breaks FlashInfer ReplaySSM's <= 16 cap (vllm.fi_max_window), not the L >= 1 + T rule
    (vllm.spec_fi): each violation quotes its own rule."""
    found = {v.rule: v for v in violations(target("vllm", drafts=3), Setting.parse("bf16@replay32"), "mamba2")}
    assert found["buffer_len"].fact == "vllm.fi_max_window"
    assert '"FlashInfer ReplaySSM requires --replayssm-buffer-len <= 16"' in found["buffer_len"].message
    short = {v.rule: v for v in violations(target("vllm", drafts=4), Setting.parse("bf16@replay4"), "mamba2")}
    assert short["spec_buffer"].fact == "vllm.spec_fi" and "buffer_len" not in short


# -- vLLM 0.34.0 ------------------------------------------------------------------------------------------------
def test_vllm_034_drops_the_runner_variable_and_keeps_prefix_caching_under_flashinfer_replay():
    """vllm.v1_runner_removed: VLLM_USE_V2_MODEL_RUNNER=0 stops 0.34.0 at start-up, so Triton ReplaySSM (L > 16)
    gets no environment there (0.33.0 needed it); vllm.fi_replay_align: FlashInfer ReplaySSM keeps prefix caching
    where the rings hold bfloat16 inputs, and turns it off for other buffer dtypes."""
    old, new = target("vllm", "0.33.0"), target("vllm", "0.34.0")
    assert runtime(old, Setting.parse("bf16@replay32"), "mamba2").env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    rt = runtime(new, Setting.parse("bf16@replay32"), "mamba2")
    assert rt.backend == "triton" and rt.env == {} and "vllm.v1_runner_removed" in rt.facts
    assert runtime(old, Setting.parse("bf16@replay16"), "mamba2").prefix_caching is False
    rt = runtime(new, Setting.parse("bf16@replay16"), "mamba2")
    assert rt.backend == "flashinfer" and rt.prefix_caching is None and "vllm.fi_replay_align" in rt.facts
    fp16_ring = Setting.parse("bf16@replay16:fp16")
    assert runtime(new, fp16_ring, "mamba2").prefix_caching is False


def test_state_copies_are_counted_as_each_engine_reserves_them():
    """vllm.state_pages: 1 + S pages without prefix caching, 2 + S + C with it (S drafts, 0 under ReplaySSM; C
    Mamba-2's prefill checkpoint); trtllm.intermediate_ssm: 2 + T states with drafts and no replay."""
    conv = Setting.parse("bf16@conventional")
    per_state = NANO.heads * NANO.rows * NANO.state_dim * 2
    for version in ("0.33.0", "0.34.0"):
        t = target("vllm", version)
        rt = runtime(t, conv, "mamba2")
        assert rt.state_copies == 3 and "vllm.state_pages" in rt.facts and "prefix caching on" in rt.state_copies_assume
        assert engine_bytes(t, conv, "mamba2", NANO, rt)["state"] == 3 * per_state
    assert runtime(target("vllm", "0.34.0", drafts=2), conv, "mamba2").state_copies == 2 + 2 + 1
    old_fi = runtime(target("vllm", "0.33.0", drafts=3), Setting.parse("bf16@spec16x3"), "mamba2")
    assert old_fi.prefix_caching is False and old_fi.state_copies == 1  # ReplaySSM: no draft pages
    assert runtime(target("vllm", gpu=90, dims=QWEN), conv, "gdn").state_copies == 3  # FlashInfer GDN prefill on SM 9.0
    assert runtime(target("vllm", gpu=80, dims=QWEN), conv, "gdn").state_copies == 2
    rt = runtime(target("trtllm", drafts=3), conv, "mamba2")
    assert rt.state_copies == 5 and "trtllm.intermediate_ssm" in rt.facts
    assert runtime(target("trtllm", drafts=3), Setting.parse("bf16@spec16x3"), "mamba2").state_copies == 1
    assert runtime(target("flashinfer"), conv, "mamba2").state_copies == 1


def test_flashinfer_gdn_bf16_pool_reserves_the_null_slot():
    """flashinfer.gdn_null_slot: the bfloat16 fast path writes slot 0 for -1 padding; the function lives in
    flashinfer.gdn_decode."""
    rt = runtime(target("flashinfer", dims=QWEN), Setting.parse("bf16@conventional"), "gdn")
    assert rt.backend == "flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose"
    assert "flashinfer.gdn_null_slot" in rt.facts
    assert "flashinfer.gdn_null_slot" not in runtime(target("flashinfer", dims=QWEN), Setting.parse("fp32@conventional"), "gdn").facts


# -- fix 5: FlashInfer stochastic rounding ----------------------------------------------------------------------
def test_fix5_flashinfer_replay_rounds_bf16_and_fp32_to_nearest_despite_rand_seed():
    """flashinfer.cssu_sr: kPhiloxF16 = PHILOX_ROUNDS > 0 && state_t == __half; 8-bit SR exists."""
    assert "rounds it to nearest" in rules(target("flashinfer"), "bf16:sr@replay16")["sr"]
    assert ok(target("flashinfer"), "fp16:sr@replay16") and ok(target("flashinfer"), "fp8_e4m3:sr@replay16")


def test_fix5_flashinfer_selective_state_update_rounds_stochastically_into_fp16_only():
    """flashinfer.ssu_sr: cvt_rs_f16_f32 is written into the state element; other dtypes fail to compile."""
    assert "cvt_rs_f16_f32" in rules(target("flashinfer"), "bf16:sr@conventional")["sr"]
    assert ok(target("flashinfer"), "fp16:sr@conventional")


# -- fix 6: FlashInfer 8-bit constraints ----------------------------------------------------------------------
@pytest.mark.parametrize("dims", [LayerDims("mamba2", 8, 32, 128, 1), LayerDims("mamba2", 8, 64, 64, 1)])
def test_fix6_flashinfer_8bit_needs_head_dim_64_and_d_state_128(dims):
    """flashinfer.cssu_8bit_shape: static_assert D_PER_CTA == 64; row offsets row << 7 (d_state 128)."""
    m = rules(target("flashinfer", dims=dims), "int8@replay16")["shape"]
    assert f"head_dim {dims.rows}, d_state {dims.state_dim}" in m and "row_lo << 7" in m
    assert ok(target("flashinfer"), "int8@replay16")
    assert ok(target("flashinfer", dims=dims), "bf16@replay16")  # the float kernel takes these sizes


def test_fix6_flashinfer_8bit_needs_a_2_byte_ring_in_the_input_dtype():
    """flashinfer.cssu_8bit_shape: static_assert sizeof(input_t) == 2; x_cache.dtype must match x.dtype."""
    assert "buffers fp32" in rules(target("flashinfer"), "int8@replay16:fp32")["shape"]


def test_fix6_flashinfer_window_and_8bit_only_in_replay():
    """flashinfer.cssu_window (max_window <= 16, T <= L) and flashinfer.ssu_dtypes (no 8-bit conventional)."""
    assert "FlashInfer buffer length must be <= 16" in rules(target("flashinfer"), "fp16@replay32")["buffer_len"]
    assert "L=8, T=8" in rules(target("flashinfer", drafts=8), "fp16@replay8")["spec_buffer"]
    assert "selective_state_update has none" in rules(target("flashinfer"), "int8@conventional")["8bit_replay"]
    rt = runtime(target("flashinfer", drafts=3), Setting.parse("int8@spec16x3"), "mamba2")
    assert (rt.window, rt.ring_rows, rt.tokens) == (16, 20, 4) and "flashinfer.tie_hdim" in rt.facts


# -- fix 7: wrong refusals ----------------------------------------------------------------------------------------
def test_fix7_flashinfer_has_gdn_decode_kernels():
    """flashinfer.gdn_decode: float32 (K, V >= 128) or bfloat16 (K = V = 128) state, SM 90+."""
    t = target("flashinfer", dims=QWEN)
    assert ok(t, "fp32@conventional", "gdn") and ok(t, "bf16@conventional", "gdn")
    assert runtime(t, Setting.parse("bf16@conventional"), "gdn").backend.endswith("gated_delta_rule_decode_pretranspose")
    assert "needs SM 90+" in rules(target("flashinfer", gpu=80, dims=QWEN), "fp32@conventional", "gdn")["gpu"]
    assert "K = V = 128" in rules(target("flashinfer", dims=LayerDims("gdn", 4, 64, 64, 4)), "bf16@conventional", "gdn")["shape"]
    assert "not fp16" in rules(t, "fp16@conventional", "gdn")["dtype"]


def test_fix7_flashinfer_gdn_replay_commits_every_verify_step():
    """flashinfer.gdn_replay: an FP32 checkpoint updated after each verify, no L-token window."""
    assert "commits every verify step" in rules(target("flashinfer", dims=QWEN), "fp32@replay16", "gdn")["scheme"]


def test_vllm_gdn_layers_decode_conventionally_without_stochastic_rounding():
    """vllm.replay_arch (NemotronH only) and vllm.sr_mamba_only."""
    t = target("vllm", dims=QWEN)
    assert "not supported for architecture" in rules(t, "bf16@replay16", "gdn")["layer_kind"]
    assert "no stochastic rounding for Gated DeltaNet" in rules(t, "fp16:sr@conventional", "gdn")["sr"]
    assert ok(t, "bf16@conventional", "gdn")


def test_takeable_by_any_uses_newest_releases_on_sm90():
    assert takeable_by_any(Setting.parse("int8@replay16"), "mamba2")  # FlashInfer (sizes unchecked)
    assert not takeable_by_any(Setting.parse("int8@replay16"), "gdn")
    assert takeable_by_any(Setting.parse("fp16@conventional"), "gdn")


def test_takeability_follows_the_given_engine_versions_and_gpu():
    """vllm.replay_flags (ReplaySSM from vLLM 0.27.0) and flashinfer.sm80 (FlashInfer's Mamba kernels are built
    for SM 8.x and later): on an sm75 GPU only vLLM can replay fp16 state, and only from 0.27.0 on."""
    s = Setting.parse("fp16@replay8")
    old, note = deployments({"vllm": "0.26.0"}, "sm75")
    assert [t.label for t in old] == [
        "vLLM 0.26.0 on sm75", "TensorRT-LLM main@2829508 on sm75", "FlashInfer 0.7.4 on sm75", "SGLang 0.5.23 on sm75"
    ]  # fmt: skip
    assert note is None and not takeable_by_any(s, "mamba2", old)
    new, _ = deployments({}, "sm75")
    assert takeable_by_any(s, "mamba2", new)
    assert takeable_by_any(s, "mamba2", deployments({"vllm": "0.26.0"}, "sm90")[0])  # FlashInfer replays it
    rec = describe_deployments(*deployments({"vllm": VLLM_PR_BUILD}, "sm100"))
    assert rec["engines"] == {
        "vllm": VLLM_PR_BUILD, "trtllm": DEFAULT_VERSION["trtllm"], "flashinfer": "0.7.4", "sglang": "0.5.23"
    }  # fmt: skip
    assert rec["gpu"] == "sm100" and "UNRELEASED vLLM code" in rec["unreleased"][0] and "#52962" in rec["unreleased"][0]


def test_deployments_refuse_unknown_engines_versions_and_gpus():
    with pytest.raises(EngineVersionError, match="unknown engine 'tgi'.*known: vllm, trtllm, flashinfer, sglang"):
        deployments({"tgi": "1.0"})
    with pytest.raises(EngineVersionError, match="vLLM version '0.1' is not covered.*accepted: 0.25.0"):
        deployments({"vllm": "0.1"})
    with pytest.raises(EngineVersionError, match="unknown GPU 'h200'"):
        deployments({}, "h200")


# -- bytes per sequence in the engines' own buffers -------------------------------------------------------------
def test_engine_bytes_per_layer_at_nemotron_3_nano_sizes():
    """state H*P*N*elem; scales H*P*4; ring rows * (x + B in bf16 + dt in fp32), TensorRT-LLM two fp32 per head."""
    state32 = 64 * 64 * 128 * 4
    assert state32 == 2 * 2**20  # ARCHITECTURE.md reference shapes: 2 MiB FP32 state per sequence and layer
    b = engine_bytes(target("trtllm"), Setting.parse("fp32@conventional"), "mamba2", NANO)
    assert b == {"state": state32, "scales": 0, "ring": 0, "slot": 0, "total": state32}
    row = 64 * 64 * 2 + 8 * 128 * 2  # x and B rows in bf16
    b = engine_bytes(target("flashinfer"), Setting.parse("int8@replay16"), "mamba2", NANO)
    assert b["state"] == 64 * 64 * 128 and b["scales"] == 64 * 64 * 4
    assert b["ring"] == 17 * (row + 64 * 4) and b["slot"] == 8
    assert engine_bytes(target("vllm"), Setting.parse("bf16@replay32"), "mamba2", NANO)["ring"] == 32 * (row + 64 * 4)
    t = target("trtllm", drafts=3)
    assert engine_bytes(t, Setting.parse("bf16@spec16x3"), "mamba2", NANO)["ring"] == 2 * 16 * (row + 2 * 64 * 4)


# --- Kimi Delta Attention (GLM-5.3-Flash, Kimi-Linear, Kimi-K3) ----------------------------------------


GLM = LayerDims("kda", 64, 128, 128, 64)  # GLM-5.3-Flash's KDA layers: 64 heads, K = V = 128
FI_B200 = ("flashinfer", "0.7.4", 100)


def kda_target(engine, version=None, gpu=90, drafts=None, arch="KimiK3ForConditionalGeneration", dims=GLM):
    return Target.make(engine, version, gpu, drafts, dims, arch)


@pytest.mark.parametrize(
    "tgt, name",
    [
        (("vllm",), "fp32@conventional"),
        (("vllm",), "bf16@conventional"),  # Kimi-K3 from 0.30.0
        (("vllm", "0.33.0", 90, 4), "fp32@spec5x4:fp32"),  # RecoverSSM: a window of 1 + draft tokens, u in FP32
        (("trtllm",), "fp32@conventional"),
        (FI_B200, "bf16@conventional"),
        (FI_B200, "fp32@conventional"),  # fused_kda_decode (64 heads: 0.7.4)
        (FI_B200, "bf16@spec16x4"),
    ],
)
def test_kda_takeable_settings(tgt, name):
    assert violations(kda_target(*tgt), Setting.parse(name), "kda") == []


def test_flashinfer_kda_is_recurrent_kda_on_blackwell_with_bf16_state():
    """flashinfer.kda_decode: recurrent_kda, bf16 state [N, HV, V, K], K = V in {64, 128}, SM 100 kernels: the bf16
    decode of the layers fused_kda_decode does not take (head_dim 64, sm107, heads its release lacks);
    flashinfer.kda_verify: the speculative verify reads the committed state, K = V = 128, SM 10.0 / 10.3 only."""
    b200 = target(*FI_B200, dims=GLM)
    for t in (target(*FI_B200, dims=LayerDims("kda", 4, 64, 64, 4)), target("flashinfer", "0.7.4", 107, dims=GLM),
              target("flashinfer", "0.7.2.post1", 100, dims=GLM)):  # fmt: skip
        rt = runtime(t, Setting.parse("bf16@conventional"), "kda")
        assert rt.backend == "flashinfer.recurrent_kda" and rt.facts == ["flashinfer.kda_decode"]
    assert runtime(b200, Setting.parse("bf16@spec16x4"), "kda").facts == ["flashinfer.kda_verify"]
    h200 = target("flashinfer", dims=GLM)
    assert "Requires SM100 (Blackwell) architecture" in rules(h200, "bf16@conventional", "kda")["gpu"]
    assert "exact compute capability 10.0 (SM100a) or 10.3" in rules(target("flashinfer", gpu=107, dims=GLM),
                                                                     "bf16@spec16x4", "kda")["gpu"]  # fmt: skip
    assert "K = V in (64, 128), not K=96" in rules(target(*FI_B200, dims=LayerDims("kda", 4, 96, 96, 4)),
                                                   "bf16@conventional", "kda")["shape"]  # fmt: skip
    assert "K = V in (128,)" in rules(target(*FI_B200, dims=LayerDims("kda", 4, 64, 64, 4)), "bf16@spec8x4", "kda")["shape"]
    assert "no stochastic rounding" in rules(b200, "bf16:sr@conventional", "kda")["sr"]
    assert "verify" in rules(b200, "bf16@spec32x4", "kda")["buffer_len"]
    b = engine_bytes(b200, Setting.parse("bf16@spec16x4"), "kda", GLM)
    assert b["state"] == 64 * 128 * 128 * 2 and b["ring"] == 16 * 64 * (128 * 4 + 2 * 128 * 2)


def test_issue26_2_flashinfer_fused_kda_decode_keeps_a_float32_or_bf16_state():
    """flashinfer.fused_kda_decode (flashinfer-python 0.7.4, flashinfer/kda_decode.py): "Paged recurrent state with
    shape ``[num_slots, H, 128, 128]`` and dtype float32 or bfloat16."; kda_kernels/fused_kda_decode.py:
    "Fused Kimi KDA decode kernel for SM100 and SM103.", _SUPPORTED_HEADS = (8, 12, 16, 24, 32, 48, 64, 96)."""
    assert "dtype float32 or bfloat16" in FACTS["flashinfer.fused_kda_decode"].quote
    rt = runtime(target(*FI_B200, dims=GLM), Setting.parse("fp32@conventional"), "kda")
    assert rt.backend == "flashinfer.fused_kda_decode" and rt.facts == ["flashinfer.fused_kda_decode"]
    assert "SM 100 / 103 only, not sm90" in rules(target("flashinfer", dims=GLM), "fp32@conventional", "kda")["gpu"]
    # GLM-5.3-Flash's 64 heads: only 0.7.4's kernel takes them
    assert "not 64 heads" in rules(target("flashinfer", "0.7.2.post1", 100, dims=GLM), "fp32@conventional", "kda")["shape"]
    assert ok(target("flashinfer", "0.7.2.post1", 100, dims=LayerDims("kda", 32, 128, 128, 32)), "fp32@conventional", "kda")
    assert "float32 or bfloat16, not fp16" in rules(target(*FI_B200, dims=GLM), "fp16@conventional", "kda")["dtype"]


@pytest.mark.parametrize("gpu", [100, 103])
def test_issue26_bf16_kda_state_runs_on_flashinfer_fused_kda_decode_on_sm100_and_sm103(gpu):
    """flashinfer.fused_kda_decode (flashinfer-python 0.7.0.post1 to 0.7.4, flashinfer/kda_decode.py): "Paged
    recurrent state with shape ``[num_slots, H, 128, 128]`` and dtype float32 or bfloat16." (recurrence in float32,
    the bfloat16 state rounded when written back: bf16@conventional as measured); kda_kernels/fused_kda_decode.py:
    "Fused Kimi KDA decode kernel for SM100 and SM103.". A bf16 KDA state runs there, as fp32 does; on sm90 neither
    FlashInfer KDA kernel runs, and the refusal gives both kernels' reasons."""
    f = FACTS["flashinfer.fused_kda_decode"]
    assert "dtype float32 or bfloat16" in f.quote and f.sources[0].path == "flashinfer/kda_decode.py"
    t = target("flashinfer", "0.7.4", gpu, dims=GLM)
    assert ok(t, "bf16@conventional", "kda")
    rt = runtime(t, Setting.parse("bf16@conventional"), "kda")
    assert rt.backend == "flashinfer.fused_kda_decode" and rt.facts == ["flashinfer.fused_kda_decode"]
    assert engine_bytes(t, Setting.parse("bf16@conventional"), "kda", GLM)["state"] == 64 * 128 * 128 * 2
    # Kimi-Linear's 32 heads: every release's kernel takes them
    kimi_linear = LayerDims("kda", 32, 128, 128, 32)
    rt = runtime(target("flashinfer", "0.7.0.post1", gpu, dims=kimi_linear), Setting.parse("bf16@conventional"), "kda")
    assert rt.backend == "flashinfer.fused_kda_decode"
    msgs = [v.message for v in violations(target("flashinfer", dims=GLM), Setting.parse("bf16@conventional"), "kda")]
    assert [v.rule for v in violations(target("flashinfer", dims=GLM), Setting.parse("bf16@conventional"), "kda")] == [
        "gpu", "gpu"]  # fmt: skip
    assert "fused_kda_decode (bfloat16 KDA state) runs on SM 100 / 103 only, not sm90" in msgs[0]
    assert "[FlashInfer 0.7.0.post1 and later read; flashinfer-ai/flashinfer:flashinfer/kda_decode.py" in msgs[0]
    assert '"Requires SM100 (Blackwell) architecture' in msgs[1]
    assert "recurrent_kda" in msgs[1]


@pytest.mark.parametrize(
    "version, arch, follows",
    [
        ("0.29.0", "KimiK3ForConditionalGeneration", False),  # kda_state_dtype takes no SSM dtype before 0.30.0
        ("0.30.0", "KimiK3ForConditionalGeneration", True),
        ("0.31.0", "Glm5NextForConditionalGeneration", False),
        ("0.32.0", "Glm5NextForConditionalGeneration", True),
        ("0.33.0", "Glm5NextForCausalLM", True),
        ("0.33.0", "KimiLinearForCausalLM", False),
        ("0.33.0", None, False),
    ],
)
def test_issue26_2_vllm_kda_state_follows_the_ssm_cache_dtype_per_layer(version, arch, follows):
    """vLLM 0.30.0-0.33.0 vllm/model_executor/layers/mamba/mamba_utils.py kda_state_dtype: "KDA recurrent state
    supports only auto, float32, and bfloat16; got {...}"; the layers that pass `self.cache_config.
    mamba_ssm_cache_dtype,` to it: vllm/models/kimi_k3/nvidia/kda.py (from 0.30.0), vllm/models/glm5next/common/kda.py
    (from 0.32.0); Kimi-Linear's vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py passes only
    `self.model_config.dtype, self.cache_config.mamba_cache_dtype` (float32 state). Before 0.30.0:
    "return (state_dtype, torch.float32)"."""
    t = kda_target("vllm", version, arch=arch)
    assert ok(t, "fp32@conventional", "kda")
    assert ok(t, "bf16@conventional", "kda") is follows
    if not follows:
        assert "accept and not run" in rules(t, "bf16@conventional", "kda")["dtype"]
    assert "dtype" in rules(t, "fp16@conventional", "kda") and "dtype" in rules(t, "int8@conventional", "kda")
    assert "KDA recurrent state supports only auto, float32, and bfloat16" in FACTS["vllm.kda_state_dtype"].quote
    assert FACTS["vllm.kda_state_fp32"].quote == "return (state_dtype, torch.float32)"


def test_issue26_2_vllm_kda_decode_backend_and_runtime_facts():
    """vLLM 0.30.0+ vllm/engine/arg_utils.py: --kda-decode-backend `choices=["auto", "native", "flashinfer",
    "triton"]`, read by Kimi-K3's layer only; the export leaves it at auto and says what auto picks."""
    rt = runtime(kda_target("vllm"), Setting.parse("bf16@conventional"), "kda")
    assert rt.facts == ["vllm.kda_state_dtype", "vllm.kda_k3_follows", "vllm.kda_decode_backend", "vllm.state_pages"]
    rt = runtime(kda_target("vllm", arch="KimiLinearForCausalLM"), Setting.parse("fp32@conventional"), "kda")
    assert rt.facts == ["vllm.kda_state_dtype", "vllm.kda_linear_fp32", "vllm.state_pages"] and rt.backend == "triton"
    assert runtime(kda_target("vllm", "0.29.0"), Setting.parse("fp32@conventional"), "kda").facts == ["vllm.kda_state_fp32"]


def test_issue26_2_trtllm_kda_fp32_conventional_only_until_the_pool_selector_is_read():
    """TensorRT-LLM main 0790edf tensorrt_llm/_torch/modules/kimi_kda/kimi_kda_mixer.py: "ssm_pool =
    layer_cache.temporal  # [slots, H, V, K] fp32 or bf16" and the bf16 write-back "rows.to(ssm_pool.dtype)";
    kimi_kda/cache_manager.py (2829508): KDAReplayStateUpdateStrategy. The setting that selects the bf16 pool was
    not read, so neither the bf16 pool nor the fused verify is exported."""
    fact = FACTS["trtllm.kda"]
    cite = " ".join(str(x) for x in fact.sources)
    assert "kimi_kda/kimi_kda_mixer.py" in cite and "0790edf" in cite and "(not read here)" not in cite
    assert "rows.to(ssm_pool.dtype)" in fact.quote and "were not read" in fact.says
    t = kda_target("trtllm")
    # the reason quoted is TensorRT-LLM's own (config_utils.py 00679c6): it forces float32 for Kimi and GLM
    assert "numerical parity with the HF reference" in rules(t, "bf16@conventional", "kda")["dtype"]
    assert "KDAReplayStateUpdateStrategy" in rules(t, "fp32@spec5x4:fp32", "kda")["layer_kind"]


def test_kda_replay_is_speculative_recoverssm_on_kimi_k3_only():
    """vLLM 0.29.0+ vllm/config/vllm.py: "RecoverSSM supports bfloat16/float32 SSM state caches, not
    --enable-mamba-cache-stochastic-rounding"; only Kimi-K3's layer reads use_kda_recoverssm."""
    k3 = kda_target("vllm", drafts=4)
    assert "RecoverSSM" in rules(k3, "fp32@replay16:fp32", "kda")["layer_kind"]
    assert "spec5x4" in rules(k3, "fp32@spec8x4:fp32", "kda")["buffer_len"]
    assert "records u_t in FP32" in rules(k3, "fp32@spec5x4", "kda")["layer_kind"]
    rt = runtime(k3, Setting.parse("bf16@spec5x4:fp32"), "kda")
    assert rt.backend == "triton" and rt.window == 5 and "vllm.recoverssm" in rt.facts
    assert "decode conventionally" in rules(kda_target("vllm", drafts=4, arch="KimiLinearForCausalLM"),
                                            "fp32@spec5x4:fp32", "kda")["layer_kind"]  # fmt: skip
    assert "is not supported for architecture 'Glm5NextForConditionalGeneration'" in rules(
        kda_target("vllm", drafts=4, arch="Glm5NextForConditionalGeneration"), "fp32@spec5x4:fp32", "kda")["layer_kind"]
    assert "has no RecoverSSM" in rules(kda_target("vllm", "0.28.0", drafts=4), "fp32@spec5x4:fp32", "kda")["scheme"]
    assert "its KDA replay is the speculative verify" in rules("flashinfer", "bf16@replay16", "kda")["scheme"]
    assert not takeable_by_any(Setting.parse("fp8_e4m3@replay16"), "kda")


def test_trtllm_runs_flashinfer_kernels_on_the_sizes_it_picks_them_for():
    """trtllm.fi_ssu: TensorRT-LLM's Mamba-2 mixer decodes with FlashInfer's selective_state_update for head_dim
    64 / 128 and 1 / 8 / 16 heads per group (Nemotron-3-Nano: 64 / 8), its Triton kernel elsewhere;
    trtllm.fi_checkpointing: MTP replay through FlashInfer's checkpointing_ssu there. The export's profile check then
    names the flashinfer profile."""
    from ssmquant.export.profile import target_profile

    class Plan:
        target = "trtllm"

    nano = runtime(target("trtllm"), Setting.parse("fp16@conventional"), "mamba2")
    assert nano.backend == "flashinfer" and "trtllm.fi_ssu" in nano.facts
    small = LayerDims("mamba2", 4, 16, 32, 2)  # head_dim 16: TensorRT-LLM's own Triton kernel
    assert runtime(target("trtllm", dims=small), Setting.parse("fp16@conventional"), "mamba2").backend == "conventional"
    odd_ratio = LayerDims("mamba2", 96, 64, 128, 2)  # 48 heads per group: not in the list read
    assert runtime(target("trtllm", dims=odd_ratio), Setting.parse("fp16@conventional"), "mamba2").backend == "conventional"
    mtp = runtime(target("trtllm", drafts=3), Setting.parse("bf16@spec16x3"), "mamba2")
    assert mtp.backend == "flashinfer.replay" and "trtllm.fi_checkpointing" in mtp.facts
    plan = Plan()
    plan.setting, plan.runtime = Setting.parse("fp16@conventional"), nano
    assert target_profile(plan, "mamba2", (64, 64, 128))[0] == "flashinfer"
    plan.runtime = runtime(target("trtllm", dims=small), plan.setting, "mamba2")
    assert target_profile(plan, "mamba2", (4, 16, 32))[0] == "trtllm"
