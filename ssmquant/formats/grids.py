"""Element grids and their rounding, written as exact FP32 arithmetic.

Every rounding here is built from operations that are exact in IEEE FP32 (scaling by powers of two,
floor, comparisons, integer operations on the bit pattern), so the same steps give the same bits in
torch on any device, in Triton on a GPU and in Triton's CPU interpreter. The Triton helpers in
`ssmquant.kernels.rounding` follow these functions line by line; tests compare both against torch's
own casts and against nvidia-modelopt.

A float grid with M mantissa bits and smallest normal exponent E_min has, in the binade
[2^e, 2^(e+1)), the spacing q = 2^(max(e, E_min) - M) (subnormals share the spacing of the smallest
normal binade). Rounding |v| to the grid is rounding |v| / q to an integer and multiplying back, both
exact. The helpers take `uniform` (in [0, 1)) for stochastic rounding: round up iff u < frac.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Rounding(enum.Enum):
    """How a value between two grid neighbours is rounded."""

    RNE = "rne"  # round to nearest, ties to even
    SR = "sr"  # stochastic: up with probability (v - lo) / (hi - lo); unbiased


@dataclass(frozen=True)
class FloatGrid:
    """A sign-magnitude binary float grid (E4M3, E2M1, FP16)."""

    name: str
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal binade
    max_value: float
    saturating: bool  # clamp to +-max_value (fp8, fp4) instead of overflowing to inf (IEEE fp16)

    @property
    def min_spacing_exponent(self) -> int:
        return self.min_exponent - self.mantissa_bits


# Grids are limited to spacings >= 2^-24 so that 1/q stays a normal FP32 number; BF16 shares FP32's
# exponent range and is rounded on the bit pattern instead (`round_to_bf16`).
E4M3 = FloatGrid("e4m3", mantissa_bits=3, min_exponent=-6, max_value=448.0, saturating=True)
E2M1 = FloatGrid("e2m1", mantissa_bits=1, min_exponent=0, max_value=6.0, saturating=True)
# E5M2 saturates too: the conversions the engines store an FP8 state with (PTX cvt.rn.satfinite, CuTe's .to()) clamp
# to the largest finite value, where torch's float8_e5m2 cast overflows to inf
E5M2 = FloatGrid("e5m2", mantissa_bits=2, min_exponent=-14, max_value=57344.0, saturating=True)
FP16 = FloatGrid("fp16", mantissa_bits=10, min_exponent=-14, max_value=65504.0, saturating=False)
# INT8 as a grid: spacing 2^(max(e, 7) - 7) = 1 for every |v| < 256, saturating at 127. Rounding it like
# the float grids (on |v|, sign restored) keeps one rounding routine, and one SR convention, for all.
INT8 = FloatGrid("int8", mantissa_bits=7, min_exponent=7, max_value=127.0, saturating=True)
# INT16 likewise (spacing 1 for |v| < 65536, saturating at 32767): FlashInfer's scaled int16 state of
# selective_state_update (conversion.cuh `convertAndStore(int16_t*)`: clamp to +-32767, `__float2int_rn`).
INT16 = FloatGrid("int16", mantissa_bits=15, min_exponent=15, max_value=32767.0, saturating=True)

E4M3_MAX = E4M3.max_value
E2M1_MAX = E2M1.max_value
# Magnitudes of E2M1, in code order 0..7 (a code is sign << 3 | index).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# The smallest positive E4M3 value (a subnormal); NVFP4 block scales are clamped to at least this.
E4M3_MIN_SUBNORMAL = 2.0**-9


_RNE_MAGIC = 8388608.0  # 2^23


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^e as FP32 for integer e in [-126, 127], built from the exponent field (exact)."""
    return ((exponent + 127).to(torch.int32) << 23).view(torch.float32)


def _exponent(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for a >= 0 FP32 from the exponent field (-127 for zero and subnormals)."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def round_integer(r: torch.Tensor, rounding: Rounding, uniform: torch.Tensor | None) -> torch.Tensor:
    """Round FP32 values with |r| < 2^22 to integers (as FP32), RNE or stochastic."""
    lo = torch.floor(r)
    frac = r - lo  # exact for |r| < 2^23
    if rounding is Rounding.SR:
        return lo + (uniform < frac).to(torch.float32)
    half_up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(lo, 2.0) == 1.0))
    return lo + half_up.to(torch.float32)


def round_to_grid(
    v: torch.Tensor, grid: FloatGrid, rounding: Rounding = Rounding.RNE, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """Round FP32 values to `grid`, returned as FP32 values that lie exactly on the grid.

    Saturating grids clamp |v| to max_value first; non-saturating ones overflow to +-inf exactly like
    an IEEE cast (RNE) does. `uniform` ([0, 1), same shape) is required for stochastic rounding.
    The steps are those of the Triton helper `ssmquant.kernels.rounding.round_to_grid`.
    """
    v = v.float()
    a = v.abs()
    if grid.saturating:
        a = torch.clamp(a, max=grid.max_value)
    e = torch.clamp(_exponent(a), min=grid.min_exponent)
    spacing = _pow2(e - grid.mantissa_bits)
    inv_spacing = _pow2(grid.mantissa_bits - e)
    r = a * inv_spacing  # exact, 0 <= r < 2^(mantissa_bits + 1)
    n = (r + _RNE_MAGIC) - _RNE_MAGIC  # round half to even: r + 2^23 has an ulp of 1
    if rounding is Rounding.SR:
        floor = n - (n > r).to(torch.float32)
        n = floor + (uniform < r - floor).to(torch.float32)
    out = n * spacing
    if not grid.saturating:
        out = torch.where(out > grid.max_value, torch.full_like(out, float("inf")), out)
    return torch.copysign(out, v)


def round_to_bf16(v: torch.Tensor, rounding: Rounding = Rounding.RNE, uniform_bits: torch.Tensor | None = None):
    """Round FP32 to BF16 on the bit pattern, returned as FP32 holding a BF16 value.

    RNE adds 0x7FFF plus the kept LSB and truncates the low 16 bits (torch's cast does the same);
    stochastic rounding adds 16 random bits and truncates, which rounds up with probability equal
    to the dropped fraction. `uniform_bits`: int64 tensor of random 32-bit words (SR only).
    """
    bits = v.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if rounding is Rounding.SR:
        add = uniform_bits & 0xFFFF
    else:
        add = 0x7FFF + ((bits >> 16) & 1)
    # NaN/Inf never reach here (inputs are validated); a finite value may round up to inf, as in IEEE.
    rounded = ((bits + add) >> 16) << 16
    return _bits_to_f32(rounded)


def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensor holding uint32 bit patterns -> FP32 tensor with those bits."""
    bits = bits & 0xFFFFFFFF
    signed = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return signed.view(torch.float32)


def e2m1_code(values: torch.Tensor) -> torch.Tensor:
    """E2M1 grid values (FP32, exactly on the grid) -> 4-bit codes (uint8: sign << 3 | magnitude index)."""
    a = values.abs()
    # index = 2a for a <= 2 (0, .5, 1, 1.5, 2 -> 0..4); 3 -> 5, 4 -> 6, 6 -> 7
    idx = torch.where(a <= 2.0, 2.0 * a, torch.where(a <= 3.0, 5.0, torch.where(a <= 4.0, 6.0, 7.0)))
    sign = torch.signbit(values).to(torch.uint8)
    return (sign << 3) | idx.to(torch.uint8)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) -> FP32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)
