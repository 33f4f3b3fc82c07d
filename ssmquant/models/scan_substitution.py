"""The SSM mixers' own chunked scans skipped in a forward that replaces their outputs anyway (layer-major eval).

``evaluate.layer_major`` replaces every SSM mixer's scan output at its gated norm by a variant's per-step outputs, so
the mixer's own chunked scan (transformers' torch scan, or fla's / mamba_ssm's kernels on CUDA) is computed and
thrown away, and it is most of a prefill's live memory (``sizing.prefill_bytes_per_token``). transformers lists each
mixer's scan among its kernel functions (``use_kernelized_func``), the hook through which the ``kernels`` package's
``kernelize`` swaps implementations by a kernel mapping. ``skipped_scans`` maps the kind's scan
(``LayerKind.prefill_scan_kernel``) to a placeholder (``placeholder_layer``) for the duration of a forward and
restores the original afterwards.

The mixer's causal convolution feeds its scan and nothing else (x, B and C of Mamba-2; q, k and v of the delta
rules), so where the scan is skipped its output is dead too: where the mixer also lists its convolution
(``CONV_FUNCTION``, transformers 5.25's name in all four families), a placeholder returns zeros of its output for it
(``conv_placeholder_forward``). The substitution derives the recurrence inputs from the recorded projections with its
own convolution (``models.taps``), as capture does.

The placeholder runs the real scan on the first ``PROBE_POSITIONS`` positions (more than the layer has heads) of the
first sequence, so that what it returns has the real scan's dtype and trailing sizes (they differ between
transformers' torch scan, float32, and the fused packages, the inputs' dtype), and returns zeros of the full
[B, L, ...] shape in that dtype. Where the caller
asks for the scan's final state (a cache), or the probe returns one, the whole scan runs: a placeholder never stands in
for a state.

``kernels`` is a dependency of transformers 5.25 (0.19.x); at the 5.24 floor it is an optional extra that the floor's
huggingface_hub cannot take, so there the scans run as before (the floors' CI runs that path). Whether a mixer lists
its scan is read from the per-instance wrappers ``use_kernelized_func`` attaches (``_kernel_funcs``), and the
placeholder calls a wrapper's own class forward for the real scan: tests/models/test_scan_substitution.py verifies both
against the real scan on the shipped models.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator

import torch

from .. import kinds

# Positions of the first sequence the placeholder's probe scans at least (more where a layer has more heads).
PROBE_POSITIONS = 16
# The arguments by which the scans return their final state (Mamba-2's chunk scan; the delta rules' chunk functions).
FINAL_STATE_FLAGS = ("return_final_states", "output_final_state")
# The kernel function of the mixers' causal depthwise convolution (its input and output [B, channels, L]).
CONV_FUNCTION = "causal_conv1d_forward"
# The loggers through which kernels' kernelize reports every extensible layer it leaves with its original forward.
KERNELS_LOGGERS = ("kernels", "kernels._internals.layer.layer", "kernels._internals.layer.kernelize")


def _probe(value, batch: int, length: int, positions: int):
    """``value`` cut to the first sequence's first ``positions`` positions where it is a [batch, length, ...] tensor."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, length):
        return value[:1, :positions]
    return value


def placeholder_forward(wrapper: torch.nn.Module, args: tuple, kwargs: dict):
    """What a placeholder returns for a call of the scan function ``wrapper`` (a mixer's kernel-function wrapper):
    zeros of the scan's output [B, L, ...] in its dtype (module docstring)."""
    original = type(wrapper).forward  # the wrapper's own forward: the scan transformers would run here
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
    if first is None or any(kwargs.get(flag) for flag in FINAL_STATE_FLAGS):
        return original(wrapper, *args, **kwargs)
    batch, length = first.shape[:2]
    # more positions than heads: fla reads a [B, H, L, ...] layout into a call with fewer positions than heads and warns
    heads = int(first.shape[2]) if first.dim() >= 3 else 0
    n = min(int(length), max(PROBE_POSITIONS, heads + 1))
    probe = original(wrapper, *(_probe(a, batch, length, n) for a in args),
                     **{k: _probe(v, batch, length, n) for k, v in kwargs.items()})  # fmt: skip
    out, rest = (probe[0], probe[1:]) if isinstance(probe, tuple) else (probe, None)
    if rest is not None and any(r is not None for r in rest):
        return original(wrapper, *args, **kwargs)
    zeros = out.new_zeros((batch, length, *out.shape[2:]))
    return zeros if rest is None else (zeros, *rest)


