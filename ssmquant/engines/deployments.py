"""Which measured settings an engine runs, at one version on one GPU, and how it runs them.

`Target` is a deployment: engine, version (a release whose source was read, or a build with open PRs),
GPU compute capability, draft tokens per step, and the layer sizes. `violations(target, setting, kind)`
lists every reason why the target cannot run `setting` as measured, each citing an engine fact
(`facts.py`) with the engine's own words; [] means it runs. `runtime(...)` says how a runnable setting
runs there (backend, replay window, ring rows, flags and environment the engine needs), and
`engine_bytes(...)` its bytes per sequence in the engine's own buffers.

Rule ids (the `rule` of a Violation):

- nvfp4, static, granularity: what no engine takes (NVFP4 state, static scales, scales coarser than a row)
- dtype:       the engine (version) has no knob or kernel for this state dtype
- unreleased:  the setting runs only on a build with open pull requests (see facts.BUILDS)
- 8bit_replay: int8 / fp8_e4m3 state exists only under FlashInfer's replay kernel (checkpointing_ssu)
- layer_kind:  not for this kind of layer (ReplaySSM is Mamba-2 only in vLLM, ...)
- scheme:      the engine does not decode this way at this version (replay without drafts on TensorRT-LLM, ...)
- buffer_len, spec_buffer: the replay window the engine has or allows differs from the setting's
- sr:          stochastic rounding is not applied to this state dtype / backend
- gpu:         not on this GPU
- shape:       the kernel does not take these layer sizes
- prompt_store: the engine keeps no cached prompt state that way (int8col is SGLang's int8 prefix cache)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import SsmquantError
from .facts import (
    DEFAULT_GPU,
    ENGINE_NAMES,
    ENGINES,
    FACTS,
    PROMPT_STORES_KEPT,
    RELEASES,
    RULED_ENCODINGS,
    SERVED_KINDS,
    VLLM_PR_BUILD,
    EngineVersionError,
    build,
    check_version,
    parse_gpu,
    resolve_gpu,
)

TARGETS = ENGINES
TARGET_NAMES = ENGINE_NAMES
FLOAT_ENCODINGS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
EIGHT_BIT_ENCODINGS = ("int8", "fp8_e4m3")
# states stored with one FP32 decode scale per (head, row): FlashInfer's 8-bit checkpoint and its int16 SSU state
SCALED_STATE_ENCODINGS = (*EIGHT_BIT_ENCODINGS, "int16")
TORCH_DTYPES = {
    "fp32": "torch.float32",
    "fp16": "torch.float16",
    "bf16": "torch.bfloat16",
    "int8": "torch.int8",
    "fp8_e4m3": "torch.float8_e4m3fn",
    "int16": "torch.int16",
}
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8_e4m3": 1, "int16": 2}
# vLLM builds with #52962 take these --mamba-ssm-cache-dtype strings (vLLM's STR_DTYPE_TO_TORCH_DTYPE names)
VLLM_DTYPES = {**FLOAT_ENCODINGS, "int8": "int8", "fp8_e4m3": "fp8_e4m3"}
FLASHINFER_MAX_WINDOW = 16  # checkpointing_ssu: max_window <= 16
TRTLLM_MIN_REPLAY_HISTORY = 16  # MIN_REPLAY_HISTORY_SIZE
TRTLLM_GDN_REPLAY_MAX_TOKENS = 8  # GDN replay: tokens per step (1 + draft tokens) at most, else the non-replay path
DEFAULT_PHILOX_ROUNDS = 10  # TensorRT-LLM's and FlashInfer's default; what vLLM's 0 resolves to
FLASHINFER_8BIT_HEAD_DIM, FLASHINFER_8BIT_D_STATE = 64, 128
# Which vLLM KDA layer an architecture decodes with; that decides whether --mamba-ssm-cache-dtype reaches the
# KDA state (facts vllm.kda_*). KimiLinearForCausalLM is Kimi-Linear's layer unless the checkpoint sets Kimi-K3's
# use_full_rank_gate, which a recipe does not record: it is treated as Kimi-Linear (the safe reading: float32).
KDA_FAMILIES = {
    "Glm5NextForCausalLM": "glm5next",
    "Glm5NextForConditionalGeneration": "glm5next",
    "KimiK3ForConditionalGeneration": "kimi_k3",
    "KimiK31ForConditionalGeneration": "kimi_k3",  # vLLM 0.34.0: the Kimi-K3 class under a new name
    "KimiLinearForCausalLM": "kimi_linear",
}
KDA_FAMILY_NAMES = {"glm5next": "GLM-5.3-Flash", "kimi_k3": "Kimi-K3", "kimi_linear": "Kimi-Linear", None: "this"}
# the fact that makes a family's KDA state follow --mamba-ssm-cache-dtype (None: it never does)
_KDA_FOLLOWS = {"kimi_k3": "vllm.kda_k3_follows", "glm5next": "vllm.kda_glm_follows", "kimi_linear": None, None: None}
FLASHINFER_KDA_HEAD_DIMS = (64, 128)  # K = V
FLASHINFER_KDA_DECODE_SM = (100, 103, 107)  # recurrent_kda's CuTe DSL kernels (SM 10.x)
FLASHINFER_KDA_VERIFY_SM = (100, 103)  # the frozen verify: "exact compute capability 10.0 or 10.3"
# vLLM's KDA replay is RecoverSSM (cache_config.use_kda_recoverssm; vllm/models/kimi_k3/nvidia/ops/recoverssm.py):
# a speculative verify window of 1 + num_speculative_tokens tokens against one checkpoint, u_t recorded in FP32
# and the raw k | gate in the activation dtype, the accepted tokens folded into the checkpoint after every round.
# FlashInfer's output-only KDA verify (kda_wy_output_only) takes windows of 1..16 tokens.
FLASHINFER_KDA_MAX_WINDOW = 16
# flashinfer.fused_kda_decode: head counts per release (its _SUPPORTED_HEADS), head_dim 128, SM 100 / 103
FLASHINFER_FUSED_KDA_HEADS = {
    "0.7.0.post1": (12, 24, 32, 48, 96),
    "0.7.2.post1": (8, 12, 24, 32, 48, 96),
    "0.7.4": (8, 12, 16, 24, 32, 48, 64, 96),
}
FLASHINFER_FUSED_KDA_SM = (100, 103)


class UnknownTargetError(SsmquantError, ValueError):
    """The export target is not one of TARGETS."""


def check_target(target: str) -> str:
    t = str(target).strip().lower()
    if t not in TARGETS:
        raise UnknownTargetError(f"unknown export target {target!r}; known targets: {', '.join(TARGETS)}")
    return t


@dataclass(frozen=True)
class Target:
    """A deployment to check settings against.

    draft_tokens: speculative draft tokens per step (None: each setting's own, 0 unless it is a spec
    scheme); dims: the layer sizes (None skips the rules on sizes).
    """

    engine: str
    version: str
    gpu: int
    draft_tokens: int | None = None
    dims: object | None = None
    arch: str | None = None

    @classmethod
    def make(
        cls, engine: str, version: str | None = None, gpu=None, draft_tokens: int | None = None, dims=None, arch=None
    ):
        """Validated Target; version None: the newest release read; gpu None: sm90; arch: the model's
        architecture (HF `architectures[0]`; None: unknown), which decides what vLLM does with a KDA state dtype."""
        e = check_target(engine)
        if draft_tokens is not None and (isinstance(draft_tokens, bool) or int(draft_tokens) != draft_tokens):
            raise ValueError(f"draft tokens must be an integer >= 0, got {draft_tokens!r}")
        if draft_tokens is not None and draft_tokens < 0:
            raise ValueError(f"draft tokens must be an integer >= 0, got {draft_tokens!r}")
        cc = parse_gpu(DEFAULT_GPU if gpu is None else gpu)
        return cls(e, check_version(e, version), cc, draft_tokens, dims, None if arch is None else str(arch))

    @property
    def kda_family(self) -> str | None:
        """'glm5next' | 'kimi_k3' | 'kimi_linear' | None (unknown architecture)."""
        return KDA_FAMILIES.get(self.arch)

    @property
    def name(self) -> str:
        return ENGINE_NAMES[self.engine]

    @property
    def label(self) -> str:
        """'vLLM 0.33.0 on sm90'."""
        return f"{self.name} {self.version} on sm{self.gpu}"

    @property
    def build(self):
        return build(self.engine, self.version)

    def holds(self, fact_id: str) -> bool:
        return FACTS[fact_id].holds(self.version)

    def at_least(self, version: str) -> bool:
        """Whether this target's release (a build's base release) is ``version`` or later."""
        order = RELEASES[self.engine]
        mine = self.build.base if self.build is not None else self.version
        return order.index(mine) >= order.index(version)

    def drafts(self, setting) -> int:
        return setting.draft_tokens if self.draft_tokens is None else int(self.draft_tokens)


class Violation(NamedTuple):
    rule: str
    message: str
    fact: str | None


def _v(rule: str, fact_id: str | None, detail: str, quote: bool = True, **fmt) -> Violation:
    """A violation: `detail`, then the engine's own words (its quote, formatted with `fmt` if given; what the
    fact says where it has no quote or `quote` is False) and where they were read."""
    if fact_id is None:
        return Violation(rule, detail, None)
    f = FACTS[fact_id]
    words = f'"{f.quote.format(**fmt) if fmt else f.quote}"' if f.quote and quote else f"({f.says})"
    return Violation(rule, f"{detail}: {words} {f.cite()}", fact_id)


@dataclass
class Runtime:
    """How a target runs a setting it takes.

    backend: vLLM "triton" | "flashinfer"; FlashInfer: the kernel function; TensorRT-LLM: "replay" |
    "conventional". window: logical replay window L (0: conventional); ring_rows: rows the engine allocates
    per sequence and layer; tokens: tokens per decode call (1 + drafts); env: environment variables the
    engine needs; prefix_caching: False where it must be off (vLLM), None where untouched; facts: ids
    relied on; state_copies: states per sequence and layer the engine reserves (state_copies_assume: the setting
    assumed).
    """

    backend: str
    window: int
    ring_rows: int
    tokens: int
    env: dict[str, str] = field(default_factory=dict)
    prefix_caching: bool | None = None
    facts: list[str] = field(default_factory=list)
    # copies of the layer's state the engine reserves per sequence (vLLM's state pages, TensorRT-LLM's
    # intermediate states of a speculative step), and the engine setting that count assumes
    state_copies: int = 1
    state_copies_assume: str = "one state per sequence"

    @property
    def replay(self) -> bool:
        return self.window > 0


def _replay(setting) -> bool:
    return setting.scheme_kind in ("replay", "spec")


def violations(target, setting, layer_kind: str, draft_tokens=None, *, version=None, gpu=None, dims=None):
    """Why `target` cannot run `setting` as measured, as Violations (rule, message, fact id); [] if it can.

    target: a Target, or an engine name ("vllm" | "trtllm" | "flashinfer") completed by version (None: the
    newest release read), gpu (None: sm90), draft_tokens and dims. layer_kind: a kind name (``SERVED_KINDS`` says which each engine
    serves).
    """
    if not isinstance(target, Target):
        target = Target.make(target, version, gpu, draft_tokens, dims)
    out: list[Violation] = []
    served = SERVED_KINDS[target.engine]
    if layer_kind not in served:
        served_names = ", ".join(served)
        return [_v("layer_kind", None, f"{target.name} serves no {layer_kind} layers (it serves {served_names})")]
    if setting.encoding not in RULED_ENCODINGS:
        detail = f"{target.name} stores no {setting.encoding} SSM state that ssmquant's engine facts know of"
        return [_v("dtype", _DTYPE_FACT[target.engine], detail, quote=False)]
    store = getattr(setting, "prompt_store", None)
    if store is not None and store not in PROMPT_STORES_KEPT[target.engine]:
        out.append(
            _v("prompt_store", "sglang.int8_checkpoint", f"{target.name} keeps no prompt state as {store} (SGLang's "
               "int8 prefix cache)", quote=False)
        )
    _common(target, setting, out)
    if layer_kind == "kda":
        _kda(target, setting, out)
        return out
    {"vllm": _vllm, "trtllm": _trtllm, "flashinfer": _flashinfer, "sglang": _sglang}[target.engine](
        target, setting, layer_kind, out
    )
    return out


def deployments(engine_versions: dict[str, str] | None = None, gpu=None) -> tuple[tuple[Target, ...], str | None]:
    """(one Target per engine, note): each engine at the version given in `engine_versions` ({engine: version},
    e.g. {"vllm": "0.33.0+pr52962"}; an engine left out: its newest release read) on `gpu` ("sm90" etc.; None:
    the local GPU, else sm90). note: what was assumed about the GPU, or None. Raises EngineVersionError for an
    unknown engine, version or GPU (the message lists the accepted values)."""
    ev = dict(engine_versions or {})
    unknown = sorted(set(ev) - set(TARGETS))
    if unknown:
        raise EngineVersionError(f"unknown engine {unknown[0]!r} in the engine versions; known: {', '.join(TARGETS)}")
    cc, note = resolve_gpu(gpu)
    return tuple(Target.make(e, ev.get(e), cc) for e in TARGETS), note


def describe_deployments(targets, note: str | None = None) -> dict:
    """What takeability was checked for, as recorded in a recipe: {"engines": {engine: version}, "gpu",
    "unreleased": [labels of builds with open PRs], "note"}."""
    return {
        "engines": {t.engine: t.version for t in targets},
        "gpu": f"sm{targets[0].gpu}",
        "unreleased": [t.build.label(t.engine) for t in targets if t.build is not None],
        "note": note,
    }


def takeable_by_any(setting, layer_kind: str, targets=None) -> bool:
    """True when at least one of `targets` runs `setting` as measured (sizes unchecked). targets: Targets (see
    `deployments`); None: every engine's newest release read, on sm90."""
    targets = targets if targets is not None else tuple(Target.make(e) for e in TARGETS)
    return any(not violations(t, setting, layer_kind) for t in targets)


