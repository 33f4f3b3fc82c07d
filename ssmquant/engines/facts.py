"""Serving-engine facts as versioned data, each with the version range it holds for and where it was read.

A `Fact` is one statement about an engine (what a knob accepts, what a kernel checks, what a config
validator rejects), the engine versions it holds for, the engine's own words where it has any (an error
message, a type, a log line), and the sources it was read from (repository path and release or commit).
`deployments.py` turns facts into checks on one measured setting; the export cites them in every message.

Versions are the releases whose source was read, in order; a fact holds for the half-open range
[since, until) of that list (None: open end). A *build* is a release plus open pull requests: it is
listed after its release, it is never a default, and every output that uses it says so with the PR
numbers. Versions that were not read are refused rather than guessed.

Where a description of an engine disagreed with its released source, the source wins; ssmquant/export/README.md
lists those points.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import SsmquantError

ENGINES = ("vllm", "trtllm", "flashinfer", "sglang")
ENGINE_NAMES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "flashinfer": "FlashInfer", "sglang": "SGLang"}
# The layer kinds each engine serves (ssmquant's kind names); the facts below refine what each serves them with.
# A kind outside an engine's list gets one violation naming the kinds it serves, before any other rule is read.
SERVED_KINDS: dict[str, tuple[str, ...]] = {
    "vllm": ("mamba2", "gdn", "kda"),
    "trtllm": ("mamba2", "gdn", "kda"),
    "flashinfer": ("mamba2", "gdn", "kda"),
    "sglang": ("mamba2", "gdn", "kda"),
}
# The prompt stores (formats.prompt_store) each engine keeps a cached prompt's state in (fact sglang.int8_checkpoint);
# a variant naming another is refused by that engine.
PROMPT_STORES_KEPT: dict[str, tuple[str, ...]] = {"vllm": (), "trtllm": (), "flashinfer": (), "sglang": ("int8col",)}
# The state encodings the facts below were read for (what each engine stores is then their rules' business). A
# state encoding outside this list is refused for every engine until its facts are read: the rules name the encodings
# they refuse, and an unnamed one would pass them unchecked.
RULED_ENCODINGS = ("fp32", "bf16", "fp16", "int8", "fp8_e4m3", "nvfp4", "int16")

# Releases read, oldest first (vLLM and FlashInfer: the PyPI wheels; TensorRT-LLM: its repository at one
# commit of main, because its PyPI package is a 10 kB stub that downloads the wheel from NVIDIA's own index,
# which cannot be reached here).
# Re-checked 2026-11-30 against the newest releases on PyPI (`pip index versions`): vllm 0.33.0, flashinfer-python
# 0.7.4, tensorrt-llm 1.2.1 (the stub): nothing newer than the versions below. Every FlashInfer quote below was
# found again in the 0.7.4 wheel, except gdn_replay's, which 0.7.4 words "ReplaySSM caching requires SM100/SM103
# or SM120" (flashinfer/gdn_decode.py; the fact's text says so). vLLM 0.25.1 exists but was not read.
VLLM_PR_BUILD = "0.33.0+pr52962"
TRTLLM_MAIN = "main@2829508"
VERSIONS: dict[str, tuple[str, ...]] = {
    "vllm": (
        "0.25.0",
        "0.26.0",
        "0.27.0",
        "0.27.1",
        "0.28.0",
        "0.29.0",
        "0.30.0",
        "0.31.0",
        "0.32.0",
        "0.33.0",
        "0.34.0",
        VLLM_PR_BUILD,
    ),  # fmt: skip
    "trtllm": (TRTLLM_MAIN,),
    "flashinfer": ("0.7.0.post1", "0.7.2.post1", "0.7.4"),
    "sglang": ("0.5.23",),
}


@dataclass(frozen=True)
class Build:
    """A release plus open pull requests: base release, the PRs (in stack order) and their state when read."""

    base: str
    prs: tuple[str, ...]
    state: str

    def label(self, engine: str) -> str:
        return (
            f"UNRELEASED {ENGINE_NAMES[engine]} code: {self.base} plus {', '.join(self.prs)} ({self.state}); "
            "no release runs this"
        )


BUILDS: dict[str, dict[str, Build]] = {
    "vllm": {
        VLLM_PR_BUILD: Build(
            "0.33.0",
            ("vllm-project/vllm#52962",),
            "open when read (2026-08-19); stacked on #52506 and #52928, whose config checks are in the 0.32.0 "
            "release; its code was not read, only its description",
        )
    }
}
RELEASES = {e: tuple(v for v in vs if v not in BUILDS.get(e, {})) for e, vs in VERSIONS.items()}
DEFAULT_VERSION = {e: RELEASES[e][-1] for e in ENGINES}


@dataclass(frozen=True)
class Source:
    """Where a fact was read: repository, path inside it, and the release or commit."""

    repo: str
    path: str
    ref: str

    def __str__(self) -> str:
        return f"{self.repo}:{self.path} @ {self.ref}"


@dataclass(frozen=True)
class Fact:
    """One engine fact. since/until: covered versions, [since, until) (None: open); quote: the engine's words."""

    id: str
    engine: str
    says: str
    sources: tuple[Source, ...]
    since: str | None = None
    until: str | None = None
    quote: str | None = None
    read_in: tuple[str, ...] = field(default_factory=tuple)

    def holds(self, version: str) -> bool:
        """Whether the fact holds at ``version``: a release by the order of the releases read; a build as its base
        release, except for the facts that the build itself starts (since) or ends (until)."""
        builds = BUILDS.get(self.engine, {})
        if version in builds:
            if self.since == version:
                return True
            if self.until == version:
                return False
            version = builds[version].base
        if self.since in builds:  # a fact of that build alone
            return False
        order = RELEASES[self.engine]
        i = order.index(version)
        lo = 0 if self.since is None else order.index(self.since)
        hi = len(order) if self.until is None or self.until in builds else order.index(self.until)
        return lo <= i < hi

    @property
    def range(self) -> str:
        builds = BUILDS.get(self.engine, {})
        if self.since in builds:
            return self.since
        order = RELEASES[self.engine]
        lo = order[0] if self.since is None else self.since
        if self.until is None or self.until in builds:
            return f"{lo} and later read" if lo != order[-1] else lo
        return f"{lo} to {order[order.index(self.until) - 1]}"

    def cite(self) -> str:
        """'[vLLM 0.30.0 to 0.33.0; vllm-project/vllm:vllm/config/vllm.py @ 0.33.0]'."""
        return f"[{ENGINE_NAMES[self.engine]} {self.range}; {self.sources[0]}]"


def _refs(versions: tuple[str, ...]) -> str:
    if len(versions) <= 2:
        return ", ".join(versions)
    return f"{versions[0]} to {versions[-1]} ({len(versions)} releases read)"


def _vllm(path: str, *versions: str) -> Source:
    return Source(
        "vllm-project/vllm",
        path,
        f"vllm {_refs(versions)} wheels" if len(versions) > 1 else f"vllm {versions[0]} wheel",
    )


def _fi(path: str, *versions: str) -> Source:
    return Source("flashinfer-ai/flashinfer", path, f"flashinfer-python {_refs(versions or ('0.7.2.post1',))} wheel")


def _trt(path: str, commit: str) -> Source:
    return Source("NVIDIA/TensorRT-LLM", path, f"main {commit}")


def _sgl(path: str, version: str = "0.5.23") -> Source:
    return Source("sgl-project/sglang", f"python/sglang/{path}", f"sglang {version} wheel")


