"""Torch reference encode / decode of SSM states in every storage format.

Scale arithmetic (shared bit for bit with the Triton helpers and with nvidia-modelopt):

- fp8_e4m3 / int8 / int16, per scale group: encode multiplier m = max_code / amax (one FP32 division), stored
  scale s = 1 / m; codes = round(clamp(x * m)); decode x~ = code * s. A static scale s gives m = 1 / s.
  An all-zero group (amax = 0) stores s = 1 and zero codes.
- nvfp4: second-level FP32 scale s2 = amax / (6 * 448) per scale group (static: given); per 16-element
  block, block scale b = E4M3(clamp(block_amax / (6 * s2), 2^-9, 448)) (1.0 when block_amax = 0);
  d = b * s2; codes = E2M1(x / d); decode x~ = E2M1 value * d. This is modelopt's NVFP4QTensor.
- bf16 / fp16: the element rounded to the float type; fp32: unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .encodings import FormatError
from .grids import (
    E4M3,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    Rounding,
    e2m1_code,
    e2m1_value,
    round_to_bf16,
    round_to_grid,
)
from .random import check_seed, random_bits, uniform_from_bits

if TYPE_CHECKING:  # the formats' specs build on this module (StateFormat.quantize): annotations only
    from .spec import StateFormat


@dataclass(frozen=True)
class QuantizedState:
    """An encoded state.

    - codes: element codes, shape of the state [..., rows, state_dim]: float32 (fp32), bfloat16,
      float16, float8_e4m3fn (fp8_e4m3), int8, int16, or uint8 4-bit E2M1 codes, one per element (nvfp4;
      `bytes_per_state` counts them packed two per byte)
    - scale: FP32 decode scales [..., rows // group_rows] (second-level scale for nvfp4), or None
    - block_scale: nvfp4 only, float8_e4m3fn [..., rows, state_dim // 16]
    """

    format: StateFormat
    codes: torch.Tensor
    scale: torch.Tensor | None = None
    block_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def validate_state(fmt: StateFormat, state: torch.Tensor) -> None:
    """Check a state tensor for `fmt` (shape [..., rows, state_dim], float, finite)."""
    if not isinstance(state, torch.Tensor):
        raise FormatError(f"state must be a torch.Tensor, got {type(state).__name__}")
    if state.ndim < 2:
        raise FormatError(f"state must have shape [..., rows, state_dim], got {tuple(state.shape)}")
    if not state.is_floating_point():
        raise FormatError(f"state must be a float tensor, got {state.dtype}")
    if state.numel() >= 2**32:
        raise FormatError(f"state has {state.numel()} elements; at most 2^32 - 1 are supported")
    bad = ~torch.isfinite(state)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise FormatError(f"state contains NaN/Inf (first at index {idx}); a state to store must be finite")
    block = fmt.encoding.spec.block
    if block is not None and state.shape[-1] % block:
        raise FormatError(
            f"{fmt.encoding.value} needs state_dim divisible by {block}, got state shape {tuple(state.shape)}"
        )
    fmt.granularity.group_rows(state.shape[-2])


def group_shape(fmt: StateFormat, state_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the FP32 scale tensor for a state of `state_shape`."""
    rows = state_shape[-2]
    return (*state_shape[:-2], rows // fmt.granularity.group_rows(rows))


def _static_scale(fmt: StateFormat, scale, state: torch.Tensor) -> torch.Tensor:
    """Check a static scale: shape = the group shape, or its trailing dims (shared across leading dims)."""
    if fmt.scale_mode.value != "static":
        if scale is not None:
            raise FormatError(f"{fmt.name} uses dynamic scales; pass scale only to a ':static' format")
        return None
    expected = group_shape(fmt, tuple(state.shape))
    if scale is None:
        raise FormatError(f"{fmt.name} is static: pass scale with shape {expected} (FP32 decode scales)")
    scale = torch.as_tensor(scale, dtype=torch.float32, device=state.device)
    n = scale.ndim
    if n == 0 or n > len(expected) or tuple(scale.shape) != expected[len(expected) - n :]:
        raise FormatError(
            f"static scale has shape {tuple(scale.shape)}; expected {expected} or its trailing dims "
            f"(state shape {tuple(state.shape)}, granularity {fmt.granularity.name})"
        )
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise FormatError("static scales must be finite and > 0")
    return scale.expand(expected)


def ieee_div(num, den) -> torch.Tensor:
    """Correctly rounded FP32 division num / den, with scalars broadcast as tensors.

    torch computes `scalar / tensor` as reciprocal-times-scalar, and on CUDA divides by a host scalar
    through its reciprocal; both round twice. Dividing two tensors is one IEEE division everywhere.
    """
    like = den if isinstance(den, torch.Tensor) else num
    num = torch.as_tensor(num, dtype=torch.float32, device=like.device)
    den = torch.as_tensor(den, dtype=torch.float32, device=like.device)
    num, den = torch.broadcast_tensors(num, den)
    return torch.div(num, den)


def group_amax(fmt: StateFormat, x: torch.Tensor) -> torch.Tensor:
    """max |x| per scale group: [..., rows, state_dim] -> group shape."""
    rows, sdim = x.shape[-2], x.shape[-1]
    g = fmt.granularity.group_rows(rows)
    return x.abs().reshape(*x.shape[:-2], rows // g, g * sdim).amax(-1)


def expand_groups(fmt: StateFormat, per_group: torch.Tensor, rows: int) -> torch.Tensor:
    """Group shape [..., rows // g] -> [..., rows, 1], for broadcasting against the state."""
    g = fmt.granularity.group_rows(rows)
    return per_group.repeat_interleave(g, dim=-1)[..., None]


def scales_from_amax(fmt: StateFormat, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8/int8 scales: (encode multiplier m = max_code / amax, decode scale s = 1 / m).

    A group whose amax is 0, or so small that max_code / amax overflows FP32 (below max_code / FLT_MAX: 1.3e-36
    for fp8_e4m3, 3.7e-37 for int8), gets m = s = 1: its elements round to 0, as a zero group's do. An infinite
    multiplier would turn the group's zeros into 0 x inf = NaN and its decode scale into 0.
    """
    zero = amax == 0
    mult = ieee_div(fmt.encoding.max_code, torch.where(zero, 1.0, amax))
    mult = torch.where(zero | torch.isinf(mult), 1.0, mult)
    return mult, ieee_div(1.0, mult)


def element_index(shape, device) -> torch.Tensor:
    """Flat element indices (int64) of a state of `shape`: the counter of its random words."""
    return torch.arange(int(torch.Size(shape).numel()), device=device, dtype=torch.int64).reshape(shape)


@dataclass(frozen=True)
class Encoded:
    """Internal result of `encode`: element values on the grid plus what decodes them.

    values: FP32 [..., rows, state_dim] exactly on the element grid (fp8 / e2m1 values, int8
    integers, or the bf16 / fp16 / fp32 element itself); group_scale: FP32 group shape or None;
    block_scale: FP32 [..., rows, state_dim // 16] on the E4M3 grid (nvfp4) or None.
    """

    values: torch.Tensor
    group_scale: torch.Tensor | None
    block_scale: torch.Tensor | None

    def decode(self, fmt: StateFormat) -> torch.Tensor:
        """FP32 decoded state: values times the per-element decode scale."""
        if self.group_scale is None:
            return self.values
        rows = self.values.shape[-2]
        s_rows = expand_groups(fmt, self.group_scale, rows)  # [..., rows, 1]
        if self.block_scale is None:
            return self.values * s_rows
        d = self.block_scale * s_rows  # [..., rows, nblocks]
        v = self.values
        return (v.reshape(*v.shape[:-1], -1, fmt.encoding.spec.block) * d[..., None]).reshape(v.shape)


def encode(
    fmt: StateFormat,
    x: torch.Tensor,
    *,
    static_scale: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
    bits: torch.Tensor | None = None,
) -> Encoded:
    """Unchecked encode of an FP32 state x [..., rows, state_dim] (callers validate).

    static_scale: decode scales already expanded to the group shape (static formats) or None;
    uniform / bits: the random draws of stochastic rounding (`uniform_from_bits(bits)`) or None.
    Pure tensor code with no host synchronisation, so that a per-step loop can be compiled.
    """
    spec, rnd = fmt.encoding.spec, fmt.rounding
    if spec.scale_layout == "none":  # fp32 as is, bf16 on the bit pattern, fp16 on its grid
        if spec.pattern_bits is not None:
            return Encoded(round_to_bf16(x, rnd, bits), None, None)
        return Encoded(x if spec.grid is None else round_to_grid(x, spec.grid, rnd, uniform), None, None)

    rows = x.shape[-2]
    if spec.scale_layout == "group":
        if static_scale is None:
            mult, dec = scales_from_amax(fmt, group_amax(fmt, x))
        else:
            dec = static_scale
            mult = ieee_div(1.0, dec)
        v = x * expand_groups(fmt, mult, rows)
        return Encoded(round_to_grid(v, spec.grid, rnd, uniform), dec, None)

    # two-level (nvfp4)
    if static_scale is None:
        s2 = ieee_div(group_amax(fmt, x), spec.max_code)
        s2 = torch.where(s2 == 0, torch.ones_like(s2), s2)
    else:
        s2 = static_scale
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // spec.block, spec.block)
    s2_rows = expand_groups(fmt, s2, rows)  # [..., rows, 1]
    bscale = ieee_div(blocks.abs().amax(-1), spec.grid.max_value * s2_rows)  # [..., rows, nblocks]
    bscale = torch.where(bscale == 0, torch.ones_like(bscale), bscale)
    bscale = round_to_grid(torch.clamp(bscale, E4M3_MIN_SUBNORMAL, E4M3_MAX), E4M3)
    d = bscale * s2_rows
    v = ieee_div(blocks, d[..., None]).reshape(x.shape)
    return Encoded(round_to_grid(v, spec.grid, rnd, uniform), s2, bscale)


def quantize(
    fmt: StateFormat, state: torch.Tensor, *, scale=None, seed: int | None = None, stream: int = 0
) -> QuantizedState:
    """Encode a state [..., rows, state_dim] in `fmt` (validated here).

    scale: FP32 decode scales for ':static' formats (group shape or its trailing dims); None otherwise.
    seed, stream: stochastic-rounding counter inputs (seed defaults to 0); the element's random word
    is `random_bits(seed, stream, flat_index)`, so results are reproducible on every backend.
    """
    validate_state(fmt, state)
    static = _static_scale(fmt, scale, state)
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream <= 0xFFFFFFFF:
        raise FormatError(f"stream must be an integer in [0, 2^32), got {stream!r}")
    seed = check_seed(0 if seed is None else seed)
    x = state.float()
    bits = uniform = None
    if fmt.rounding is Rounding.SR:
        bits = random_bits(seed, stream, element_index(x.shape, x.device))
        uniform = uniform_from_bits(bits)
    e = encode(fmt, x, static_scale=static, uniform=uniform, bits=bits)
    spec = fmt.encoding.spec
    if spec.scale_layout == "none":
        return QuantizedState(fmt, e.values.clone() if spec.storage == torch.float32 else e.values.to(spec.storage))
    if spec.scale_layout == "group":
        return QuantizedState(fmt, e.values.to(spec.storage), e.group_scale.clone())
    return QuantizedState(fmt, e2m1_code(e.values), e.group_scale.clone(), e.block_scale.to(torch.float8_e4m3fn))


def dequantize(q: QuantizedState) -> torch.Tensor:
    """Decode a QuantizedState to an FP32 tensor of the state's shape."""
    fmt, spec = q.format, q.format.encoding.spec
    if spec.scale_layout == "none":
        return q.codes.float()
    if spec.scale_layout == "group":
        return Encoded(q.codes.float(), q.scale, None).decode(fmt)
    return Encoded(e2m1_value(q.codes), q.scale, q.block_scale.float()).decode(fmt)