def engines_running(setting, layer_kind: str, dims=None, arch=None) -> tuple[list[str], list[str]]:
    """(labels of the engines that run ``setting`` as measured, labels of those that do not), each engine at its
    newest release read, on sm90 ("FlashInfer 0.7.4"); ``dims``: the layer sizes (None: sizes unchecked)."""
    runs, not_runs = [], []
    for engine in TARGETS:
        target = Target.make(engine, dims=dims, arch=arch)
        label = f"{target.name} {target.version}"
        (not_runs if violations(target, setting, layer_kind) else runs).append(label)
    return runs, not_runs


# -- rules ------------------------------------------------------------------------------------------------
_DTYPE_FACT = {
    "vllm": "vllm.state_dtype",
    "trtllm": "trtllm.state_dtype",
    "flashinfer": "flashinfer.cssu_dtypes",
    "sglang": "sglang.state_dtype",
}


def _common(t: Target, s, out: list) -> None:
    if s.encoding == "nvfp4":
        fmt = {"value": "'nvfp4'"} if t.engine == "vllm" else {}
        detail = f"{t.name} stores no NVFP4 SSM state (no engine does)"
        out.append(_v("nvfp4", _DTYPE_FACT[t.engine], detail, quote=t.engine != "flashinfer", **fmt))
    if s.scale_mode == "static":
        out.append(
            _v(
                "static",
                "flashinfer.scale" if t.engine in ("vllm", "flashinfer") else None,
                f"{t.name} takes no static (calibrated) SSM-state scales: 8-bit state scales are recomputed from "
                "the row amax at every checkpoint write",
            )
        )
    if s.encoding in EIGHT_BIT_ENCODINGS + ("nvfp4",) and s.granularity != "row" and t.engine in ("vllm", "flashinfer"):
        out.append(
            _v(
                "granularity",
                "flashinfer.cssu_dtypes",
                f"{s.granularity} scales are not taken: the 8-bit state scale is one FP32 value per row "
                "(cache, nheads, head_dim)",
            )
        )


