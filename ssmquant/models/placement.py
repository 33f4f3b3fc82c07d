"""Placing a model's weights over several devices: which block goes where, decided before any weight exists.

A transformers decoder is a stack of layers between a few blocks that run before it (embeddings, a vision
tower, the rotary table) and after it (final norm, LM head). ``model_units`` lists those blocks in forward
order with their bytes (read from a model on the meta device: the shapes only), and ``balanced_plan`` cuts
the stack into one contiguous run of layers per device, each device's share proportional to the room it
has, so that a forward crosses each device boundary once. The plan is a ``device_map`` in the form
transformers' ``from_pretrained(device_map=...)`` and accelerate's ``dispatch_model`` take ({module name:
device}). A model that does not fit is refused before anything is allocated, with the estimate per device
and what to lower.

Like accelerate's ``device_map="auto"`` with its default balancing (``get_balanced_memory``), but the
split is over decoder layers only (the no-split unit of every supported family) and it needs no
accelerate; accelerate does the moving of hidden states between devices at run time (``dispatch_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import GIB, SizingError, free_bytes
from .mixers import find_ssm_mixers

# GPU memory kept free on every device beyond the weights when a model is built in memory: the prefill
# of capture and one layer's emulation run there (sizing.analyze_memory gives the run's own estimate)
DEFAULT_HEADROOM_GIB = 8.0


@dataclass(frozen=True)
class Unit:
    """One block of a model that stays whole on one device. role: "head" (runs before the layer stack,
    or shares weights with a head block), "layer" (one decoder layer, ``index`` its number) or "tail"."""

    name: str
    nbytes: int
    role: str
    index: int | None = None


def _module_bytes(module: torch.nn.Module) -> int:
    # parameters and buffers; on the meta device the sizes are exact although nothing is allocated
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def decoder_layers_path(model: torch.nn.Module) -> str:
    """The dotted name of the model's decoder-layer ModuleList (the longest ModuleList whose elements hold
    parameters), e.g. "model.layers" or "model.language_model.layers"."""
    lists = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and any(True for _ in mod[0].parameters())
    ]
    # a vision tower's block list can be longer than a small decoder's: lists of layers with layer_idx first
    decoders = [x for x in lists if _is_decoder_list(x[1])] or lists
    if not decoders:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to place")
    return max(decoders, key=lambda x: len(x[1]))[0]


def _is_decoder_list(mod: torch.nn.ModuleList) -> bool:
    return any(getattr(m, "layer_idx", None) is not None for m in mod[0].modules())


def model_units(model: torch.nn.Module) -> list[Unit]:
    """The model's blocks in forward order: heads, then each decoder layer, then tails (``Unit``).

    Siblings of the layer list (and of each of its ancestors) registered before it are heads, those after
    it tails, except the rotary table (computed before the stack: a head) and an output embedding whose
    weight is tied to the input embedding (kept with it: a head). Raises ValueError if a parameter or
    buffer sits directly on an ancestor of the layer list (no block would carry it).
    """
    path = decoder_layers_path(model)
    parts = path.split(".")
    heads: list[Unit] = []
    tails: list[Unit] = []
    tied = _tied_output_name(model)
    for depth in range(len(parts)):
        parent_name = ".".join(parts[:depth])
        parent = model.get_submodule(parent_name) if parent_name else model
        direct = [n for n, _ in parent.named_parameters(recurse=False)] + [n for n, _ in parent.named_buffers(recurse=False)]
        if direct:
            raise ValueError(f"{parent_name or type(model).__name__} holds tensors {direct} outside any block to place")
        before = True
        for child_name, child in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if child_name == parts[depth]:
                before = False
                continue
            nbytes = _module_bytes(child)
            if nbytes == 0 and not any(True for _ in child.buffers()):
                continue  # e.g. an activation module: nothing to place
            is_head = before or "rotary" in child_name or full == tied
            (heads if is_head else tails).append(Unit(full, nbytes, "head" if is_head else "tail"))
    # tails reversed: the walk meets outer ones (LM head) before inner ones (final norm), which run first
    layers = model.get_submodule(path)
    stack = [Unit(f"{path}.{i}", _module_bytes(m), "layer", i) for i, m in enumerate(layers)]
    return heads + stack + tails[::-1]


def _tied_output_name(model: torch.nn.Module) -> str | None:
    """The module name of the output embedding when its weight is tied to the input embedding."""
    if not (hasattr(model, "get_output_embeddings") and hasattr(model, "get_input_embeddings")):
        return None
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if out is None or inp is None or not getattr(text, "tie_word_embeddings", False):
        return None
    return next((n for n, m in model.named_modules() if m is out), None)


def balanced_plan(units: list[Unit], room: dict[str, int], *, what: str = "the model") -> dict[str, str]:
    """A device map {unit name: device}: heads on the first device, tails on the last, the decoder layers
    cut into contiguous runs, device i's run ending where the cumulative bytes reach its share of the total
    (shares proportional to ``room``, the bytes each device may take in the order given).

    Raises SizingError, before anything is allocated, when the weights exceed the total room or a device's
    share exceeds its room; the message gives the estimate per device and what to lower.
    """
    devices = list(room)
    if not devices:
        raise ValueError("no devices to place the model on")
    total = sum(u.nbytes for u in units)
    cap = sum(max(0, r) for r in room.values())
    if total > cap:
        raise SizingError(
            f"{what} needs about {total / GIB:.1f} GiB of weights but the {len(devices)} device(s) "
            f"{', '.join(devices)} have {cap / GIB:.1f} GiB of room after the headroom kept for capture and emulation "
            f"({', '.join(f'{d} {max(0, r) / GIB:.1f} GiB' for d, r in room.items())}); use more GPUs, a smaller "
            "weights dtype, fewer layers, or lower the headroom (smaller --steps / --batch)"
        )
    plan: dict[str, str] = {}
    load = dict.fromkeys(devices, 0)
    for u in units:
        if u.role == "head":
            plan[u.name] = devices[0]
            load[devices[0]] += u.nbytes
        elif u.role == "tail":
            plan[u.name] = devices[-1]
            load[devices[-1]] += u.nbytes
    # boundaries of the cumulative layer bytes, counting the fixed head / tail bytes into each device's share
    shares = [total * max(0, room[d]) / cap for d in devices]
    target = [sum(shares[: i + 1]) for i in range(len(devices))]
    done = sum(u.nbytes for u in units if u.role == "head")
    i = 0
    for u in units:
        if u.role != "layer":
            continue
        # move on when this layer would take the device past its boundary by more than half the layer
        while i < len(devices) - 1 and done + u.nbytes / 2 > target[i]:
            i += 1
        plan[u.name] = devices[i]
        load[devices[i]] += u.nbytes
        done += u.nbytes
    over = [d for d in devices if load[d] > room[d]]
    if over:
        raise SizingError(
            f"{what}: no contiguous split of its layers fits: "
            + ", ".join(f"{d} would take {load[d] / GIB:.1f} GiB of {max(0, room[d]) / GIB:.1f} GiB" for d in devices)
            + "; use more GPUs, a smaller weights dtype or fewer layers"
        )
    return {u.name: plan[u.name] for u in units}


def plan_loads(plan: dict[str, str], units: list[Unit]) -> dict[str, int]:
    """Bytes of weights per device under ``plan``."""
    out: dict[str, int] = {}
    sizes = {u.name: u.nbytes for u in units}
    for name, dev in plan.items():
        out[dev] = out.get(dev, 0) + sizes[name]
    return out


def ssm_mixer_devices(model: torch.nn.Module) -> dict[int, torch.device]:
    """{decoder-layer index: the device holding that SSM mixer's weights} (its first parameter's device)."""
    out = {}
    for layer, mixer in find_ssm_mixers(model).items():
        p = next(mixer.module.parameters(), None)
        out[layer] = p.device if p is not None else torch.device("cpu")
    return out


__all__ = ["Unit", "balanced_plan", "decoder_layers_path", "model_units", "plan_loads", "ssm_mixer_devices"]


def device_room(devices: list[str], headroom_bytes: int, free=None) -> dict[str, int]:
    """Bytes each device may take for weights: its free memory (``memory.free_bytes``) less the headroom."""

    free = free or free_bytes
    out = {}
    for d in devices:
        f = free(torch.device(d))
        if f is None:
            raise SizingError(f"cannot read the free memory of {d}")
        out[d] = int(f) - int(headroom_bytes)
    return out
