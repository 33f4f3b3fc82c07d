"""The SSM mixers of a transformers model: which modules they are, at which decoder layer, of which layer kind.

Shared by capture (which intercepts their recurrence inputs), placement (which puts their layers on devices) and the
evaluation (which stores their cached states).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kinds
from ..errors import SsmquantError


def known_layer_kinds() -> dict[str, str]:
    """The registered layer kinds that transformers models have, and those models (named in refusals)."""
    return {k.name: f"{k.title} ({k.model_names})" for k in kinds.registered() if k.transformers_families}


class CaptureError(SsmquantError, RuntimeError):
    """Capture could not run or did not see every requested layer; the message says why."""



@dataclass(frozen=True)
class SSMMixer:
    layer: int
    kind: str  # a registered layer kind's name
    module: torch.nn.Module


def find_ssm_mixers(model: torch.nn.Module) -> dict[int, SSMMixer]:
    """The SSM mixers of a transformers model, by decoder-layer index.

    A module is a mixer of the first registered kind whose ``is_mixer`` matches it (Mamba-2: class names ending in
    ``Mamba2Mixer``; GDN: in ``GatedDeltaNet``; KDA: in ``DeltaAttention`` or ``LinearAttention`` with a
    per-channel ``forget_gate``). A layer that the config types "linear_attention" but whose mixer is none of
    these is refused, naming its class and the known kinds.
    """
    found: dict[int, SSMMixer] = {}
    for _, mod in model.named_modules():
        kind = _mixer_kind(mod)
        if kind is None:
            continue
        cls = type(mod).__name__
        layer = getattr(mod, "layer_idx", None)
        if layer is None:
            raise CaptureError(f"{cls} has no layer_idx; cannot tell which layer it is")
        if layer in found:
            raise CaptureError(f"two SSM mixers claim layer {layer} ({cls})")
        found[int(layer)] = SSMMixer(int(layer), kind, mod)
    _refuse_unknown_linear_layers(model, found)
    return dict(sorted(found.items()))


def _mixer_kind(mod: torch.nn.Module) -> str | None:
    return next((k.name for k in kinds.registered() if k.is_mixer(mod)), None)


def _refuse_unknown_linear_layers(model: torch.nn.Module, found: dict[int, SSMMixer]) -> None:
    """Raise if the config types a layer "linear_attention" and no known mixer sits at it."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    types = list(getattr(text, "layer_types", None) or [])
    missing = [i for i, t in enumerate(types) if t == "linear_attention" and i not in found]
    if not missing:
        return
    at = {
        type(m).__name__
        for _, m in model.named_modules()
        if getattr(m, "layer_idx", None) == missing[0] and not isinstance(m.layer_idx, bool)
    }
    raise CaptureError(
        f"layer {missing[0]} is a linear-attention layer (config layer_types) but its mixer "
        f"({', '.join(sorted(at)) or 'no module with that layer_idx'}) is of no layer kind ssmquant knows; known "
        "kinds: " + "; ".join(f"{k}: {v}" for k, v in known_layer_kinds().items())
    )
