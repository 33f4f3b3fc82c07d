"""Layer kinds: one module per kind of SSM layer, each with its inputs, state layout and FP32 recurrence.

>>> from ssmquant import kinds
>>> kinds.get("gdn")                 # the GatedDeltaNet kind object
>>> kinds.of(inputs).decays(inputs)  # dispatch through the inputs' kind

`base.py` says what a kind provides; `mamba2.py`, `gdn.py` and `kda.py` (with `delta_rule.py`, what GDN and KDA
share) are the kinds ssmquant ships; every module of this package is imported here, and a kind's module registers
it, so a new kind is one new module. A kind defined elsewhere joins with `kinds.register`.
"""

import importlib
import pkgutil

from .base import (
    Checks,
    InputError,
    KindError,
    LayerDims,
    LayerInputs,
    LayerKind,
    LiteralReplay,
    Physics,
    TransformersFamily,
    after_prompt,
    expand_groups,
    get,
    is_validated,
    names,
    of,
    raise_input_error,
    register,
    registered,
    remember_valid,
    step_metrics,
)
from .delta_rule import DeltaRuleInputs, DeltaRuleKind, gdn_delta, gdn_output, kda_decay
from .gdn import GDN, GDNInputs, gdn_advance, gdn_decays
from .kda import KDA, KDAInputs, kda_advance, kda_decays
from .mamba2 import MAMBA2, Mamba2Inputs, buffer_round, mamba2_advance, mamba2_decays, mamba2_output, mamba2_step

__all__ = [
    "GDN",
    "KDA",
    "MAMBA2",
    "Checks",
    "DeltaRuleInputs",
    "DeltaRuleKind",
    "GDNInputs",
    "InputError",
    "KDAInputs",
    "KindError",
    "LayerDims",
    "LayerInputs",
    "LayerKind",
    "LiteralReplay",
    "Mamba2Inputs",
    "Physics",
    "TransformersFamily",
    "after_prompt",
    "buffer_round",
    "expand_groups",
    "gdn_advance",
    "gdn_decays",
    "gdn_delta",
    "gdn_output",
    "get",
    "is_validated",
    "kda_decay",
    "kda_advance",
    "kda_decays",
    "mamba2_advance",
    "mamba2_decays",
    "mamba2_output",
    "mamba2_step",
    "names",
    "of",
    "raise_input_error",
    "register",
    "registered",
    "remember_valid",
    "step_metrics",
]


def _import_all() -> None:
    """Import every module of this package: each kind's module registers its kind on import."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()
