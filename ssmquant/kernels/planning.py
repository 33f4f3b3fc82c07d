"""Launch planning of the fused kernels: which ideal variants share a launch, at which tile (BLOCK_P rows per
program, num_warps): from a register budget and the coarsest scale group of the launch's variants."""

from __future__ import annotations

import triton

from ..engines.profiles import arithmetic
from ..formats import Rounding, ScaleMode
from ..replay.variants import Variant
from .common import BUFFER_CODES, MAX_SLOTS, slot_spec
from .quantize import group_rows_for_kernel
from .rounding import FORMAT_CODES

# FP32 state elements per thread, summed over the reference and the NV variants: the largest budget that does not
# spill (lab/DESIGN_NOTES.md). Each state gets 128 / (NV + 1), rounded down to a power of two (six variants: a
# [128, 4] tile per warp).
_STATE_ELEMENTS_PER_THREAD = 128
_MAX_WARPS = 16


def _rows_needed(variant: Variant, rows: int) -> int:
    """Rows one program must hold for the variant's scale groups (a per-head scale: the whole head)."""
    fmt = variant.format
    full = triton.next_power_of_2(rows)
    if not fmt.encoding.scaled:
        return 1
    return full if fmt.granularity.rows is None else min(full, fmt.granularity.rows)


def _rows_per_warp(nv: int, state_dim: int) -> int:
    per_state = 1 << ((_STATE_ELEMENTS_PER_THREAD // (nv + 1)).bit_length() - 1)  # power of two
    return max(1, 32 * per_state // triton.next_power_of_2(state_dim))


def plan_blocks(variants: list[Variant], rows: int, state_dim: int) -> tuple[int, int]:
    """(BLOCK_P rows per program, num_warps) for one launch carrying `variants` on [rows, state_dim] head
    states: rows per warp from the register budget, and enough rows for the coarsest scale group."""
    per_warp = _rows_per_warp(len(variants), state_dim)
    block_p = min(triton.next_power_of_2(rows), max([per_warp] + [_rows_needed(v, rows) for v in variants]))
    return block_p, min(_MAX_WARPS, max(1, block_p // per_warp))


def plan_launches(
    variants: list[Variant], rows: int, state_dim: int, tiling: tuple[int, int] | None = None, kind: str = "mamba2"
) -> list[tuple[list[int], tuple[int, int]]]:
    """Group the ideal (non-engine) variants into launches: [(variant indices, (BLOCK_P, num_warps))].

    Variants whose scale groups need the same rows per program share launches of at most MAX_SLOTS, in order; those
    needing several warps even alone launch one at a time. tiling: one (BLOCK_P, num_warps) for every launch
    (sweeps, tests), holding every variant's scale group. kind: for `profiles.arithmetic` (engine profiles whose
    arithmetic is the ideal one launch here too).
    """
    ideal = [i for i, v in enumerate(variants) if arithmetic(v.engine, kind) == "ideal"]
    if tiling is not None:
        for i in ideal:
            if _rows_needed(variants[i], rows) > tiling[0]:
                raise ValueError(
                    f"tiling BLOCK_P={tiling[0]} is smaller than the scale group of {variants[i].name} "
                    f"({_rows_needed(variants[i], rows)} rows)"
                )
        return [(ideal[j : j + MAX_SLOTS], tiling) for j in range(0, len(ideal), MAX_SLOTS)]
    smallest = _rows_per_warp(MAX_SLOTS, state_dim)
    buckets: dict[int, list[int]] = {}
    for i in ideal:
        buckets.setdefault(max(smallest, _rows_needed(variants[i], rows)), []).append(i)
    out = []
    for idx in buckets.values():
        # several warps even alone: one variant per launch, as the extra states' registers cost more than sharing
        # the reference saves (lab/DESIGN_NOTES.md)
        size = 1 if plan_blocks([variants[idx[0]]], rows, state_dim)[1] > 1 else MAX_SLOTS
        for j in range(0, len(idx), size):
            chunk = idx[j : j + size]
            out.append((chunk, plan_blocks([variants[i] for i in chunk], rows, state_dim)))
    return out


def variant_slot_spec(variant: Variant, rows: int, block_p: int) -> int:
    """`common.slot_spec` of an ideal variant in a launch of block_p rows per program on heads of `rows` rows (a
    per-head scale group is the program's rows)."""
    fmt = variant.format
    return slot_spec(
        FORMAT_CODES[fmt.encoding],
        block_p if fmt.granularity.rows is None else group_rows_for_kernel(fmt, rows, block_p),
        fmt.scale_mode is ScaleMode.STATIC,
        fmt.rounding is Rounding.SR,
        BUFFER_CODES[variant.scheme.buffer_dtype] if variant.scheme.rounds_buffer else 0,
    )
