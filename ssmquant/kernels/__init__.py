"""Fused kernels: multi-step decode emulation of Mamba-2, Gated DeltaNet and KDA layers, registered per layer kind.

`emulate_triton_steps` is the backend that `ssmquant.simulate(..., backend="triton")` dispatches to; it trusts
inputs already validated by `simulate`. A layer kind's fused kernel registers itself (`registry.py`: how to prepare
its inputs and launch it); `mamba2.py` and `delta_rule.py` (GDN and KDA) carry up to MAX_SLOTS variants per launch
beside one FP32 reference; `planning.plan_launches` groups the variants and picks the tile from a register budget;
`mamba2_engine.py` emulates engine profiles. A kind may also register one-variant kernels (`VariantKernel`) that run
the variants they cover in place of its fused kernel: on a CUDA GPU, KDA's 8-bit RNE variants with per-row dynamic
scales and Dk = 128 run in `kda_cuda.py` (`fused_kernels` says which kernel runs each variant). Shared rounding helpers
live in `rounding.py`; each kernel's torch reference is `ssmquant.replay.naive` (state form) and, for
the tile fake-quant, `ssmquant.formats.codec`.
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
from .planning import plan_blocks, plan_launches, variant_slot_spec
from .quantize import fake_quant_triton, store_state_triton
from .registry import FusedKernel, VariantKernel, has_kernel, kernel_of, register, variant_kernels_of

__all__ = [
    "FusedKernel",
    "MAX_SLOTS",
    "VariantKernel",
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
    """Which kernel runs each variant on these inputs: "engine" (an engine profile's own kernel,
    `mamba2_engine.py`), the name of a one-variant kernel registered for the kind that is available on the inputs'
    device and covers the variant (KDA's "cuda", `kda_cuda.py`), or "triton" (the kind's fused kernel)."""
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

    Yields (variant index, b0, metrics [T, b, H, 4] fp32 on the inputs' device) with the metrics of
    sequences b0..b0+b at every step (the kernel's row-block partial sums added). Inputs are made
    contiguous and the decays computed once; the ideal variants are grouped by `plan_launches` so that
    one launch reads each step's inputs once and advances the FP32 reference once for up to MAX_SLOTS
    variants (a variant's metrics are bit-identical to those of a launch of it alone at the same tiling).
    Variants that a one-variant kernel of the kind covers run in it (`fused_kernels`: KDA's CUDA kernel on a GPU).
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
    singles = {k.name: k for k in variant_kernels_of(inputs.kind)}
    for i, name in enumerate(kernels):
        if name in singles:
            for b0, m in singles[name].steps(inputs, variants[i], shared, s0, metric_budget, None if stored is None else stored[i]):
                yield i, b0, m
    rest = [i for i, name in enumerate(kernels) if name not in singles]
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
