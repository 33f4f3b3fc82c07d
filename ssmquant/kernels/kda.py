"""Fused Kimi Delta Attention decode emulation: all T steps of one layer in one launch.

GDN's kernel (`gdn.py`) with the decay applied per key channel: one program owns one (batch, value
head) and a block of BLOCK_P value channels (rows) of the head's state [Dv, Dk], held as a transposed
tile [Dk, BLOCK_P], so that the per-step decay alpha_t [Dk] scales the tile along its first (key)
axis, and S k, S q and the per-row amax stay reductions over Dk inside each thread. The reference and
the variant's emulated state live in registers for the whole time loop; only per-step metrics are
written. Reference: `ssmquant.replay.naive` (`kda_advance`, state form), followed op for op with
alpha = exp(g) [B, T, Hv, Dk] precomputed by the caller (`replay.reference.kda_decays`). As for GDN,
the row reductions run in another order than torch's, so u_t differs from the reference by FP32 noise.

_kernel -> launcher (`kda_launch`, no validation; `ssmquant.replay.simulate` validates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import round_buffer, store_metrics
from .rounding import fake_quant_tile, stream_key


@triton.jit
def _kda_emulate_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    alpha_ptr,
    beta_ptr,
    s0_ptr,
    write_ptr,
    scale_ptr,
    metrics_ptr,
    B,
    T,
    HV,
    HK,
    DV,
    DK,
    V_PER_K,
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
    b = pid_bh // HV
    h = pid_bh % HV
    hk = h // V_PER_K
    rows = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < DV
    col_ok = cols < DK
    tile_ok = col_ok[:, None] & row_ok[None, :]

    b64 = b.to(tl.int64)
    head_base = (b64 * HV + h) * DV
    state_offs = (head_base + rows)[None, :] * DK + cols[:, None]
    if HAS_S0:
        s_ref = tl.load(s0_ptr + state_offs, mask=tile_ok, other=0.0)
    else:
        s_ref = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
    s_var = s_ref
    # stochastic rounding counts elements over the whole batch, so that a launch on a batch slice draws
    # the same bits as the torch reference does for those sequences
    sr_index = state_offs + (batch_offset * HV).to(tl.int64) * DV * DK
    static_scale = tl.full([BLOCK_P], 1.0, tl.float32)
    if STATIC:
        static_scale = tl.load(scale_ptr + head_base + rows, mask=row_ok, other=1.0)

    for t in range(T):
        bt = b64 * T + t
        kvec = tl.load(k_ptr + (bt * HK + hk) * DK + cols, mask=col_ok, other=0.0).to(tl.float32)
        qvec = tl.load(q_ptr + (bt * HK + hk) * DK + cols, mask=col_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (bt * HV + h) * DV + rows, mask=row_ok, other=0.0).to(tl.float32)
        alpha = tl.load(alpha_ptr + (bt * HV + h) * DK + cols, mask=col_ok, other=1.0)  # [BLOCK_N]
        beta = tl.load(beta_ptr + bt * HV + h)
        s_ref = alpha[:, None] * s_ref
        u = beta * (v - tl.sum(s_ref * kvec[:, None], axis=0))
        s_ref = s_ref + kvec[:, None] * u[None, :]
        y_ref = tl.sum(s_ref * qvec[:, None], axis=0)
        kb = round_buffer(kvec, BUF)
        s_var = alpha[:, None] * s_var
        ub = round_buffer(beta * (v - tl.sum(s_var * kb[:, None], axis=0)), BUF)
        s_var = s_var + kb[:, None] * ub[None, :]
        y_var = tl.sum(s_var * qvec[:, None], axis=0)
        if tl.load(write_ptr + bt) != 0:
            key = stream_key(seed, t)
            s_var = fake_quant_tile(s_var, static_scale, sr_index, key, BLOCK_N, BLOCK_P, FMT, GROUP, STATIC, SR)
        if (t + 1) % record_every == 0:
            store_metrics(
                metrics_ptr, t, record_every, B, b, HV, h, npb, pid_p, s_var, s_ref, y_var, y_ref, BLOCK_N * BLOCK_P
            )


def kda_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
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
    """Launch the kernel on contiguous inputs; returns metrics [R, B, Hv, NPB, 4] (fp32)."""
    bsz, steps, hv, dv = v.shape
    hk, dk = k.shape[2], k.shape[3]
    block_n = triton.next_power_of_2(dk)
    npb = triton.cdiv(dv, block_p)
    group = block_p if group_rows is None else group_rows
    n_rec = steps // record_every
    # NaN-filled: a metric the kernel fails to write stays NaN and fails every check downstream
    metrics = torch.full((n_rec, bsz, hv, npb, 4), float("nan"), device=v.device, dtype=torch.float32)
    dummy = torch.empty(1, device=v.device, dtype=torch.float32)
    _kda_emulate_kernel[(bsz * hv, npb)](
        q,
        k,
        v,
        alpha,
        beta,
        s0 if s0 is not None else dummy,
        write,
        static_scale_rows if static_scale_rows is not None else dummy,
        metrics,
        bsz,
        steps,
        hv,
        hk,
        dv,
        dk,
        hv // hk,
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