def _flashinfer_8bit_shape(t: Target, s, out: list) -> None:
    """FlashInfer's 8-bit replay kernel: head_dim 64, d_state 128, 2-byte inputs and ring (also for vLLM #52962)."""
    d = t.dims
    if d is not None and (d.rows != FLASHINFER_8BIT_HEAD_DIM or d.state_dim != FLASHINFER_8BIT_D_STATE):
        out.append(
            _v(
                "shape",
                "flashinfer.cssu_8bit_shape",
                f"FlashInfer's 8-bit replay kernel takes head_dim {FLASHINFER_8BIT_HEAD_DIM} and d_state "
                f"{FLASHINFER_8BIT_D_STATE} only; this layer has head_dim {d.rows}, d_state {d.state_dim}",
            )
        )
    if s.scheme.buffer_dtype not in ("bf16", "fp16"):
        out.append(
            _v(
                "shape",
                "flashinfer.cssu_8bit_shape",
                f"FlashInfer's 8-bit replay kernel needs 2-byte inputs and keeps its ring in the input dtype; the "
                f"setting buffers {s.scheme.buffer_dtype}",
            )
        )


def _window(t: Target, s, T: int, fact: str, out: list, spec_fact: str | None = None) -> None:
    """The FlashInfer replay window's two rules, each citing the fact that states it: the <= 16 cap (``fact``) and,
    with drafts, L >= 1 + T (``spec_fact``, default ``fact``)."""
    L = s.buffer_len
    if L > FLASHINFER_MAX_WINDOW:
        out.append(
            _v(
                "buffer_len",
                fact,
                f"FlashInfer buffer length must be <= {FLASHINFER_MAX_WINDOW}; the setting uses L={L}",
            )
        )
    if T and L < 1 + T:
        out.append(
            _v(
                "spec_buffer",
                spec_fact or fact,
                f"speculative replay needs buffer length >= 1 + draft tokens: L={L}, T={T}",
            )
        )


def _kda(t: Target, s, out: list) -> None:
    """What each engine runs for a Kimi Delta Attention layer (GLM-5.3-Flash, Kimi-Linear, Kimi-K3)."""
    {"vllm": _vllm_kda, "trtllm": _trtllm_kda, "flashinfer": _flashinfer_kda, "sglang": _sglang_kda}[t.engine](
        t, s, out
    )


def kda_state_follows_flag(t: Target) -> str | None:
    """The fact under which vLLM's KDA layer of `t.arch` takes --mamba-ssm-cache-dtype at t.version, else None
    (its state is float32 whatever the flag says)."""
    fid = _KDA_FOLLOWS[t.kda_family]
    return fid if fid is not None and t.holds(fid) else None


def _vllm_kda(t: Target, s, out: list) -> None:
    """vLLM: the KDA state is float32 unless the model's layer passes the flag on (facts vllm.kda_*); replay is
    Kimi-K3's RecoverSSM."""
    enc, T, L = s.encoding, t.drafts(s), s.buffer_len
    fam, who = t.kda_family, KDA_FAMILY_NAMES[t.kda_family]
    if enc in EIGHT_BIT_ENCODINGS:
        if t.version == VLLM_PR_BUILD:
            out.append(
                _v("8bit_replay", "vllm.pr_8bit", f"{enc} state exists only under FlashInfer ReplaySSM (Mamba-2)")
            )
        else:
            out.append(_v("dtype", "vllm.state_dtype", f"vLLM {t.version} has no {enc} SSM state", value=repr(enc)))
    elif enc == "fp16":  # raised by the layers that pass the flag on, ignored (float32) by the others
        fid = "vllm.kda_state_dtype" if t.holds("vllm.kda_state_dtype") else "vllm.kda_state_fp32"
        out.append(
            _v(
                "dtype",
                fid,
                f"vLLM {t.version} keeps no float16 KDA state",
                **({"value": "float16"} if "{" in FACTS[fid].quote else {}),
            )
        )
    elif enc == "bf16" and not kda_state_follows_flag(t):
        if t.holds("vllm.kda_state_fp32"):
            fid, why = "vllm.kda_state_fp32", f"vLLM {t.version}'s KDA state is float32 for every model"
        elif fam is None:
            fid, why = (
                None,
                (
                    f"the recipe does not name the model's architecture, and vLLM {t.version} keeps a bfloat16 KDA state "
                    "only for Kimi-K3 (KimiK3ForConditionalGeneration, from 0.30.0) and GLM-5.3-Flash (Glm5Next, from "
                    "0.32.0); every other KDA layer stays float32 and ignores the flag"
                ),
            )
        elif fam == "glm5next":
            fid, why = (
                "vllm.kda_glm_follows",
                f"GLM-5.3-Flash's KDA state follows the flag only from vLLM 0.32.0 (this is {t.version})",
            )
        else:
            fid, why = "vllm.kda_linear_fp32", "Kimi-Linear's KDA layer keeps a float32 state and ignores the flag"
        out.append(
            _v(
                "dtype",
                fid,
                f"{why}; the setting stores bf16, which this vLLM would accept and not run",
                quote=fid != "vllm.kda_glm_follows",
            )
        )
    if s.rounding == "sr":
        out.append(_v("sr", "vllm.sr_mamba_only", "vLLM has no stochastic rounding for KDA state", quote=False))
    if not _replay(s):
        return
    if s.scheme_kind != "spec":
        out.append(
            _v(
                "layer_kind",
                "vllm.recoverssm",
                f"vLLM's KDA replay is RecoverSSM, which runs only with speculative decoding: a window of 1 + draft "
                f"tokens folded into the checkpoint every round (spec{1 + max(T, 1)}x{max(T, 1)}); the setting is "
                f"{s.scheme.name}",
                quote=False,
            )
        )
        return
    if not t.holds("vllm.recoverssm"):
        fid = "vllm.spec_refused_027" if t.holds("vllm.replay_flags") else "vllm.replay_flags"
        out.append(_v("scheme", fid, f"vLLM {t.version} has no RecoverSSM (KDA replay with drafts)"))
        return
    if fam != "kimi_k3":
        if fam == "glm5next" and t.holds("vllm.glm_no_replay"):
            out.append(
                _v(
                    "layer_kind",
                    "vllm.glm_no_replay",
                    "GLM-5.3-Flash has no RecoverSSM",
                    architecture="Glm5NextForConditionalGeneration",
                )  # fmt: skip
            )
        else:
            out.append(
                _v(
                    "layer_kind",
                    "vllm.kda_linear_fp32" if fam == "kimi_linear" else "vllm.recoverssm",
                    f"only Kimi-K3's KDA layer implements RecoverSSM; {who} model's layer would accept "
                    "--use-replayssm and decode conventionally"
                    if fam is not None
                    else "only Kimi-K3's KDA layer implements RecoverSSM, and the recipe does not name the model's "
                    "architecture",
                    quote=False,
                )
            )
    if L != 1 + T:
        out.append(
            _v(
                "buffer_len",
                "vllm.recoverssm",
                f"RecoverSSM verifies 1 + draft tokens against the checkpoint and folds them in every round, i.e. "
                f"spec{1 + T}x{T} for {T} draft tokens; the setting uses L={L}",
                quote=False,
            )
        )
    elif s.scheme.buffer_dtype != "fp32":
        out.append(
            _v(
                "layer_kind",
                "vllm.recoverssm",
                "vLLM's RecoverSSM records u_t in FP32 (and k, gate as the model's activations): measure with an "
                f"fp32 buffer (spec{L}x{T}:fp32), not {s.scheme.buffer_dtype}",
                quote=False,
            )
        )


