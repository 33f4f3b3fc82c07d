"""Decoding schemes, variants, the naive torch reference emulation and window statistics of error traces.

>>> from ssmquant.replay import parse_variants, emulate
>>> res = emulate(inputs, parse_variants("fp8_e4m3@conventional,fp8_e4m3@replay16"))   # torch, every step

`ssmquant.simulate` runs variants on a chosen backend (this reference or the fused kernels) and returns a Trace.
"""

from .naive import EmulationResult, StateStore, emulate
from .reference import reference_decode
from .schemes import Scheme, SchemeError, SchemeKind, parse_scheme
from .trace import METRIC_NAMES, STATS, Trace, WindowAccumulator, cycle_window, snr_db, window_ends, window_statistics
from .variants import Variant, VariantError, check_variants_fit, parse_variant, parse_variants

__all__ = [
    "METRIC_NAMES",
    "EmulationResult",
    "Scheme",
    "SchemeError",
    "SchemeKind",
    "STATS",
    "StateStore",
    "Trace",
    "Variant",
    "VariantError",
    "WindowAccumulator",
    "check_variants_fit",
    "cycle_window",
    "emulate",
    "parse_scheme",
    "parse_variant",
    "parse_variants",
    "reference_decode",
    "snr_db",
    "window_ends",
    "window_statistics",
]
