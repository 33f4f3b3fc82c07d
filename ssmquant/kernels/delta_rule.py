"""Fused delta-rule decode emulation (Gated DeltaNet and KDA): all T steps of one layer, for up to
MAX_SLOTS variants, in one launch.

One program owns one (batch, value head) and BLOCK_P value rows of the head's state [Dv, Dk], as a tile
[Dk, BLOCK_P] (`common`). GDN and KDA differ only in the decay (VEC_DECAY): one scalar per head, or a vector over Dk.

Reference: `ssmquant.replay.naive` (`kda_advance` for KDA), op for op, with alpha = exp(g) precomputed by the caller
(`kinds.gdn_decays` [B, T, Hv] / `kda_decays` [B, T, Hv, Dk]). Compiled with FMA contraction, as the engines' own
Triton kernels (fla's fused_recurrent) run: the dots, the rank-1 update and the metric sums are FMAs and the Dk sums
run in another order than torch's, so states differ from the reference by FP32 noise (the tests bound it). The
writes round exactly as the reference: s * mult is an explicit mul.rn (`_mul_rn`). FP8 / INT8 RNE writes take
`_fake_quant_8bit_rne`, equal bit for bit to `rounding.fake_quant_tile` (tests/kernels/test_delta_rule_paths.py).

_kernel -> launcher (`delta_rule_launch`, no validation; `ssmquant.simulate` validates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import kinds
from .common import (
    register_cap,
    slot_initial_state,
    slot_round_buffer,
    slot_static_scale,
    slot_takes_reference_step,
    slot_write,
    spec_format,
    spec_group,
    spec_sr,
    spec_static,
    store_slot_metrics,
    store_slot_output,
)
from .registry import FusedKernel, register
from .rounding import (
    FMT_NVFP4,
    INTERPRETING,
    encoding_of_code,
    fmt_integer_grid,
    fmt_max_code,
    group_reduce_max,
    tile_columns,
)

_INT_MAGIC = tl.constexpr(1.5 * 2.0**23)  # ulp 1 over (2^23, 2^24): x + M - M rounds |x| < 2^22 half to even


@triton.constexpr_function
def _min_normal(fmt):
    """2^E_min: the smallest normal magnitude of the float grid of format code ``fmt``."""
    return 2.0 ** encoding_of_code(fmt).grid.min_exponent


@triton.constexpr_function
def _magic_scale(fmt):
    """1.5 x 2^(23 - M) for a float grid of M mantissa bits: 1.5 x 2^(e + 23 - M) has an FP32 ulp of 2^(e - M), the
    grid's spacing in the binade of 2^e."""
    return 1.5 * 2.0 ** (23 - encoding_of_code(fmt).grid.mantissa_bits)


@triton.constexpr_function
def _fast_round_takes(spec):
    """Whether `_fake_quant_8bit_rne` rounds this slot: an 8-bit encoding with one scale per row group, RNE."""
    enc = encoding_of_code(spec_format(spec))
    return enc.scale_layout == "group" and enc.bits == 8 and not spec_sr(spec)
_FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _mul_rn(a, b):
    """a * b rounded on its own (mul.rn), never contracted with a later add into an FMA. Needs the launcher's
    enable_reflect_ftz=False, else libdevice picks mul.rn.ftz and flushes subnormals."""
    if INTERPRETING:  # no libdevice there, and no contraction either
        return a * b
    else:
        return libdevice.mul_rn(a, b)


