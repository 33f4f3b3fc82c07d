"""State storage formats: specs, exact torch reference quantize / dequantize / fake-quant, footprints.

>>> from ssmquant import formats
>>> fmt = formats.parse("fp8_e4m3")          # per-row dynamic scales, RNE
>>> q = fmt.quantize(state)                  # state [..., rows, state_dim]
>>> state_hat = fmt.dequantize(q)            # FP32, same shape
>>> fmt.bytes_per_state((64, 64, 128))       # elements + scales
"""

from .codec import QuantizedState, dequantize, group_amax, group_shape, quantize, scales_from_amax
from .grids import E2M1, E4M3, FP16, INT8, INT16, FloatGrid, Rounding, round_integer, round_to_bf16, round_to_grid
from .random import random_bits, stream_key, uniform_from_bits
from .spec import (
    ENCODING_NAMES,
    NVFP4_BLOCK,
    PER_HEAD,
    PER_ROW,
    Encoding,
    FormatError,
    Granularity,
    ScaleMode,
    StateFormat,
    parse,
    standard_formats,
)

__all__ = [
    "E2M1",
    "E4M3",
    "ENCODING_NAMES",
    "FP16",
    "INT8",
    "INT16",
    "NVFP4_BLOCK",
    "PER_HEAD",
    "PER_ROW",
    "Encoding",
    "FloatGrid",
    "FormatError",
    "Granularity",
    "QuantizedState",
    "Rounding",
    "ScaleMode",
    "StateFormat",
    "dequantize",
    "group_amax",
    "group_shape",
    "parse",
    "quantize",
    "random_bits",
    "round_integer",
    "round_to_bf16",
    "round_to_grid",
    "scales_from_amax",
    "standard_formats",
    "stream_key",
    "uniform_from_bits",
]
