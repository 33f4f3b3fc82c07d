"""Fused Mamba-2 decode emulation: all T steps of one layer, for up to MAX_SLOTS variants, in one launch.

One program owns one (batch, head) and BLOCK_P rows of the head's state S[P, N], as a transposed tile [N, BLOCK_P]
(the layout: `common`; its measurement: lab/DESIGN_NOTES.md).

Reference: `ssmquant.replay.naive` (state form), op for op, with a = exp(dt A) precomputed by the caller: the state
update a * S + (dt * x) B^T without FMA (`_mul_add_rn`), the write `fake_quant_tile`. The outputs S C and the metric
sums, which no state depends on, are contracted into FMAs (the tests compare them with tolerances).

_kernel -> launcher (`mamba2_launch`, no validation; `ssmquant.simulate` validates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..kinds.mamba2 import mamba2_decays
from .common import (
    slot_initial_state,
    slot_round_buffer,
    slot_static_scale,
    slot_takes_reference_step,
    slot_write,
    store_slot_output,
)
from .registry import FusedKernel, register
from .rounding import INTERPRETING, constant, tile_columns

# the Mamba-2 tile takes `fake_quant_tile`'s per-head nvfp4 path: one scalar s2, quotients clamped
HEAD_SCALAR = constant(True)


@triton.jit
def _mul_add_rn(a, b, c):
    """a * b + c rounded twice, as torch computes it: explicit mul.rn / add.rn are never contracted into an FMA."""
    if INTERPRETING:  # no libdevice there, and no fused multiply-add either
        return a * b + c
    else:
        return libdevice.add_rn(libdevice.mul_rn(a, b), c)


@triton.jit
def _sum_squares(a):
    """sum of a^2 over a tile [BN, BR]: over the state dim (an in-thread FMA chain), then over the rows."""
    return tl.sum(tl.sum(a * a, axis=0), axis=0)


@triton.jit
def _store_slot_metrics(metrics_ptr, k, slot_stride, base, s_var, s_ref, y_var, y_ref, ss_ref, yy_ref):
    """`common.store_slot_metrics`, with the tile's sum of squares taken by `_sum_squares`."""
    dy = y_var - y_ref
    p = metrics_ptr + k * slot_stride + base
    tl.store(p + 0, _sum_squares(s_var - s_ref))
    tl.store(p + 1, ss_ref)
    tl.store(p + 2, tl.sum(dy * dy, axis=0))
    tl.store(p + 3, yy_ref)


@triton.jit
def _slot_update(s, s_ref, y_ref, a, dt, x, bvec, cvec, d, SPEC: tl.constexpr):
    """One variant's step: the buffered inputs in its buffer dtype, then the update and the output. An FP32 slot
    with FP32 buffers takes the reference's step (s_ref, y_ref, already advanced) as its own (`common.slot_spec`)."""
    if slot_takes_reference_step(SPEC):
        return s_ref, y_ref
    xb = slot_round_buffer(x, SPEC)
    bb = slot_round_buffer(bvec, SPEC)
    s = _mul_add_rn(a, s, bb[:, None] * (dt * xb)[None, :])
    return s, tl.sum(s * cvec[:, None], axis=0) + d * x


