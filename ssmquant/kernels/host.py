"""Host-side tensors of a launch: write masks and seeds built, pinned and copied once per process, and the batch
slices that keep a launch's metric buffer under its budget."""

from __future__ import annotations

import functools

import torch


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev``. To a GPU through pinned memory and a non-blocking copy: a copy from pageable
    memory waits for everything queued on the stream (the previous layer's kernels); the caching host
    allocator keeps the pinned block until the copy has run."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


# Cached per process, not built per launch: every layer asks for the same ones, and building them stalls the GPU
# (lab/DESIGN_NOTES.md). The cached tensors are read, never written.
@functools.lru_cache(maxsize=32)
def write_mask_on(scheme, bsz: int, steps: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The scheme's write mask [B, T] as int8 on ``device``, and whether every step writes."""
    mask = scheme.write_mask(bsz, steps)
    return _to_device(mask.to(torch.int8), device), bool(mask.all())


@functools.lru_cache(maxsize=32)
def seeds_on(seeds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The variants' seeds [NV] int64 on ``device``."""
    return _to_device(torch.tensor(seeds, dtype=torch.int64), device)


def batch_slices(batch: int, per_sequence_bytes: int, budget: int) -> list[tuple[int, int]]:
    """[(b0, b1)] slices of the batch whose metric buffers fit the budget (at least one sequence each)."""
    per = max(1, budget // max(1, per_sequence_bytes))
    return [(b0, min(batch, b0 + per)) for b0 in range(0, batch, per)]