def _trtllm_kda(t: Target, s, out: list) -> None:
    """TensorRT-LLM: float32 conventional KDA state only (fact trtllm.kda_fp32: the cache dtype is forced to float32
    for Kimi-Linear and GLM; trtllm.kda: the verify was not read)."""
    if s.encoding != "fp32":
        out.append(
            _v(
                "dtype",
                "trtllm.kda_fp32",
                f"TensorRT-LLM keeps the KDA state in float32 whatever the config asks for; the setting stores "
                f"{s.encoding}",
            )
        )
    if s.rounding == "sr":
        out.append(_v("sr", "trtllm.sr", "TensorRT-LLM documents stochastic rounding for Mamba SSM state updates only"))
    if _replay(s):
        out.append(
            _v(
                "layer_kind",
                "trtllm.kda",
                "TensorRT-LLM verifies KDA drafts with KDAReplayStateUpdateStrategy, whose window and flush rule were "
                f"not read: {s.scheme.name} is not exported",
                quote=False,
            )
        )


def _flashinfer_kda(t: Target, s, out: list) -> None:
    """FlashInfer's KDA kernels: fused_kda_decode keeps a float32 or bfloat16 state (float32 recurrence, a bfloat16
    state rounded when written back); recurrent_kda keeps a bfloat16 state and is the decode of the bfloat16 layers
    fused_kda_decode does not take (its speculative verify reads the committed state for up to 16 tokens and never
    writes it)."""
    enc, L = s.encoding, s.buffer_len
    spec = s.scheme_kind == "spec"
    if enc not in ("bf16", "fp32"):
        out.append(
            _v(
                "dtype",
                "flashinfer.fused_kda_decode",
                f"FlashInfer keeps KDA state in float32 or bfloat16, not {enc}",
                quote=False,
            )
        )
    elif enc == "fp32" and _replay(s):
        out.append(
            _v(
                "dtype",
                "flashinfer.kda_verify",
                "FlashInfer's KDA verify reads a bfloat16 state only, not fp32",
                quote=False,
            )
        )
    if s.rounding == "sr":
        out.append(_v("sr", "flashinfer.kda_decode", "FlashInfer's KDA decode has no stochastic rounding", quote=False))
    if s.scheme_kind == "replay":
        out.append(
            _v(
                "scheme",
                "flashinfer.kda_verify",
                f"FlashInfer has no KDA checkpoint + buffer decode without drafts; {s.scheme.name} is not what it "
                "runs (its KDA replay is the speculative verify)",
                quote=False,
            )
        )
    if spec and L > FLASHINFER_KDA_MAX_WINDOW:
        out.append(
            _v(
                "buffer_len",
                "flashinfer.kda_verify",
                f"the KDA verify takes at most {FLASHINFER_KDA_MAX_WINDOW} tokens, L={L}",
                quote=False,
            )
        )
    if _replay(s) or enc not in ("bf16", "fp32"):
        out += _recurrent_kda(t, spec)
        return
    fused = _fused_kda(t, enc)
    if enc == "fp32" or not fused:  # float32: fused_kda_decode only; bfloat16: it where it takes the layer
        out += fused
        return
    recurrent = _recurrent_kda(t, spec=False)
    if recurrent:  # neither kernel takes this bfloat16 layer here: both say why
        out += fused + recurrent


def _fused_kda(t: Target, enc: str) -> list[Violation]:
    """Why fused_kda_decode does not take a conventional `enc` KDA state here (GPU, heads, head_dim); [] if it does."""
    out = []
    if t.gpu not in FLASHINFER_FUSED_KDA_SM:
        out.append(
            _v(
                "gpu",
                "flashinfer.fused_kda_decode",
                f"FlashInfer's fused_kda_decode ({FLOAT_ENCODINGS[enc]} KDA state) "
                f"runs on SM 100 / 103 only, not sm{t.gpu}",
                quote=False,
            )  # fmt: skip
        )
    d = t.dims
    heads = FLASHINFER_FUSED_KDA_HEADS[t.version]
    if d is not None and (d.rows != 128 or d.state_dim != 128 or d.heads not in heads):
        out.append(
            _v(
                "shape",
                "flashinfer.fused_kda_decode",
                f"FlashInfer {t.version}'s fused_kda_decode takes head_dim 128 and {heads} heads, not "
                f"{d.heads} heads of K={d.state_dim}, V={d.rows}",
                quote=False,
            )
        )
    return out


