"""Decoding schemes, naive torch reference recurrences and the `simulate` entry point.

>>> from ssmquant.replay import simulate
>>> trace = simulate(inputs, ["fp8_e4m3@conventional", "fp8_e4m3@replay16"], backend="auto")
>>> trace.to_frame()      # variant, step, state_rel_err, out_rel_err, state_snr_db, out_snr_db
"""

from .inputs import GDNInputs, InputError, LayerInputs, Mamba2Inputs
from .naive import METRIC_NAMES, EmulationResult, emulate, recorded_steps
from .reference import reference_decode
from .schemes import Scheme, SchemeError, SchemeKind, parse_scheme
from .simulate import BACKENDS, BackendError, resolve_backend, simulate
from .trace import Trace, snr_db
from .variants import Variant, VariantError, parse_variant, parse_variants

__all__ = [
    "BACKENDS",
    "METRIC_NAMES",
    "BackendError",
    "EmulationResult",
    "GDNInputs",
    "InputError",
    "LayerInputs",
    "Mamba2Inputs",
    "Scheme",
    "SchemeError",
    "SchemeKind",
    "Trace",
    "Variant",
    "VariantError",
    "emulate",
    "parse_scheme",
    "parse_variant",
    "parse_variants",
    "recorded_steps",
    "reference_decode",
    "resolve_backend",
    "simulate",
    "snr_db",
]
