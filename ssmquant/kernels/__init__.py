"""Triton kernels: fused multi-step decode emulation of Mamba-2, Gated DeltaNet and KDA layers.

`emulate_triton` is the backend that `ssmquant.replay.simulate(..., backend="triton")` dispatches to;
it trusts inputs already validated by `simulate`. Shared rounding helpers live in `rounding.py`; each
kernel's torch reference is `ssmquant.replay.naive` (state form) and, for the tile fake-quant,
`ssmquant.formats.codec`.
"""

from __future__ import annotations

import torch
import triton

from ..formats import Rounding, ScaleMode
from ..replay.inputs import KDAInputs, LayerInputs, Mamba2Inputs
from ..replay.reference import gdn_decays, kda_decays, mamba2_decays
from ..replay.trace import METRIC_BUFFER_BYTES
from ..replay.variants import Variant
from .gdn import gdn_launch
from .kda import kda_launch
from .mamba2 import mamba2_launch
from .quantize import fake_quant_triton, group_rows_for_kernel
from .rounding import FORMAT_CODES

__all__ = ["emulate_triton", "emulate_triton_steps", "fake_quant_triton", "plan_blocks"]

_BUFFER_CODES = {"fp32": 0, "bf16": 1, "fp16": 2}
# State elements per thread and per state tile: the reference and the emulated state (2 x 64 registers)
# plus temporaries fit without spilling. Measured on an H200 (benchmarks/results/emulation.md): one warp
# per 16 x 128 tile ran fastest for both layer kinds; twice that spilled and ran 2-30x slower.
_ELEMENTS_PER_THREAD = 64


def plan_blocks(variant: Variant, rows: int, state_dim: int) -> tuple[int, int]:
    """(BLOCK_P rows per program, num_warps) for a variant on a [rows, state_dim] head state."""
    block_n = triton.next_power_of_2(state_dim)
    full = triton.next_power_of_2(rows)
    per_warp = max(1, 32 * _ELEMENTS_PER_THREAD // block_n)  # rows one warp holds
    fmt = variant.format
    if fmt.encoding.scaled and fmt.granularity.rows is None:
        block_p = full  # a per-head scale needs the whole head in one program
    else:
        g = fmt.granularity.rows if fmt.encoding.scaled else 1
        block_p = min(full, max(per_warp, g))
    num_warps = min(16, max(1, block_p // per_warp))
    return block_p, num_warps


def _static_rows(variant: Variant, bsz: int, heads: int, rows: int) -> torch.Tensor | None:
    """A static variant's decode scales expanded to one per row: [B, H, rows] fp32."""
    if variant.format.scale_mode is not ScaleMode.STATIC:
        return None
    g = variant.format.granularity.group_rows(rows)
    s = variant.static_scale.float()
    return s.expand(bsz, heads, rows // g).repeat_interleave(g, -1).contiguous()


def _batch_slices(batch: int, per_sequence_bytes: int, budget: int) -> list[tuple[int, int]]:
    """[(b0, b1)] slices of the batch whose metric buffers fit the budget (at least one sequence each)."""
    per = max(1, budget // max(1, per_sequence_bytes))
    return [(b0, min(batch, b0 + per)) for b0 in range(0, batch, per)]


def emulate_triton_steps(
    inputs: LayerInputs,
    variants: list[Variant],
    *,
    tiling: tuple[int, int] | None = None,
    metric_budget: int = METRIC_BUFFER_BYTES,
):
    """Run every variant through the fused kernel, one batch slice at a time.

    Yields (variant index, b0, metrics [T, b, H, 4] fp32 on the inputs' device) with the metrics of
    sequences b0..b0+b at every step (the kernel's row-block partial sums added). Inputs are made
    contiguous and the decays computed once, shared by all variants. tiling: (BLOCK_P, num_warps) to
    override `plan_blocks` (benchmark sweeps); metric_budget: bytes of one launch's metric buffer.
    """
    dev = inputs.device
    bsz, steps, heads, rows, sdim = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows, inputs.state_dim
    s0 = None if inputs.initial_state is None else inputs.initial_state.float().contiguous()
    if isinstance(inputs, Mamba2Inputs):
        shared = dict(
            x=inputs.x.contiguous(),
            dt=inputs.dt.float().contiguous(),
            a=mamba2_decays(inputs).contiguous(),
            bm=inputs.B.contiguous(),
            cm=inputs.C.contiguous(),
            d=inputs.D.float().contiguous(),
        )
        launch = mamba2_launch
        per_sequence = {"x", "dt", "a", "bm", "cm"}
    elif isinstance(inputs, KDAInputs):
        shared = dict(
            q=inputs.q.contiguous(),
            k=inputs.k.contiguous(),
            v=inputs.v.contiguous(),
            alpha=kda_decays(inputs).contiguous(),  # [B, T, Hv, Dk]
            beta=inputs.beta.float().contiguous(),
        )
        launch = kda_launch
        per_sequence = set(shared)
    else:
        shared = dict(
            q=inputs.q.contiguous(),
            k=inputs.k.contiguous(),
            v=inputs.v.contiguous(),
            alpha=gdn_decays(inputs).contiguous(),
            beta=inputs.beta.float().contiguous(),
        )
        launch = gdn_launch
        per_sequence = set(shared)
    for i, variant in enumerate(variants):
        if variant.engine != "ideal":  # an engine profile: its own kernel (mamba2_engine.py)
            from .mamba2_engine import engine_steps

            yield from engine_steps(inputs, variant, i, shared, s0, metric_budget)
            continue
        fmt = variant.format
        block_p, num_warps = tiling or plan_blocks(variant, rows, sdim)
        group = None if fmt.granularity.rows is None else group_rows_for_kernel(fmt, rows, block_p)
        write = variant.scheme.write_mask(bsz, steps).to(device=dev, dtype=torch.int8).contiguous()
        buf = _BUFFER_CODES[variant.scheme.buffer_dtype] if variant.scheme.rounds_buffer else 0
        static = _static_rows(variant, bsz, heads, rows)
        blocks = triton.cdiv(rows, block_p)
        for b0, b1 in _batch_slices(bsz, steps * heads * blocks * 4 * 4, metric_budget):
            args = [t[b0:b1] if name in per_sequence else t for name, t in shared.items()]
            m = launch(
                *args,
                None if s0 is None else s0[b0:b1],
                write[b0:b1],
                None if static is None else static[b0:b1],
                1,
                fmt_code=FORMAT_CODES[fmt.encoding],
                group_rows=group,
                sr=fmt.rounding is Rounding.SR,
                seed=variant.seed,
                buf_code=buf,
                block_p=block_p,
                num_warps=num_warps,
                batch_offset=b0,
            )
            yield i, b0, m.sum(3)  # row-block partial sums -> [T, b, H, 4]


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
