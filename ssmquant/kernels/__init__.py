"""Fused kernels: multi-step decode emulation of Mamba-2, Gated DeltaNet and KDA layers, registered per layer kind.

`emulate_triton_steps` is `ssmquant.simulate(..., backend="triton")`'s backend; it trusts inputs `simulate` validated.
Each kind registers a fused kernel (`registry.py`) that carries up to MAX_SLOTS variants beside one FP32 reference
(`mamba2.py`, `delta_rule.py`) and may register one-variant kernels that run the variants they cover instead
(`kda_cuda.py`); `planning.py` groups the variants into launches; `mamba2_engine.py` runs engine profiles; `metrics.py` compares the
layer-major evaluation's logits.
Torch references: `ssmquant.replay.naive` (state form) and `ssmquant.formats.codec` (tile fake-quant).
"""

from __future__ import annotations

import importlib
import pkgutil

import torch
import triton

from ..engines.profiles import arithmetic
from ..formats import ScaleMode
from ..kinds import LayerInputs
from ..replay.naive import stored_initial_states
from ..replay.trace import METRIC_BUFFER_BYTES
from ..replay.variants import Variant
from .common import MAX_SLOTS
from .host import batch_slices, seeds_on, write_mask_on
from .mamba2_engine import engine_steps
from .planning import plan_blocks, plan_launches, plan_output_launches, variant_slot_spec
from .quantize import fake_quant_triton, store_state_triton
from .registry import FusedKernel, VariantKernel, has_kernel, kernel_of, register, variant_kernels_of

__all__ = [
    "FusedKernel",
    "MAX_SLOTS",
    "VariantKernel",
    "emulate_triton",
    "emulate_triton_outputs",
    "emulate_triton_steps",
    "fake_quant_triton",
    "fused_kernels",
    "has_kernel",
    "plan_blocks",
    "plan_launches",
    "plan_output_launches",
    "register",
    "store_state_triton",
]



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


def _layer_operands(inputs: LayerInputs, variants: list[Variant]):
    """(s0: the reference's initial state [B, H, rows, state_dim] fp32 or None, each variant's state before step 0
    (s0 stored in its format; None without s0), the kind's FusedKernel, its per-layer operands)."""
    s0 = None if inputs.initial_state is None else inputs.initial_state.float().contiguous()
    fused = kernel_of(inputs.kind)
    return s0, stored_initial_states(inputs, variants), fused, fused.operands(inputs)


def _slot_operands(inputs: LayerInputs, variants: list[Variant], idx: list[int], stored, block_p: int):
    """The slot operands of one launch carrying ``variants[i]`` for i in ``idx`` at BLOCK_P rows: (slot specs,
    write masks [NV, B, T] int8, seeds [NV], static scales [NV, B, H, rows] or None, initial states
    [NV, B, H, rows, state_dim] as stored, or None without ``stored``)."""
    group = [variants[i] for i in idx]
    bsz, steps, dev = inputs.batch, inputs.steps, inputs.device
    return (
        tuple(variant_slot_spec(v, inputs.rows, block_p) for v in group),
        torch.stack([write_mask_on(v.scheme, bsz, steps, dev)[0] for v in group]),
        seeds_on(tuple(v.seed for v in group), dev),
        _static_rows(group, bsz, inputs.num_heads, inputs.rows, dev),
        None if stored is None else torch.stack([stored[i] for i in idx]),
    )


def fused_kernels(inputs: LayerInputs, variants: list[Variant]) -> list[str]:
    """Which kernel runs each variant on these inputs: "engine" (`mamba2_engine.py`), the name of a one-variant
    kernel of the kind available on the inputs' device that covers the variant (KDA's "cuda"), or "triton"."""
    singles = [k for k in variant_kernels_of(inputs.kind) if k.available(inputs.device)]
    out = []
    for v in variants:
        if arithmetic(v.engine, inputs.kind) != "ideal":
            out.append("engine")
            continue
        single = next((k for k in singles if k.eligible(v, inputs.kind, inputs.state_dim, inputs.rows)), None)
        out.append("triton" if single is None else single.name)
    return out