def conv_placeholder_forward(wrapper: torch.nn.Module, args: tuple, kwargs: dict):
    """What a placeholder returns for a call of the convolution function ``wrapper`` (``CONV_FUNCTION``): zeros of
    its output [B, channels, L] in its dtype, both taken from the real convolution of the first sequence's first
    ``PROBE_POSITIONS`` positions; with a cache (whose conv state it updates) the real convolution runs."""
    original = type(wrapper).forward
    bound = inspect.signature(original).bind(wrapper, *args, **kwargs)
    hidden, cache = bound.arguments.get("hidden_states"), bound.arguments.get("cache")
    if cache is not None or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return original(wrapper, *args, **kwargs)
    batch, length = hidden.shape[0], hidden.shape[-1]
    bound.arguments["hidden_states"] = hidden[:1, :, : min(int(length), PROBE_POSITIONS)]
    probe = original(*bound.args, **bound.kwargs)
    return probe.new_zeros((batch, probe.shape[1], length))


def placeholder_layer(function_class: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """kernels' replacement layer for the scan (or convolution) function whose wrapper class is ``function_class``:
    stateless, with the function's forward signature, as ``kernelize`` requires of a layer (``placeholder_forward``,
    ``conv_placeholder_forward``)."""
    stand_in = conv_placeholder_forward if function_class.kernel_layer_name == CONV_FUNCTION else placeholder_forward

    def forward(self, *args, **kwargs):
        return stand_in(self, args, kwargs)

    forward.__signature__ = inspect.signature(function_class.forward)
    return type(f"ScanPlaceholder_{function_class.kernel_layer_name}", (torch.nn.Module,), {"forward": forward})


class _PlaceholderRepository:
    """A kernel repository (kernels' RepositoryProtocol) whose layer is the placeholder of one scan function; one
    per function (kernels memoizes a repository's layer)."""

    def __init__(self, function_class: type[torch.nn.Module]):
        self.function_class = function_class

    def load(self) -> type[torch.nn.Module]:
        return placeholder_layer(self.function_class)

    def __repr__(self) -> str:
        return f"ssmquant's placeholder of {self.function_class.kernel_layer_name}"


_REPOSITORIES: dict[type, _PlaceholderRepository] = {}


def _repository(function_class: type[torch.nn.Module]) -> _PlaceholderRepository:
    return _REPOSITORIES.setdefault(function_class, _PlaceholderRepository(function_class))


def _kernel_function(mixer, name: str | None) -> torch.nn.Module | None:
    """``mixer``'s wrapper of the kernel function transformers lists under ``name`` (``use_kernelized_func``); None
    where it lists none (an older transformers, no ``kernels`` package, a kind without one, ``name`` None)."""
    funcs = getattr(mixer.module, "_kernel_funcs", None) or {}
    return next((f for f in funcs.values() if name is not None and getattr(f, "kernel_layer_name", None) == name), None)


def _scan_wrapper(mixer) -> torch.nn.Module | None:
    """``mixer``'s wrapper of its kind's chunked scan function (``LayerKind.prefill_scan_kernel``), or None."""
    return _kernel_function(mixer, kinds.get(mixer.kind).prefill_scan_kernel)


def can_skip_scans(mixers) -> bool:
    """Whether ``skipped_scans`` replaces the scan of every one of ``mixers`` (``models.mixers.find_ssm_mixers``'
    values): the ``kernels`` package imports, its mappings are not switched off (``DISABLE_KERNEL_MAPPING``, which
    makes ``kernelize`` keep every original forward) and each mixer lists its kind's scan as a kernel function."""
    try:
        import kernels  # noqa: F401
    except ImportError:
        return False
    if os.environ.get("DISABLE_KERNEL_MAPPING", "0") not in ("", "0"):
        return False
    return bool(mixers) and all(_scan_wrapper(m) is not None for m in mixers)


@contextlib.contextmanager
def _quiet_kernels():
    """kernels' per-layer notices (every extensible layer without a mapping keeps its forward) kept off the log."""
    loggers = [logging.getLogger(n) for n in KERNELS_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# What kernelize sets on a module or a kernel-function wrapper it touches (kernels' _replace_forward)
KERNELIZED_ATTRIBUTES = ("forward", "_kernel_repo")


def _instance_state(modules) -> list[tuple[object, dict]]:
    """(object, its own KERNELIZED_ATTRIBUTES) of every module under ``modules`` and of every kernel-function wrapper
    they hold: what kernelize may change (an accelerate hook's forward, an earlier kernelize's choice)."""
    state = []
    for module in modules:
        for sub in module.modules():
            for obj in (sub, *(getattr(sub, "_kernel_funcs", None) or {}).values()):
                state.append((obj, {k: obj.__dict__[k] for k in KERNELIZED_ATTRIBUTES if k in obj.__dict__}))
    return state


def _restore(state: list[tuple[object, dict]], keep: set[int] = frozenset()) -> None:
    """Put back what ``_instance_state`` saw, except on the objects whose ids are in ``keep``."""
    for obj, attrs in state:
        if id(obj) in keep:
            continue
        for k in KERNELIZED_ATTRIBUTES:
            if k in attrs:
                obj.__dict__[k] = attrs[k]
            else:
                obj.__dict__.pop(k, None)


@contextlib.contextmanager
def skipped_scans(mixers) -> Iterator[bool]:
    """Within the context every one of ``mixers`` (``find_ssm_mixers``' values) runs a placeholder
    (``placeholder_layer``) for its chunked scan and, where it lists one, for its convolution, and yields True; where
    ``can_skip_scans`` is False, or kernelize did not install the placeholders, nothing changes and it yields False.
    Only the scan and convolution functions change: every other
    module of the mixers keeps its own forward (an accelerate hook's, an earlier kernelize's) throughout, and on exit,
    normal or not, every one is as it was. Not for a forward under torch.compile (kernels then calls the placeholder on
    the shared function object, whose class forward dispatches back to it)."""
    mixers = list(mixers)
    if not can_skip_scans(mixers):
        yield False
        return
    from kernels import Mode, kernelize, use_kernel_mapping

    state = _instance_state([m.module for m in mixers])
    wrappers = [[w for w in (_scan_wrapper(m), _kernel_function(m, CONV_FUNCTION)) if w is not None] for m in mixers]
    try:
        by_device: dict[str, list] = {}
        for m, own in zip(mixers, wrappers):
            by_device.setdefault(next(m.module.parameters()).device.type, []).append((m, own))
        for device_type, group in by_device.items():
            functions = {type(wrapper) for _, own in group for wrapper in own}
            mapping = {f.kernel_layer_name: {device_type: {Mode.INFERENCE: _repository(f)}} for f in functions}
            with _quiet_kernels(), use_kernel_mapping(mapping, inherit_mapping=False):
                for m, _ in group:
                    kernelize(m.module, mode=Mode.INFERENCE, device=device_type)
        replaced = [w for own in wrappers for w in own]
        _restore(state, keep={id(w) for w in replaced})  # kernelize reset the mixers' other layers: theirs back
        installed = all(getattr(w, "_kernel_repo", None) is _repository(type(w)) for w in replaced)
        if not installed:
            _restore(state)
        yield installed
    finally:
        _restore(state)


__all__ = [
    "CONV_FUNCTION",
    "PROBE_POSITIONS",
    "can_skip_scans",
    "conv_placeholder_forward",
    "placeholder_forward",
    "placeholder_layer",
    "skipped_scans",
]
