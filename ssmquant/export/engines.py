"""What each serving engine can take today (DESIGN.md section 6), as checks on one setting.

`violations(target, setting, layer_kind)` lists, as (rule, message) pairs, every reason why `target`
cannot run a setting as measured. Rules, by id:

- nvfp4:        no engine stores NVFP4 state.
- static:       no engine takes static (calibrated) state scales; FlashInfer writes its int8/fp8 state_scale
                at every checkpoint write (dynamic).
- granularity:  FlashInfer's state_scale is one FP32 scale per row (cache, nheads, head_dim); per-head or
                grouped dynamic scales are not taken.
- dtype:        the engine has no knob for this state dtype (TensorRT-LLM: float32/float16/bfloat16 only).
- 8bit_replay:  int8/fp8_e4m3 state exists only in FlashInfer's ReplaySSM kernel (checkpointing_ssu), so it
                needs replay decoding (vLLM: --mamba-backend flashinfer --use-replayssm).
- layer_kind:   ReplaySSM (vLLM, TensorRT-LLM, FlashInfer) and FlashInfer's mamba kernels are Mamba-2 only;
                a GDN layer decodes conventionally in a float dtype.
- buffer_len:   FlashInfer's replay window is at most 16 tokens; TensorRT-LLM's history is fixed at 16.
- spec_buffer:  speculative replay needs buffer length >= 1 + draft tokens.
- sr:           vLLM and TensorRT-LLM apply stochastic rounding only when writing an fp16 state.
- for a Kimi Delta Attention layer, "dtype" says which one state dtype the engine keeps (`KDA_STATE_DTYPE`) and
  "layer_kind" which KDA replay it has (vLLM RecoverSSM, FlashInfer's output-only verify, none in TensorRT-LLM).

The table is data so that it can follow the engines as they change; every message names the engine knob.
"""

from __future__ import annotations

TARGETS = ("vllm", "trtllm", "flashinfer")
TARGET_NAMES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "flashinfer": "FlashInfer"}
FLOAT_ENCODINGS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
EIGHT_BIT_ENCODINGS = ("int8", "fp8_e4m3")
TORCH_DTYPES = {
    "fp32": "torch.float32",
    "fp16": "torch.float16",
    "bf16": "torch.bfloat16",
    "int8": "torch.int8",
    "fp8_e4m3": "torch.float8_e4m3fn",
}
# vLLM's --mamba-ssm-cache-dtype values: upstream takes the floats; int8 / fp8_e4m3 come with FlashInfer
# ReplaySSM (pending upstream).
VLLM_DTYPES = {**FLOAT_ENCODINGS, "int8": "int8", "fp8_e4m3": "fp8_e4m3"}
FLASHINFER_MAX_WINDOW = 16
TRTLLM_REPLAY_HISTORY = 16
DEFAULT_PHILOX_ROUNDS = 10
# The one state dtype each engine keeps for a KDA layer (GLM-5.3-Flash, Kimi-Linear, Kimi-K3), read from:
# - vLLM: vllm/model_executor/layers/mamba/mamba_utils.py `MambaStateDtypeCalculator.kda_state_dtype` returns
#   torch.float32 for the recurrent state whatever --mamba-ssm-cache-dtype says;
# - TensorRT-LLM: tensorrt_llm/_torch/models/modeling_kimi_linear.py (Kimi-K3): "a delta-rule recurrent slot of
#   [num_heads, head_dim, head_dim] fp32";
# - FlashInfer: flashinfer/kda_kernels/recurrent_kda.py ("State: [N,HV,V,K] bf16") and
#   kda_decode_wy_output_only.py ("bf16 I/O and state").
KDA_STATE_DTYPE = {"vllm": "fp32", "trtllm": "fp32", "flashinfer": "bf16"}
# vLLM's KDA replay is RecoverSSM (cache_config.use_kda_recoverssm; vllm/models/kimi_k3/nvidia/ops/recoverssm.py):
# a speculative verify window of 1 + num_speculative_tokens tokens against one checkpoint, u_t recorded in FP32
# and the raw k | gate in the activation dtype, the accepted tokens folded into the checkpoint after every round.
# FlashInfer's output-only KDA verify (kda_wy_output_only) takes windows of 1..16 tokens.
FLASHINFER_KDA_MAX_WINDOW = 16