def emulate_triton_steps(
    inputs: LayerInputs,
    variants: list[Variant],
    *,
    tiling: tuple[int, int] | None = None,
    metric_budget: int = METRIC_BUFFER_BYTES,
):
    """Run every variant through the fused kernels, one batch slice at a time.

    Yields (variant index, b0, metrics [T, b, H, 4] fp32 on the inputs' device) for sequences b0..b0+b at every
    step (row-block partial sums added). The ideal variants share launches (`plan_launches`); a variant's metrics
    are bit-identical to those of a launch of it alone at the same tiling. `fused_kernels` says which kernel runs
    each variant. tiling: (BLOCK_P, num_warps) overriding the plan (benchmark sweeps); metric_budget: bytes of one
    launch's metric buffer.
    """
    bsz, steps, heads, rows, sdim = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows, inputs.state_dim
    s0, stored, fused, shared = _layer_operands(inputs, variants)
    launch, per_sequence = fused.launch, fused.per_sequence
    kernels = fused_kernels(inputs, variants)
    for i, variant in enumerate(variants):
        if kernels[i] == "engine":
            yield from engine_steps(
                inputs, variant, i, shared, s0, metric_budget, None if stored is None else stored[i]
            )
    singles = {k.name: k for k in variant_kernels_of(inputs.kind)}
    for i, name in enumerate(kernels):
        if name in singles:
            for b0, m in singles[name].steps(
                inputs, variants[i], shared, s0, metric_budget, None if stored is None else stored[i]
            ):
                yield i, b0, m
    rest = [i for i, name in enumerate(kernels) if name not in singles]
    for sub, (block_p, num_warps) in plan_launches([variants[i] for i in rest], rows, sdim, tiling, inputs.kind):
        idx = [rest[j] for j in sub]
        specs, write, seeds, static, group_s0 = _slot_operands(inputs, variants, idx, stored, block_p)
        blocks = triton.cdiv(rows, block_p)
        for b0, b1 in batch_slices(bsz, len(idx) * steps * heads * blocks * 4 * 4, metric_budget):
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

    Materialises the whole per-step buffer: for tests and benchmarks (`simulate` streams `emulate_triton_steps`).
    """
    out = torch.full(
        (len(variants), inputs.steps, inputs.batch, inputs.num_heads, 4), float("nan"), device=inputs.device
    )
    for i, b0, m in emulate_triton_steps(inputs, variants, tiling=tiling):
        out[i, :, b0 : b0 + m.shape[1]] = m
    return out


def emulate_triton_outputs(
    inputs: LayerInputs,
    variants: list[Variant],
    *,
    dtype: torch.dtype = torch.float32,
    tiling: tuple[int, int] | None = None,
    final_state: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Each variant's per-step outputs through the fused kernels' output mode: ([B, T, H, rows] in ``dtype`` per
    variant, the FP32 reference's state after the last step [B, H, rows, state_dim] when ``final_state``, else None),
    what ``replay.naive.emulate(..., return_outputs=True)`` computes as outputs and the reference's final state, the
    dot products (and the delta rule's update) in the kernels' order and contraction.

    Runs the kind's fused kernel for every variant, the ideal arithmetic only (an engine profile's variant is a
    ValueError; a one-variant kernel such as KDA's CUDA one is not used), at the output mode's tiling
    (``planning.plan_output_launches``) unless ``tiling`` names one. Memory: the outputs themselves, no metrics.
    """
    engine = [v.name for v in variants if arithmetic(v.engine, inputs.kind) != "ideal"]
    if engine:
        raise ValueError(f"the fused kernels' output mode runs the ideal arithmetic only, not {', '.join(engine)}")
    dev = inputs.device
    bsz, steps, heads, rows, sdim = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows, inputs.state_dim
    s0, stored, fused, shared = _layer_operands(inputs, variants)
    outs: list[torch.Tensor | None] = [None] * len(variants)
    final = torch.empty(inputs.state_shape, device=dev, dtype=torch.float32) if final_state else None
    if tiling is None:
        plan = plan_output_launches(variants, rows, sdim, inputs.kind)
    else:
        plan = plan_launches(variants, rows, sdim, tiling, inputs.kind)
    for n, (idx, (block_p, num_warps)) in enumerate(plan):
        specs, write, seeds, static, group_s0 = _slot_operands(inputs, variants, idx, stored, block_p)
        out = torch.empty(len(idx), bsz, steps, heads, rows, device=dev, dtype=dtype)
        fused.launch(
            *shared.values(),
            s0,
            write,
            seeds,
            static,
            specs=specs,
            block_p=block_p,
            num_warps=num_warps,
            slot_s0=None if group_s0 is None else group_s0.contiguous(),
            outputs=out,
            final_state=final if n == 0 else None,
        )
        for j, i in enumerate(idx):
            outs[i] = out[j]
    return outs, final


def _import_all() -> None:
    """Import every module of this package: each kind's kernel module registers its kernel on import."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()
