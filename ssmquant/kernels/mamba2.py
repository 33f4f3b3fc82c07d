"""Fused Mamba-2 decode emulation: all T steps of one layer in one launch.

One program owns one (batch, head) and a block of BLOCK_P rows of the head's state S[P, N], held as a
transposed tile [N, BLOCK_P]: rows on the fast axis, so that the reductions over the state dim (the
output S C and the per-row amax) stay inside each thread (4.7x faster on an H200 than the row-major
tile, whose reductions crossed threads and warps every step; benchmarks/results/emulation.md). It
keeps the FP32 reference state and the variant's emulated state in registers for the whole time loop
and writes only the per-step metrics. Its torch reference is `ssmquant.replay.naive` (state form), which it
follows op for op: a = exp(dt A) is precomputed by the caller (shared by both backends), the state
update is a * S + (dt * x) B^T with no fused multiply-add, and the store at a write step is
`fake_quant_tile`, the exact mirror of `ssmquant.formats.codec.encode`.

_kernel -> launcher (`mamba2_launch`, no validation; `ssmquant.replay.simulate` validates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import round_buffer, store_metrics
from .rounding import fake_quant_tile, stream_key


@triton.jit
def _mamba2_emulate_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    bm_ptr,
    cm_ptr,
    d_ptr,
    s0_ptr,
    write_ptr,
    scale_ptr,
    metrics_ptr,
    B,
    T,
    H,
    P,
    N,
    HEADS_PER_GROUP,
    G,
    seed,
    record_every,
    batch_offset,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    STATIC: tl.constexpr,
    SR: tl.constexpr,
    BUF: tl.constexpr,
    HAS_S0: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    npb = tl.num_programs(1)
    b = pid_bh // H
    h = pid_bh % H
    g = h // HEADS_PER_GROUP
    rows = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < P
    col_ok = cols < N
    tile_ok = col_ok[:, None] & row_ok[None, :]

    b64 = b.to(tl.int64)
    head_base = (b64 * H + h) * P
    state_offs = (head_base + rows)[None, :] * N + cols[:, None]  # [BLOCK_N, BLOCK_P] flat indices
    if HAS_S0:
        s_ref = tl.load(s0_ptr + state_offs, mask=tile_ok, other=0.0)
    else:
        s_ref = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
    s_var = s_ref
    # stochastic rounding counts elements over the whole batch, so that a launch on a batch slice draws
    # the same bits as the torch reference does for those sequences
    sr_index = state_offs + (batch_offset * H).to(tl.int64) * P * N
    static_scale = tl.full([BLOCK_P], 1.0, tl.float32)
    if STATIC:
        static_scale = tl.load(scale_ptr + head_base + rows, mask=row_ok, other=1.0)
    d = tl.load(d_ptr + h)

    for t in range(T):
        bt = b64 * T + t
        x = tl.load(x_ptr + (bt * H + h) * P + rows, mask=row_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + bt * H + h)
        a = tl.load(a_ptr + bt * H + h)
        bvec = tl.load(bm_ptr + (bt * G + g) * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        cvec = tl.load(cm_ptr + (bt * G + g) * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        s_ref = a * s_ref + bvec[:, None] * (dt * x)[None, :]
        y_ref = tl.sum(s_ref * cvec[:, None], axis=0) + d * x
        xb = round_buffer(x, BUF)
        bb = round_buffer(bvec, BUF)
        s_var = a * s_var + bb[:, None] * (dt * xb)[None, :]
        y_var = tl.sum(s_var * cvec[:, None], axis=0) + d * x
        if tl.load(write_ptr + bt) != 0:
            key = stream_key(seed, t)
            s_var = fake_quant_tile(s_var, static_scale, sr_index, key, BLOCK_N, BLOCK_P, FMT, GROUP, STATIC, SR)
        if (t + 1) % record_every == 0:
            store_metrics(
                metrics_ptr, t, record_every, B, b, H, h, npb, pid_p, s_var, s_ref, y_var, y_ref, BLOCK_N * BLOCK_P
            )


def mamba2_launch(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    bm: torch.Tensor,
    cm: torch.Tensor,
    d: torch.Tensor,
    s0: torch.Tensor | None,
    write: torch.Tensor,
    static_scale_rows: torch.Tensor | None,
    record_every: int,
    *,
    fmt_code: int,
    group_rows: int | None,
    sr: bool,
    seed: int,
    buf_code: int,
    block_p: int,
    num_warps: int,
    batch_offset: int = 0,
) -> torch.Tensor:
    """Launch the kernel on contiguous inputs; returns metrics [R, B, H, NPB, 4] (fp32).

    group_rows: rows per scale group (None: the whole head, which needs block_p >= P).
    """
    bsz, steps, heads, p = x.shape
    groups, n = bm.shape[2], bm.shape[3]
    block_n = triton.next_power_of_2(n)
    npb = triton.cdiv(p, block_p)
    group = block_p if group_rows is None else group_rows
    n_rec = steps // record_every
    # NaN-filled: a metric the kernel fails to write stays NaN and fails every check downstream
    metrics = torch.full((n_rec, bsz, heads, npb, 4), float("nan"), device=x.device, dtype=torch.float32)
    dummy = torch.empty(1, device=x.device, dtype=torch.float32)
    _mamba2_emulate_kernel[(bsz * heads, npb)](
        x,
        dt,
        a,
        bm,
        cm,
        d,
        s0 if s0 is not None else dummy,
        write,
        static_scale_rows if static_scale_rows is not None else dummy,
        metrics,
        bsz,
        steps,
        heads,
        p,
        n,
        heads // groups,
        groups,
        seed,
        record_every,
        batch_offset,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        FMT=fmt_code,
        GROUP=group,
        STATIC=static_scale_rows is not None,
        SR=sr,
        BUF=buf_code,
        HAS_S0=s0 is not None,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return metrics