class UnknownTargetError(ValueError):
    """The export target is not one of TARGETS."""


def check_target(target: str) -> str:
    t = str(target).strip().lower()
    if t not in TARGETS:
        raise UnknownTargetError(f"unknown export target {target!r}; known targets: {', '.join(TARGETS)}")
    return t


def violations(target: str, setting, layer_kind: str, draft_tokens: int | None = None) -> list[tuple[str, str]]:
    """Why `target` cannot take `setting` (a calibrate Setting or anything with its attributes); [] if it can.

    layer_kind: "mamba2" | "gdn" | "kda"; draft_tokens: speculative draft tokens per step in deployment (None:
    the setting's own, 0 unless its scheme is spec).
    """
    t = check_target(target)
    name = TARGET_NAMES[t]
    enc, kind = setting.encoding, setting.scheme_kind
    L = setting.buffer_len
    T = setting.draft_tokens if draft_tokens is None else int(draft_tokens)
    replay = kind in ("replay", "spec")
    out: list[tuple[str, str]] = []
    if enc == "nvfp4":
        out.append(("nvfp4", "no engine stores NVFP4 SSM state (vLLM, TensorRT-LLM and FlashInfer take none)"))
    if setting.scale_mode == "static":
        out.append(
            (
                "static",
                "no engine takes static (calibrated) SSM-state scales: FlashInfer recomputes state_scale "
                "from the row amax at every checkpoint write",
            )
        )
    if enc in EIGHT_BIT_ENCODINGS + ("nvfp4",) and setting.granularity != "row":
        out.append(
            (
                "granularity",
                f"{setting.granularity} scales are not taken: FlashInfer's state_scale is one FP32 scale per row "
                "(cache, nheads, head_dim)",
            )
        )
    if layer_kind == "gdn":
        if t == "flashinfer":
            out.append(
                (
                    "layer_kind",
                    "flashinfer.mamba.selective_state_update / checkpointing_ssu are Mamba-2 kernels; "
                    "FlashInfer has no SSM-state knobs for Gated DeltaNet layers",
                )
            )
        if replay:
            out.append(
                ("layer_kind", f"{name}'s ReplaySSM covers Mamba-2 layers only; GDN layers decode conventionally")
            )
        if enc in EIGHT_BIT_ENCODINGS:
            out.append(("dtype", f"{name} has no int8/fp8_e4m3 state for GDN layers (FlashInfer ReplaySSM is Mamba-2)"))
    if layer_kind == "kda":
        out += _kda_violations(t, setting, replay, L, T)
    if enc in EIGHT_BIT_ENCODINGS:
        if t == "trtllm":
            out.append(
                (
                    "dtype",
                    f"TensorRT-LLM has kernel support for {enc} SSM state but no config knob: "
                    "kv_cache_config.mamba_ssm_cache_dtype takes auto, float32, float16, bfloat16",
                )
            )
        elif not replay and layer_kind == "mamba2":
            how = "--mamba-backend flashinfer --use-replayssm" if t == "vllm" else "checkpointing_ssu(state_scale=...)"
            out.append(
                (
                    "8bit_replay",
                    f"{enc} state exists only in FlashInfer's ReplaySSM kernel ({how}); conventional decoding "
                    "stores a float state",
                )
            )
    if replay:
        if t == "trtllm" and L != TRTLLM_REPLAY_HISTORY:
            out.append(
                (
                    "buffer_len",
                    f"TensorRT-LLM's replay history is fixed at {TRTLLM_REPLAY_HISTORY} tokens "
                    f"(TRTLLM_USE_MAMBA_REPLAY=1); the setting uses L={L}",
                )
            )
        flashinfer_path = t == "flashinfer" or (t == "vllm" and enc in EIGHT_BIT_ENCODINGS)
        if flashinfer_path and L > FLASHINFER_MAX_WINDOW:
            out.append(
                (
                    "buffer_len",
                    f"FlashInfer buffer length must be <= {FLASHINFER_MAX_WINDOW} (checkpointing_ssu max_window); "
                    f"the setting uses L={L}",
                )
            )
        if T and (t == "trtllm" and TRTLLM_REPLAY_HISTORY < 1 + T or t != "trtllm" and L < 1 + T):
            eff = TRTLLM_REPLAY_HISTORY if t == "trtllm" else L
            out.append(("spec_buffer", f"speculative replay needs buffer length >= 1 + draft tokens: L={eff}, T={T}"))
    if setting.rounding == "sr" and t in ("vllm", "trtllm") and enc != "fp16":
        knob = "--enable-mamba-cache-stochastic-rounding" if t == "vllm" else "mamba_ssm_stochastic_rounding"
        out.append(
            ("sr", f"{name} applies stochastic rounding ({knob}) only when writing an fp16 SSM state, not {enc}")
        )
    return out


