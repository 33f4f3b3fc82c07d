"""Every element encoding as one object holding all its facts: bits, grid, scale layout, storage dtype, kernel code.

Adding an encoding is one `EncodingSpec` here (and its `Encoding` member in `spec.py`): the codec (`codec.py`),
the footprints (`spec.py`), the kernels (`ssmquant.kernels.rounding`, which branch on ``kernel_code``) and the
calibration read these facts, never a table of their own.

Scale layouts:
- "none": the element is stored as is (fp32) or rounded to a float type (bf16, fp16);
- "group": one FP32 decode scale per group of rows (fp8_e4m3, int8, int16): codes = round(clamp(x * max_code /
  amax)) on ``grid``;
- "two-level": NVFP4: an E4M3 scale per ``block`` elements along the state dim times an FP32 second-level scale
  per group of rows (modelopt's NVFP4QTensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SsmquantError
from .grids import E2M1, E4M3, E5M2, FP16, INT8, INT16, FloatGrid


class FormatError(SsmquantError, ValueError):
    """A format spec string or format option is not valid (the formats package's one error type)."""

SCALE_LAYOUTS = ("none", "group", "two-level")


@dataclass(frozen=True)
class EncodingSpec:
    """The facts of one element encoding (module docstring).

    grid: the element grid its values are rounded to (None for fp32 and bf16); pattern_bits: bf16's rounding, to the
    top 16 bits of the FP32 bit pattern (None: no such rounding);
    max_code: the largest grid magnitude a group's amax maps onto (two-level: E2M1's 6 times E4M3's 448);
    storage: the torch dtype of the stored codes (nvfp4: uint8, one 4-bit code per element, packed two per byte in
    the footprint); kernel_code: the constexpr FMT the fused kernels branch on; block: elements per block scale.
    """

    name: str
    bits: int
    scale_layout: str
    grid: FloatGrid | None
    max_code: float | None
    storage: torch.dtype
    kernel_code: int
    block: int | None = None
    pattern_bits: int | None = None
    aliases: tuple[str, ...] = ()

    def __post_init__(self):
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"{self.name}: scale_layout must be one of {SCALE_LAYOUTS}, got {self.scale_layout!r}")

    @property
    def scaled(self) -> bool:
        """True when elements are stored with FP32 scales."""
        return self.scale_layout != "none"

    def element_bytes(self, elements: int) -> int:
        """Bytes of ``elements`` codes, block scales included (not the FP32 group scales)."""
        if self.scale_layout == "two-level":
            return (elements + 1) // 2 + elements // self.block
        return elements * self.bits // 8


SPECS: dict[str, EncodingSpec] = {
    s.name: s
    for s in (
        EncodingSpec("fp32", 32, "none", None, None, torch.float32, 0, aliases=("float32",)),
        EncodingSpec("bf16", 16, "none", None, None, torch.bfloat16, 1, pattern_bits=16, aliases=("bfloat16",)),
        EncodingSpec("fp16", 16, "none", FP16, None, torch.float16, 2, aliases=("float16",)),
        EncodingSpec("fp8_e4m3", 8, "group", E4M3, E4M3.max_value, torch.float8_e4m3fn, 3, aliases=("fp8", "e4m3")),
        EncodingSpec("int8", 8, "group", INT8, INT8.max_value, torch.int8, 4),
        EncodingSpec("nvfp4", 4, "two-level", E2M1, E2M1.max_value * E4M3.max_value, torch.uint8, 5, block=16),
        # FlashInfer's scaled int16 state of selective_state_update
        EncodingSpec("int16", 16, "group", INT16, INT16.max_value, torch.int16, 6),
        EncodingSpec("fp8_e5m2", 8, "group", E5M2, E5M2.max_value, torch.float8_e5m2, 7, aliases=("e5m2",)),
        # the plain casts of FlashInfer's GDN prefill state (float8_e4m3fn / float8_e5m2, no scale): RNE, saturating
        EncodingSpec("fp8_e4m3_cast", 8, "none", E4M3, None, torch.float8_e4m3fn, 8),
        EncodingSpec("fp8_e5m2_cast", 8, "none", E5M2, None, torch.float8_e5m2, 9),
    )
}
