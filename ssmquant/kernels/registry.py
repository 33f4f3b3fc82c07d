"""The kernels of each layer kind, registered by their modules on import (``kernels/__init__.py`` imports them all):
one ``FusedKernel`` per kind and any number of ``VariantKernel``s."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..kinds import LayerInputs


@dataclass(frozen=True)
class FusedKernel:
    """A layer kind's fused multi-variant kernel.

    operands(inputs) -> the launch's per-layer operands in the launcher's order (a dict name -> tensor, contiguous,
    decays included); per_sequence: the operands cut with the batch; launch(*operands, s0, write, seeds,
    static_scale_rows, *, specs, block_p, num_warps, batch_offset, slot_s0) -> metrics [NV, T, b, H, row blocks, 4]
    (slot_s0: [NV, b, H, rows, state_dim], each slot's initial state as stored, or None)."""

    operands: Callable[[LayerInputs], dict[str, torch.Tensor]]
    per_sequence: frozenset[str]
    launch: Callable


_KERNELS: dict[str, FusedKernel] = {}


def register(kind: str, kernel: FusedKernel) -> FusedKernel:
    """Register the fused kernel of the layer kind named ``kind``."""
    _KERNELS[kind] = kernel
    return kernel


def has_kernel(kind: str) -> bool:
    """Whether a fused kernel is registered for the layer kind named ``kind``."""
    return kind in _KERNELS


def kernel_of(kind: str) -> FusedKernel:
    """The fused kernel registered for the layer kind named ``kind``."""
    return _KERNELS[kind]


@dataclass(frozen=True)
class VariantKernel:
    """A kernel that runs some variants of one layer kind, one per launch, in place of its fused kernel.

    name: what ``fused_kernels`` reports; available(device) -> bool; eligible(variant, kind, state_dim, rows) ->
    bool; steps(inputs, variant, shared, s0, metric_budget, stored) -> yields (b0, metrics [T, b, H, 4] fp32) per
    batch slice (shared: the fused kernel's operands; stored: the variant's initial state as stored, or None)."""

    name: str
    available: Callable[[torch.device], bool]
    eligible: Callable[..., bool]
    steps: Callable[..., Iterator[tuple[int, torch.Tensor]]]


_VARIANT_KERNELS: dict[str, list[VariantKernel]] = {}


def register_variant_kernel(kind: str, kernel: VariantKernel) -> VariantKernel:
    """Register a one-variant kernel for the layer kind named ``kind`` (tried in registration order)."""
    _VARIANT_KERNELS.setdefault(kind, []).append(kernel)
    return kernel


def variant_kernels_of(kind: str) -> tuple[VariantKernel, ...]:
    """The one-variant kernels registered for the layer kind named ``kind``."""
    return tuple(_VARIANT_KERNELS.get(kind, ()))