@triton.jit
def _load_step(x_ptr, dt_ptr, a_ptr, bm_ptr, cm_ptr, bt, H, h, P, rows, row_ok, G, g, N, cols, col_ok):
    """One step's inputs of program (b, h) at flat step index bt = b T + t: x [BLOCK_P] and B, C [BLOCK_N] in
    float32, dt and a = exp(dt A) scalars."""
    x = tl.load(x_ptr + (bt * H + h) * P + rows, mask=row_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + bt * H + h)
    a = tl.load(a_ptr + bt * H + h)
    bvec = tl.load(bm_ptr + (bt * G + g) * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    cvec = tl.load(cm_ptr + (bt * G + g) * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    return x, dt, a, bvec, cvec


# batch size and offset vary with the batch slices of one run: not specialised, so that they share one compile
@triton.jit(do_not_specialize=["B", "batch_offset"])
def _mamba2_emulate_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    bm_ptr,
    cm_ptr,
    d_ptr,
    s0_ptr,
    sv0_ptr,
    write_ptr,
    seed_ptr,
    scale_ptr,
    metrics_ptr,
    out_ptr,
    final_ptr,
    B,
    T,
    H,
    P,
    N,
    HEADS_PER_GROUP,
    G,
    batch_offset,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_S0: tl.constexpr,
    HAS_SV0: tl.constexpr,
    NV: tl.constexpr,
    OUTPUTS: tl.constexpr,
    FINAL: tl.constexpr,
    KMAJOR: tl.constexpr,
    SPEC0: tl.constexpr,
    SPEC1: tl.constexpr,
    SPEC2: tl.constexpr,
    SPEC3: tl.constexpr,
    SPEC4: tl.constexpr,
    SPEC5: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    npb = tl.num_programs(1)
    b = pid_bh // H
    h = pid_bh % H
    g = h // HEADS_PER_GROUP
    rows = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tile_columns(BLOCK_N, KMAJOR)
    row_ok = rows < P
    col_ok = cols < N
    tile_ok = col_ok[:, None] & row_ok[None, :]

    b64 = b.to(tl.int64)
    head_base = (b64 * H + h) * P
    state_offs = (head_base + rows)[None, :] * N + cols[:, None]  # [BLOCK_N, BLOCK_P] flat indices
    # N's contiguity hidden (max_contiguous 1): told, Triton would put the lanes along N and the rows' reductions
    # would cross lanes
    s0_offs = (head_base + rows)[None, :] * N + tl.max_contiguous(cols, 1)[:, None]
    if HAS_S0:
        s_ref = tl.load(s0_ptr + s0_offs, mask=tile_ok, other=0.0)
    else:
        s_ref = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
    sv0_stride = tl.cast(B, tl.int64) * H * P * N  # one slot's initial state [B, H, P, N]
    v0 = slot_initial_state(sv0_ptr, 0, sv0_stride, s0_offs, tile_ok, s_ref, NV, HAS_SV0)
    v1 = slot_initial_state(sv0_ptr, 1, sv0_stride, s0_offs, tile_ok, s_ref, NV, HAS_SV0)
    v2 = slot_initial_state(sv0_ptr, 2, sv0_stride, s0_offs, tile_ok, s_ref, NV, HAS_SV0)
    v3 = slot_initial_state(sv0_ptr, 3, sv0_stride, s0_offs, tile_ok, s_ref, NV, HAS_SV0)
    v4 = slot_initial_state(sv0_ptr, 4, sv0_stride, s0_offs, tile_ok, s_ref, NV, HAS_SV0)
    v5 = slot_initial_state(sv0_ptr, 5, sv0_stride, s0_offs, tile_ok, s_ref, NV, HAS_SV0)
    # stochastic rounding counts elements over the whole batch, so that a launch on a batch slice draws
    # the same bits as the torch reference does for those sequences
    sr_index = state_offs + (batch_offset * H).to(tl.int64) * P * N
    BT = B * T
    rows_stride = B * H * P  # one slot's static scales [B, H, P]
    c0 = slot_static_scale(scale_ptr, 0, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC0)
    c1 = slot_static_scale(scale_ptr, 1, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC1)
    c2 = slot_static_scale(scale_ptr, 2, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC2)
    c3 = slot_static_scale(scale_ptr, 3, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC3)
    c4 = slot_static_scale(scale_ptr, 4, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC4)
    c5 = slot_static_scale(scale_ptr, 5, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC5)
    metrics_stride = npb.to(tl.int64) * T * B * H * 4  # one slot's metrics [T, B, H, NPB, 4]
    out_stride = tl.cast(B, tl.int64) * T * H * P  # one slot's outputs [B, T, H, P]
    d = tl.load(d_ptr + h)

    # step t + 1's inputs are loaded while step t computes: a step's loads do not depend on the state, and one
    # program's steps are a sequential chain whose time is otherwise the loads' latency plus the arithmetic.
    # T >= 1 (validated inputs are never empty); the last step reloads its own inputs.
    x_n, dt_n, a_n, bvec_n, cvec_n = _load_step(x_ptr, dt_ptr, a_ptr, bm_ptr, cm_ptr, b64 * T, H, h, P, rows, row_ok,
                                                G, g, N, cols, col_ok)  # fmt: skip
    for t in range(T):
        bt = b64 * T + t
        x, dt, a, bvec, cvec = x_n, dt_n, a_n, bvec_n, cvec_n
        x_n, dt_n, a_n, bvec_n, cvec_n = _load_step(x_ptr, dt_ptr, a_ptr, bm_ptr, cm_ptr,
                                                    b64 * T + tl.minimum(t + 1, T - 1), H, h, P, rows, row_ok,
                                                    G, g, N, cols, col_ok)  # fmt: skip
        s_ref = _mul_add_rn(a, s_ref, bvec[:, None] * (dt * x)[None, :])
        y_ref = tl.sum(s_ref * cvec[:, None], axis=0) + d * x
        v0, y0 = _slot_update(v0, s_ref, y_ref, a, dt, x, bvec, cvec, d, SPEC0)
        v0 = slot_write(v0, 0, t, bt, BT, write_ptr, seed_ptr, c0, sr_index, BLOCK_N, BLOCK_P, SPEC0, KMAJOR, HEAD_SCALAR)
        if NV > 1:
            v1, y1 = _slot_update(v1, s_ref, y_ref, a, dt, x, bvec, cvec, d, SPEC1)
            v1 = slot_write(v1, 1, t, bt, BT, write_ptr, seed_ptr, c1, sr_index, BLOCK_N, BLOCK_P, SPEC1, KMAJOR, HEAD_SCALAR)
        if NV > 2:
            v2, y2 = _slot_update(v2, s_ref, y_ref, a, dt, x, bvec, cvec, d, SPEC2)
            v2 = slot_write(v2, 2, t, bt, BT, write_ptr, seed_ptr, c2, sr_index, BLOCK_N, BLOCK_P, SPEC2, KMAJOR, HEAD_SCALAR)
        if NV > 3:
            v3, y3 = _slot_update(v3, s_ref, y_ref, a, dt, x, bvec, cvec, d, SPEC3)
            v3 = slot_write(v3, 3, t, bt, BT, write_ptr, seed_ptr, c3, sr_index, BLOCK_N, BLOCK_P, SPEC3, KMAJOR, HEAD_SCALAR)
        if NV > 4:
            v4, y4 = _slot_update(v4, s_ref, y_ref, a, dt, x, bvec, cvec, d, SPEC4)
            v4 = slot_write(v4, 4, t, bt, BT, write_ptr, seed_ptr, c4, sr_index, BLOCK_N, BLOCK_P, SPEC4, KMAJOR, HEAD_SCALAR)
        if NV > 5:
            v5, y5 = _slot_update(v5, s_ref, y_ref, a, dt, x, bvec, cvec, d, SPEC5)
            v5 = slot_write(v5, 5, t, bt, BT, write_ptr, seed_ptr, c5, sr_index, BLOCK_N, BLOCK_P, SPEC5, KMAJOR, HEAD_SCALAR)
        if OUTPUTS:
            out_offs = (bt * H + h) * P + rows
            store_slot_output(out_ptr, 0, out_stride, out_offs, y0, row_ok)
            if NV > 1:
                store_slot_output(out_ptr, 1, out_stride, out_offs, y1, row_ok)
            if NV > 2:
                store_slot_output(out_ptr, 2, out_stride, out_offs, y2, row_ok)
            if NV > 3:
                store_slot_output(out_ptr, 3, out_stride, out_offs, y3, row_ok)
            if NV > 4:
                store_slot_output(out_ptr, 4, out_stride, out_offs, y4, row_ok)
            if NV > 5:
                store_slot_output(out_ptr, 5, out_stride, out_offs, y5, row_ok)
        else:
            rec = tl.cast(t, tl.int64)  # every step is recorded
            base = (((rec * B + b) * H + h) * npb + pid_p) * 4
            ss = _sum_squares(s_ref)
            yy = tl.sum(y_ref * y_ref, axis=0)
            _store_slot_metrics(metrics_ptr, 0, metrics_stride, base, v0, s_ref, y0, y_ref, ss, yy)
            if NV > 1:
                _store_slot_metrics(metrics_ptr, 1, metrics_stride, base, v1, s_ref, y1, y_ref, ss, yy)
            if NV > 2:
                _store_slot_metrics(metrics_ptr, 2, metrics_stride, base, v2, s_ref, y2, y_ref, ss, yy)
            if NV > 3:
                _store_slot_metrics(metrics_ptr, 3, metrics_stride, base, v3, s_ref, y3, y_ref, ss, yy)
            if NV > 4:
                _store_slot_metrics(metrics_ptr, 4, metrics_stride, base, v4, s_ref, y4, y_ref, ss, yy)
            if NV > 5:
                _store_slot_metrics(metrics_ptr, 5, metrics_stride, base, v5, s_ref, y5, y_ref, ss, yy)
    if FINAL:  # the reference's state after the last step
        tl.store(final_ptr + s0_offs, s_ref, mask=tile_ok)


def mamba2_launch(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    bm: torch.Tensor,
    cm: torch.Tensor,
    d: torch.Tensor,
    s0: torch.Tensor | None,
    write: torch.Tensor,
    seeds: torch.Tensor,
    static_scale_rows: torch.Tensor | None,
    *,
    specs: tuple[int, ...],
    block_p: int,
    num_warps: int,
    batch_offset: int = 0,
    slot_s0: torch.Tensor | None = None,
    outputs: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the kernel on contiguous inputs for NV = len(specs) variants; returns metrics [NV, T, B, H, NPB, 4],
    or with ``outputs`` given, each slot's per-step outputs written there instead (and ``outputs`` returned).

    s0: [B, H, P, N] fp32, the reference's initial state, or None (zeros); slot_s0: [NV, B, H, P, N] fp32, each
    slot's initial state (s0 stored in its format), or None (each slot starts from s0; needs s0 when given).
    write: [NV, B, T] int8; seeds: [NV] int64; static_scale_rows: [NV, B, H, P] fp32 (ones for dynamic slots) or
    None when no slot is static; specs: `common.slot_spec` of each slot, whose rows group divides block_p.
    outputs: [NV, B, T, H, P] contiguous, any float dtype, for the slots' outputs y (S C + D x, of the state before
    its write) rounded to it; final_state: [B, H, P, N] fp32 for the reference's state after the last step (output
    mode only).
    """
    bsz, steps, heads, p = x.shape
    groups, n = bm.shape[2], bm.shape[3]
    block_n = triton.next_power_of_2(n)
    npb = triton.cdiv(p, block_p)
    nv = len(specs)
    dummy = torch.empty(1, device=x.device, dtype=torch.float32)
    metrics = (
        torch.full((nv, steps, bsz, heads, npb, 4), float("nan"), device=x.device, dtype=torch.float32)
        if outputs is None
        else dummy
    )
    padded = tuple(specs) + (0,) * (6 - nv)
    _mamba2_emulate_kernel[(bsz * heads, npb)](
        x,
        dt,
        a,
        bm,
        cm,
        d,
        s0 if s0 is not None else dummy,
        slot_s0 if slot_s0 is not None else dummy,
        write,
        seeds,
        static_scale_rows if static_scale_rows is not None else dummy,
        metrics,
        outputs if outputs is not None else dummy,
        final_state if final_state is not None else dummy,
        bsz,
        steps,
        heads,
        p,
        n,
        heads // groups,
        groups,
        batch_offset,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        HAS_S0=s0 is not None,
        HAS_SV0=slot_s0 is not None,
        NV=nv,
        OUTPUTS=outputs is not None,
        FINAL=final_state is not None,
        KMAJOR=block_n % 16 == 0,  # whole nvfp4 blocks per lane
        SPEC0=padded[0],
        SPEC1=padded[1],
        SPEC2=padded[2],
        SPEC3=padded[3],
        SPEC4=padded[4],
        SPEC5=padded[5],
        num_warps=num_warps,
        enable_fp_fusion=True,  # contracts the dots and metric sums; the state update is _mul_add_rn
        enable_reflect_ftz=False,  # libdevice's mul.rn / add.rn keep subnormals, as torch does
    )
    return metrics if outputs is None else outputs


def mamba2_operands(inputs) -> dict[str, torch.Tensor]:
    """`mamba2_launch`'s per-layer operands of Mamba-2 inputs, contiguous, with the decays computed once."""
    return dict(
        x=inputs.x.contiguous(),
        dt=inputs.dt.float().contiguous(),
        a=mamba2_decays(inputs).contiguous(),
        bm=inputs.B.contiguous(),
        cm=inputs.C.contiguous(),
        d=inputs.D.float().contiguous(),
    )


register("mamba2", FusedKernel(mamba2_operands, frozenset({"x", "dt", "a", "bm", "cm"}), mamba2_launch))