@triton.jit
def _fake_quant_8bit_rne(s, static_scale, BN: tl.constexpr, BR: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                         STATIC: tl.constexpr):
    """`rounding.fake_quant_tile` for FP8 E4M3 (FMT 3) and INT8 (FMT 4) with RNE, in fewer instructions.

    The same scales, and each element rounded half to even by x + M - M: M = 1.5 x 2^(e + 20) for E4M3 (2^e the power
    of two at or below max(|x|, 2^-6), so x + M's ulp is the grid's spacing), 1.5 x 2^23 for INT8. Only static scales
    clamp (dynamic ones keep |x| <= QMAX). Unlike `fake_quant_tile`, NaN stays NaN (the codec refuses NaN states) and
    a zero comes back +0, which no metric sees.
    """
    qmax: tl.constexpr = fmt_max_code(FMT)
    if STATIC:
        dec = static_scale
        mult = tl.math.div_rn(tl.full([BR], 1.0, tl.float32), dec)
    else:
        amax = group_reduce_max(tl.abs(s), BN, BR, GROUP)
        mult = tl.math.div_rn(tl.full([BR], qmax, tl.float32), tl.where(amax == 0.0, 1.0, amax))
        # amax 0, or so small (< QMAX / FP32 max) that the multiplier overflows: 1, as fake_quant_tile
        mult = tl.where((amax == 0.0) | (mult > _FP32_MAX), 1.0, mult)
        dec = tl.math.div_rn(tl.full([BR], 1.0, tl.float32), mult)
    x = _mul_rn(s, mult[None, :])
    if STATIC:
        x = tl.clamp(x, -qmax, qmax, propagate_nan=tl.PropagateNan.ALL)
    if fmt_integer_grid(FMT):
        m = _INT_MAGIC
    else:
        p2 = (tl.maximum(tl.abs(x), _min_normal(FMT)).to(tl.uint32, bitcast=True) & 0x7F800000).to(
            tl.float32, bitcast=True
        )
        m = p2 * _magic_scale(FMT)
    return ((x + m) - m) * dec[None, :]


def per_step_offsets(num_warps: int, specs: tuple[int, ...]) -> bool:
    """Whether a launch computes its input and SR offsets per step (`_per_step`) instead of letting LLVM hoist them
    out of the time loop, which costs registers: several-warp launches (else ptxas spills the state tiles) and
    one-warp launches whose every slot is nvfp4 (lab/DESIGN_NOTES.md)."""
    return num_warps > 1 or all(spec_format(spec) == FMT_NVFP4 for spec in specs)


@triton.jit
def _per_step(x, t):
    """x unchanged, through a move that depends on t, so that values computed from it are not hoisted out of the
    time loop."""
    if INTERPRETING:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [x, t], dtype=x.dtype, is_pure=True, pack=1)


@triton.jit
def _slot_write(
    s, k, t, bt, BT, write_ptr, seed_ptr, static_scale, sr_index, flag, BN: tl.constexpr, BR: tl.constexpr,
    SPEC: tl.constexpr, FAST_ROUND: tl.constexpr, KMAJOR: tl.constexpr
):
    """`common.slot_write`, FP8 / INT8 RNE slots through `_fake_quant_8bit_rne` when FAST_ROUND; those take their
    write-mask byte `flag` from `_step_inputs`."""
    if FAST_ROUND and _fast_round_takes(SPEC):
        if flag != 0:
            s = _fake_quant_8bit_rne(s, static_scale, BN, BR, spec_format(SPEC), spec_group(SPEC), spec_static(SPEC))
    else:
        s = slot_write(s, k, t, bt, BT, write_ptr, seed_ptr, static_scale, sr_index, BN, BR, SPEC, KMAJOR)
    return s


