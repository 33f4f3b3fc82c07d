"""The teacher-forced metrics of one variant's logits against the reference's, fused per position.

`evaluate.metrics` defines them on float64 log-probabilities (``reference_step``, ``compare_step``: the oracle).
Through torch those take about ten passes of float64 tensors as large as the logits per variant (the conversions, the
log-softmax, the probabilities, the KL's difference and product); on a GPU at a 131K vocabulary they cost more than
the head's matrix product. This kernel reads the two logit rows in their own dtype (the head's; their float64 values
are exact conversions), three times each, and does the same float64 arithmetic in registers: per row the maxima and
first argmax, the sums of exp(x - max), then logp = (x - max) - log(sum) (torch's order), the KL
sum p (logp - logq) with p = exp(logp), and the target's log-probabilities. Only the summation order differs from
torch's, so the values agree to float64 rounding (tests/kernels/test_metrics_kernel.py states the tolerance).

Rows where either logit row is not finite are flagged, not measured: there the caller takes the torch path, whose
NaN / Inf semantics are the oracle's by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# flags[r]: bit 0 the reference's row holds a NaN / Inf, bit 1 the variant's
REFERENCE_NONFINITE = 1
VARIANT_NONFINITE = 2
MAX_BLOCK = 2048


@triton.jit
def _row_max(row_ptr, V, cols, BLOCK: tl.constexpr):
    """(max, first index of the max, any non-finite element) of one row of V logits, in FP32 (exact)."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        ok = idx < V
        x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
        bad = bad | (ok & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32)
        take = x > best  # strictly greater: each lane keeps its first index of its max
        where = tl.where(take, idx, where)
        best = tl.where(take, x, best)
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, where, V), 0)
    return top, first, tl.max(bad, 0)


@triton.jit
def _row_log_sum(row_ptr, V, cols, top, BLOCK: tl.constexpr):
    """log(sum exp(x - top)) of one row, in FP64."""
    acc = tl.zeros([BLOCK], tl.float64)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float64)
        acc += tl.exp(x - top)
    return tl.log(tl.sum(acc, 0))


@triton.jit
def _pair_metrics_kernel(
    p_ptr,  # [R, V] the reference's logits (any float dtype)
    q_ptr,  # [R, V] the variant's logits
    target_ptr,  # [R] int64
    out_ptr,  # [4, R] float64: kl, top-1 agreement, delta nll, the reference's nll (nats)
    flags_ptr,  # [R] int32
    R,
    V,
    stride_p,
    stride_q,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    p_row = p_ptr + row * stride_p
    q_row = q_ptr + row * stride_q
    top_p, first_p, bad_p = _row_max(p_row, V, cols, BLOCK)
    top_q, first_q, bad_q = _row_max(q_row, V, cols, BLOCK)
    tl.store(flags_ptr + row, bad_p * 1 + bad_q * 2)
    if bad_p == 0:  # the reference's nll wherever its row is finite, the comparison where both are
        mp = top_p.to(tl.float64)
        lp = _row_log_sum(p_row, V, cols, mp, BLOCK)
        t = tl.load(target_ptr + row)
        known = (t >= 0) & (t < V)  # a target outside the vocabulary has no log-probability: NaN
        nll_p = -((tl.load(p_row + t, mask=known, other=float("nan")).to(tl.float64) - mp) - lp)
        tl.store(out_ptr + 3 * R + row, nll_p)
        if bad_q == 0:
            mq = top_q.to(tl.float64)
            lq = _row_log_sum(q_row, V, cols, mq, BLOCK)
            kl = tl.zeros([BLOCK], tl.float64)
            for start in range(0, V, BLOCK):
                idx = start + cols
                ok = idx < V
                x = tl.load(p_row + idx, mask=ok, other=0.0).to(tl.float64)
                y = tl.load(q_row + idx, mask=ok, other=0.0).to(tl.float64)
                logp = (x - mp) - lp
                logq = (y - mq) - lq
                kl += tl.where(ok, tl.exp(logp) * (logp - logq), 0.0)
            nll_q = -((tl.load(q_row + t, mask=known, other=float("nan")).to(tl.float64) - mq) - lq)
            tl.store(out_ptr + row, tl.maximum(tl.sum(kl, 0), 0.0))
            tl.store(out_ptr + R + row, (first_p == first_q).to(tl.float64))
            tl.store(out_ptr + 2 * R + row, nll_q - nll_p)


def pair_metrics_triton(
    ref_logits: torch.Tensor, logits: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``evaluate.metrics``' per-position metrics of ``logits`` [R, V] against ``ref_logits`` [R, V] (any float
    dtype, rows contiguous), target [R] (the actual next tokens) -> (values [4, R] float64: kl (nats, clamped at 0),
    top-1 agreement, delta nll (nats), the reference's nll; flags [R] int32: REFERENCE_NONFINITE |
    VARIANT_NONFINITE where a row holds a NaN / Inf: its kl, agreement and delta nll are left unset, and its
    reference nll too where the reference's row is not finite)."""
    if ref_logits.shape != logits.shape or ref_logits.ndim != 2 or target.shape != ref_logits.shape[:1]:
        raise ValueError(
            f"logits {tuple(ref_logits.shape)} and {tuple(logits.shape)} must both be [R, V] with target [R], got "
            f"target {tuple(target.shape)}"
        )
    if ref_logits.stride(1) != 1 or logits.stride(1) != 1:
        raise ValueError("the logit rows must be contiguous")
    rows, vocab = ref_logits.shape
    dev = ref_logits.device
    out = torch.empty(4, rows, dtype=torch.float64, device=dev)
    flags = torch.empty(rows, dtype=torch.int32, device=dev)
    if rows:
        block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
        _pair_metrics_kernel[(rows,)](
            ref_logits, logits, target.to(device=dev, dtype=torch.int64).contiguous(), out, flags, rows, vocab,
            ref_logits.stride(0), logits.stride(0), BLOCK=block, num_warps=4 if block >= 1024 else 1,
            enable_fp_fusion=False,  # each product and sum rounded on its own, as torch's float64 passes round them
        )  # fmt: skip
    return out, flags