def _recurrent_kda(t: Target, spec: bool) -> list[Violation]:
    """Why recurrent_kda (its decode, or with `spec` its speculative verify) does not run here; [] if it does."""
    out = []
    sms = FLASHINFER_KDA_VERIFY_SM if spec else FLASHINFER_KDA_DECODE_SM
    fact = "flashinfer.kda_verify" if spec else "flashinfer.kda_decode"
    if t.gpu not in sms:
        out.append(
            _v(
                "gpu",
                fact,
                f"FlashInfer's KDA {'verify' if spec else 'decode'} (recurrent_kda) does not run on sm{t.gpu}",
            )
        )
    d = t.dims
    if d is not None:
        K, V = d.state_dim, d.rows
        dims_ok = (128,) if spec else FLASHINFER_KDA_HEAD_DIMS
        if K != V or K not in dims_ok:
            out.append(
                _v(
                    "shape",
                    fact,
                    f"FlashInfer's KDA {'verify' if spec else 'decode'} takes K = V in {dims_ok}, not K={K}, V={V}",
                    quote=False,
                )
            )
    return out


def flashinfer_kda_kernel(t: Target, s) -> str:
    """The FlashInfer function that runs KDA setting `s` (which must have no violations on `t`): fused_kda_decode for
    a conventional state it takes, else recurrent_kda (bfloat16 decode, or the speculative verify)."""
    if not _replay(s) and s.encoding in ("bf16", "fp32") and not _fused_kda(t, s.encoding):
        return "flashinfer.fused_kda_decode"
    return "flashinfer.recurrent_kda"


def _vllm(t: Target, s, kind: str, out: list) -> None:
    enc, T, replay, sr = s.encoding, t.drafts(s), _replay(s), s.rounding == "sr"
    pr_build = t.version == VLLM_PR_BUILD
    eight = enc in EIGHT_BIT_ENCODINGS
    if eight and not pr_build:
        out.append(_v("dtype", "vllm.state_dtype", f"vLLM {t.version} has no {enc} SSM state", value=repr(enc)))
        if kind == "mamba2" and replay:
            out.append(
                _v(
                    "unreleased",
                    "vllm.pr_8bit",
                    f"{enc} state under FlashInfer ReplaySSM runs only on unreleased vLLM code (PR #52962): "
                    f"--engine-version {VLLM_PR_BUILD}",
                )
            )
    if eight and pr_build:
        if kind != "mamba2" or not replay:
            out.append(
                _v("8bit_replay", "vllm.pr_8bit", f"{enc} state exists only under FlashInfer ReplaySSM (Mamba-2)")
            )
        else:
            _flashinfer_8bit_shape(t, s, out)
    if sr:
        if kind != "mamba2":
            out.append(_v("sr", "vllm.sr_mamba_only", "vLLM has no stochastic rounding for Gated DeltaNet state"))
        elif pr_build and enc == "fp8_e4m3":
            if not replay:
                out.append(_v("sr", "vllm.pr_sr", "fp8_e4m3 stochastic rounding needs FlashInfer ReplaySSM"))
        elif enc != "fp16":
            fact = "vllm.pr_sr" if pr_build else "vllm.sr_fp16"
            out.append(_v("sr", fact, f"vLLM rounds stochastically only into a float16 SSM state, not {enc}"))
    if not replay:
        return
    if kind != "mamba2":
        out.append(_v("layer_kind", "vllm.replay_arch", "vLLM's ReplaySSM covers Mamba-2 (NemotronH) layers only"))
        return
    if not t.holds("vllm.replay_flags"):
        out.append(_v("scheme", "vllm.replay_flags", f"vLLM {t.version} has no ReplaySSM"))
        return
    if T:
        if t.holds("vllm.spec_refused_027"):
            out.append(_v("scheme", "vllm.spec_refused_027", "vLLM's ReplaySSM refuses speculative decoding here"))
        elif t.holds("vllm.spec_refused_029"):
            out.append(_v("scheme", "vllm.spec_refused_029", "vLLM's ReplaySSM refuses speculative decoding here"))
    backend = _vllm_backend(t, s)
    if backend == "triton":
        if sr and t.gpu // 10 != 10:
            out.append(
                _v(
                    "gpu",
                    "vllm.sr_triton_sm10x",
                    f"stochastic rounding on vLLM's Triton ReplaySSM (the only backend for L={s.buffer_len} at "
                    f"{t.version}) needs an SM 10.x GPU, not sm{t.gpu}",
                )
            )
    else:
        _window(t, s, T, "vllm.fi_max_window", out, spec_fact="vllm.spec_fi")