def _issue(what: str) -> Source:
    """A statement taken from the text of ssmquant issue 26, not read in the engine's source here: TensorRT-LLM's
    source is not on PyPI (the `tensorrt-llm` package is a stub), so these are marked as such in every citation."""
    return Source("NVIDIA/TensorRT-LLM", f"(not read here) {what}", "as stated in ssmquant issue 26")


# the releases read before 0.34.0 (a source read again at 0.34.0 names it beside them)
V_ALL = VERSIONS["vllm"][: VERSIONS["vllm"].index("0.33.0") + 1]
V34 = "0.34.0"

FACTS: dict[str, Fact] = {
    f.id: f
    for f in [
        # -- vLLM --------------------------------------------------------------------------------------
        Fact(
            "vllm.state_dtype",
            "vllm",
            "--mamba-ssm-cache-dtype takes auto, float32, float16, bfloat16 (MambaDType); any other value fails "
            "argument parsing",
            (
                _vllm("vllm/config/cache.py", *V_ALL),
                _vllm("vllm/engine/arg_utils.py", "0.33.0"),
                _vllm("vllm/config/cache.py", V34),
            ),
            until=VLLM_PR_BUILD,
            quote="argument --mamba-ssm-cache-dtype: invalid choice: {value} (choose from 'auto', 'bfloat16', "
            "'float16', 'float32')",
        ),
        Fact(
            "vllm.pr_8bit",
            "vllm",
            "int8 / fp8_e4m3 SSM state with one FP32 decode scale per (head, head_dim), only under FlashInfer "
            "ReplaySSM (Mamba-2); convolution state and the replay ring keep their dtypes",
            (Source("vllm-project/vllm", "pull/52962 (description)", "open, 2026-08-19"),),
            since=VLLM_PR_BUILD,
            quote="Add INT8 and FP8 E4M3 SSM-cache dtypes for FlashInfer ReplaySSM. [...] Reject quantized SSM "
            "caches outside FlashInfer ReplaySSM.",
        ),
        Fact(
            "vllm.sr_fp16",
            "vllm",
            "stochastic rounding (--enable-mamba-cache-stochastic-rounding) needs --mamba-ssm-cache-dtype float16",
            (
                _vllm("vllm/config/vllm.py", *V_ALL),
                _vllm("vllm/config/vllm.py", V34),
            ),
            until=VLLM_PR_BUILD,
            quote="Stochastic rounding for Mamba cache requires the SSM cache to be float16.",
        ),
        Fact(
            "vllm.pr_sr",
            "vllm",
            "stochastic rounding on float16 state, and on fp8_e4m3 state through FlashInfer ReplaySSM (the PR "
            "describes no stochastic rounding for int8)",
            (Source("vllm-project/vllm", "pull/52962 (description)", "open, 2026-08-19"),),
            since=VLLM_PR_BUILD,
            quote="Preserve stochastic rounding for FP8 through the existing Mamba SSU seed and Philox-round controls.",
        ),
        Fact(
            "vllm.sr_triton_sm10x",
            "vllm",
            "stochastic rounding on the Triton Mamba backend needs a compute capability 10.x GPU "
            "(is_device_capability_family(100)); the FlashInfer backend has no such check",
            (
                _vllm("vllm/config/mamba.py", *V_ALL),
                _vllm("vllm/platforms/interface.py", "0.33.0"),
                _vllm("vllm/config/mamba.py", V34),
            ),
            quote="Stochastic rounding for Mamba cache with triton backend requires compute capability 10.0 "
            "(data center Blackwell). [...] or set `--mamba-backend flashinfer`.",
        ),
        Fact(
            "vllm.sr_mamba_only",
            "vllm",
            "stochastic rounding is applied only by the Mamba selective-state-update backends; Gated DeltaNet "
            "layers decode with kernels that take no rounding option",
            (
                _vllm("vllm/model_executor/layers/mamba/ops/ssu_dispatch.py", "0.30.0", "0.31.0", "0.32.0", "0.33.0"),
                _vllm("vllm/model_executor/layers/mamba/ops/ssu_dispatch.py", V34),
            ),
            read_in=("0.30.0", "0.31.0", "0.32.0", "0.33.0"),
        ),
        Fact(
            "vllm.philox",
            "vllm",
            "--mamba-cache-philox-rounds defaults to 0: Triton's default rounds (tl.randint, 10) on the Triton "
            "backend, 10 on the FlashInfer backend",
            (
                _vllm("vllm/model_executor/layers/mamba/ops/ssu_dispatch.py", "0.33.0"),
                _vllm("vllm/model_executor/layers/mamba/ops/ssu_dispatch.py", V34),
            ),
            quote="philox_rounds=self._mamba_config.stochastic_rounding_philox_rounds or 10",
        ),
        Fact(
            "vllm.replay_flags",
            "vllm",
            "ReplaySSM: --use-replayssm and --replayssm-buffer-len (default 16); absent before 0.27.0",
            (
                _vllm("vllm/config/cache.py", "0.27.0", "0.33.0"),
                _vllm("vllm/config/cache.py", V34),
            ),
            since="0.27.0",
            quote="replayssm_buffer_len: int = Field(default=16, gt=0)",
        ),
        Fact(
            "vllm.replay_arch",
            "vllm",
            "ReplaySSM runs only for models marked SupportsReplaySSM: NemotronH (Mamba-2); Gated DeltaNet models "
            "decode conventionally",
            (
                _vllm("vllm/model_executor/models/nemotron_h.py", "0.33.0"),
                _vllm("vllm/config/vllm.py", *V_ALL[2:]),
                _vllm("vllm/config/vllm.py", V34),
            ),
            since="0.27.0",
            quote="--use-replayssm is not supported for architecture {architecture!r}",
        ),
        Fact(
            "vllm.replay_triton_only",
            "vllm",
            "ReplaySSM runs only on the Triton Mamba backend",
            (_vllm("vllm/config/vllm.py", "0.27.0", "0.27.1", "0.28.0", "0.29.0"),),
            since="0.27.0",
            until="0.30.0",
            quote="--use-replayssm requires --mamba-backend triton",
        ),
        Fact(
            "vllm.fi_replay_no_prefix",
            "vllm",
            "FlashInfer ReplaySSM refuses prefix caching, which is on by default for hybrid models and turns "
            "the Mamba cache mode to 'align'; the export passes --no-enable-prefix-caching",
            (
                _vllm("vllm/config/vllm.py", "0.30.0", "0.31.0", "0.32.0", "0.33.0"),
                _vllm("vllm/model_executor/models/config.py", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"),
                _vllm("vllm/config/model.py", "0.33.0"),
            ),
            since="0.30.0",
            until="0.34.0",
            quote="FlashInfer ReplaySSM does not support prefix caching yet; use --disable-prefix-caching",
        ),
        Fact(
            "vllm.triton_replay_v1",
            "vllm",
            "Triton ReplaySSM needs Model Runner V1, while V2 is the default wherever Triton is installed; the "
            "export sets VLLM_USE_V2_MODEL_RUNNER=0",
            (_vllm("vllm/config/vllm.py", "0.30.0", "0.31.0", "0.32.0", "0.33.0"),),
            since="0.30.0",
            until="0.34.0",
            quote="Triton ReplaySSM requires Model Runner V1; use --mamba-backend flashinfer or Model Runner V1",
        ),
        Fact(
            "vllm.fi_max_window",
            "vllm",
            "FlashInfer ReplaySSM needs --replayssm-buffer-len <= 16 (checked by the config from 0.32.0, by "
            "the kernel's max_window assert before)",
            (
                _vllm("vllm/config/vllm.py", "0.32.0", "0.33.0"),
                _fi("flashinfer/mamba/checkpointing_ssu.py"),
                _vllm("vllm/config/vllm.py", V34),
            ),
            since="0.30.0",
            quote="FlashInfer ReplaySSM requires --replayssm-buffer-len <= 16",
        ),
        Fact(
            "vllm.spec_refused_027",
            "vllm",
            "ReplaySSM refuses speculative decoding",
            (_vllm("vllm/config/vllm.py", "0.27.0", "0.27.1", "0.28.0"),),
            since="0.27.0",
            until="0.29.0",
            quote="--use-replayssm does not support speculative decoding",
        ),
        Fact(
            "vllm.spec_refused_029",
            "vllm",
            "ReplaySSM with speculative decoding is RecoverSSM, which only Kimi-K3 / Kimi-Linear KDA models take",
            (_vllm("vllm/config/vllm.py", "0.29.0", "0.30.0", "0.31.0"),),
            since="0.29.0",
            until="0.32.0",
            quote="RecoverSSM is only supported for Kimi-K3 KDA",
        ),
        Fact(
            "vllm.spec_fi",
            "vllm",
            "Mamba-2 ReplaySSM with speculative decoding: FlashInfer backend only, --replayssm-buffer-len >= 1 + "
            "num_speculative_tokens",
            (
                _vllm("vllm/config/vllm.py", "0.32.0", "0.33.0"),
                _vllm("vllm/config/vllm.py", V34),
            ),
            since="0.32.0",
            quote="FlashInfer ReplaySSM speculative decoding requires --replayssm-buffer-len >= 1 + "
            "num_speculative_tokens",
        ),
        Fact(
            "vllm.ring",
            "vllm",
            "ReplaySSM ring per layer and sequence: x (heads, rows, head_dim) and B (groups, rows, d_state) in the "
            "activation dtype, dt (heads, rows) in float32; rows = L on Triton, L + 1 + num_speculative_tokens "
            "on FlashInfer",
            (
                _vllm("vllm/model_executor/layers/mamba/mamba_utils.py", "0.30.0", "0.32.0", "0.33.0"),
                _vllm("vllm/config/cache.py", "0.30.0", "0.32.0", "0.33.0"),
                _vllm("vllm/model_executor/layers/mamba/mamba_utils.py", V34),
            ),
            since="0.27.0",
            quote="ReplaySSM logical history length B for Mamba2. Triton uses B physical rows and FlashInfer uses B+T",
        ),
        Fact(
            "vllm.mamba_cache_mode",
            "vllm",
            "--mamba-cache-mode follows prefix caching ('align' with it, 'none' without); deprecated and without "
            "effect in 0.33.0",
            (_vllm("vllm/engine/arg_utils.py", "0.33.0"), _vllm("vllm/model_executor/models/config.py", "0.33.0")),
            until="0.34.0",
            quote="--mamba-cache-mode is deprecated and will be removed in v0.33.0. It has no effect: Mamba prefix "
            "caching follows --enable-prefix-caching.",
        ),
        Fact(
            "vllm.mamba_cache_mode_034",
            "vllm",
            "--mamba-cache-mode follows prefix caching ('align' with it, 'none' without); deprecated and without "
            "effect",
            (_vllm("vllm/engine/arg_utils.py", V34), _vllm("vllm/model_executor/models/config.py", V34)),
            since="0.34.0",
            quote="--mamba-cache-mode is deprecated and will be removed in v0.34.0. It has no effect: Mamba prefix "
            "caching follows --enable-prefix-caching.",
        ),
        Fact(
            "vllm.v1_runner_removed",
            "vllm",
            "Model Runner V1 is gone: VLLM_USE_V2_MODEL_RUNNER set to anything but 1 stops start-up, so Triton "
            "ReplaySSM runs on the default runner with no environment variable",
            (_vllm("vllm/platforms/interface.py", V34), _vllm("vllm/envs.py", V34)),
            since="0.34.0",
            quote="VLLM_USE_V2_MODEL_RUNNER={value} is no longer supported: Model Runner V1 has been removed. Unset "
            "this variable.",
        ),
        Fact(
            "vllm.fi_replay_align",
            "vllm",
            "FlashInfer ReplaySSM takes prefix caching (mamba_cache_mode 'align', on by default for hybrid models), "
            "with or without speculative decoding, when the model dtype is bfloat16 (its replay rings hold the "
            "inputs in it); the prefixes are materialised by flashinfer.mamba.replayssm_materialize. With another "
            "model dtype the export turns prefix caching off",
            (_vllm("vllm/config/vllm.py", V34), _vllm("vllm/v1/worker/replayssm_utils.py", V34)),
            since="0.34.0",
            quote="FlashInfer ReplaySSM align requires bfloat16 model inputs for its replay rings; SSM state cache "
            "dtype is independent",
        ),
        Fact(
            "vllm.state_pages",
            "vllm",
            "state pages reserved per sequence and Mamba layer group: 1 + S without prefix caching, 2 + S + C with "
            "it (mamba_cache_mode 'align'); S = num_speculative_tokens, 0 under --use-replayssm; C = 1 prefill "
            "checkpoint page for Mamba-2, for Qwen GDN only with the FlashInfer GDN prefill (the default on SM 9.0, "
            "and on SM 10.x / 12.x with K = 128 and CUDA 13), for Kimi-K3 / GLM KDA only with the FlashKDA prefill, "
            "0 for Kimi-Linear. A page holds the conv and SSM states, padded to the attention page size in hybrids",
            (
                _vllm("vllm/v1/kv_cache_interface.py", "0.33.0", V34),
                _vllm("vllm/model_executor/layers/mamba/abstract.py", "0.33.0", V34),
                _vllm("vllm/model_executor/layers/mamba/mamba_mixer2.py", V34),
                _vllm("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py", V34),
            ),
            since="0.33.0",
            quote="page_size_bytes * (2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks)",
        ),
        Fact(
            "vllm.hf_nemotron",
            "vllm",
            "with --mamba-ssm-cache-dtype auto, NemotronH takes mamba_ssm_cache_dtype from the top level of the HF "
            "config (default float32) with getattr, unchecked: a value the release has no kernel for (int8) is "
            "not refused there; an explicit flag wins",
            (
                _vllm("vllm/model_executor/models/config.py", *V_ALL),
                _vllm("vllm/model_executor/models/config.py", V34),
            ),
            quote='mamba_ssm_cache_dtype: MambaDType = getattr(hf_config, "mamba_ssm_cache_dtype", '
            "cls.DEFAULT_MAMBA_SSM_CACHE_DTYPE)",
        ),
        Fact(
            "vllm.hf_qwen35",
            "vllm",
            "with --mamba-ssm-cache-dtype auto, Qwen3.5 takes mamba_ssm_dtype from its text config (hf_text_config: "
            "text_config of the multimodal Qwen3_5(Moe)ForConditionalGeneration checkpoints, the top level of "
            "Qwen3_5(Moe)ForCausalLM); a top-level key of a multimodal checkpoint is ignored. Qwen3-Next and the "
            "KDA models read no HF key: the flag is their only knob",
            (
                _vllm("vllm/model_executor/models/config.py", *V_ALL),
                _vllm("vllm/model_executor/models/config.py", V34),
            ),
            quote='mamba_ssm_dtype = getattr(hf_text_config, "mamba_ssm_dtype", None)',
        ),
        Fact(
            "vllm.fused_gdn_dtypes",
            "vllm",
            "Qwen's fused CUDA GDN decode takes a float32 or bfloat16 recurrent state only (and a bf16 model, K = V "
            "= 128, SM 8.0+); a float16 state falls back to the Triton GDN path, while bfloat16 is the same size "
            "and stays on the fused kernel",
            (
                _vllm("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py", *V_ALL[4:]),
                _vllm("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py", V34),
            ),
            since="0.28.0",
            quote="FUSED_GDN_STATE_DTYPES = (torch.float32, torch.bfloat16)",
        ),
        Fact(
            "vllm.kda_state_fp32",
            "vllm",
            "the KDA recurrent state is float32 whatever --mamba-ssm-cache-dtype says "
            "(MambaStateDtypeCalculator.kda_state_dtype takes no SSM cache dtype)",
            (_vllm("vllm/model_executor/layers/mamba/mamba_utils.py", *V_ALL[:6]),),
            until="0.30.0",
            quote="return (state_dtype, torch.float32)",
        ),
        Fact(
            "vllm.kda_state_dtype",
            "vllm",
            "MambaStateDtypeCalculator.kda_state_dtype maps the SSM cache dtype it is given to the KDA recurrent "
            "state: auto -> float32, float32, bfloat16; any other value raises at model construction",
            (
                _vllm("vllm/model_executor/layers/mamba/mamba_utils.py", *V_ALL[6:]),
                _vllm("vllm/model_executor/layers/mamba/mamba_utils.py", V34),
            ),
            since="0.30.0",
            quote="KDA recurrent state supports only auto, float32, and bfloat16; got {value}",
        ),
        Fact(
            "vllm.kda_k3_follows",
            "vllm",
            "Kimi-K3's KDA layer (KimiK3DeltaAttention) passes --mamba-ssm-cache-dtype to kda_state_dtype: its "
            "state follows the flag (float32 or bfloat16)",
            (
                _vllm("vllm/models/kimi_k3/nvidia/kda.py", *V_ALL[6:]),
                _vllm("vllm/models/kimi_k3/nvidia/kda.py", V34),
            ),
            since="0.30.0",
            quote="self.cache_config.mamba_ssm_cache_dtype,",
        ),
        Fact(
            "vllm.kda_glm_follows",
            "vllm",
            "GLM-5.3-Flash's KDA layer (Glm5Next) passes --mamba-ssm-cache-dtype to kda_state_dtype from 0.32.0: "
            "its state follows the flag (float32 or bfloat16); in 0.30.0 and 0.31.0 it passes only the conv cache "
            "dtype, so the state stays float32",
            (
                _vllm("vllm/models/glm5next/common/kda.py", "0.31.0", "0.32.0", "0.33.0"),
                _vllm("vllm/models/glm5next/nvidia/kda.py", "0.30.0"),
                _vllm("vllm/models/glm5next/common/kda.py", V34),
            ),
            since="0.32.0",
            quote="self.cache_config.mamba_ssm_cache_dtype,",
        ),
        Fact(
            "vllm.kda_linear_fp32",
            "vllm",
            "Kimi-Linear's KDA layer (kimi_gdn_linear_attn.py, KimiLinearForCausalLM without Kimi-K3's full-rank "
            "gate) passes only the conv cache dtype to kda_state_dtype: its state stays float32 whatever "
            "--mamba-ssm-cache-dtype says, and it never reads use_kda_recoverssm",
            (
                _vllm("vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py", *V_ALL),
                _vllm("vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py", V34),
            ),
            quote="return MambaStateDtypeCalculator.kda_state_dtype(self.model_config.dtype, "
            "self.cache_config.mamba_cache_dtype)",
        ),
        Fact(
            "vllm.kda_decode_backend",
            "vllm",
            "--kda-decode-backend {auto, native, flashinfer, triton} (default auto), read by Kimi-K3's KDA layer "
            "only: auto takes the native fused kernel (float32 state, head_dim 128, 12/24/48/96 heads per GPU, no "
            "drafts, SM 90 / 10.x / 12.x), else Triton; FlashInfer's fused_kda_decode (SM 10.x, float32 or bfloat16 "
            "state, no drafts) runs only when asked for with --kda-decode-backend flashinfer",
            (
                _vllm("vllm/models/kimi_k3/nvidia/kda.py", *V_ALL[6:]),
                _vllm("vllm/engine/arg_utils.py", *V_ALL[6:]),
                _vllm("vllm/models/kimi_k3/nvidia/kda.py", V34),
            ),
            since="0.30.0",
            quote='choices=["auto", "native", "flashinfer", "triton"]',
        ),
        Fact(
            "vllm.recoverssm",
            "vllm",
            "KDA replay is RecoverSSM: --use-replayssm with speculative decoding on a Kimi architecture "
            "(KimiLinearForCausalLM, KimiK3ForConditionalGeneration; KimiK31ForConditionalGeneration from 0.34.0), "
            "the Triton Mamba backend, no stochastic "
            "rounding, bfloat16 or float32 state; only Kimi-K3's layer implements it",
            (
                _vllm("vllm/config/vllm.py", *V_ALL[5:]),
                _vllm("vllm/models/kimi_k3/nvidia/kda.py", *V_ALL[5:]),
                _vllm("vllm/config/vllm.py", V34),
            ),
            since="0.29.0",
            quote="RecoverSSM supports bfloat16/float32 SSM state caches, not --enable-mamba-cache-stochastic-rounding",
        ),
        Fact(
            "vllm.glm_no_replay",
            "vllm",
            "GLM-5.3-Flash (Glm5Next) is not a SupportsReplaySSM model: --use-replayssm is refused for it",
            (
                _vllm("vllm/config/vllm.py", *V_ALL[6:]),
                _vllm("vllm/config/vllm.py", V34),
            ),
            since="0.30.0",
            quote="--use-replayssm is not supported for architecture {architecture!r}",
        ),
        Fact(
            "vllm.spec_method",
            "vllm",
            "a speculative config needs a method (mtp, ngram, eagle3, ...) or a draft model: with "
            "num_speculative_tokens alone vLLM assumes a draft model and refuses",
            (
                _vllm("vllm/config/speculative.py", *V_ALL),
                _vllm("vllm/v1/worker/gpu/spec_decode/speculator_config.py", V34),
            ),
            quote="num_speculative_tokens was provided but without speculative model.",
        ),
        # -- TensorRT-LLM -------------------------------------------------------------------------------
        Fact(
            "trtllm.state_dtype",
            "trtllm",
            "kv_cache_config.mamba_ssm_cache_dtype takes auto, float16, bfloat16, float32; no int8 / fp8 knob",
            (_trt("tensorrt_llm/llmapi/llm_args.py", "0004396"),),
            quote='mamba_ssm_cache_dtype: Literal["auto", "float16", "bfloat16", "float32"]',
        ),
        Fact(
            "trtllm.sr",
            "trtllm",
            "kv_cache_config.mamba_ssm_stochastic_rounding applies to a float16 cache only; "
            "mamba_ssm_philox_rounds defaults to 10 (>= 1)",
            (_trt("tensorrt_llm/llmapi/llm_args.py", "0004396"),),
            quote="Enable stochastic rounding for Mamba SSM state updates. Only applicable with float16 cache dtype.",
        ),
        Fact(
            "trtllm.hf_key",
            "trtllm",
            "the HF config key read for the SSM cache dtype is mamba_ssm_cache_dtype (top level or text_config), "
            "for Mamba-2 and GDN alike; mamba_ssm_dtype is ignored",
            (_trt("tensorrt_llm/_torch/pyexecutor/config_utils.py", "00679c6"),),
            quote="Only the explicit mamba_ssm_cache_dtype field is honored here.",
        ),
        Fact(
            "trtllm.replay_spec_only",
            "trtllm",
            "Mamba-2 replay runs only with speculative decoding; without it the state is stored every token",
            (_trt("tensorrt_llm/_torch/modules/mamba/cache_manager.py", "2829508"),),
            quote="Replay kernel requires speculative decoding; using non-replay path",
        ),
        Fact(
            "trtllm.replay_gates",
            "trtllm",
            "with speculative decoding, replay is on by default on SM >= 80 unless the drafts form a tree "
            "(eagle_choices / use_dynamic_tree) or TRTLLM_USE_MAMBA_REPLAY=0; only '0' disables it",
            (_trt("tensorrt_llm/_torch/modules/mamba/cache_manager.py", "2829508"),),
            quote='if os.environ.get("TRTLLM_USE_MAMBA_REPLAY", "1") == "0": [...] use_replay = False',
        ),
        Fact(
            "trtllm.replay_sr_sm",
            "trtllm",
            "float16 + stochastic rounding keeps replay only on 100 <= SM < 120 (not SM 120/121); elsewhere the "
            "state is stored every token (legacy MTP path)",
            (_trt("tensorrt_llm/_torch/modules/mamba/cache_manager.py", "2829508"),),
            quote="Replay kernel Philox requires 100 <= sm < 120; using legacy MTP path for stochastic rounding "
            "support",
        ),
        Fact(
            "trtllm.fi_ssu",
            "trtllm",
            'the Mamba-2 mixer decodes with FlashInfer\'s selective_state_update ("default to flashinfer") where '
            "head_dim is 64 or 128 and heads per group (after tensor parallelism) is 1, 8 or 16; later commits widen "
            "the ratio list (1 to 64) or drop it; elsewhere it runs its own Triton selective_state_update. "
            "Nemotron-3-Nano (head_dim 64, 64 heads, 8 groups) and Nemotron-H-8B decode on FlashInfer's kernel",
            (
                Source(
                    "NVIDIA/TensorRT-LLM",
                    "tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py",
                    "main, snapshots of a code index (02140fd among them; commit of the newest not pinned)",
                ),
            ),
            quote="# Choose between flashinfer and native implementation. (default to flashinfer)",
        ),
        Fact(
            "trtllm.fi_checkpointing",
            "trtllm",
            "MTP replay runs FlashInfer's checkpointing_ssu where the FlashInfer decode applies, "
            "TRTLLM_MAMBA2_USE_FI_CHECKPOINTING is 1 (its default), the SSM cache is bfloat16, float16 or float32 "
            "and max_draft_len + 1 <= 16; else TensorRT-LLM's Triton replay kernel",
            (
                Source(
                    "NVIDIA/TensorRT-LLM",
                    "tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py",
                    "main, a snapshot of a code index (commit not pinned)",
                ),
            ),
            quote='fi_ckpt_requested = os.environ.get("TRTLLM_MAMBA2_USE_FI_CHECKPOINTING", "1") == "1"',
        ),
        Fact(
            "trtllm.intermediate_ssm",
            "trtllm",
            "with speculative decoding and replay off, the Mamba cache manager allocates intermediate_ssm_states "
            "[layers, max_batch_size, tokens per step = 1 + draft tokens, *state] in the SSM cache dtype beside the "
            "live states: 2 + T states per sequence and layer; with replay on it allocates none",
            (
                Source(
                    "NVIDIA/TensorRT-LLM",
                    "tensorrt_llm/_torch/pyexecutor/kv_cache/mamba_cache_manager/common.py",
                    "main, several snapshots of a code index (commit not pinned)",
                ),
            ),
            quote="Legacy SSM intermediate buffer is only needed when replay is disabled",
        ),
        Fact(
            "trtllm.replay_history",
            "trtllm",
            "replay history = max(16, tokens per step) with tokens per step = 1 + draft tokens; double-buffered x, "
            "B (model dtype), dt and dA_cumsum (float32); the checkpoint is written when held + step > history",
            (
                _trt("tensorrt_llm/_torch/modules/mamba/cache_manager.py", "2829508"),
                _trt("tensorrt_llm/_torch/pyexecutor/kv_cache/mamba_cache_manager/common.py", "2829508"),
            ),
            quote="self.replay_history_size = max(MIN_REPLAY_HISTORY_SIZE, tokens_per_gen_step)",
        ),
        Fact(
            "trtllm.gdn_replay",
            "trtllm",
            "Gated DeltaNet MTP replay (Qwen3-Next / Qwen3.5) is opt-in: TRTLLM_USE_GDN_REPLAY=1 enables it, any other "
            "value or none leaves it off. It runs only with speculative decoding, on SM >= 80, with at most 8 tokens "
            "per step, no dynamic draft tree and a float32, bfloat16 or float16 state; history max(16, tokens per "
            "step) = 16 and the Mamba-2 flush rule (the checkpoint is written when held + step > history). Its "
            "double-buffered rows reuse Mamba-2's: U (the delta rule's update, beta folded in) and the l2-normalised "
            "k in the model dtype, the cumulative log decay in float32 (Triton _cached_replay_kernel)",
            (
                _trt("tensorrt_llm/_torch/modules/fla/cache_manager.py", "3f4f808"),
                _trt("tensorrt_llm/_torch/pyexecutor/kv_cache/mamba_cache_manager/replay.py", "3f4f808"),
                _trt("tensorrt_llm/_torch/pyexecutor/kv_cache/mamba_cache_manager/common.py", "2829508"),
                _trt("tensorrt_llm/_torch/modules/fla/cached_replay.py", "1607eb4"),
            ),
            quote="GDN replay kernel requires speculative decoding; using non-replay path",
        ),
        Fact(
            "trtllm.kda_fp32",
            "trtllm",
            "TensorRT-LLM sets the recurrent-state cache to float32 for Kimi-Linear's KDA whatever "
            "mamba_ssm_cache_dtype says (extract_mamba_kv_cache_params), and for GLM's KDA (get_glm5_next_cache_params, "
            "\"its required FP32 recurrent state\")",
            (_trt("tensorrt_llm/_torch/pyexecutor/config_utils.py", "00679c6"),),
            quote="# The KDA delta-rule recurrent state must be kept in fp32 for numerical parity with the HF "
            "reference (fla chunk/fused_recurrent KDA kernels carry the state in fp32).",
        ),
        Fact(
            "trtllm.kda",
            "trtllm",
            "Kimi K3 KDA: the recurrent-state pool is float32 or bfloat16; with a bfloat16 pool the float32 kernels "
            "(indexed prefill, fused decode) run on a staged float32 copy of the rows, which is rounded back into the "
            "pool after every call (torch's .to: round to nearest even), prefill included; speculative decoding "
            "verifies in a fused multi-token kernel (KDAReplayStateUpdateStrategy: V2 cache manager, float32 "
            "copies of q/k/g, v and beta per draft, Philox seeds with stochastic rounding). Which setting selects "
            "the bfloat16 pool, and the verify's window, were not read: only a float32 conventional KDA state is "
            "exported",
            (
                _trt("tensorrt_llm/_torch/modules/kimi_kda/kimi_kda_mixer.py", "0790edf"),
                _trt("tensorrt_llm/_torch/modules/kimi_kda/cache_manager.py", "2829508"),
                Source(
                    "NVIDIA/TensorRT-LLM",
                    "tensorrt_llm/_torch/models/modeling_kimi_linear.py",
                    "main, commit not recorded",
                ),
            ),
            quote="ssm_pool = layer_cache.temporal  # [slots, H, V, K] fp32 or bf16; "
            "ssm_pool.index_copy_(0, slot_indices.long(), rows.to(ssm_pool.dtype))",
        ),
        Fact(
            "trtllm.spec_config",
            "trtllm",
            "replay runs only with a speculative_config in the LLM-API options (decoding_type and the draft length "
            "max_draft_len; the draft-model method's decoding_type is Draft_Target; MTP's num_nextn_predict_layers "
            "is deprecated, remapped to max_draft_len with a warning, so the export does not write it); the export "
            "writes it from --speculative-method",
            (
                _trt("tensorrt_llm/llmapi/llm_args.py", "0004396"),
                _issue("its TensorRT-LLM YAML carries speculative_config only as a comment although replay needs it"),
            ),
            quote='decoding_type: Literal["Draft_Target"] = Field(default="Draft_Target")',
        ),
        # -- FlashInfer ---------------------------------------------------------------------------------
        Fact(
            "flashinfer.ssu_dtypes",
            "flashinfer",
            "selective_state_update (conventional decode) stores float32, float16, bfloat16 (and int16 with "
            "state_scale) state; no int8 / fp8",
            (_fi("flashinfer/jit/mamba/selective_state_update.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),),
            quote="_dtype_map = {torch.float16: 'half', torch.bfloat16: 'nv_bfloat16', torch.float32: 'float', "
            "torch.int16: 'int16_t', ...}",
        ),
        Fact(
            "flashinfer.ssu_sr",
            "flashinfer",
            "selective_state_update rounds stochastically only into a float16 state (cvt_rs_f16_f32 written into "
            "the state element: other state dtypes fail to compile) and not together with state_scale",
            (
                _fi(
                    "flashinfer/data/include/flashinfer/mamba/kernel_selective_state_update_stp.cuh",
                    "0.7.0.post1",
                    "0.7.2.post1",
                    "0.7.4",
                ),
            ),
            quote="rState.val[ii] = cvt_rs_f16_f32(new_state, rand_ints[ii % 4] & 0x1FFFu);",
        ),
        Fact(
            "flashinfer.cssu_dtypes",
            "flashinfer",
            "checkpointing_ssu (replay) stores float32, float16, bfloat16, int8 or fp8_e4m3 state; the 8-bit ones "
            "need state_scale, float32 (cache, nheads, head_dim), float ones must not pass it",
            (_fi("flashinfer/mamba/checkpointing_ssu.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),),
            quote="state.dtype={state.dtype} requires a state_scale tensor of shape (cache, nheads, dim) and "
            "dtype float32",
        ),
        Fact(
            "flashinfer.cssu_sr",
            "flashinfer",
            "checkpointing_ssu rounds stochastically into float16, int8 and fp8_e4m3 state; with a bfloat16 or "
            "float32 state rand_seed is accepted and the state is rounded to nearest",
            (
                _fi(
                    "flashinfer/data/include/flashinfer/mamba/kernel_checkpointing_ssu.cuh",
                    "0.7.0.post1",
                    "0.7.2.post1",
                    "0.7.4",
                ),
                _fi(
                    "flashinfer/data/include/flashinfer/mamba/kernel_checkpointing_ssu_8bit.cuh",
                    "0.7.0.post1",
                    "0.7.2.post1",
                    "0.7.4",
                ),
            ),
            quote="constexpr bool kPhiloxF16 = (PHILOX_ROUNDS > 0) && std::is_same_v<state_t, __half>;",
        ),
        Fact(
            "flashinfer.cssu_window",
            "flashinfer",
            "the ring has L + T rows (T tokens per call): max_window = L <= 16 and T <= L",
            (_fi("flashinfer/mamba/checkpointing_ssu.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),),
            quote="checkpointing_ssu supports at most 16 cache tokens (max_window)",
        ),
        Fact(
            "flashinfer.cssu_8bit_shape",
            "flashinfer",
            "8-bit state: head_dim 64 (static_assert D_PER_CTA == 64, d_split 1), d_state 128 (row offsets are "
            "row << 7, unchecked), 2-byte inputs (static_assert), ring in the input dtype (x_cache.dtype == "
            "x.dtype)",
            (
                _fi(
                    "flashinfer/data/include/flashinfer/mamba/kernel_checkpointing_ssu_8bit.cuh",
                    "0.7.0.post1",
                    "0.7.2.post1",
                    "0.7.4",
                ),
                _fi("flashinfer/data/csrc/checkpointing_ssu.cu", "0.7.0.post1", "0.7.2.post1", "0.7.4"),
            ),
            quote='static_assert(D_PER_CTA == 64, "int8 chain kernel requires DIM == 64"); '
            "int const state_base_lo = row_lo << 7;  // row_lo * DSTATE",
        ),
        Fact(
            "flashinfer.tie_hdim",
            "flashinfer",
            "dt (.., nheads, dim) strides (1, 0), A (nheads, dim, dstate) strides (1, 0, 0), D and dt_bias "
            "(nheads, dim) strides (1, 0): one value per head broadcast over head_dim ('tie_hdim')",
            (
                _fi("flashinfer/data/csrc/checkpointing_ssu.cu", "0.7.0.post1", "0.7.2.post1", "0.7.4"),
                _fi("flashinfer/data/csrc/selective_state_update.cu"),
            ),
            quote='FLASHINFER_CHECK(dt.stride(3) == 0, "dt.stride(3) must be 0 (tie_hdim), got ", dt.stride(3));',
        ),
        Fact(
            "flashinfer.scale",
            "flashinfer",
            "state_scale holds decode scales (value = code * scale), written at every checkpoint as "
            "1 / (QMAX / amax) over d_state per (slot, head, row), 1 where amax = 0; QMAX 127 (int8), 448 (fp8)",
            (
                _fi(
                    "flashinfer/data/include/flashinfer/mamba/kernel_checkpointing_ssu_8bit.cuh",
                    "0.7.0.post1",
                    "0.7.2.post1",
                    "0.7.4",
                ),
            ),
            quote="state_scale_w[state_scale_base + d_row] = 1.f / encode_scale_per_row[i];",
        ),
        Fact(
            "flashinfer.sm80",
            "flashinfer",
            "the Mamba kernels are built for SM 8.x to 12.x (software fallbacks for stochastic rounding below "
            "SM 100 and for fp8 below SM 89)",
            (_fi("flashinfer/jit/mamba/checkpointing_ssu.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),),
            quote="_SUPPORTED_MAJORS = [8, 9, 10, 11, 12]",
        ),
        Fact(
            "flashinfer.gdn_decode",
            "flashinfer",
            "Gated DeltaNet decode (gated_delta_rule_decode_pretranspose, state [B, HV, V, K]): float32 state "
            "(K, V >= 128, V % 8 == 0) or bfloat16 state (K = V = 128), SM 90+",
            (_fi("flashinfer/gdn_decode.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),),
            quote="Requires SM90+ (Hopper, Blackwell, etc.).",
        ),
        Fact(
            "flashinfer.gdn_decode_fp32_shape",
            "flashinfer",
            "Gated DeltaNet decode with float32 state (the legacy pretranspose kernel, T = 1) asserts K >= 128 and "
            "V >= 128, and V a multiple of its tile (8)",
            (_fi("flashinfer/gdn_decode.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),),
            quote='assert K >= 128, f"K must be at least 128, got K={K}"',
        ),
        Fact(
            "flashinfer.gdn_null_slot",
            "flashinfer",
            "Gated DeltaNet decode, bfloat16 fast path (K = V = 128): an index of -1 (padding) is redirected to "
            "slot 0, which the kernel reads and writes; the pool needs one slot more than the sequences it holds, "
            "live indices in [1, pool). The float32 path skips -1 entries. gated_delta_rule_decode_pretranspose "
            "is flashinfer.gdn_decode's, not exported at the top level",
            (_fi("flashinfer/gdn_decode.py", "0.7.4"), _fi("flashinfer/__init__.py", "0.7.4")),
            quote="The caller must therefore allocate the pool with an extra leading slot (`pool_size = "
            "num_real_slots + 1`) and keep real slots at indices `1..pool_size-1`.",
        ),
        Fact(
            "flashinfer.gdn_decode_state",
            "flashinfer",
            "Gated DeltaNet decode keeps a float32 state (the legacy kernel, T = 1) or a bfloat16 state (its BF16 "
            "state kernel, which takes K = V = 128); no other state dtype, and no stochastic rounding",
            (_fi("flashinfer/gdn_decode.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),),
            quote="Float32: legacy kernel (T=1 only). Bfloat16: BF16 state backend (T=1 or MTP for T>1) when K=V=128.",
        ),
        Fact(
            "flashinfer.gdn_replay",
            "flashinfer",
            "Gated DeltaNet ReplaySSM (gated_delta_rule_mtp(cache_replayssm=True) + "
            "gated_delta_rule_replayssm_commit): float32 checkpoint, K = V = 128, T >= 3 tokens per verify, "
            "SM 100/103 (SM 120 from 0.7.4); the checkpoint takes every verify's accepted tokens, there is no "
            "L-token window",
            (_fi("flashinfer/gdn_decode.py", "0.7.2.post1", "0.7.4"),),
            since="0.7.2.post1",
            quote="ReplaySSM caching currently requires SM100/SM103",
        ),
        Fact(
            "flashinfer.kda_decode",
            "flashinfer",
            "KDA decode is flashinfer.recurrent_kda (flashinfer.kda_decode.recurrent_kda is a deprecated shim): a "
            "bfloat16 state [N, HV, V, K] updated in place, bfloat16 q, k, v, g, beta, K = V in {64, 128}, HV a "
            "multiple of H, int32 ssm_state_indices; CuTe DSL kernels for SM 100 (Blackwell); no float32, 8-bit or "
            "stochastically rounded decode state",
            (
                _fi("flashinfer/kda_kernels/recurrent_kda.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),
                _fi("flashinfer/kda_decode.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),
            ),
            quote="Requires SM100 (Blackwell) architecture; State is bfloat16 ``[N, HV, V, K]`` and updated in-place",
        ),
        Fact(
            "flashinfer.fused_kda_decode",
            "flashinfer",
            "fused_kda_decode (Kimi KDA: width-4 conv + one recurrent step + gated RMSNorm): a float32 or bfloat16 "
            "state [slots, H, 128, 128] updated in place (recurrence in float32, a bfloat16 state rounded when "
            "written back), head_dim 128, slot 0 reserved as the null slot; SM 100 (0.7.0.post1) / SM 100 and 103; "
            "heads 12, 24, 32, 48, 96 (0.7.0.post1), also 8 (0.7.2.post1), also 16 and 64 (0.7.4)",
            (
                _fi("flashinfer/kda_decode.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),
                _fi("flashinfer/kda_kernels/fused_kda_decode.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),
            ),
            quote="Paged recurrent state with shape ``[num_slots, H, 128, 128]`` and dtype float32 or bfloat16.",
        ),
        Fact(
            "flashinfer.kda_verify",
            "flashinfer",
            "KDA speculative verify (recurrent_kda(disable_state_update=True)): outputs of up to 16 tokens from the "
            "committed bfloat16 state, which it never writes; the per-token corrections go to a float32 "
            "correction_cache [slots, HV, T_max, V] and the raw key | gate to a bfloat16 kg_cache [slots, HV, "
            "T_max, 2K] (vLLM's RecoverSSM convention), for a commit kernel; K = V = 128; SM 10.0 / 10.3 only",
            (
                _fi("flashinfer/kda_decode.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),
                _fi("flashinfer/kda_kernels/recurrent_kda.py", "0.7.0.post1", "0.7.2.post1", "0.7.4"),
            ),
            quote="frozen recurrent-KDA decode requires exact compute capability 10.0 (SM100a) or 10.3 (SM103a)",
        ),
        # -- SGLang ------------------------------------------------------------------------------------
        Fact(
            "sglang.state_dtype",
            "sglang",
            "--mamba-ssm-dtype takes float32, bfloat16, float16 (unset: the HF config's mamba_ssm_dtype, else "
            "float32); no 8-bit live SSM state (int8 only as the prefix-cache checkpoint)",
            (_sgl("srt/arg_groups/fields/exec_.py"),),
            quote='choices=["float32", "bfloat16", "float16"]',
        ),
        Fact(
            "sglang.dtype_order",
            "sglang",
            "--mamba-ssm-dtype is carried to SGLANG_MAMBA_SSM_DTYPE, which overrides the HF config's "
            "mamba_ssm_dtype (text_config's, else the top level's); an unknown value falls back to float32 with a "
            "warning. Mamba-2, GDN and KDA layers all read it",
            (_sgl("srt/configs/mamba_utils.py"), _sgl("srt/arg_groups/serving_hook.py")),
            quote="1. Environment variable SGLANG_MAMBA_SSM_DTYPE",
        ),
        Fact(
            "sglang.mamba_backend",
            "sglang",
            "--mamba-backend triton (default) or flashinfer; flashinfer decodes Mamba-2 with "
            "flashinfer.mamba.selective_state_update, the kernel the flashinfer profile emulates",
            (_sgl("srt/arg_groups/fields/exec_.py"), _sgl("srt/arg_groups/mamba_hook.py")),
            quote='choices=["triton", "flashinfer"]',
        ),
        Fact(
            "sglang.sr",
            "sglang",
            "--enable-mamba-cache-stochastic-rounding needs --mamba-ssm-dtype float16 (the flag itself, not the HF "
            "key) and CUDA; --mamba-cache-philox-rounds 0 means 10 on FlashInfer",
            (_sgl("srt/arg_groups/mamba_hook.py"), _sgl("srt/arg_groups/fields/exec_.py")),
            quote="Stochastic rounding for the Mamba SSM cache requires --mamba-ssm-dtype float16, got {value}.",
        ),
        Fact(
            "sglang.sr_triton_sm100",
            "sglang",
            "stochastic rounding on --mamba-backend triton needs an SM 10.x GPU with CUDA >= 12.8; the FlashInfer "
            "backend has no GPU check",
            (_sgl("srt/arg_groups/mamba_hook.py"), _sgl("srt/utils/common.py")),
            quote="Stochastic rounding for the Mamba SSM cache with --mamba-backend triton requires SM100 with "
            "CUDA >= 12.8 because it uses the cvt.rs.f16x2.f32 PTX instruction.",
        ),
        Fact(
            "sglang.sr_mamba_only",
            "sglang",
            "stochastic rounding is applied by the Mamba selective-state-update kernels only "
            "(kernels/ops/mamba); GDN and KDA decode take no rounding option",
            (_sgl("kernels/ops/mamba/triton_ops/ssu_dispatch.py"),),
        ),
        Fact(
            "sglang.linear_decode",
            "sglang",
            "the GDN / KDA decode backend defaults to FlashInfer on SM 10.x with a bfloat16 state (SM 9.0: float32 "
            "state), else Triton; FlashInfer's linear-attention decode is not modelled here, so the export pins "
            "--linear-attn-decode-backend triton (fla's fused recurrent arithmetic, the ideal recurrence)",
            (_sgl("srt/arg_groups/attention_hook.py"),),
            quote="--linear-attn-decode-backend flashinfer on SM100+ requires --mamba-ssm-dtype bfloat16",
        ),
        Fact(
            "sglang.linear_replayssm",
            "sglang",
            "GDN / KDA ReplaySSM: --enable-linear-replayssm with --linear-replayssm-cache-len L (default 16, >= 1): "
            "the state is flushed every L decode steps, the ring holds the inputs in the SSM dtype; Triton decode "
            "backend (or Helion for KDA) and --mamba-radix-cache-strategy no_buffer, which needs the overlap "
            "schedule off (--disable-overlap-schedule): the default strategy auto resolves to extra_buffer while the "
            "overlap schedule is on, its default, whatever the flag's help says; no Mamba-2 ReplaySSM",
            (
                _sgl("srt/arg_groups/fields/exec_.py"),
                _sgl("srt/arg_groups/attention_hook.py"),
                _sgl("srt/arg_groups/overrides.py"),
                _sgl("srt/arg_groups/mamba_hook.py"),
                _sgl("srt/mem_cache/memory_pool.py"),
            ),
            quote="--enable-linear-replayssm requires Triton, or Helion for KDA, as the linear-attn decode backend",
        ),
        Fact(
            "sglang.linear_replayssm_spec",
            "sglang",
            "GDN / KDA speculative verify by fold-every-commit (--enable-linear-replayssm-spec): each verify "
            "stores the draft steps' inputs and the commit folds the accepted prefix into the float32 checkpoint "
            "(--mamba-ssm-dtype is set to float32 when unset); a linear draft chain only (topk 1); exclusive with "
            "--enable-linear-replayssm; no intermediate state snapshots. KDA's ring (--linear-replayssm-cache-len) "
            "must be a power of two >= 2 x the draft tokens",
            (
                _sgl("srt/arg_groups/fields/exec_.py"),
                _sgl("srt/arg_groups/attention_hook.py"),
                _sgl("srt/mem_cache/memory_pool.py"),
            ),
            quote="--enable-linear-replayssm-spec requires a linear draft chain (--speculative-eagle-topk in {None, 1})",
        ),
        Fact(
            "sglang.spec_states",
            "sglang",
            "with speculative decoding a running request holds its live state and speculative_num_draft_tokens "
            "(1 + drafts in a chain) intermediate states per SSM layer (intermediate_ssm_state_cache), none under "
            "--enable-linear-replayssm-spec",
            (_sgl("srt/mem_cache/memory_pool.py"),),
            quote="if enable_linear_replayssm_spec:\n                    intermediate_ssm_state_cache = None",
        ),
        Fact(
            "sglang.spec_algorithm",
            "sglang",
            "--speculative-algorithm (EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, ...), --speculative-num-steps, "
            "--speculative-eagle-topk, --speculative-num-draft-tokens (the verify window, 1 + drafts in a chain), "
            "--speculative-draft-model-path; NGRAM takes the tree's breadth (speculative_eagle_topk) from "
            "--speculative-ngram-max-bfs-breadth (default 10), so a chain needs it at 1",
            (_sgl("srt/arg_groups/fields/spec.py"), _sgl("srt/arg_groups/speculative_hook.py")),
            quote="Speculative algorithm. Builtins: EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, DFLASH, DSPARK, UNO.",
        ),
        Fact(
            "sglang.int8_checkpoint",
            "sglang",
            "--enable-int8-mamba-checkpoint stores radix-cached (prefix) states once in int8 in a separate pool: "
            "one scale per (layer, slot, head, key channel) reduced over the value rows (dim -2: d_v, Mamba-2's "
            "head_dim), amax clamped to >= 1e-8, scale = amax / 127 rounded to the live state dtype before use, "
            "codes torch.round (half to even) of state / scale clamped to [-127, 127]; a cache hit dequantizes into "
            "the live pool at its dtype. Not with the hierarchical cache, another radix-cache backend or LMCache",
            (_sgl("srt/mem_cache/mamba_checkpoint_pool.py"), _sgl("srt/arg_groups/mamba_hook.py")),
            quote="amax = state_fp32.abs().amax(dim=-2, keepdim=True).clamp(min=1e-8)",
        ),
    ]
}


class EngineVersionError(SsmquantError, ValueError):
    """An engine version or GPU that the facts do not cover; the message lists the accepted values."""


def check_version(engine: str, version: str | None) -> str:
    """None -> the newest release read; otherwise a read release or build of `engine` (else EngineVersionError)."""
    if version is None:
        return DEFAULT_VERSION[engine]
    v = str(version).strip().lstrip("v")
    if v not in VERSIONS[engine]:
        raise EngineVersionError(
            f"{ENGINE_NAMES[engine]} version {version!r} is not covered by the engine facts; accepted: "
            f"{', '.join(VERSIONS[engine])} (releases whose source was read"
            + (", and builds with open PRs" if BUILDS.get(engine) else "")
            + ")"
        )
    return v


def build(engine: str, version: str) -> Build | None:
    return BUILDS.get(engine, {}).get(version)


_GPU_RE = re.compile(r"^(?:sm_?)(\d{2,3})[af]?$")
GPU_EXAMPLES = "sm80 (A100), sm86, sm89 (L40S), sm90 (H100/H200), sm100 (B200), sm103 (B300), sm120, sm121"
DEFAULT_GPU = 90


def parse_gpu(gpu: str | int) -> int:
    """'sm90' / 'sm_100a' / 90 -> compute capability as major * 10 + minor (90, 100, 120)."""
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        cc = gpu
    else:
        m = _GPU_RE.match(str(gpu).strip().lower())
        if not m:
            raise EngineVersionError(f"unknown GPU {gpu!r}; give its compute capability as smXY, e.g. {GPU_EXAMPLES}")
        cc = int(m.group(1))
    if not 70 <= cc <= 129:
        raise EngineVersionError(f"GPU compute capability {cc} out of range; e.g. {GPU_EXAMPLES}")
    return cc


def local_gpu() -> int | None:
    """Compute capability of the local CUDA GPU (90 for an H200), or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return major * 10 + minor


def resolve_gpu(gpu: str | int | None) -> tuple[int, str | None]:
    """(compute capability, note): the given GPU, else the local one, else sm90 with a note saying so."""
    if gpu is not None:
        return parse_gpu(gpu), None
    cc = local_gpu()
    if cc is not None:
        return cc, f"checked for the local GPU, sm{cc}"
    return DEFAULT_GPU, f"no GPU here and no --gpu given: checked for sm{DEFAULT_GPU} (H100/H200)"