@triton.jit
def _step_inputs(q_ptr, k_ptr, v_ptr, alpha_ptr, beta_ptr, write_ptr, bt, BT, HV, HK, h, hk, DV, DK, rows, cols,
                 row_ok, col_ok, VEC_DECAY: tl.constexpr, NV: tl.constexpr):
    """The inputs of step bt = b * T + t: k, q [BLOCK_N], v [BLOCK_P], the decay ([BLOCK_N, 1] per key channel
    (KDA) or one scalar (GDN)), beta, and each slot's write-mask byte (0 for slots past NV)."""
    kvec = tl.load(k_ptr + (bt * HK + hk) * DK + cols, mask=col_ok, other=0.0).to(tl.float32)
    qvec = tl.load(q_ptr + (bt * HK + hk) * DK + cols, mask=col_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + (bt * HV + h) * DV + rows, mask=row_ok, other=0.0).to(tl.float32)
    if VEC_DECAY:
        alpha = tl.load(alpha_ptr + (bt * HV + h) * DK + cols, mask=col_ok, other=1.0)[:, None]  # [BLOCK_N, 1]
    else:
        alpha = tl.load(alpha_ptr + bt * HV + h)
    beta = tl.load(beta_ptr + bt * HV + h)
    w0 = tl.load(write_ptr + bt)
    w1, w2, w3, w4, w5 = tl.zeros_like(w0), tl.zeros_like(w0), tl.zeros_like(w0), tl.zeros_like(w0), tl.zeros_like(w0)
    if NV > 1:
        w1 = tl.load(write_ptr + BT + bt)
    if NV > 2:
        w2 = tl.load(write_ptr + 2 * BT + bt)
    if NV > 3:
        w3 = tl.load(write_ptr + 3 * BT + bt)
    if NV > 4:
        w4 = tl.load(write_ptr + 4 * BT + bt)
    if NV > 5:
        w5 = tl.load(write_ptr + 5 * BT + bt)
    return kvec, qvec, v, alpha, beta, w0, w1, w2, w3, w4, w5


@triton.jit
def _rank1(s, k, u, FP_FUSION: tl.constexpr):
    """s + k u^T on a tile [BLOCK_N, BLOCK_P]: one FMA per element under FP_FUSION (as fla's update compiles), else
    the reference's product-then-sum."""
    if FP_FUSION:
        return tl.fma(k[:, None], u[None, :], s)
    else:
        return s + k[:, None] * u[None, :]


@triton.jit
def _slot_update(s, s_ref, y_ref, alpha, kvec, qvec, v, beta, SPEC: tl.constexpr, FP_FUSION: tl.constexpr):
    """One variant's step (decay, delta rule with k and u in its buffer dtype, output), or the reference's
    (s_ref, y_ref, already advanced) for an FP32 slot (`common.slot_spec`)."""
    if slot_takes_reference_step(SPEC):
        return s_ref, y_ref
    kb = slot_round_buffer(kvec, SPEC)
    s = alpha * s
    ub = slot_round_buffer(beta * (v - tl.sum(s * kb[:, None], axis=0)), SPEC)
    s = _rank1(s, kb, ub, FP_FUSION)
    return s, tl.sum(s * qvec[:, None], axis=0)


@triton.jit
def _tile_sum_sq(x, TILE: tl.constexpr, FP_FUSION: tl.constexpr):
    """Sum of squares over a tile [BLOCK_N, BLOCK_P]: under FP_FUSION over the key dim first (an in-thread FMA
    chain), else in `common.store_slot_metrics`' order."""
    if FP_FUSION:
        return tl.sum(tl.sum(x * x, axis=0), axis=0)
    else:
        return tl.sum(tl.reshape(x * x, [TILE]), axis=0)


@triton.jit
def _store_slot_metrics(
    metrics_ptr, k, slot_stride, base, s_var, s_ref, y_var, y_ref, ss_ref, yy_ref, TILE: tl.constexpr,
    FP_FUSION: tl.constexpr
):
    """`common.store_slot_metrics`, with the tile's sum of squares taken by `_tile_sum_sq`."""
    if FP_FUSION:
        ds = s_var - s_ref
        dy = y_var - y_ref
        p = metrics_ptr + k * slot_stride + base
        tl.store(p + 0, _tile_sum_sq(ds, TILE, FP_FUSION))
        tl.store(p + 1, ss_ref)
        tl.store(p + 2, tl.sum(dy * dy, axis=0))
        tl.store(p + 3, yy_ref)
    else:
        store_slot_metrics(metrics_ptr, k, slot_stride, base, s_var, s_ref, y_var, y_ref, ss_ref, yy_ref, TILE)


