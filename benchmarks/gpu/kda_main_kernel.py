"""Frozen copy of the KDA/GDN kernel of main at 5907aeb (ssmquant/kernels/delta_rule.py), for the same-run
comparison in benchmarks/gpu/kda_paths.py only. Not imported by the package; delete once the sweep is done."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmquant.kernels.common import slot_round_buffer, slot_static_scale, slot_write, store_slot_metrics


@triton.jit
def _slot_update(s, alpha, kvec, qvec, v, beta, SPEC: tl.constexpr):
    """One variant's step: decay, the delta rule with its buffered k and u in its buffer dtype, output."""
    kb = slot_round_buffer(kvec, SPEC)
    s = alpha * s
    ub = slot_round_buffer(beta * (v - tl.sum(s * kb[:, None], axis=0)), SPEC)
    s = s + kb[:, None] * ub[None, :]
    return s, tl.sum(s * qvec[:, None], axis=0)


@triton.jit
def _delta_rule_emulate_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    alpha_ptr,
    beta_ptr,
    s0_ptr,
    write_ptr,
    seed_ptr,
    scale_ptr,
    metrics_ptr,
    B,
    T,
    HV,
    HK,
    DV,
    DK,
    V_PER_K,
    record_every,
    batch_offset,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    NV: tl.constexpr,
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
    v0, v1, v2, v3, v4, v5 = s_ref, s_ref, s_ref, s_ref, s_ref, s_ref
    # stochastic rounding counts elements over the whole batch, so that a launch on a batch slice draws
    # the same bits as the torch reference does for those sequences
    sr_index = state_offs + (batch_offset * HV).to(tl.int64) * DV * DK
    BT = B * T
    rows_stride = B * HV * DV  # one slot's static scales [B, Hv, Dv]
    c0 = slot_static_scale(scale_ptr, 0, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC0)
    c1 = slot_static_scale(scale_ptr, 1, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC1)
    c2 = slot_static_scale(scale_ptr, 2, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC2)
    c3 = slot_static_scale(scale_ptr, 3, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC3)
    c4 = slot_static_scale(scale_ptr, 4, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC4)
    c5 = slot_static_scale(scale_ptr, 5, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC5)
    metrics_stride = npb.to(tl.int64) * (T // record_every) * B * HV * 4  # one slot's metrics [R, B, Hv, NPB, 4]

    for t in range(T):
        bt = b64 * T + t
        kvec = tl.load(k_ptr + (bt * HK + hk) * DK + cols, mask=col_ok, other=0.0).to(tl.float32)
        qvec = tl.load(q_ptr + (bt * HK + hk) * DK + cols, mask=col_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (bt * HV + h) * DV + rows, mask=row_ok, other=0.0).to(tl.float32)
        if VEC_DECAY:
            alpha = tl.load(alpha_ptr + (bt * HV + h) * DK + cols, mask=col_ok, other=1.0)[:, None]  # [BLOCK_N, 1]
        else:
            alpha = tl.load(alpha_ptr + bt * HV + h)
        beta = tl.load(beta_ptr + bt * HV + h)
        s_ref = alpha * s_ref
        u = beta * (v - tl.sum(s_ref * kvec[:, None], axis=0))
        s_ref = s_ref + kvec[:, None] * u[None, :]
        y_ref = tl.sum(s_ref * qvec[:, None], axis=0)
        v0, y0 = _slot_update(v0, alpha, kvec, qvec, v, beta, SPEC0)
        v0 = slot_write(v0, 0, t, bt, BT, write_ptr, seed_ptr, c0, sr_index, BLOCK_N, BLOCK_P, SPEC0)
        if NV > 1:
            v1, y1 = _slot_update(v1, alpha, kvec, qvec, v, beta, SPEC1)
            v1 = slot_write(v1, 1, t, bt, BT, write_ptr, seed_ptr, c1, sr_index, BLOCK_N, BLOCK_P, SPEC1)
        if NV > 2:
            v2, y2 = _slot_update(v2, alpha, kvec, qvec, v, beta, SPEC2)
            v2 = slot_write(v2, 2, t, bt, BT, write_ptr, seed_ptr, c2, sr_index, BLOCK_N, BLOCK_P, SPEC2)
        if NV > 3:
            v3, y3 = _slot_update(v3, alpha, kvec, qvec, v, beta, SPEC3)
            v3 = slot_write(v3, 3, t, bt, BT, write_ptr, seed_ptr, c3, sr_index, BLOCK_N, BLOCK_P, SPEC3)
        if NV > 4:
            v4, y4 = _slot_update(v4, alpha, kvec, qvec, v, beta, SPEC4)
            v4 = slot_write(v4, 4, t, bt, BT, write_ptr, seed_ptr, c4, sr_index, BLOCK_N, BLOCK_P, SPEC4)
        if NV > 5:
            v5, y5 = _slot_update(v5, alpha, kvec, qvec, v, beta, SPEC5)
            v5 = slot_write(v5, 5, t, bt, BT, write_ptr, seed_ptr, c5, sr_index, BLOCK_N, BLOCK_P, SPEC5)
        if (t + 1) % record_every == 0:
            rec = ((t + 1) // record_every - 1).to(tl.int64)
            base = (((rec * B + b) * HV + h) * npb + pid_p) * 4
            ss = tl.sum(tl.reshape(s_ref * s_ref, [BLOCK_N * BLOCK_P]), axis=0)
            yy = tl.sum(y_ref * y_ref, axis=0)
            store_slot_metrics(metrics_ptr, 0, metrics_stride, base, v0, s_ref, y0, y_ref, ss, yy, BLOCK_N * BLOCK_P)
            if NV > 1:
                store_slot_metrics(metrics_ptr, 1, metrics_stride, base, v1, s_ref, y1, y_ref, ss, yy, BLOCK_N * BLOCK_P)
            if NV > 2:
                store_slot_metrics(metrics_ptr, 2, metrics_stride, base, v2, s_ref, y2, y_ref, ss, yy, BLOCK_N * BLOCK_P)
            if NV > 3:
                store_slot_metrics(metrics_ptr, 3, metrics_stride, base, v3, s_ref, y3, y_ref, ss, yy, BLOCK_N * BLOCK_P)
            if NV > 4:
                store_slot_metrics(metrics_ptr, 4, metrics_stride, base, v4, s_ref, y4, y_ref, ss, yy, BLOCK_N * BLOCK_P)
            if NV > 5:
                store_slot_metrics(metrics_ptr, 5, metrics_stride, base, v5, s_ref, y5, y_ref, ss, yy, BLOCK_N * BLOCK_P)


def delta_rule_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    s0: torch.Tensor | None,
    write: torch.Tensor,
    seeds: torch.Tensor,
    static_scale_rows: torch.Tensor | None,
    record_every: int,
    *,
    specs: tuple[int, ...],
    block_p: int,
    num_warps: int,
    batch_offset: int = 0,
) -> torch.Tensor:
    """Launch the kernel on contiguous inputs for NV = len(specs) variants; returns metrics [NV, R, B, Hv, NPB, 4].

    alpha: [B, T, Hv] (GDN) or [B, T, Hv, Dk] (KDA, the decay per key channel); write: [NV, B, T] int8;
    seeds: [NV] int64; static_scale_rows: [NV, B, Hv, Dv] fp32 (ones for dynamic slots) or None when no
    slot is static; specs: `common.slot_spec` of each slot, whose rows group divides block_p.
    """
    bsz, steps, hv, dv = v.shape
    hk, dk = k.shape[2], k.shape[3]
    block_n = triton.next_power_of_2(dk)
    npb = triton.cdiv(dv, block_p)
    nv = len(specs)
    n_rec = steps // record_every
    # NaN-filled: a metric the kernel fails to write stays NaN and fails every check downstream
    metrics = torch.full((nv, n_rec, bsz, hv, npb, 4), float("nan"), device=v.device, dtype=torch.float32)
    dummy = torch.empty(1, device=v.device, dtype=torch.float32)
    padded = tuple(specs) + (0,) * (6 - nv)
    _delta_rule_emulate_kernel[(bsz * hv, npb)](
        q,
        k,
        v,
        alpha,
        beta,
        s0 if s0 is not None else dummy,
        write,
        seeds,
        static_scale_rows if static_scale_rows is not None else dummy,
        metrics,
        bsz,
        steps,
        hv,
        hk,
        dv,
        dk,
        hv // hk,
        record_every,
        batch_offset,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        VEC_DECAY=alpha.dim() == 4,
        HAS_S0=s0 is not None,
        NV=nv,
        SPEC0=padded[0],
        SPEC1=padded[1],
        SPEC2=padded[2],
        SPEC3=padded[3],
        SPEC4=padded[4],
        SPEC5=padded[5],
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return metrics
