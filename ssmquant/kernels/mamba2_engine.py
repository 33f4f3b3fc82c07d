"""Fused Mamba-2 decode emulation under an engine profile (`flashinfer`): all T steps in one launch.

The Triton twin of `ssmquant.engines.emulation.Mamba2EngineStep`, its torch reference, op for op (profiles:
`ssmquant.engines.profiles`). Layout as `mamba2.py`. Besides the FP32 reference and the metric state, a replay
variant keeps its checkpoint (code values and per-row decode scales, or the stored values) and reads its ring back
from the inputs. The coefficient tables (`profiles.flashinfer_tables`) come from torch, so both backends apply the
same bits; replay sums run over the ring in order, as in the reference. SR of 8-bit checkpoints and of conventional
fp16 states draws FlashInfer's Philox words (`tl.randint4x` is `philox_randint4x`'s stream).

_kernel -> launcher (`mamba2_engine_launch`, no validation; `ssmquant.simulate` validates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..engines.mufu import table_on
from ..engines.philox import engine_seed
from ..engines.profiles import arithmetic, flashinfer_tables
from ..engines.triton_ssu import ssu_decays
from ..formats import Rounding
from ..kinds.mamba2 import mamba2_decays
from ..replay.naive import stored_initial_states
from ..replay.schemes import SchemeKind
from .common import BUFFER_CODES, round_buffer, store_metrics
from .host import batch_slices
from .rounding import (
    E4M3_MAX,
    FMT_FP8,
    FMT_FP16,
    FMT_INT8,
    FORMAT_CODES,
    constant,
    encoding_of_code,
    fake_quant_tile,
    round_element,
    round_to_bf16,
    stream_key,
)

# the format codes FlashInfer's own conversions below are written for
FMT_E4M3 = constant(FMT_FP8)
FMT_I8 = constant(FMT_INT8)
FMT_F16 = constant(FMT_FP16)


@triton.jit
def _bf16(v):
    return round_to_bf16(v, 0, False)


@triton.jit
def _signed(mag, negative):
    """mag with its sign bit set where `negative`, so that -0.0 stays -0.0: the kernel negates no float, as some
    Triton releases compile -x as 0 - x (lab/DESIGN_NOTES.md)."""
    bits = mag.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pow2(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exponent(v):
    """Unbiased exponent field of FP32 v (int32); zero: -1000 (flashinfer._exponent)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.where(v == 0.0, -1000, e)


@triton.jit
def _pow2_f64(e):
    """2^e as FP64 for int32 e in [-1022, 1023]."""
    return ((e + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _rz_f32(s):
    """FP64 -> FP32 rounded toward zero (flashinfer._rz_from_f64)."""
    f = s.to(tl.float32)
    return tl.where(tl.abs(f.to(tl.float64)) > tl.abs(s), (f.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), f)


@triton.jit
def _trunc_f64(v):
    return tl.where(v >= 0.0, tl.floor(v), tl.ceil(v))


@triton.jit
def _rcp(v, rcp_ptr):
    """MUFU.RCP (rcp.approx.ftz.f32) of finite FP32 v as sm_90 computes it (`mufu.rcp_sm90`, bit for bit):
    RN(1/m) of the significand m plus its tabulated correction (rcp_ptr: int8 [2^23]), times 2^-e."""
    bits = v.to(tl.int32, bitcast=True)
    mant = bits & 0x7FFFFF
    e = ((bits >> 23) & 0xFF) - 127
    m = (mant | (127 << 23)).to(tl.float32, bitcast=True)
    ym = tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), m).to(tl.int32, bitcast=True)
    ym = (ym + tl.load(rcp_ptr + mant).to(tl.int32)).to(tl.float32, bitcast=True)
    y = ym * _pow2(tl.minimum(-e, 127))  # exact; 2^-127 is 0 here (flushed, as are results below 2^-126)
    y = tl.where(y < 1.1754943508222875e-38, 0.0, y)
    y = tl.where(e == -127, float("inf"), y)  # zero / subnormal v (flushed to zero)
    return _signed(y, bits < 0)