def _kda_violations(t: str, setting, replay: bool, L: int, T: int) -> list[tuple[str, str]]:
    """What `t` keeps for a KDA layer, against the setting (KDA_STATE_DTYPE and the notes beside it)."""
    name, enc, want = TARGET_NAMES[t], setting.encoding, KDA_STATE_DTYPE[t]
    out = []
    if enc != want:
        where = {
            "vllm": "MambaStateDtypeCalculator.kda_state_dtype: --mamba-ssm-cache-dtype does not apply",
            "trtllm": "the Kimi-K3 KDA runtime's recurrent slot",
            "flashinfer": "recurrent_kda / kda_wy_output_only",
        }[t]
        out.append(("dtype", f"{name} keeps KDA state in {want} only ({where}); the setting stores {enc}"))
    if not replay:
        return out
    if t == "vllm":
        if setting.scheme_kind != "spec" or L != 1 + T:
            out.append(
                (
                    "layer_kind",
                    "vLLM's KDA replay is RecoverSSM (use_kda_recoverssm): speculative decoding only, a window of "
                    f"1 + draft tokens folded into the checkpoint every round, i.e. spec{1 + max(T, 1)}x{max(T, 1)}; "
                    f"the setting uses {setting.scheme_kind} with L={L}",
                )
            )
        elif setting.scheme.buffer_dtype != "fp32":
            out.append(
                (
                    "layer_kind",
                    "vLLM's RecoverSSM records u_t in FP32 (and k, gate as the model's activations): measure with an "
                    f"fp32 buffer (spec{L}x{T}:fp32), not {setting.scheme.buffer_dtype}",
                )
            )
    elif t == "flashinfer":
        if setting.scheme_kind != "spec":
            out.append(("layer_kind", "FlashInfer's KDA replay is the speculative verify kda_wy_output_only only"))
        elif L > FLASHINFER_KDA_MAX_WINDOW:
            out.append(("layer_kind", f"kda_wy_output_only takes at most {FLASHINFER_KDA_MAX_WINDOW} tokens, L={L}"))
    else:
        out.append(
            (
                "layer_kind",
                "TensorRT-LLM's Mamba replay (TRTLLM_USE_MAMBA_REPLAY) covers Mamba-2 / GDN layers; its Kimi-K3 KDA "
                "runtime verifies draft tokens with deferred state promotion, not from a checkpoint and input buffer",
            )
        )
    return out


def takeable_by_any(setting, layer_kind: str) -> bool:
    """True when at least one engine can run `setting` as measured."""
    return any(not violations(t, setting, layer_kind) for t in TARGETS)
