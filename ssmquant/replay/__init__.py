"""Decoding schemes, naive torch reference recurrences and the `simulate` entry point.

>>> from ssmquant.replay import simulate
>>> trace = simulate(inputs, ["fp8_e4m3@conventional", "fp8_e4m3@replay16"], backend="auto")
>>> trace.to_frame()      # variant, step (window end), window_start, {state,out}_rel_err[_max|_last], SNR
"""

from .inputs import GDNInputs, InputError, KDAInputs, LayerInputs, Mamba2Inputs
from .naive import EmulationResult, emulate
from .reference import reference_decode
from .schemes import Scheme, SchemeError, SchemeKind, parse_scheme
from .simulate import BACKENDS, BackendError, resolve_backend, simulate
from .trace import METRIC_NAMES, STATS, Trace, WindowAccumulator, cycle_window, snr_db, window_ends, window_statistics
from .variants import Variant, VariantError, parse_variant, parse_variants

__all__ = [
    "BACKENDS",
    "METRIC_NAMES",
    "BackendError",
    "EmulationResult",
    "GDNInputs",
    "InputError",
    "KDAInputs",
    "LayerInputs",
    "Mamba2Inputs",
    "Scheme",
    "SchemeError",
    "SchemeKind",
    "STATS",
    "Trace",
    "Variant",
    "VariantError",
    "WindowAccumulator",
    "cycle_window",
    "emulate",
    "parse_scheme",
    "parse_variant",
    "parse_variants",
    "reference_decode",
    "resolve_backend",
    "simulate",
    "snr_db",
    "window_ends",
    "window_statistics",
]