@triton.jit
def _bitrev16(x):
    x = ((x >> 1) & 0x5555) | ((x & 0x5555) << 1)
    x = ((x >> 2) & 0x3333) | ((x & 0x3333) << 2)
    x = ((x >> 4) & 0x0F0F) | ((x & 0x0F0F) << 4)
    return ((x >> 8) & 0x00FF) | ((x & 0x00FF) << 8)


@triton.jit
def _select4(r0, r1, r2, r3, k):
    return tl.where(k == 0, r0, tl.where(k == 1, r1, tl.where(k == 2, r2, r3)))


@triton.jit
def _ckpt_chunks(seed, head_base, rows, cols, N):
    """`philox.checkpoint_8bit_words` for a tile [BN, BP]: the 16-bit SR chunk of each element (int64)."""
    hi = (rows % 16) >= 8
    r_lo = tl.where(hi, rows - 8, rows)
    pair_col = 32 * (cols // 32) + 2 * ((cols % 8) // 2)
    offset = (head_base * N + r_lo.to(tl.int64) * N)[None, :] + pair_col[:, None].to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, offset, 10)
    k = ((cols // 8) % 4)[:, None]
    word = _select4(r0, r1, r2, r3, k).to(tl.int64) & 0xFFFFFFFF
    chunk = tl.where(hi[None, :], word >> 16, word & 0xFFFF)
    return tl.where((cols % 2 == 1)[:, None], _bitrev16(chunk), chunk)


@triton.jit
def _sr_e4m3(v, chunk):
    """`philox.sr_e4m3`: FlashInfer's software stochastic E4M3 conversion, as FP32 values."""
    bits = v.to(tl.uint32, bitcast=True).to(tl.int64)
    sign = bits >> 31
    ex = (bits >> 23) & 0xFF
    mant = 0x800000 | (bits & 0x7FFFFF)
    unb = ex - 127
    normal = unb >= -6
    shift = tl.where(normal, 20, 14 - unb)
    rs = shift - 16
    contrib = tl.where(rs < 56, chunk << tl.minimum(tl.maximum(rs, 0), 55), 0)
    total = mant + contrib
    ip = tl.where(shift >= 64, 0, total >> tl.minimum(shift, 63))
    up = (ip >= 16).to(tl.int64)
    e_n = unb + 7 + up
    ip_n = tl.where(up == 1, ip >> 1, ip)
    e = tl.where(normal, e_n, tl.where(ip >= 8, 1, 0))
    frac = tl.where(normal, ip_n, ip) & 7
    sat = (e > 15) | ((e == 15) & (frac == 7))
    mag = tl.where(e == 0, frac.to(tl.float32) * 0.001953125, (8 + frac).to(tl.float32) * _pow2(e.to(tl.int32) - 10))
    mag = tl.where(sat, E4M3_MAX, mag)
    mag = tl.where(ex == 0, 0.0, mag)
    return _signed(mag, sign == 1)


@triton.jit
def _sr_fp16(v, word):
    """`philox.sr_fp16`: add the low 13 random bits below the fp16 mantissa and truncate (FP32 values)."""
    bits = v.to(tl.uint32, bitcast=True).to(tl.int64)
    sign = bits >> 31
    a = (bits & 0x7FFFFFFF) + (word & 0x1FFF)
    ex = (a >> 23) & 0xFF
    out = ((a >> 13) << 13).to(tl.int32).to(tl.float32, bitcast=True)
    out = tl.where(ex > 142, float("inf"), out)
    out = tl.where(ex < 113, 0.0, out)
    return _signed(out, sign == 1)


@triton.jit
def _fingerprint(v, weight, ok, TILE: tl.constexpr):
    """Sum of v's FP32 bit patterns times their weights over the tile, int64 (exact, any order)."""
    bits = v.to(tl.int32, bitcast=True).to(tl.int64) * weight
    return tl.sum(tl.reshape(tl.where(ok, bits, 0), [TILE]), axis=0)


@triton.constexpr_function
def _checkpoint_max_code(fmt):
    """The grid magnitude an 8-bit checkpoint row's amax maps onto (1 for the unscaled formats, which never read it)."""
    return encoding_of_code(fmt).max_code or 1.0


@triton.jit
def _mamba2_engine_kernel(
    x_ptr, dt_ptr, a_ptr, bm_ptr, cm_ptr, d_ptr, s0_ptr, sv0_ptr, write_ptr, metrics_ptr,
    fac_ptr, cbn_ptr, cbo_ptr, coef_ptr, tdec_ptr, start_ptr, fcall_ptr, ae_ptr, rcp_ptr, probe_ptr, yout_ptr,
    B, T, H, P, N, HEADS_PER_GROUP, G, seed_hi, batch_offset, store_seed,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, REPLAY: tl.constexpr,
    SR: tl.constexpr, BUF: tl.constexpr, HAS_S0: tl.constexpr, HAS_SV0: tl.constexpr, SSU: tl.constexpr,
    PROBE: tl.constexpr,
):  # fmt: skip
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
    EIGHT: tl.constexpr = FMT == FMT_E4M3 or FMT == FMT_I8  # FlashInfer's 8-bit checkpoints
    QMAX: tl.constexpr = _checkpoint_max_code(FMT)
    b64 = b.to(tl.int64)
    head_base = (b64 * H + h) * P
    state_offs = (head_base + rows)[None, :] * N + cols[:, None]
    # Philox counters and SR indices count elements over the whole batch (batch slices draw the same bits)
    global_head = ((b64 + batch_offset) * H + h) * P
    sr_index = state_offs + (batch_offset * H).to(tl.int64) * P * N
    if HAS_S0:
        s_ref = tl.load(s0_ptr + state_offs, mask=tile_ok, other=0.0)
    else:
        s_ref = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
    if HAS_SV0:  # the initial state stored in the variant's format (replay.naive.stored_initial_states)
        s_var = tl.load(sv0_ptr + state_offs, mask=tile_ok, other=0.0)
    else:
        s_var = s_ref
    ones = tl.full([BLOCK_P], 1.0, tl.float32)
    codes = s_var  # the checkpoint: code values (8-bit: the engine's own encoding of s_ref, below) or stored values
    dec = ones
    if REPLAY and EIGHT:
        amax = tl.max(tl.abs(s_ref), axis=0)
        enc = tl.where(amax == 0.0, 1.0, _rcp(tl.where(amax == 0.0, 1.0, amax), rcp_ptr) * QMAX)
        dec = _rcp(enc, rcp_ptr)
        codes = round_element(s_ref * enc[None, :], 0.0, 0, FMT, False)
        s_var = codes * dec[None, :]
    pending = tl.zeros([BLOCK_P], dtype=tl.float32)
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
        write = tl.load(write_ptr + bt) != 0
        if REPLAY:
            fac = tl.load(fac_ptr + bt * H + h)
            cbn = tl.load(cbn_ptr + bt * H + h)
            start = tl.load(start_ptr + bt)
            fcall = tl.load(fcall_ptr + bt) != 0
            if fcall:
                y = fac * pending + cbn * xb
            else:
                if EIGHT:
                    y = tl.sum(codes * cvec[:, None], axis=0) * (fac * dec) + cbn * xb
                else:
                    y = tl.sum(_bf16(codes) * cvec[:, None], axis=0) * fac + cbn * xb
                # ring loops rolled (range, not static_range): unrolling multiplies compile time (lab/DESIGN_NOTES.md)
                for j in range(L):
                    st = tl.minimum(start + j, T - 1)
                    xj = tl.load(x_ptr + ((b64 * T + st) * H + h) * P + rows, mask=row_ok, other=0.0).to(tl.float32)
                    w = tl.load(cbo_ptr + (bt * H + h) * L + j)
                    y = y + w * round_buffer(xj, BUF)
            y = y + d * x
            s_var = a * s_var + bb[:, None] * (dt * xb)[None, :]
            if write:
                rstart = tl.where(fcall, t, start)
                tdec = tl.load(tdec_ptr + bt * H + h)
                # the replay HMMA (flashinfer.hmma): exponents of the products (and of the accumulator), then
                # each product truncated 25 bits below the largest, summed exactly in FP64, truncated to FP32
                if EIGHT:
                    emax = tl.full([BLOCK_N, BLOCK_P], -1000, tl.int32)
                else:
                    acc0 = codes * tdec
                    emax = _exponent(acc0)
                for j in range(L):
                    st = tl.minimum(rstart + j, T - 1)
                    stt = b64 * T + st
                    xj = round_buffer(tl.load(x_ptr + (stt * H + h) * P + rows, mask=row_ok, other=0.0).to(tl.float32), BUF)
                    bj = round_buffer(tl.load(bm_ptr + (stt * G + g) * N + cols, mask=col_ok, other=0.0).to(tl.float32), BUF)
                    cj = tl.load(coef_ptr + (bt * H + h) * L + j)
                    if EIGHT:
                        ea = _exponent(_bf16(xj * cj))[None, :]
                        eb = _exponent(bj)[:, None]
                    else:
                        ea = _exponent(xj)[None, :]
                        eb = _exponent(_bf16(bj * cj))[:, None]
                    emax = tl.maximum(emax, tl.where((ea > -1000) & (eb > -1000), ea + eb, -1000))
                emax = tl.maximum(emax, -900)
                inv_q = _pow2_f64(25 - emax)  # 1 / 2^(emax - 23 - HMMA_EXTRA_BITS)
                if EIGHT:
                    accq = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float64)
                else:
                    accq = _trunc_f64(acc0.to(tl.float64) * inv_q)
                for j in range(L):
                    st = tl.minimum(rstart + j, T - 1)
                    stt = b64 * T + st
                    xj = round_buffer(tl.load(x_ptr + (stt * H + h) * P + rows, mask=row_ok, other=0.0).to(tl.float32), BUF)
                    bj = round_buffer(tl.load(bm_ptr + (stt * G + g) * N + cols, mask=col_ok, other=0.0).to(tl.float32), BUF)
                    cj = tl.load(coef_ptr + (bt * H + h) * L + j)
                    if EIGHT:
                        prod = _bf16(xj * cj)[None, :].to(tl.float64) * bj[:, None].to(tl.float64)
                    else:
                        prod = xj[None, :].to(tl.float64) * _bf16(bj * cj)[:, None].to(tl.float64)
                    accq = accq + _trunc_f64(prod * inv_q)
                acc = _rz_f32(accq * _pow2_f64(emax - 25))
                if EIGHT:
                    # FFMA(code, dec * total_decay, mma): one rounding
                    ts = (dec * tdec)[None, :]
                    rep = (codes.to(tl.float64) * ts.to(tl.float64) + acc.to(tl.float64)).to(tl.float32)
                    amax = tl.max(tl.abs(rep), axis=0)
                    enc = tl.where(amax == 0.0, 1.0, _rcp(tl.where(amax == 0.0, 1.0, amax), rcp_ptr) * QMAX)
                    dec = _rcp(enc, rcp_ptr)
                    v = rep * enc[None, :]
                    if SR:
                        chunk = _ckpt_chunks(seed_hi + t + 1, global_head, rows, cols, N)
                        if FMT == FMT_E4M3:
                            codes = _sr_e4m3(v, chunk)
                        else:
                            codes = tl.minimum(tl.maximum(tl.floor(v + chunk.to(tl.float32) * 1.52587890625e-05), -QMAX), QMAX)
                    else:
                        codes = round_element(v, 0.0, 0, FMT, False)
                    codes = tl.where(tile_ok, codes, 0.0)
                    s_var = codes * dec[None, :]
                    out_state = rep
                else:
                    key = stream_key(store_seed, t)
                    codes = fake_quant_tile(acc, ones, sr_index, key, BLOCK_N, BLOCK_P, FMT, 1, False, SR)
                    s_var = codes
                    out_state = codes
                if t + 1 < T:
                    cnext = tl.load(cm_ptr + ((bt + 1) * G + g) * N + cols, mask=col_ok, other=0.0).to(tl.float32)
                    pending = tl.sum(_bf16(out_state) * cnext[:, None], axis=0)
        else:
            if SSU:  # vLLM / TensorRT-LLM selective_state_update: fma(S, dA, fp32(dt B) x), one rounding (float64)
                ae = tl.load(ae_ptr + bt * H + h)  # the engine's decay bits; `a` stays the reference's
                s_var = (s_var.to(tl.float64) * ae.to(tl.float64) + ((bb * dt)[:, None] * xb[None, :]).to(tl.float64)).to(tl.float32)
            else:
                s_var = a * s_var + bb[:, None] * (dt * xb)[None, :]
            y = tl.sum(s_var * cvec[:, None], axis=0) + d * x
            if write:
                if FMT == FMT_F16 and SR and not SSU:  # FlashInfer's fp16 SR: Philox word of (row, col - col % 4), word col % 4
                    offset = (global_head * N + rows.to(tl.int64) * N)[None, :] + (cols - cols % 4)[:, None].to(tl.int64)
                    r0, r1, r2, r3 = tl.randint4x(seed_hi + t, offset, 10)
                    word = _select4(r0, r1, r2, r3, (cols % 4)[:, None]).to(tl.int64) & 0xFFFFFFFF
                    s_var = tl.where(tile_ok, _sr_fp16(s_var, word), 0.0)
                else:
                    key = stream_key(store_seed, t)
                    s_var = fake_quant_tile(s_var, ones, sr_index, key, BLOCK_N, BLOCK_P, FMT, 1, False, SR)
        store_metrics(metrics_ptr, t, B, b, H, h, npb, pid_p, s_var, s_ref, y, y_ref, BLOCK_N * BLOCK_P)
        if PROBE:  # what the torch profile's state carries, as exact integer sums (`engines.twin.fingerprint`)
            weight = (rows[None, :] * N + cols[:, None] + 1).to(tl.int64)
            pbase = probe_ptr + (((t * B + b64) * H + h) * npb + pid_p) * 3
            tl.store(pbase + 0, _fingerprint(s_var, weight, tile_ok, BLOCK_N * BLOCK_P))
            tl.store(pbase + 1, _fingerprint(codes, weight, tile_ok, BLOCK_N * BLOCK_P))
            dec_bits = dec.to(tl.int32, bitcast=True).to(tl.int64) * (rows + 1).to(tl.int64)
            tl.store(pbase + 2, tl.sum(tl.where(row_ok, dec_bits, 0), axis=0))
            tl.store(yout_ptr + ((t * B + b64) * H + h) * P + rows, y, mask=row_ok)


# The twin's compiler options: no multiply-add contraction (every product rounded, as torch computes), and libdevice
# without flush-to-zero (with it tl.floor compiles to cvt.rmi.ftz, which takes a negative subnormal to -0.0, not -1).
COMPILE_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def mamba2_engine_launch(
    x, dt, a, bm, cm, d, s0, write, tables, *, fmt_code: int, replay: bool, sr: bool, seed: int, buf_code: int,
    block_p: int, num_warps: int, batch_offset: int = 0, a_engine: torch.Tensor | None = None,
    probe: tuple[torch.Tensor, torch.Tensor] | None = None, slot_s0: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Launch on contiguous inputs; returns per-step metrics [T, B, H, NPB, 4] (fp32).

    s0: [B, H, P, N] fp32, the reference's initial state, or None (zeros); slot_s0: the same shape, the variant's
    state before step 0 (s0 stored in its format), or None (s0). An 8-bit replay checkpoint is the engine's own
    encoding of s0 either way. tables: `FlashInferTables` of this batch slice (replay), or None. a_engine: decays
    [B, T, H] of the vllm / trtllm conventional arithmetic (`triton_ssu.ssu_decays`), or None. seed: the variant's
    (the engine's call c draws `philox.engine_seed(seed, c)`). block_p covers the rows (per-row scales).
    probe: (fingerprints int64 [T, B, H, NPB, 3], outputs fp32 [T, B, H, P]) filled at every step with
    `engines.twin.fingerprint` of the metric state, the checkpoint codes and the decode scales, and the output
    (a separate compile; None: not computed).
    """
    bsz, steps, heads, p = x.shape
    groups, n = bm.shape[2], bm.shape[3]
    block_n = triton.next_power_of_2(n)
    npb = triton.cdiv(p, block_p)
    metrics = torch.full((steps, bsz, heads, npb, 4), float("nan"), device=x.device, dtype=torch.float32)
    dummy = torch.zeros(1, device=x.device, dtype=torch.float32)
    if tables is None:
        length = 1
        fac = cbn = cbo = coef = tdec = dummy
        start = torch.zeros(1, device=x.device, dtype=torch.int64)
        fcall = torch.zeros(1, device=x.device, dtype=torch.int8)
    else:
        length = tables.cb_old.shape[-1]
        fac, cbn = tables.fac.contiguous(), tables.cb_new.contiguous()
        cbo, coef, tdec = tables.cb_old.contiguous(), tables.coef.contiguous(), tables.total_decay.contiguous()
        start = tables.start.contiguous()
        fcall = tables.flush_call.to(torch.int8).contiguous()
    rcp_tab = fcall
    if replay and fmt_code in (3, 4):  # the 8-bit checkpoint's scales go through MUFU.RCP
        rcp_tab = table_on("rcp_delta", x.device)
    _mamba2_engine_kernel[(bsz * heads, npb)](
        x, dt, a, bm, cm, d, s0 if s0 is not None else dummy, dummy if slot_s0 is None else slot_s0, write, metrics,
        fac, cbn, cbo, coef, tdec, start, fcall, dummy if a_engine is None else a_engine, rcp_tab,
        dummy if probe is None else probe[0], dummy if probe is None else probe[1],
        bsz, steps, heads, p, n, heads // groups, groups, engine_seed(seed, 0), batch_offset, seed,
        L=length, BLOCK_P=block_p, BLOCK_N=block_n, FMT=fmt_code, REPLAY=replay, SR=sr, BUF=buf_code,
        HAS_S0=s0 is not None, HAS_SV0=slot_s0 is not None, SSU=a_engine is not None, PROBE=probe is not None,
        num_warps=num_warps,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return metrics


# State elements per thread and tile: four tiles live at a flush (reference, metric state, checkpoint,
# replay accumulator), so half the plain kernel's budget.
_ELEMENTS_PER_THREAD = 32


def _launch_plan(inputs, variant):
    """(write mask int8 [B, T], FlashInferTables or None, decays a_engine [B, T, H] or None, launch keywords)
    of one engine-profile variant on Mamba-2 inputs: what every batch slice's launch shares."""
    fmt, scheme = variant.format, variant.scheme
    replay = scheme.kind is SchemeKind.REPLAY
    a_engine = None
    if arithmetic(variant.engine, inputs.kind) == "triton_ssu":  # the engine's decay bits (engines.triton_ssu)
        a_engine = ssu_decays(inputs.A, inputs.dt, variant.engine).contiguous()
    write = scheme.write_mask(inputs.batch, inputs.steps).to(inputs.device)
    tables = flashinfer_tables(inputs, write, scheme.buffer_len) if replay else None
    rows, sdim = inputs.rows, inputs.state_dim
    block_n = triton.next_power_of_2(sdim)
    block_p = min(triton.next_power_of_2(rows), max(1, 32 * _ELEMENTS_PER_THREAD // block_n))
    num_warps = max(1, min(4, block_p * block_n // (32 * _ELEMENTS_PER_THREAD)))
    buf = BUFFER_CODES[scheme.buffer_dtype] if scheme.rounds_buffer else 0
    kw = dict(
        fmt_code=FORMAT_CODES[fmt.encoding], replay=replay, sr=fmt.rounding is Rounding.SR, seed=variant.seed,
        buf_code=buf, block_p=block_p, num_warps=num_warps,
    )  # fmt: skip
    return write.to(torch.int8).contiguous(), tables, a_engine, kw


def engine_steps(inputs, variant, index: int, shared: dict, s0, metric_budget: int, slot_s0=None):
    """Yield (index, b0, metrics [T, b, H, 4]) of one engine-profile variant, batch slice by batch slice.

    shared: the contiguous inputs `emulate_triton_steps` prepared (x, dt, a, bm, cm, d); s0 / slot_s0: the
    reference's initial state and the variant's (stored), [B, H, P, N] fp32 or None; metric_budget: bytes of one
    launch's per-step metric buffer.
    """
    write8, tables, a_engine, kw = _launch_plan(inputs, variant)
    per_sequence = {"x", "dt", "a", "bm", "cm"}
    per_seq_bytes = inputs.steps * inputs.num_heads * triton.cdiv(inputs.rows, kw["block_p"]) * 4 * 4
    for b0, b1 in batch_slices(inputs.batch, per_seq_bytes, metric_budget):
        args = [t[b0:b1] if name in per_sequence else t for name, t in shared.items()]
        tab = None
        if tables is not None:
            tab = type(tables)(*(getattr(tables, f)[b0:b1] for f in tables.__dataclass_fields__))
        m = mamba2_engine_launch(
            *args, None if s0 is None else s0[b0:b1], write8[b0:b1], tab, batch_offset=b0,
            a_engine=None if a_engine is None else a_engine[b0:b1],
            slot_s0=None if slot_s0 is None else slot_s0[b0:b1].contiguous(), **kw,
        )  # fmt: skip
        yield index, b0, m.sum(3)


def engine_probe(inputs, variant):
    """One engine-profile variant over the whole batch with the probe on (`mamba2_engine_launch`).

    Returns (metrics [T, B, H, 4] fp32, fingerprints int64 [T, B, H, 3] of the metric state, the checkpoint
    codes and the decode scales (`engines.twin.fingerprint`), outputs fp32 [T, B, H, P]), on the inputs'
    device. For checking the twin against the torch profile (`lab.engines.twin`); not for analyses.
    """
    write8, tables, a_engine, kw = _launch_plan(inputs, variant)
    bsz, steps, heads, rows = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows
    npb = triton.cdiv(rows, kw["block_p"])
    fps = torch.zeros(steps, bsz, heads, npb, 3, dtype=torch.int64, device=inputs.device)
    ys = torch.full((steps, bsz, heads, rows), float("nan"), device=inputs.device)
    s0 = None if inputs.initial_state is None else inputs.initial_state.float().contiguous()
    stored = stored_initial_states(inputs, [variant])
    m = mamba2_engine_launch(
        inputs.x.contiguous(), inputs.dt.float().contiguous(), mamba2_decays(inputs).contiguous(),
        inputs.B.contiguous(), inputs.C.contiguous(), inputs.D.float().contiguous(), s0, write8, tables,
        a_engine=a_engine, probe=(fps, ys), slot_s0=None if stored is None else stored[0].contiguous(), **kw,
    )  # fmt: skip
    return m.sum(3), fps.sum(3), ys
