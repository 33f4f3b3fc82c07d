"""Presets: the exact SSM-layer shapes and layer positions of real hybrid models.

Every number here comes from the model's published ``config.json`` (read through public copies of it,
see ``sources`` on each preset and ``ssmquant/models/README.md``), or, where the config does not set a
field, from the default that transformers' config class applies when it loads that checkpoint; such
fields are named in the preset's ``notes``. Init distributions of ``A_log`` / ``dt_bias`` are the ones
transformers' ``_init_weights`` of the family uses (NemotronH, Qwen3.5, Qwen3-Next, Glm5Next, KimiLinear).

Kimi-K3 (Kimi Delta Attention, served with vLLM's RecoverSSM) has no preset: its KDA head count is not
in any public source read here. TensorRT-LLM's ``tensorrt_llm/_torch/models/modeling_kimi_linear.py``
documents 93 decoder layers (69 KDA, 24 MLA) and an FP32 [H, V, K] state, and FlashInfer's KDA WY kernel
(``flashinfer/kda_kernels/kda_decode_wy_output_only.py``, "the Kimi K3 contract") needs K = V = 128; the
number of heads per layer is unknown.

A preset needs no weights: it is what ``synthetic_inputs`` and the ``presets`` command work from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import SsmquantError

FP32_BYTES = 4

# Layer-pattern characters of NemotronH's `hybrid_override_pattern` (transformers' NemotronHConfig).
NEMOTRON_PATTERN_CHARS = {"M": "mamba2", "*": "attention", "E": "moe", "-": "mlp"}


class PresetError(SsmquantError, ValueError):
    """Unknown preset name or inconsistent preset definition."""


@dataclass(frozen=True)
class Mamba2Shape:
    """Mamba-2 mixer shape and init (NemotronH).

    - num_heads H, head_dim P, state_size N, n_groups G (heads share B/C within a group)
    - conv_kernel: depthwise causal conv width; chunk_size: the prefill scan's chunk
    - time_step_min/max/floor: dt init range (dt_bias = softplus^-1(dt), dt log-uniform in
      [min, max], floored) -- transformers' NemotronHPreTrainedModel._init_weights
    - dt_limit: the clamp transformers' NemotronHMamba2Mixer applies to softplus(dt_raw + dt_bias):
      (time_step_min, inf) in transformers 5.x (mamba_ssm / vLLM use config.time_step_limit,
      (0, inf) by default; captures record whatever the loaded model applies)
    - A_log init: log(arange(1, H + 1)), i.e. A_h = -(h + 1); D init: 1
    """

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    time_step_min: float
    time_step_max: float
    time_step_floor: float
    dt_limit: tuple[float, float]
    use_conv_bias: bool = True
    a_log_init: str = "log(arange(1, num_heads + 1))"
    dt_bias_init: str = "softplus^-1(clamp(exp(U(log time_step_min, log time_step_max)), time_step_floor))"

    kind = "mamba2"
    pattern_char = "M"  # the SSM layers' character in the layer pattern (NemotronH's hybrid_override_pattern)

    @property
    def groups(self) -> int:
        """B/C groups: how many distinct B / C vectors a step has."""
        return self.n_groups

    @property
    def rows(self) -> int:
        """Rows of a per-head state S[P, N] (the head_dim P)."""
        return self.head_dim

    @property
    def state_dim(self) -> int:
        """Reduction dim of a per-head state (the state size N)."""
        return self.state_size

    @property
    def state_heads(self) -> int:
        return self.num_heads


@dataclass(frozen=True)
class GDNShape:
    """Gated DeltaNet mixer shape and init (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

    - num_value_heads Hv (one state per value head), num_key_heads Hk (q/k heads, shared by Hv/Hk
      value heads), key_head_dim Dk, value_head_dim Dv, conv_kernel (linear_conv_kernel_dim)
    - A_log init: log(U(0.01, 16)); dt_bias init: 1 -- transformers' Qwen3_5PreTrainedModel /
      Qwen3NextPreTrainedModel._init_weights. The conv has no bias.
    """

    num_value_heads: int
    num_key_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    a_init_low: float = 0.01
    a_init_high: float = 16.0
    dt_bias_init_value: float = 1.0
    use_conv_bias: bool = False
    a_log_init: str = "log(U(0.01, 16))"
    dt_bias_init: str = "1"

    kind = "gdn"
    pattern_char = "L"  # "linear_attention" layers

    @property
    def groups(self) -> int:
        """Key heads: how many distinct k vectors a step has."""
        return self.num_key_heads

    @property
    def rows(self) -> int:
        """Rows of a per-head state, stored [Dv, Dk] (the value dim Dv)."""
        return self.value_head_dim

    @property
    def state_dim(self) -> int:
        """Reduction dim of a per-head state (the key dim Dk)."""
        return self.key_head_dim

    @property
    def state_heads(self) -> int:
        return self.num_value_heads


@dataclass(frozen=True)
class KDAShape:
    """Kimi Delta Attention mixer shape and init (GLM-5.3-Flash ``glm5_next``, Kimi-Linear ``kimi_linear``).

    - num_heads H (q, k, v and state heads alike), head_dim D (key dim = value dim = D), conv_kernel
      (the short conv on q, k, v; no bias)
    - gate_lower_bound: GLM-5.3-Flash's "safe gate" g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
      in [lower_bound, 0] (fp32 sigmoid saturates); None for Kimi-Linear's g = -exp(A_log) * softplus(f + dt_bias)
    - dt_bias [H * D] init: softplus^-1(dt), dt log-uniform in [time_step_min, time_step_max], floored;
      A_log [H]: zeros with the lower-bound gate, log(U(1, 16)) without (transformers'
      Glm5NextPreTrainedModel / KimiLinearPreTrainedModel._init_weights, "following FLA")
    """

    num_heads: int
    head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    time_step_min: float = 1e-3
    time_step_max: float = 1e-1
    time_step_floor: float = 1e-4
    a_init_low: float = 1.0
    a_init_high: float = 16.0
    use_conv_bias: bool = False

    kind = "kda"
    pattern_char = "L"  # "linear_attention" layers

    @property
    def groups(self) -> int:
        return self.num_heads

    @property
    def a_log_init(self) -> str:
        return "0" if self.gate_lower_bound is not None else "log(U(1, 16))"

    @property
    def dt_bias_init(self) -> str:
        return "softplus^-1(clamp(exp(U(log time_step_min, log time_step_max)), time_step_floor)), per key channel"

    @property
    def num_key_heads(self) -> int:
        return self.num_heads

    @property
    def rows(self) -> int:
        """Rows of a per-head state, stored [Dv, Dk] (the value dim)."""
        return self.head_dim

    @property
    def state_dim(self) -> int:
        """Reduction dim of a per-head state (the key dim)."""
        return self.head_dim

    @property
    def state_heads(self) -> int:
        return self.num_heads


@dataclass(frozen=True)
class Preset:
    """One real model: where its SSM layers are and what shape their state has.

    ``ssm_layers`` are 0-based decoder-layer indices (the ``layer_idx`` of transformers' mixers).
    ``layer_pattern`` is the per-layer pattern: NemotronH's ``hybrid_override_pattern`` (M Mamba-2,
    * attention, E MoE, - MLP), and for the Qwen, GLM and Kimi families "L" (linear attention: GDN or
    KDA) / "F" (full attention: Qwen's gated attention, GLM's DSA, Kimi's MLA).
    """

    name: str
    hf_repo: str
    architecture: str
    model_type: str
    layer_kind: str  # a registered layer kind's name (`ssmquant.kinds`): "mamba2", "gdn", "kda"
    num_layers: int
    ssm_layers: tuple[int, ...]
    layer_pattern: str
    hidden_size: int
    shape: Mamba2Shape | GDNShape | KDAShape  # or any shape with kind, pattern_char, groups, rows, state_dim, state_heads
    initializer_range: float = 0.02
    ssm_cache_dtype: str | None = None  # the checkpoint's own default state dtype, where the config sets one
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # Consistency checks run once, at import: a typo in a preset must not reach a user.
        if self.layer_kind != self.shape.kind:
            raise PresetError(f"{self.name}: layer_kind {self.layer_kind!r} but shape is {self.shape.kind!r}")
        if len(self.layer_pattern) != self.num_layers:
            raise PresetError(
                f"{self.name}: pattern has {len(self.layer_pattern)} layers, num_layers is {self.num_layers}"
            )
        derived = tuple(i for i, c in enumerate(self.layer_pattern) if c == self.shape.pattern_char)
        if derived != self.ssm_layers:
            raise PresetError(f"{self.name}: ssm_layers {self.ssm_layers} disagree with the pattern {derived}")
        if self.shape.state_heads % self.shape.groups:
            raise PresetError(f"{self.name}: heads are not a multiple of groups / key heads")

    # -- derived numbers -------------------------------------------------------------------------
    @property
    def num_ssm_layers(self) -> int:
        return len(self.ssm_layers)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """(heads, rows, state_dim) of one layer's state for one sequence, as in the Inputs classes.

        Mamba-2: (H, head_dim P, state_size N); GDN / KDA: (Hv, Dv, Dk) -- the [Dv, Dk] layout of their Inputs.
        """
        return (self.shape.state_heads, self.shape.rows, self.shape.state_dim)

    @property
    def groups(self) -> int:
        """B/C groups (Mamba-2) or key heads (GDN, KDA): how many distinct B / k vectors a step has."""
        return self.shape.groups

    def state_elements_per_layer(self) -> int:
        """Elements of one layer's SSM state for one sequence (heads * rows * state_dim)."""
        return math.prod(self.state_shape)

    def state_rows_per_layer(self) -> int:
        """Rows (heads * rows) of one layer's state: the count of per-row scales a row-scaled format keeps."""
        return self.state_shape[0] * self.state_shape[1]

    def fp32_state_bytes_per_layer(self) -> int:
        """FP32 bytes of one SSM layer's recurrent state for one sequence (conv state excluded)."""
        return self.state_elements_per_layer() * FP32_BYTES

    def fp32_state_bytes_per_sequence(self) -> int:
        """FP32 bytes of the recurrent state of all SSM layers for one sequence (conv state excluded)."""
        return self.fp32_state_bytes_per_layer() * self.num_ssm_layers

    def layer_position(self, layer: int) -> int:
        """Position of decoder layer ``layer`` among the SSM layers (0-based). Raises naming the valid indices."""
        try:
            return self.ssm_layers.index(layer)
        except ValueError:
            raise PresetError(
                f"layer {layer} of {self.name} is not an SSM layer; its {self.layer_kind} layers are "
                f"{list(self.ssm_layers)}"
            ) from None


# -- helpers to build presets -------------------------------------------------------------------------


def _nemotron_ssm_layers(pattern: str) -> tuple[int, ...]:
    bad = set(pattern) - set(NEMOTRON_PATTERN_CHARS)
    if bad:
        raise PresetError(f"hybrid_override_pattern has unknown characters {sorted(bad)}")
    return tuple(i for i, c in enumerate(pattern) if c == "M")


def qwen_layer_pattern(num_layers: int, full_attention_interval: int = 4) -> str:
    """Qwen3.5 / Qwen3-Next layer pattern: full attention where (i + 1) % interval == 0, else GDN.

    This is the rule of transformers' Qwen3_5TextConfig / Qwen3NextConfig when a config gives
    ``full_attention_interval`` and no explicit ``layer_types``. Returns "L"/"F" per layer.
    """
    return "".join("F" if (i + 1) % full_attention_interval == 0 else "L" for i in range(num_layers))


def _nemotron(
    name: str,
    hf_repo: str,
    pattern: str,
    *,
    heads: int,
    hidden: int,
    time_step: tuple[float, float, float] = (0.001, 0.1, 1e-4),
    ssm_cache_dtype: str | None,
    sources: tuple[str, ...],
    notes: tuple[str, ...] = (),
) -> Preset:
    tmin, tmax, tfloor = time_step
    return Preset(
        name=name,
        hf_repo=hf_repo,
        architecture="NemotronHForCausalLM",
        model_type="nemotron_h",
        layer_kind="mamba2",
        num_layers=len(pattern),
        ssm_layers=_nemotron_ssm_layers(pattern),
        layer_pattern=pattern,
        hidden_size=hidden,
        shape=Mamba2Shape(
            num_heads=heads,
            head_dim=64,
            state_size=128,
            n_groups=8,
            conv_kernel=4,
            chunk_size=128,
            time_step_min=tmin,
            time_step_max=tmax,
            time_step_floor=tfloor,
            dt_limit=(tmin, math.inf),
        ),
        ssm_cache_dtype=ssm_cache_dtype,
        sources=sources,
        notes=notes,
    )


def _qwen(
    name: str,
    hf_repo: str,
    *,
    architecture: str,
    model_type: str,
    layers: int,
    v_heads: int,
    hidden: int,
    sources: tuple[str, ...],
    notes: tuple[str, ...] = (),
    ssm_cache_dtype: str | None = "float32",
) -> Preset:
    pattern = qwen_layer_pattern(layers, 4)
    return Preset(
        name=name,
        hf_repo=hf_repo,
        architecture=architecture,
        model_type=model_type,
        layer_kind="gdn",
        num_layers=layers,
        ssm_layers=tuple(i for i, c in enumerate(pattern) if c == "L"),
        layer_pattern=pattern,
        hidden_size=hidden,
        shape=GDNShape(num_value_heads=v_heads, num_key_heads=16, key_head_dim=128, value_head_dim=128, conv_kernel=4),
        ssm_cache_dtype=ssm_cache_dtype,
        sources=sources,
        notes=notes,
    )


def _kda(
    name: str,
    hf_repo: str,
    *,
    architecture: str,
    model_type: str,
    full_attention: tuple[int, ...],
    layers: int,
    heads: int,
    hidden: int,
    gate_lower_bound: float | None,
    sources: tuple[str, ...],
    notes: tuple[str, ...] = (),
) -> Preset:
    pattern = "".join("F" if i in full_attention else "L" for i in range(layers))
    return Preset(
        name=name,
        hf_repo=hf_repo,
        architecture=architecture,
        model_type=model_type,
        layer_kind="kda",
        num_layers=layers,
        ssm_layers=tuple(i for i, c in enumerate(pattern) if c == "L"),
        layer_pattern=pattern,
        hidden_size=hidden,
        shape=KDAShape(num_heads=heads, head_dim=128, conv_kernel=4, gate_lower_bound=gate_lower_bound),
        # vLLM keeps KDA state in FP32 whatever its cache dtype knobs (MambaStateDtypeCalculator.kda_state_dtype)
        ssm_cache_dtype="float32",
        sources=sources,
        notes=notes,
    )


_HF = "https://huggingface.co/{}/blob/main/config.json"
_NEMOTRON_DEFAULTS_NOTE = (
    "chunk_size 128, conv_kernel 4, n_groups 8 and head_dim 64 are in the published config; "
    "the dt clamp (time_step_min, inf) is the one transformers 5.x's NemotronHMamba2Mixer applies"
)
_QWEN_COMMON_NOTE = (
    "linear_num_key_heads 16, linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4 "
    "and full_attention_interval 4 (layer i is full attention iff (i + 1) % 4 == 0) as in the text_config"
)

_NO_SSM_DTYPE_NOTE = "mamba_ssm_dtype was not found in a public copy of this config (unverified)"

_PRESETS: tuple[Preset, ...] = (
    _nemotron(
        "nemotron-3-nano",
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        heads=64,
        hidden=2688,
        ssm_cache_dtype="float32",
        sources=(
            _HF.format("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"),
            "verbatim copies of that config.json in public repositories (mamba_num_heads 64, mamba_head_dim 64, "
            "ssm_state_size 128, n_groups 8, conv_kernel 4, chunk_size 128, time_step_min 0.001, "
            "time_step_max 0.1, time_step_floor 0.0001, hidden_size 2688, mamba_ssm_cache_dtype float32)",
            "ARCHITECTURE.md, reference shapes",
        ),
        notes=(_NEMOTRON_DEFAULTS_NOTE, "the config sets no time_step_limit (transformers default (0, inf))"),
    ),
    _nemotron(
        "nemotron-3-super",
        "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
        "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
        heads=128,
        hidden=4096,
        ssm_cache_dtype=None,
        sources=(
            _HF.format("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"),
            "public copies of the config / Megatron launch arguments (88 layers, 40 M / 40 E / 8 *, "
            "mamba_num_heads 128, mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4, "
            "chunk_size 128, time_step_min 0.001, hidden_size 4096)",
            "ARCHITECTURE.md, reference shapes",
        ),
        notes=(
            _NEMOTRON_DEFAULTS_NOTE,
            "time_step_max 0.1 and time_step_floor 1e-4 were not found in a public copy of this config: "
            "transformers' NemotronHConfig defaults are used (unverified)",
            "mamba_ssm_cache_dtype was not found in a public copy of this config (unverified)",
            "the MTP layers (mtp_hybrid_override_pattern '*E') have no Mamba-2 layer and are not counted",
        ),
    ),
    _nemotron(
        "nemotron-h-8b",
        "nvidia/Nemotron-H-8B-Base-8K",
        "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        heads=128,
        hidden=4096,
        ssm_cache_dtype=None,
        sources=(
            _HF.format("nvidia/Nemotron-H-8B-Base-8K"),
            "public copies of that config.json (52 layers, mamba_num_heads 128, mamba_head_dim 64, "
            "ssm_state_size 128, n_groups 8, conv_kernel 4, chunk_size 128, hidden_size 4096)",
            "ARCHITECTURE.md, reference shapes",
        ),
        notes=(
            _NEMOTRON_DEFAULTS_NOTE,
            "the config sets no time_step_min/max/floor: transformers' NemotronHConfig defaults "
            "(0.001, 0.1, 1e-4) apply when it loads this checkpoint",
            "the config sets no mamba_ssm_cache_dtype (transformers' default is float32)",
        ),
    ),
    _qwen(
        "qwen3.5-0.8b",
        "Qwen/Qwen3.5-0.8B",
        architecture="Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5",
        layers=24,
        v_heads=16,
        hidden=1024,
        sources=(
            _HF.format("Qwen/Qwen3.5-0.8B"),
            "public transcriptions of that config (24 layers, hidden 1024, linear key/value heads 16/16, "
            "key/value dims 128/128, conv kernel 4, mamba_ssm_dtype float32)",
            "ARCHITECTURE.md, reference shapes",
        ),
        notes=(_QWEN_COMMON_NOTE,),
    ),
    _qwen(
        "qwen3.5-9b",
        "Qwen/Qwen3.5-9B",
        architecture="Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5",
        layers=32,
        v_heads=32,
        hidden=4096,
        sources=(
            _HF.format("Qwen/Qwen3.5-9B"),
            "public copies of that config (32 layers, hidden 4096, linear_num_value_heads 32, "
            "linear_num_key_heads 16, 128/128, conv 4, mamba_ssm_dtype float32)",
            "ARCHITECTURE.md, reference shapes",
        ),
        notes=(_QWEN_COMMON_NOTE,),
    ),
    _qwen(
        "qwen3.5-27b",
        "Qwen/Qwen3.5-27B",
        architecture="Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5",
        layers=64,
        v_heads=48,
        hidden=5120,
        sources=(
            _HF.format("Qwen/Qwen3.5-27B"),
            "public copies of a Qwen3_5 text_config with hidden 5120, 64 layers, 24 q / 4 kv heads, "
            "linear_num_value_heads 48, linear_num_key_heads 16, 128/128, conv 4, mamba_ssm_dtype float32",
        ),
        notes=(
            _QWEN_COMMON_NOTE,
            "not in ARCHITECTURE.md's reference shapes; linear_num_value_heads 48 is from copies of the config, not "
            "from the Hugging Face page itself (no copy of the file under its own name was found)",
        ),
    ),
    _qwen(
        "qwen3.5-35b-a3b",
        "Qwen/Qwen3.5-35B-A3B",
        architecture="Qwen3_5MoeForConditionalGeneration",
        model_type="qwen3_5_moe",
        layers=40,
        v_heads=32,
        hidden=2048,
        sources=(
            _HF.format("Qwen/Qwen3.5-35B-A3B"),
            "public copies of that config (40 layers, hidden 2048, linear heads 16 key / 32 value, 128/128, conv 4)",
            "ARCHITECTURE.md, reference shapes",
        ),
        ssm_cache_dtype=None,
        notes=(_QWEN_COMMON_NOTE, _NO_SSM_DTYPE_NOTE),
    ),
    _qwen(
        "qwen3.5-122b-a10b",
        "Qwen/Qwen3.5-122B-A10B",
        architecture="Qwen3_5MoeForConditionalGeneration",
        model_type="qwen3_5_moe",
        layers=48,
        v_heads=64,
        hidden=3072,
        sources=(
            _HF.format("Qwen/Qwen3.5-122B-A10B"),
            "public copies of that config (48 layers, hidden 3072, linear heads 16 key / 64 value, 128/128, conv 4)",
            "ARCHITECTURE.md, reference shapes",
        ),
        ssm_cache_dtype=None,
        notes=(_QWEN_COMMON_NOTE, _NO_SSM_DTYPE_NOTE),
    ),
    _qwen(
        "qwen3.5-397b-a17b",
        "Qwen/Qwen3.5-397B-A17B",
        architecture="Qwen3_5MoeForConditionalGeneration",
        model_type="qwen3_5_moe",
        layers=60,
        v_heads=64,
        hidden=4096,
        sources=(
            _HF.format("Qwen/Qwen3.5-397B-A17B"),
            "public copies of that config (60 layers, hidden 4096, linear heads 16 key / 64 value, 128/128, conv 4)",
        ),
        ssm_cache_dtype=None,
        notes=(_QWEN_COMMON_NOTE, "not in ARCHITECTURE.md's reference shapes", _NO_SSM_DTYPE_NOTE),
    ),
    _qwen(
        "qwen3-next-80b",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        architecture="Qwen3NextForCausalLM",
        model_type="qwen3_next",
        layers=48,
        v_heads=32,
        hidden=2048,
        ssm_cache_dtype=None,
        sources=(
            _HF.format("Qwen/Qwen3-Next-80B-A3B-Instruct"),
            "transformers' Qwen3NextConfig defaults, documented against this checkpoint (48 layers, hidden "
            "2048, linear heads 16 key / 32 value, 128/128, conv 4, full_attention_interval 4)",
            "public copies of the Qwen3-Coder-Next config (same architecture and parameter count)",
            "ARCHITECTURE.md, reference shapes",
        ),
        notes=(_QWEN_COMMON_NOTE, "the config sets no mamba_ssm_dtype (state dtype left to the engine)"),
    ),
    _kda(
        "glm-5.3-flash",
        "zai-org/GLM-5.3-Flash",
        architecture="Glm5NextForConditionalGeneration",
        model_type="glm5_next",
        # Glm5NextTextConfig: layer i is KDA unless i % 4 == 3 (DSA, "indexed_attention")
        full_attention=tuple(i for i in range(45) if i % 4 == 3),
        layers=45,
        heads=64,
        hidden=4096,
        gate_lower_bound=-5.0,
        sources=(
            _HF.format("zai-org/GLM-5.3-Flash"),
            "transformers 5.24 Glm5NextTextConfig (models/glm5_next/configuration_glm5_next.py), documented "
            "against zai-org/GLM-5.3-Flash: 45 layers, hidden 4096, linear_num_heads 64, linear_head_dim 128, "
            "linear_conv_kernel_dim 4, linear_lower_bound -5.0, KDA at every layer with i % 4 != 3",
            "ARCHITECTURE.md, reference shapes",
        ),
        notes=(
            "no public copy of the published config.json was found: the shapes are transformers' config "
            "defaults for this checkpoint (unverified against the file itself)",
            "the MTP layer (layers.45, ignored by transformers on load) is not counted",
        ),
    ),
    _kda(
        "kimi-linear-48b-a3b",
        "moonshotai/Kimi-Linear-48B-A3B-Instruct",
        architecture="KimiLinearForCausalLM",
        model_type="kimi_linear",
        # linear_attn_config.full_attn_layers [4, 8, 12, 16, 20, 24, 27], 1-indexed
        full_attention=(3, 7, 11, 15, 19, 23, 26),
        layers=27,
        heads=32,
        hidden=2304,
        gate_lower_bound=None,
        sources=(
            _HF.format("moonshotai/Kimi-Linear-48B-A3B-Instruct"),
            "a public copy of that config.json (the NVFP4 re-quantisation Firworks/Kimi-Linear-48B-A3B-Instruct-"
            "nvfp4 keeps it): num_hidden_layers 27, hidden_size 2304, linear_attn_config {num_heads 32, head_dim "
            "128, short_conv_kernel_size 4, kda_layers [1-3, 5-7, ..., 25, 26], full_attn_layers [4, 8, 12, 16, "
            "20, 24, 27]}, no gate_lower_bound",
            "ARCHITECTURE.md, reference shapes",
        ),
        notes=(
            "kda_layers / full_attn_layers are 1-indexed in the config; KimiLinearConfig converts them to "
            "layer_types, which the preset follows (0-based)",
        ),
    ),
)

PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def register_preset(preset: Preset) -> Preset:
    """Add a preset (a model of a kind defined outside the package, say) to those ``get_preset`` knows."""
    if preset.name in PRESETS and PRESETS[preset.name] is not preset:
        raise PresetError(f"a preset named {preset.name!r} exists already")
    PRESETS[preset.name] = preset
    return preset


def list_presets() -> list[str]:
    """Names of all presets, in table order (Nemotron family first, then Qwen, then the KDA models)."""
    return list(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (case-insensitive; ``_`` and ``-`` are interchangeable).

    Raises PresetError listing the known names when there is none.
    """
    if isinstance(name, Preset):
        return name
    key = str(name).strip().lower().replace("_", "-")
    if key in PRESETS:
        return PRESETS[key]
    raise PresetError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")


def presets_frame(names: list[str] | None = None):
    """One row per preset, for the ``ssmquant presets`` command (pandas DataFrame).

    Columns: preset, kind, hf_repo, architecture, ssm_layers, total_layers, heads, rows, state_dim,
    groups (Mamba-2 B/C groups, GDN key heads), fp32_bytes_per_layer, fp32_bytes_per_sequence,
    state_elements_per_sequence, state_rows_per_sequence. The CLI adds the per-format byte columns from
    ``ssmquant.formats`` using the element and row counts (models/ knows nothing of formats).
    """
    import pandas as pd

    rows = []
    for name in names if names is not None else list_presets():
        p = get_preset(name)
        heads, r, sdim = p.state_shape
        rows.append(
            {
                "preset": p.name,
                "kind": p.layer_kind,
                "hf_repo": p.hf_repo,
                "architecture": p.architecture,
                "ssm_layers": p.num_ssm_layers,
                "total_layers": p.num_layers,
                "heads": heads,
                "rows": r,
                "state_dim": sdim,
                "groups": p.groups,
                "fp32_bytes_per_layer": p.fp32_state_bytes_per_layer(),
                "fp32_bytes_per_sequence": p.fp32_state_bytes_per_sequence(),
                "state_elements_per_sequence": p.state_elements_per_layer() * p.num_ssm_layers,
                "state_rows_per_sequence": p.state_rows_per_layer() * p.num_ssm_layers,
            }
        )
    return pd.DataFrame(rows)