@triton.jit
def _delta_rule_emulate_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    alpha_ptr,
    beta_ptr,
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
    HV,
    HK,
    DV,
    DK,
    V_PER_K,
    batch_offset,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC_DECAY: tl.constexpr,
    HAS_S0: tl.constexpr,
    HAS_SV0: tl.constexpr,
    FAST_ROUND: tl.constexpr,
    FP_FUSION: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROW_BLOCKS_FIRST: tl.constexpr,
    KMAJOR: tl.constexpr,
    PER_STEP_OFFSETS: tl.constexpr,
    NV: tl.constexpr,
    OUTPUTS: tl.constexpr,
    FINAL: tl.constexpr,
    SPEC0: tl.constexpr,
    SPEC1: tl.constexpr,
    SPEC2: tl.constexpr,
    SPEC3: tl.constexpr,
    SPEC4: tl.constexpr,
    SPEC5: tl.constexpr,
):
    if ROW_BLOCKS_FIRST:  # grid (NPB, B * Hv): a head's row blocks are launched together, sharing its inputs in L2
        pid_p = tl.program_id(0)
        pid_bh = tl.program_id(1)
        npb = tl.num_programs(0)
    else:  # grid (B * Hv, NPB)
        pid_bh = tl.program_id(0)
        pid_p = tl.program_id(1)
        npb = tl.num_programs(1)
    b = pid_bh // HV
    h = pid_bh % HV
    hk = h // V_PER_K
    rows = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tile_columns(BLOCK_N, KMAJOR)
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
    sv0_stride = tl.cast(B, tl.int64) * HV * DV * DK  # one slot's initial state [B, HV, DV, DK]
    v0 = slot_initial_state(sv0_ptr, 0, sv0_stride, state_offs, tile_ok, s_ref, NV, HAS_SV0)
    v1 = slot_initial_state(sv0_ptr, 1, sv0_stride, state_offs, tile_ok, s_ref, NV, HAS_SV0)
    v2 = slot_initial_state(sv0_ptr, 2, sv0_stride, state_offs, tile_ok, s_ref, NV, HAS_SV0)
    v3 = slot_initial_state(sv0_ptr, 3, sv0_stride, state_offs, tile_ok, s_ref, NV, HAS_SV0)
    v4 = slot_initial_state(sv0_ptr, 4, sv0_stride, state_offs, tile_ok, s_ref, NV, HAS_SV0)
    v5 = slot_initial_state(sv0_ptr, 5, sv0_stride, state_offs, tile_ok, s_ref, NV, HAS_SV0)
    # stochastic rounding counts elements over the whole batch, so that a launch on a batch slice draws
    # the same bits as the torch reference does for those sequences
    sr_base = (((head_base + pid_p * BLOCK_P) * DK + (batch_offset * HV).to(tl.int64) * DV * DK).to(tl.uint32)
               + (tl.arange(0, BLOCK_P) * DK).to(tl.uint32))
    BT = B * T  # one slot's write mask [B, T]
    rows_stride = B * HV * DV  # one slot's static scales [B, Hv, Dv]
    c0 = slot_static_scale(scale_ptr, 0, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC0)
    c1 = slot_static_scale(scale_ptr, 1, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC1)
    c2 = slot_static_scale(scale_ptr, 2, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC2)
    c3 = slot_static_scale(scale_ptr, 3, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC3)
    c4 = slot_static_scale(scale_ptr, 4, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC4)
    c5 = slot_static_scale(scale_ptr, 5, rows_stride, head_base, rows, row_ok, BLOCK_P, SPEC5)
    metrics_stride = npb.to(tl.int64) * T * B * HV * 4  # one slot's metrics [T, B, Hv, NPB, 4]
    out_stride = tl.cast(B, tl.int64) * T * HV * DV  # one slot's outputs [B, T, Hv, Dv]

    # PREFETCH: step 0's inputs here; each step then loads the next one's (the last step its own again, unused)
    if PREFETCH:
        nk, nq, nvec, na, nb, nw0, nw1, nw2, nw3, nw4, nw5 = _step_inputs(
            q_ptr, k_ptr, v_ptr, alpha_ptr, beta_ptr, write_ptr, b64 * T, BT, HV, HK, h, hk, DV, DK, rows,
            cols, row_ok, col_ok, VEC_DECAY, NV
        )
    for t in range(T):
        bt = b64 * T + t
        if PER_STEP_OFFSETS:
            cols_t = _per_step(cols, t)
        else:
            cols_t = cols
        sr_index = sr_base[None, :] + cols_t.to(tl.uint32)[:, None]
        if PREFETCH:
            kvec, qvec, v, alpha, beta, w0, w1, w2, w3, w4, w5 = nk, nq, nvec, na, nb, nw0, nw1, nw2, nw3, nw4, nw5
            nk, nq, nvec, na, nb, nw0, nw1, nw2, nw3, nw4, nw5 = _step_inputs(
                q_ptr, k_ptr, v_ptr, alpha_ptr, beta_ptr, write_ptr, b64 * T + tl.minimum(t + 1, T - 1), BT, HV,
                HK, h, hk, DV, DK, rows, cols_t, row_ok, col_ok, VEC_DECAY, NV
            )
        else:
            kvec, qvec, v, alpha, beta, w0, w1, w2, w3, w4, w5 = _step_inputs(
                q_ptr, k_ptr, v_ptr, alpha_ptr, beta_ptr, write_ptr, bt, BT, HV, HK, h, hk, DV, DK, rows,
                cols_t, row_ok, col_ok, VEC_DECAY, NV
            )
        s_ref = alpha * s_ref
        u = beta * (v - tl.sum(s_ref * kvec[:, None], axis=0))
        s_ref = _rank1(s_ref, kvec, u, FP_FUSION)
        y_ref = tl.sum(s_ref * qvec[:, None], axis=0)
        v0, y0 = _slot_update(v0, s_ref, y_ref, alpha, kvec, qvec, v, beta, SPEC0, FP_FUSION)
        v0 = _slot_write(v0, 0, t, bt, BT, write_ptr, seed_ptr, c0, sr_index, w0, BLOCK_N, BLOCK_P, SPEC0, FAST_ROUND, KMAJOR)
        if NV > 1:
            v1, y1 = _slot_update(v1, s_ref, y_ref, alpha, kvec, qvec, v, beta, SPEC1, FP_FUSION)
            v1 = _slot_write(v1, 1, t, bt, BT, write_ptr, seed_ptr, c1, sr_index, w1, BLOCK_N, BLOCK_P, SPEC1, FAST_ROUND, KMAJOR)
        if NV > 2:
            v2, y2 = _slot_update(v2, s_ref, y_ref, alpha, kvec, qvec, v, beta, SPEC2, FP_FUSION)
            v2 = _slot_write(v2, 2, t, bt, BT, write_ptr, seed_ptr, c2, sr_index, w2, BLOCK_N, BLOCK_P, SPEC2, FAST_ROUND, KMAJOR)
        if NV > 3:
            v3, y3 = _slot_update(v3, s_ref, y_ref, alpha, kvec, qvec, v, beta, SPEC3, FP_FUSION)
            v3 = _slot_write(v3, 3, t, bt, BT, write_ptr, seed_ptr, c3, sr_index, w3, BLOCK_N, BLOCK_P, SPEC3, FAST_ROUND, KMAJOR)
        if NV > 4:
            v4, y4 = _slot_update(v4, s_ref, y_ref, alpha, kvec, qvec, v, beta, SPEC4, FP_FUSION)
            v4 = _slot_write(v4, 4, t, bt, BT, write_ptr, seed_ptr, c4, sr_index, w4, BLOCK_N, BLOCK_P, SPEC4, FAST_ROUND, KMAJOR)
        if NV > 5:
            v5, y5 = _slot_update(v5, s_ref, y_ref, alpha, kvec, qvec, v, beta, SPEC5, FP_FUSION)
            v5 = _slot_write(v5, 5, t, bt, BT, write_ptr, seed_ptr, c5, sr_index, w5, BLOCK_N, BLOCK_P, SPEC5, FAST_ROUND, KMAJOR)
        if OUTPUTS:
            out_offs = (bt * HV + h) * DV + rows
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
            base = (((rec * B + b) * HV + h) * npb + pid_p) * 4
            ss = _tile_sum_sq(s_ref, BLOCK_N * BLOCK_P, FP_FUSION)
            yy = tl.sum(y_ref * y_ref, axis=0)
            _store_slot_metrics(metrics_ptr, 0, metrics_stride, base, v0, s_ref, y0, y_ref, ss, yy, BLOCK_N * BLOCK_P, FP_FUSION)
            if NV > 1:
                _store_slot_metrics(metrics_ptr, 1, metrics_stride, base, v1, s_ref, y1, y_ref, ss, yy, BLOCK_N * BLOCK_P, FP_FUSION)
            if NV > 2:
                _store_slot_metrics(metrics_ptr, 2, metrics_stride, base, v2, s_ref, y2, y_ref, ss, yy, BLOCK_N * BLOCK_P, FP_FUSION)
            if NV > 3:
                _store_slot_metrics(metrics_ptr, 3, metrics_stride, base, v3, s_ref, y3, y_ref, ss, yy, BLOCK_N * BLOCK_P, FP_FUSION)
            if NV > 4:
                _store_slot_metrics(metrics_ptr, 4, metrics_stride, base, v4, s_ref, y4, y_ref, ss, yy, BLOCK_N * BLOCK_P, FP_FUSION)
            if NV > 5:
                _store_slot_metrics(metrics_ptr, 5, metrics_stride, base, v5, s_ref, y5, y_ref, ss, yy, BLOCK_N * BLOCK_P, FP_FUSION)
    if FINAL:  # the reference's state after the last step
        tl.store(final_ptr + state_offs, s_ref, mask=tile_ok)


