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
# The output mode (eval --mode layer) launches one variant over all steps of a layer: its time is one program's
# per-step latency times T, not the GPU's throughput, so a one-warp program holds at most this many rows (more
# programs, fewer elements per thread). lab/bench/output_tiling.py (benchmarks/RESULTS.md): with the quantized
# variants 8 rows ran fastest, or within 8% of the fastest tiling, on Mamba-2 heads [64, 128] (8 and 64 heads) and GDN
# heads [64, 64]; up to 1.7x faster than 16 rows on the small Mamba-2 layer, and faster than 4 rows everywhere.
OUTPUT_ROWS_PER_PROGRAM = 8


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


def plan_output_launches(
    variants: list[Variant], rows: int, state_dim: int, kind: str = "mamba2"
) -> list[tuple[list[int], tuple[int, int]]]:
    """`plan_launches` for the output mode: where a launch is one warp per program and every variant's scale group
    fits OUTPUT_ROWS_PER_PROGRAM rows, at most that many rows per program; other launches as `plan_launches`
    plans them."""
    out = []
    for idx, (block_p, num_warps) in plan_launches(variants, rows, state_dim, None, kind):
        if num_warps == 1 and all(_rows_needed(variants[i], rows) <= OUTPUT_ROWS_PER_PROGRAM for i in idx):
            block_p = min(block_p, OUTPUT_ROWS_PER_PROGRAM)
        out.append((idx, (block_p, num_warps)))
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
