"""Fused kernels: multi-step decode emulation of Mamba-2, Gated DeltaNet and KDA layers, registered per layer kind.

`emulate_triton_steps` is the backend that `ssmquant.simulate(..., backend="triton")` dispatches to; it trusts
inputs already validated by `simulate`. A layer kind's fused kernel registers itself (`registry.py`: how to prepare
its inputs and launch it); `mamba2.py` and `delta_rule.py` (GDN and KDA) carry up to MAX_SLOTS variants per launch
beside one FP32 reference; `plan_launches` groups the variants and picks the tile from a register budget;
`mamba2_engine.py` emulates engine profiles. On a CUDA GPU, the KDA
variants that `kda_cuda.py` covers (8-bit RNE with per-row dynamic scales, Dk = 128) run in its CUDA kernel
instead, one variant per launch (`fused_kernels` says which kernel runs each variant). Shared rounding helpers
live in `rounding.py`; each kernel's torch reference is `ssmquant.replay.naive` (state form) and, for
the tile fake-quant, `ssmquant.formats.codec`.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch
import triton

from ..engines.profiles import arithmetic
from ..formats import Rounding, ScaleMode
from ..kinds import LayerInputs
from ..replay.naive import stored_initial_states
from ..replay.trace import METRIC_BUFFER_BYTES
from ..replay.variants import Variant
from . import kda_cuda
from .common import BUFFER_CODES, MAX_SLOTS, slot_spec
from .host import batch_slices, seeds_on, write_mask_on
from .mamba2_engine import engine_steps
from .quantize import fake_quant_triton, group_rows_for_kernel, store_state_triton
from .registry import FusedKernel, has_kernel, kernel_of, register
from .rounding import FORMAT_CODES

__all__ = [
    "FusedKernel",
    "MAX_SLOTS",
    "emulate_triton",
    "emulate_triton_steps",
    "fake_quant_triton",
    "fused_kernels",
    "has_kernel",
    "plan_blocks",
    "plan_launches",
    "register",
    "store_state_triton",
]



# FP32 state elements per thread, summed over every state a launch carries (the reference and NV variants): one
# warp per 16 x 128 tile with two states (2 x 64 elements per thread) is the fastest tiling for both layer kinds, and
# twice that spills (lab/DESIGN_NOTES.md). A launch carrying NV variants keeps the same budget: 128 / (NV + 1) elements per state and thread,
# rounded down to a power of two, so its tile has fewer rows per warp (six variants: a [128, 4] tile per
# warp). Compiled for sm_90a, none of the planned tilings spills, and every tiling with twice the rows does
# (`python benchmarks/run.py sass`).
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

    Variants whose scale groups need the same rows per program (at the smallest tile of a full launch)
    share launches of at most MAX_SLOTS, in their given order; variants needing several warps even alone (a whole
    head per program) launch one at a time. tiling: one (BLOCK_P, num_warps) for every
    launch (benchmark sweeps and tests), which must hold every variant's scale group. kind: the layer kind
    (an engine profile whose arithmetic on it is the ideal one, `profiles.arithmetic`, launches here too).
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
        # a group that needs several warps even alone (a whole head per program) launches one variant at a time:
        # sharing a launch saves the reference's work but costs more in the registers of the extra states
        # (lab/DESIGN_NOTES.md). The others fit MAX_SLOTS variants in one warp's rows.
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


def _static_rows(variants: list[Variant], bsz: int, heads: int, rows: int, device) -> torch.Tensor | None:
    """The static variants' decode scales expanded to one per row, ones for the others: [NV, B, H, rows]
    fp32, or None when no variant is static."""
    if all(v.format.scale_mode is not ScaleMode.STATIC for v in variants):
        return None
    out = torch.ones(len(variants), bsz, heads, rows, device=device)
    for j, v in enumerate(variants):
        if v.format.scale_mode is ScaleMode.STATIC:
            g = v.format.granularity.group_rows(rows)
            s = v.static_scale.float().to(device)
            out[j] = s.expand(bsz, heads, rows // g).repeat_interleave(g, -1)
    return out


def fused_kernels(inputs: LayerInputs, variants: list[Variant]) -> list[str]:
    """Which fused kernel runs each variant on these inputs: "cuda" (`kda_cuda.py`), "engine" (an engine profile's
    own kernel, `mamba2_engine.py`) or "triton" (the kind's registered kernel)."""
    cuda = kda_cuda.available(inputs.device)
    out = []
    for v in variants:
        if arithmetic(v.engine, inputs.kind) != "ideal":
            out.append("engine")
        elif cuda and kda_cuda.eligible(v, inputs.kind, inputs.state_dim, inputs.rows):
            out.append("cuda")
        else:
            out.append("triton")
    return out


def _kda_cuda_steps(
    inputs: LayerInputs, variants: list[Variant], indices: list[int], shared: dict, s0, metric_budget: int, stored
):
    """`emulate_triton_steps` for the variants at ``indices``, each in its own launch of `kda_cuda`'s kernel
    (stored: each variant's initial state, s0 stored in its format, or None)."""
    bsz, steps, heads, rows = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows
    q, k = shared["q"], shared["k"]
    if q.dtype != k.dtype:  # the kernel reads both with one load
        q, k = q.float(), k.float()
    blocks = rows // kda_cuda.ROWS_PER_WARP
    for i in indices:
        v = variants[i]
        fmt, buf = kda_cuda.variant_config(v)
        write, always = write_mask_on(v.scheme, bsz, steps, inputs.device)
        for b0, b1 in batch_slices(bsz, steps * heads * blocks * 4 * 4, metric_budget):
            m = kda_cuda.kda_cuda_launch(
                q[b0:b1],
                k[b0:b1],
                shared["v"][b0:b1],
                shared["alpha"][b0:b1],
                shared["beta"][b0:b1],
                None if s0 is None else s0[b0:b1],
                write[b0:b1],
                fmt=fmt,
                buf=buf,
                always=always,
                slot_s0=None if stored is None else stored[i][b0:b1].contiguous(),
            )
            yield i, b0, m.sum(3)  # row-block partial sums -> [T, b, H, 4]


def emulate_triton_steps(
    inputs: LayerInputs,
    variants: list[Variant],
    *,
    tiling: tuple[int, int] | None = None,
    metric_budget: int = METRIC_BUFFER_BYTES,
):
    """Run every variant through the fused kernels, one batch slice at a time.

    Yields (variant index, b0, metrics [T, b, H, 4] fp32 on the inputs' device) with the metrics of
    sequences b0..b0+b at every step (the kernel's row-block partial sums added). Inputs are made
    contiguous and the decays computed once; the ideal variants are grouped by `plan_launches` so that
    one launch reads each step's inputs once and advances the FP32 reference once for up to MAX_SLOTS
    variants (a variant's metrics are bit-identical to those of a launch of it alone at the same tiling).
    KDA variants that `kda_cuda` covers run in its CUDA kernel on a GPU (`fused_kernels`).
    tiling: (BLOCK_P, num_warps) to override the plan (benchmark sweeps); metric_budget: bytes of one
    launch's metric buffer.
    """
    dev = inputs.device
    bsz, steps, heads, rows, sdim = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows, inputs.state_dim
    s0 = None if inputs.initial_state is None else inputs.initial_state.float().contiguous()
    # each variant's own state before step 0: s0 stored in its format (replay.naive), None without s0
    stored = stored_initial_states(inputs, variants)
    fused = kernel_of(inputs.kind)
    shared = fused.operands(inputs)
    launch, per_sequence = fused.launch, fused.per_sequence
    kernels = fused_kernels(inputs, variants)
    for i, variant in enumerate(variants):
        if kernels[i] == "engine":  # an engine profile: its own kernel (mamba2_engine.py)
            yield from engine_steps(inputs, variant, i, shared, s0, metric_budget, None if stored is None else stored[i])
    on_cuda = [i for i, name in enumerate(kernels) if name == "cuda"]
    if on_cuda:
        yield from _kda_cuda_steps(inputs, variants, on_cuda, shared, s0, metric_budget, stored)
    rest = [i for i, name in enumerate(kernels) if name != "cuda"]
    for sub, (block_p, num_warps) in plan_launches([variants[i] for i in rest], rows, sdim, tiling, inputs.kind):
        idx = [rest[j] for j in sub]
        group = [variants[i] for i in idx]
        specs = tuple(variant_slot_spec(v, rows, block_p) for v in group)
        write = torch.stack([write_mask_on(v.scheme, bsz, steps, dev)[0] for v in group])
        seeds = seeds_on(tuple(v.seed for v in group), dev)
        static = _static_rows(group, bsz, heads, rows, dev)
        blocks = triton.cdiv(rows, block_p)
        group_s0 = None if stored is None else torch.stack([stored[i] for i in idx])  # [NV, B, H, rows, state_dim]
        for b0, b1 in batch_slices(bsz, len(group) * steps * heads * blocks * 4 * 4, metric_budget):
            args = [t[b0:b1] if name in per_sequence else t for name, t in shared.items()]
            m = launch(
                *args,
                None if s0 is None else s0[b0:b1],
                write[:, b0:b1].contiguous(),
                seeds,
                None if static is None else static[:, b0:b1].contiguous(),
                specs=specs,
                block_p=block_p,
                num_warps=num_warps,
                batch_offset=b0,
                slot_s0=None if group_s0 is None else group_s0[:, b0:b1].contiguous(),
            )
            sums = m.sum(4)  # row-block partial sums -> [NV, T, b, H, 4]
            for j, i in enumerate(idx):
                yield i, b0, sums[j]


def emulate_triton(inputs: LayerInputs, variants: list[Variant], *, tiling: tuple[int, int] | None = None):
    """Every variant through the fused kernel; returns the per-step metrics [V, T, B, H, 4] fp32.

    The whole per-step buffer is materialised: for tests and benchmarks. `simulate` streams the batch
    slices of `emulate_triton_steps` into window statistics instead.
    """
    out = torch.full(
        (len(variants), inputs.steps, inputs.batch, inputs.num_heads, 4), float("nan"), device=inputs.device
    )
    for i, b0, m in emulate_triton_steps(inputs, variants, tiling=tiling):
        out[i, :, b0 : b0 + m.shape[1]] = m
    return out


def _import_all() -> None:
    """Import every module of this package: each kind's kernel module registers its kernel on import."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()
