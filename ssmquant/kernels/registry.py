"""The registry of fused kernels per layer kind: a kernel module registers its kind's kernel when it is imported
(``kernels/__init__.py`` imports every module of the package), so a new kind's kernel is one new module."""

from __future__ import annotations

from collections.abc import Callable
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
