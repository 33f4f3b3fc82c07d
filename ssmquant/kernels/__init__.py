"""Triton kernels: fused multi-step decode emulation of Mamba-2 and Gated DeltaNet layers.

`emulate_triton` is the backend that `ssmquant.replay.simulate(..., backend="triton")` dispatches to;
it trusts inputs already validated by `simulate`. Shared rounding helpers live in `rounding.py`; each
kernel's torch reference is `ssmquant.replay.naive` (state form) and, for the tile fake-quant,
`ssmquant.formats.codec`.
"""

from __future__ import annotations

import torch
import triton

from ..formats import Rounding, ScaleMode
from ..replay.inputs import LayerInputs, Mamba2Inputs
from ..replay.naive import recorded_steps
from ..replay.reference import gdn_decays, mamba2_decays
from ..replay.variants import Variant
from .gdn import gdn_launch
from .mamba2 import mamba2_launch
from .quantize import fake_quant_triton, group_rows_for_kernel
from .rounding import FORMAT_CODES

__all__ = ["emulate_triton", "fake_quant_triton", "plan_blocks"]

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


def emulate_triton(
    inputs: LayerInputs,
    variants: list[Variant],
    *,
    record_every: int = 1,
    tiling: tuple[int, int] | None = None,
):
    """Run every variant through the fused kernel; returns (metrics [V, R, B, H, 4] fp32, steps [R]).

    Inputs are made contiguous and the decays computed once, shared by all variants. tiling:
    (BLOCK_P, num_warps) to override `plan_blocks` (benchmark sweeps).
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
    else:
        shared = dict(
            q=inputs.q.contiguous(),
            k=inputs.k.contiguous(),
            v=inputs.v.contiguous(),
            alpha=gdn_decays(inputs).contiguous(),
            beta=inputs.beta.float().contiguous(),
        )
        launch = gdn_launch
    out = []
    for variant in variants:
        fmt = variant.format
        block_p, num_warps = tiling or plan_blocks(variant, rows, sdim)
        group = None if fmt.granularity.rows is None else group_rows_for_kernel(fmt, rows, block_p)
        write = variant.scheme.write_mask(bsz, steps).to(device=dev, dtype=torch.int8).contiguous()
        buf = _BUFFER_CODES[variant.scheme.buffer_dtype] if variant.scheme.rounds_buffer else 0
        m = launch(
            *shared.values(),
            s0,
            write,
            _static_rows(variant, bsz, heads, rows),
            record_every,
            fmt_code=FORMAT_CODES[fmt.encoding],
            group_rows=group,
            sr=fmt.rounding is Rounding.SR,
            seed=variant.seed,
            buf_code=buf,
            block_p=block_p,
            num_warps=num_warps,
        )
        out.append(m.sum(3))  # partial sums of the row blocks -> [R, B, H, 4]
    return torch.stack(out), recorded_steps(steps, record_every)