# (kind, BLOCK_P, num_warps) whose grid puts a head's row blocks first by default: the launches measured faster so
# (lab/DESIGN_NOTES.md); the others keep the previous order. Prefetch stays off: it was slower there.
ROW_BLOCKS_FIRST_DEFAULT = {("kda", 16, 1)}


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
    *,
    specs: tuple[int, ...],
    block_p: int,
    num_warps: int,
    batch_offset: int = 0,
    fast_round: bool = True,
    fp_fusion: bool = True,
    prefetch: bool = False,
    row_blocks_first: bool | None = None,
    slot_s0: torch.Tensor | None = None,
    outputs: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the kernel on contiguous inputs for NV = len(specs) variants; returns metrics [NV, T, B, Hv, NPB, 4],
    or with ``outputs`` given, each slot's per-step outputs written there instead (and ``outputs`` returned).

    s0: [B, Hv, Dv, Dk] fp32, the reference's initial state, or None (zeros); slot_s0: [NV, B, Hv, Dv, Dk] fp32,
    each slot's initial state (s0 stored in its format), or None (each slot starts from s0; needs s0 when given).
    alpha: [B, T, Hv] (GDN) or [B, T, Hv, Dk] (KDA); write: [NV, B, T] int8; seeds: [NV] int64;
    static_scale_rows: [NV, B, Hv, Dv] fp32 (ones for dynamic slots) or None when no slot is static;
    specs: `common.slot_spec` of each slot, whose rows group divides block_p.
    fast_round: FP8 / INT8 RNE writes by `_fake_quant_8bit_rne`, else `fake_quant_tile`; fp_fusion: FMA contraction,
    else every product rounded, as torch (both off: the previous path, for tests and benchmarks).
    prefetch: each step loads the next step's inputs before its arithmetic; row_blocks_first: grid (NPB, B * Hv), a
    head's programs (same inputs) in one wave, None: `ROW_BLOCKS_FIRST_DEFAULT` where B * Hv <= 65535. Both reorder
    work only: the metrics are bit-identical (tests/kernels/test_delta_rule_paths.py). outputs: [NV, B, T, Hv, Dv]
    contiguous, any float dtype, for the slots' outputs y (S q, of the state before its write) rounded to it;
    final_state: [B, Hv, Dv, Dk] fp32 for the reference's state after the last step (output mode only).
    """
    bsz, steps, hv, dv = v.shape
    hk, dk = k.shape[2], k.shape[3]
    block_n = triton.next_power_of_2(dk)
    npb = triton.cdiv(dv, block_p)
    nv = len(specs)
    dummy = torch.empty(1, device=v.device, dtype=torch.float32)
    # NaN-filled: a metric the kernel fails to write stays NaN and fails every check downstream
    metrics = (
        torch.full((nv, steps, bsz, hv, npb, 4), float("nan"), device=v.device, dtype=torch.float32)
        if outputs is None
        else dummy
    )
    padded = tuple(specs) + (0,) * (6 - nv)
    if row_blocks_first is None:
        kind = "kda" if alpha.dim() == 4 else "gdn"
        row_blocks_first = (kind, block_p, num_warps) in ROW_BLOCKS_FIRST_DEFAULT and bsz * hv <= 65535
    if row_blocks_first and bsz * hv > 65535:  # CUDA's limit on the grid's second dimension
        raise ValueError(f"row_blocks_first takes at most 65535 (batch x heads) programs, got {bsz * hv}")
    grid = (npb, bsz * hv) if row_blocks_first else (bsz * hv, npb)
    _delta_rule_emulate_kernel[grid](
        q,
        k,
        v,
        alpha,
        beta,
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
        hv,
        hk,
        dv,
        dk,
        hv // hk,
        batch_offset,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        VEC_DECAY=alpha.dim() == 4,
        HAS_S0=s0 is not None,
        HAS_SV0=slot_s0 is not None,
        FAST_ROUND=fast_round,
        FP_FUSION=fp_fusion,
        PREFETCH=prefetch and steps > 0,  # no step 0 to load ahead of the loop otherwise
        ROW_BLOCKS_FIRST=row_blocks_first,
        KMAJOR=block_n % 16 == 0,  # whole nvfp4 blocks per lane
        PER_STEP_OFFSETS=per_step_offsets(num_warps, specs),
        NV=nv,
        OUTPUTS=outputs is not None,
        FINAL=final_state is not None,
        SPEC0=padded[0],
        SPEC1=padded[1],
        SPEC2=padded[2],
        SPEC3=padded[3],
        SPEC4=padded[4],
        SPEC5=padded[5],
        num_warps=num_warps,
        enable_fp_fusion=fp_fusion,
        enable_reflect_ftz=False,  # _mul_rn keeps subnormals
        maxnreg=register_cap(num_warps),
    )
    return metrics if outputs is None else outputs


def delta_rule_operands(inputs) -> dict[str, torch.Tensor]:
    """`delta_rule_launch`'s per-layer operands of GDN / KDA inputs, contiguous, with the kind's decays computed once
    (alpha [B, T, Hv] for GDN, [B, T, Hv, Dk] for KDA)."""
    return dict(
        q=inputs.q.contiguous(),
        k=inputs.k.contiguous(),
        v=inputs.v.contiguous(),
        alpha=kinds.of(inputs).decays(inputs).contiguous(),
        beta=inputs.beta.float().contiguous(),
    )


_DELTA_RULE = FusedKernel(delta_rule_operands, frozenset({"q", "k", "v", "alpha", "beta"}), delta_rule_launch)
register("gdn", _DELTA_RULE)
register("kda", _DELTA_RULE)