def _vllm_backend(t: Target, s) -> str:
    """vLLM Mamba backend: FlashInfer where a rule needs it and it runs the setting, else Triton (module doc)."""
    fi_replay = t.at_least("0.30.0")  # FlashInfer ReplaySSM backend
    if not _replay(s):
        return "flashinfer" if s.rounding == "sr" and t.gpu // 10 != 10 else "triton"
    if not fi_replay:
        return "triton"
    needs_fi = s.encoding in EIGHT_BIT_ENCODINGS or t.drafts(s) > 0 or (s.rounding == "sr" and t.gpu // 10 != 10)
    # FlashInfer is preferred whenever its window fits (before 0.34.0 Triton ReplaySSM also needs Model Runner V1)
    return "flashinfer" if needs_fi or s.buffer_len <= FLASHINFER_MAX_WINDOW else "triton"


def _trtllm(t: Target, s, kind: str, out: list) -> None:
    enc, T, sr = s.encoding, t.drafts(s), s.rounding == "sr"
    if enc in EIGHT_BIT_ENCODINGS:
        out.append(_v("dtype", "trtllm.state_dtype", f"TensorRT-LLM has no config knob for {enc} SSM state"))
    if sr and enc != "fp16":
        out.append(
            _v("sr", "trtllm.sr", f"TensorRT-LLM rounds stochastically only into a float16 SSM state, not {enc}")
        )
    if kind != "mamba2":
        if sr:
            out.append(
                _v("sr", "trtllm.sr", "TensorRT-LLM documents stochastic rounding for Mamba SSM state updates only")
            )
        if _replay(s):
            _trtllm_gdn_replay(t, s, T, out)
        return
    if not _replay(s):
        return
    if not T:
        out.append(
            _v(
                "scheme",
                "trtllm.replay_spec_only",
                f"TensorRT-LLM does not replay {s.scheme.name} without draft tokens",
            )
        )
        return
    _trtllm_history(s, T, "replay", out)
    if t.gpu < 80:
        out.append(_v("gpu", "trtllm.replay_gates", f"TensorRT-LLM replays on SM >= 80 only, not sm{t.gpu}"))
    if sr and enc == "fp16" and (t.gpu < 100 or t.gpu >= 120):
        out.append(
            _v(
                "gpu",
                "trtllm.replay_sr_sm",
                f"on sm{t.gpu} TensorRT-LLM turns replay off for float16 + stochastic rounding and stores the state "
                "every token",
            )
        )


def _trtllm_history(s, T: int, what: str, out: list) -> None:
    """The replay window must be TensorRT-LLM's history, max(16, 1 + T) tokens (fact trtllm.replay_history)."""
    hist = max(TRTLLM_MIN_REPLAY_HISTORY, 1 + T)
    if s.buffer_len != hist:
        out.append(
            _v(
                "buffer_len",
                "trtllm.replay_history",
                f"TensorRT-LLM's {what} history with {T} draft tokens is max(16, 1 + {T}) = {hist} tokens; the "
                f"setting uses L={s.buffer_len}",
            )
        )


def _trtllm_gdn_replay(t: Target, s, T: int, out: list) -> None:
    """TensorRT-LLM's GDN MTP replay (fact trtllm.gdn_replay, behind TRTLLM_USE_GDN_REPLAY=1): speculative decoding,
    at most 8 tokens per step, the 16-token history of the Mamba-2 replay, SM >= 80."""
    if not T:
        out.append(_v("scheme", "trtllm.gdn_replay", f"TensorRT-LLM does not replay {s.scheme.name} without drafts"))
        return
    if 1 + T > TRTLLM_GDN_REPLAY_MAX_TOKENS:
        out.append(
            _v(
                "draft_tokens",
                "trtllm.gdn_replay",
                f"TensorRT-LLM's GDN replay takes at most {TRTLLM_GDN_REPLAY_MAX_TOKENS} tokens per step, not 1 + {T}",
                quote=False,
            )
        )
        return
    _trtllm_history(s, T, "GDN replay", out)
    if t.gpu < 80:
        out.append(
            _v("gpu", "trtllm.gdn_replay", f"TensorRT-LLM replays GDN on SM >= 80 only, not sm{t.gpu}", quote=False)
        )


def _sglang(t: Target, s, kind: str, out: list) -> None:
    """SGLang on a Mamba-2, GDN or KDA layer (facts sglang.*)."""
    enc, T, sr, sk = s.encoding, t.drafts(s), s.rounding == "sr", s.scheme_kind
    if enc not in FLOAT_ENCODINGS and enc != "nvfp4":
        out.append(_v("dtype", "sglang.state_dtype", f"SGLang has no {enc} live SSM state", quote=False))
    if sr:
        if kind != "mamba2":
            out.append(_v("sr", "sglang.sr_mamba_only", f"SGLang has no stochastic rounding for {kind} state"))
        elif enc != "fp16":
            out.append(
                _v(
                    "sr",
                    "sglang.sr",
                    f"SGLang rounds stochastically only into a float16 SSM state, not {enc}",
                    value=repr(FLOAT_ENCODINGS.get(enc, enc)),
                )
            )
    if kind == "mamba2" and t.gpu < 80:  # the export runs Mamba-2 on FlashInfer's kernels
        out.append(_v("gpu", "flashinfer.sm80", f"FlashInfer's Mamba kernels need SM 8.x or later, not sm{t.gpu}"))
    if sk == "conventional":
        return
    if kind == "mamba2":
        out.append(
            _v(
                "layer_kind",
                "sglang.linear_replayssm",
                "SGLang's ReplaySSM covers GDN and KDA layers; Mamba-2 layers decode conventionally",
            )
        )
        return
    if sk == "replay":
        if T:
            out.append(
                _v(
                    "scheme",
                    "sglang.linear_replayssm_spec",
                    "with draft tokens SGLang's ReplaySSM is the fold-every-commit verify into a float32 checkpoint "
                    "(a spec scheme of a float32 state), not a replay window",
                )
            )
        if s.scheme.buffer_dtype != enc:  # buffer dtypes are named as the float encodings
            out.append(
                _v(
                    "buffer_dtype",
                    "sglang.linear_replayssm",
                    f"SGLang's ReplaySSM ring holds the inputs in the SSM dtype ({enc}); the setting measured a "
                    f"{s.scheme.buffer_dtype} ring",
                    quote=False,
                )
            )
        return
    # spec: fold-every-commit into a float32 checkpoint
    if enc != "fp32":
        out.append(
            _v(
                "dtype",
                "sglang.linear_replayssm_spec",
                f"SGLang's speculative ReplaySSM folds every commit into a float32 checkpoint; a {enc} state under it "
                "is not modelled",
                quote=False,
            )
        )
    if kind == "kda":
        L = s.buffer_len
        if L & (L - 1) or L < 2 * (1 + T):
            out.append(
                _v(
                    "spec_buffer",
                    "sglang.linear_replayssm_spec",
                    f"SGLang's KDA verify ring must be a power of two >= 2 x {1 + T} draft-window tokens; the setting "
                    f"uses L={L}",
                    quote=False,
                )
            )


def _sglang_kda(t: Target, s, out: list) -> None:
    _sglang(t, s, "kda", out)


def _flashinfer(t: Target, s, kind: str, out: list) -> None:
    enc, T, sr = s.encoding, t.drafts(s), s.rounding == "sr"
    if t.gpu < 80:
        out.append(_v("gpu", "flashinfer.sm80", f"FlashInfer's Mamba kernels are not built for sm{t.gpu}"))
    if kind != "mamba2":
        _flashinfer_gdn(t, s, out)
        return
    if not _replay(s):
        if enc in EIGHT_BIT_ENCODINGS:
            out.append(
                _v(
                    "8bit_replay",
                    "flashinfer.ssu_dtypes",
                    f"{enc} state exists only in FlashInfer's replay kernel checkpointing_ssu(state_scale=...); "
                    "selective_state_update has none",
                )
            )
        if sr and enc != "fp16":
            out.append(
                _v(
                    "sr",
                    "flashinfer.ssu_sr",
                    f"selective_state_update rounds stochastically only into float16, not {enc}",
                )
            )
        return
    _window(t, s, T, "flashinfer.cssu_window", out)
    if sr and enc in ("bf16", "fp32"):
        out.append(
            _v(
                "sr",
                "flashinfer.cssu_sr",
                f"checkpointing_ssu accepts rand_seed with {enc} state but rounds it to nearest",
            )
        )
    if enc in EIGHT_BIT_ENCODINGS:
        _flashinfer_8bit_shape(t, s, out)


def _flashinfer_gdn(t: Target, s, out: list) -> None:
    enc = s.encoding
    if _replay(s):
        out.append(
            _v(
                "scheme",
                "flashinfer.gdn_replay",
                f"FlashInfer's GDN replay commits every verify step into a float32 checkpoint; {s.scheme.name} "
                "is not what it runs",
            )
        )
    if enc not in ("fp32", "bf16"):
        out.append(
            _v("dtype", "flashinfer.gdn_decode_state", f"FlashInfer's GDN decode keeps float32 or bfloat16 state, not {enc}")
        )
    if s.rounding == "sr":
        out.append(_v("sr", "flashinfer.gdn_decode_state", "FlashInfer's GDN decode has no stochastic rounding"))
    if t.gpu < 90:
        out.append(_v("gpu", "flashinfer.gdn_decode", f"FlashInfer's GDN decode needs SM 90+, not sm{t.gpu}"))
    d = t.dims
    if d is not None:
        K, V = d.state_dim, d.rows
        if enc == "bf16" and (K, V) != (128, 128):
            out.append(
                _v(
                    "shape",
                    "flashinfer.gdn_decode_state",
                    f"bfloat16 GDN state needs K = V = 128, not K={K}, V={V}",
                )
            )
        if enc == "fp32" and (K < 128 or V < 128 or V % 8):
            out.append(
                _v(
                    "shape",
                    "flashinfer.gdn_decode_fp32_shape",
                    f"float32 GDN state needs K, V >= 128 and V % 8 == 0, not K={K}, V={V}",
                )
            )


# -- how a runnable setting runs ------------------------------------------------------------------------
def _kda_runtime(target: Target, s, tokens: int) -> Runtime:
    """vLLM / TensorRT-LLM on a KDA layer: conventional decode, or vLLM's RecoverSSM (Triton Mamba backend)."""
    if target.engine == "trtllm":
        return Runtime("conventional", 0, 0, tokens, facts=["trtllm.kda_fp32", "trtllm.kda"])
    facts = ["vllm.kda_state_fp32"] if target.holds("vllm.kda_state_fp32") else ["vllm.kda_state_dtype"]
    follows = kda_state_follows_flag(target)
    facts += [follows] if follows else (["vllm.kda_linear_fp32"] if target.kda_family == "kimi_linear" else [])
    if target.kda_family == "kimi_k3" and target.holds("vllm.kda_decode_backend"):
        facts.append("vllm.kda_decode_backend")
    if s.scheme_kind == "spec":
        return Runtime("triton", s.buffer_len, s.buffer_len, tokens, facts=facts + ["vllm.recoverssm"])
    return Runtime("triton", 0, 0, tokens, facts=facts)


def runtime(target: Target, setting, layer_kind: str) -> Runtime:
    """How `target` runs `setting` (which must have no violations): backend, window, ring, env, prefix caching,
    and the state copies it reserves per sequence."""
    rt = _runtime(target, setting, layer_kind)
    rt.state_copies, rt.state_copies_assume, fact = state_copies(target, setting, layer_kind, rt)
    if fact is not None and fact not in rt.facts:
        rt.facts.append(fact)
    return rt


def _prefill_checkpoint_pages(target: Target, layer_kind: str) -> tuple[int, str]:
    """vLLM's prefill-checkpoint page under prefix caching (fact vllm.state_pages): (pages, what decides it)."""
    if layer_kind == "mamba2":
        return 1, "Mamba-2's prefill checkpoint"
    if layer_kind == "gdn":
        # the FlashInfer GDN prefill is the default on SM 9.0, and on SM 10.x / 12.x with K = 128 under CUDA 13
        fi_prefill = target.gpu == 90 or (
            target.gpu // 10 in (10, 12) and getattr(target.dims, "state_dim", 128) == 128
        )
        return (
            (1, "the FlashInfer GDN prefill's checkpoint (assumes CUDA 13 on SM 10.x / 12.x)")
            if fi_prefill
            else (0, "no FlashInfer GDN prefill")
        )
    return 0, "no FlashKDA prefill (its checkpoint would add one)"


def state_copies(target: Target, setting, layer_kind: str, rt: Runtime) -> tuple[int, str, str | None]:
    """(copies of one layer's state the engine reserves per sequence, the engine setting assumed, the fact id).

    vLLM: its state pages, 1 + S without prefix caching, 2 + S + C with it (on by default for hybrid models);
    S the draft tokens (0 under ReplaySSM), C a prefill checkpoint page. TensorRT-LLM: the live state plus
    intermediate_ssm [1 + T] of a speculative step decoded without replay. FlashInfer: the caller's pool, one.
    """
    T = target.drafts(setting)
    if target.engine == "vllm" and not target.holds("vllm.state_pages"):
        return 1, f"one state counted: how vLLM {target.version} reserves state pages was not read", None
    if target.engine == "vllm":
        spec = 0 if rt.replay else T
        if rt.prefix_caching is False:
            return 1 + spec, f"prefix caching off; {spec} draft-token pages", "vllm.state_pages"
        extra, why = _prefill_checkpoint_pages(target, layer_kind)
        return (
            2 + spec + extra,
            f"prefix caching on (vLLM's default for hybrid models): 2 pages + {spec} draft-token pages + {extra} "
            f"({why})",
            "vllm.state_pages",
        )
    if target.engine == "trtllm" and T and not rt.replay:
        return (
            2 + T,
            f"speculative decoding without replay: the live state and intermediate_ssm [1 + {T}]",
            "trtllm.intermediate_ssm",
        )
    if target.engine == "sglang" and T and setting.scheme_kind != "spec":
        return (
            2 + T,
            f"speculative decoding: the live state and {1 + T} intermediate states (the verify window)",
            "sglang.spec_states",
        )
    return 1, "one state per sequence", None


# TensorRT-LLM's Mamba-2 mixer: FlashInfer's decode for these head sizes and heads per group (fact trtllm.fi_ssu)
TRTLLM_FI_HEAD_DIMS = (64, 128)
TRTLLM_FI_HEAD_GROUP_RATIOS = (1, 8, 16)


def trtllm_uses_flashinfer(dims) -> bool:
    """Whether TensorRT-LLM's Mamba-2 mixer decodes layers of ``dims`` with FlashInfer's kernels (trtllm.fi_ssu);
    False where the sizes are unknown (None)."""
    if dims is None or dims.groups < 1:
        return False
    return dims.rows in TRTLLM_FI_HEAD_DIMS and dims.heads // dims.groups in TRTLLM_FI_HEAD_GROUP_RATIOS


def _sglang_runtime(target: Target, s, layer_kind: str, tokens: int) -> Runtime:
    """SGLang: Mamba-2 on its FlashInfer backend (the kernel the flashinfer profile emulates); GDN / KDA on the Triton
    linear-attention decode, conventional, ReplaySSM (window L, ring L rows) or the fold-every-commit verify."""
    facts = ["sglang.state_dtype", "sglang.dtype_order"]
    if getattr(s, "prompt_store", None) is not None:  # the int8 prefix-cache checkpoint
        facts.append("sglang.int8_checkpoint")
    if layer_kind == "mamba2":
        facts += ["sglang.mamba_backend"] + (["sglang.sr"] if s.rounding == "sr" else [])
        return Runtime("flashinfer", 0, 0, tokens, facts=facts)
    facts.append("sglang.linear_decode")
    if s.scheme_kind == "replay":
        L = s.buffer_len
        return Runtime("triton.replayssm", L, L, tokens, facts=facts + ["sglang.linear_replayssm"])
    if s.scheme_kind == "spec":
        return Runtime(
            "triton.replayssm_spec", s.buffer_len, s.buffer_len, tokens, facts=facts + ["sglang.linear_replayssm_spec"]
        )
    return Runtime("triton", 0, 0, tokens, facts=facts)


def _runtime(target: Target, setting, layer_kind: str) -> Runtime:
    s, T = setting, target.drafts(setting)
    tokens = 1 + T
    e = target.engine
    if e == "sglang":
        return _sglang_runtime(target, s, layer_kind, tokens)
    if layer_kind == "kda" and e != "flashinfer":
        return _kda_runtime(target, s, tokens)
    if e == "vllm":
        backend = _vllm_backend(target, s)
        if not _replay(s):
            facts = ["vllm.state_dtype"] + (["vllm.sr_fp16", "vllm.sr_triton_sm10x"] if s.rounding == "sr" else [])
            if layer_kind == "gdn":  # where Qwen3.5 reads its HF key; which state dtypes keep the fused decode
                facts += ["vllm.hf_qwen35"] + (
                    ["vllm.fused_gdn_dtypes"] if target.holds("vllm.fused_gdn_dtypes") else []
                )
            return Runtime(backend, 0, 0, tokens, facts=facts)
        L = s.buffer_len
        if backend == "flashinfer":
            facts = ["vllm.fi_max_window", "vllm.ring"] + (["vllm.spec_fi"] if T else [])
            if target.holds("vllm.fi_replay_no_prefix"):
                return Runtime(
                    backend, L, L + tokens, tokens, prefix_caching=False, facts=["vllm.fi_replay_no_prefix", *facts]
                )
            # prefix caching stays on where the rings hold bfloat16 inputs, as measured; off otherwise
            prefix = None if s.scheme.buffer_dtype == "bf16" else False
            return Runtime(
                backend, L, L + tokens, tokens, prefix_caching=prefix, facts=["vllm.fi_replay_align", *facts]
            )
        env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if target.holds("vllm.triton_replay_v1") else {}
        facts = ["vllm.ring"] + (["vllm.triton_replay_v1"] if env else [])
        facts += ["vllm.v1_runner_removed"] if target.holds("vllm.v1_runner_removed") else []
        facts += ["vllm.replay_triton_only"] if target.holds("vllm.replay_triton_only") else []
        return Runtime(backend, L, L, tokens, env=env, facts=facts)
    if e == "trtllm":
        env_key = "TRTLLM_USE_MAMBA_REPLAY" if layer_kind == "mamba2" else "TRTLLM_USE_GDN_REPLAY"
        fi = layer_kind == "mamba2" and trtllm_uses_flashinfer(target.dims)
        if not _replay(s):
            # Mamba-2 replay is on by default with drafts (only "0" disables it); GDN replay is opt-in (unset: off)
            env = {env_key: "0"} if T and layer_kind == "mamba2" else {}
            facts = ["trtllm.replay_gates"] if layer_kind == "mamba2" else ["trtllm.gdn_replay"]
            if layer_kind == "mamba2" and target.dims is not None:
                facts.append("trtllm.fi_ssu")
            return Runtime("flashinfer" if fi else "conventional", 0, 0, tokens, env=env, facts=facts)
        hist = max(TRTLLM_MIN_REPLAY_HISTORY, tokens)
        facts = ["trtllm.replay_gates" if layer_kind == "mamba2" else "trtllm.gdn_replay", "trtllm.replay_history"]
        fi_replay = fi and s.encoding in FLOAT_ENCODINGS and tokens <= FLASHINFER_MAX_WINDOW
        if layer_kind == "mamba2" and target.dims is not None:
            facts += ["trtllm.fi_ssu", "trtllm.fi_checkpointing"]
        return Runtime(
            "flashinfer.replay" if fi_replay else "replay", hist, 2 * hist, tokens, env={env_key: "1"}, facts=facts
        )
    if layer_kind == "kda":
        if s.scheme_kind == "spec":  # the committed state, read-only, for the L tokens of a verify
            return Runtime(
                "flashinfer.recurrent_kda", s.buffer_len, s.buffer_len, tokens, facts=["flashinfer.kda_verify"]
            )
        if flashinfer_kda_kernel(target, s) == "flashinfer.fused_kda_decode":
            return Runtime("flashinfer.fused_kda_decode", 0, 0, tokens, facts=["flashinfer.fused_kda_decode"])
        return Runtime("flashinfer.recurrent_kda", 0, 0, tokens, facts=["flashinfer.kda_decode"])
    if layer_kind != "mamba2":
        facts = ["flashinfer.gdn_decode"] + (["flashinfer.gdn_null_slot"] if s.encoding == "bf16" else [])
        return Runtime("flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose", 0, 0, tokens, facts=facts)
    if not _replay(s):
        return Runtime("flashinfer.mamba.selective_state_update", 0, 0, tokens, facts=["flashinfer.ssu_dtypes"])
    L = s.buffer_len
    facts = ["flashinfer.cssu_window", "flashinfer.tie_hdim"]
    if s.encoding in EIGHT_BIT_ENCODINGS:
        facts += ["flashinfer.cssu_8bit_shape", "flashinfer.scale"]
    return Runtime("flashinfer.mamba.checkpointing_ssu", L, L + tokens, tokens, facts=facts)


def engine_bytes(target: Target, setting, layer_kind: str, dims, rt: Runtime | None = None) -> dict[str, int]:
    """Bytes per sequence and SSM layer in the engine's own buffers: {"state", "scales", "ring", "slot", "total"}.

    state: the state tensors [heads, rows, state_dim], times the copies the engine reserves per sequence
    (``Runtime.state_copies``); scales: 8-bit decode scales, FP32 per row, as many; ring: the
    replay buffers the engine allocates (vLLM / FlashInfer: x, B and dt rows; TensorRT-LLM: two buffers of
    x, B, dt and dA_cumsum); slot: per-sequence bookkeeping (FlashInfer ring_start and
    prev_num_accepted_tokens; TensorRT-LLM prev_num_accepted_tokens and cache_buf_idx, shared by all
    layers but counted here per layer). Buffered inputs are in the setting's buffer dtype (the model's
    activation dtype in the engines).
    """
    rt = runtime(target, setting, layer_kind) if rt is None else rt
    s = setting
    state = rt.state_copies * dims.heads * dims.rows * dims.state_dim * ELEMENT_BYTES[s.encoding]
    scales = rt.state_copies * dims.heads * dims.rows * 4 if s.encoding in SCALED_STATE_ENCODINGS else 0
    act = {"bf16": 2, "fp16": 2, "fp32": 4}[s.scheme.buffer_dtype]
    ring = slot = 0
    if rt.replay and target.engine == "sglang":
        # per ring row: d (value heads x V) and k (key heads x K) in the ring dtype, the gate in float32 (KDA's per
        # key channel)
        gate = dims.heads * (dims.state_dim if layer_kind == "kda" else 1) * 4
        ring = rt.ring_rows * ((dims.heads * dims.rows + dims.groups * dims.state_dim) * act + gate)
    elif rt.replay and layer_kind == "kda":
        # per verified token and value head: a float32 correction over V and the raw key | gate (2K) in the
        # activation dtype (FlashInfer's correction_cache / kg_cache; vLLM's RecoverSSM records the same)
        kg = 2 if target.engine == "flashinfer" else act
        ring = rt.ring_rows * dims.heads * (dims.rows * 4 + 2 * dims.state_dim * kg)
    elif rt.replay:
        vectors = (dims.heads * dims.rows + dims.groups * dims.state_dim) * act
        if target.engine == "trtllm":
            ring = rt.ring_rows * (vectors + 2 * dims.heads * 4)  # old_x, old_B, old_dt, old_dA_cumsum
            slot = 2 * 4
        else:
            ring = rt.ring_rows * (vectors + dims.heads * 4)  # x, B, dt
            slot = 2 * 4 if target.engine == "flashinfer" else 0
    return {"state": state, "scales": scales, "ring": ring, "slot": slot, "total": state + scales + ring + slot}
