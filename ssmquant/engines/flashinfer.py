"""FlashInfer's Mamba-2 decode kernels, re-computed in torch one call at a time.

The arithmetic of flashinfer-python 0.7.2.post1 (`flashinfer/data/include/flashinfer/mamba/`), read
from the sources and written out as plain FP32 torch:

`checkpointing_ssu` (ReplaySSM: a checkpoint plus a ring of the last inputs; `kernel_checkpointing_ssu*.cuh`)
  - Scans are Hillis-Steele over the warp: new tokens `cumAdt = scan(A * dt)`, ring tokens
    `old_cumAdt = A * scan(old_dt)` (`compute_cumAdt`, `load_old_dt_cumAdt`); decays `exp` of them.
  - A call flushes when `prev_k + T > max_window` (ring length = max_window + T): the checkpoint is
    replayed over the `prev_k` ring tokens and rewritten; the call's T tokens join the ring either way.
  - Replay, 8-bit state (int8 / fp8_e4m3; `replay_state_mma_8bit_chain`): `S = fma(code, RN(decode_scale *
    total_decay), hmma(bf16(x_j * c_j), B_j))` with `c_j = __expf(total - old_cumAdt_j) * old_dt_j`: one
    tensor-core MMA from a zero accumulator (`hmma`), then one FFMA. Per row: encode = rcp(amax) * QMAX (1
    when amax == 0), stored decode scale = rcp(encode) (`encode_rows_fast`), codes = `cvt.rni.sat.s8` /
    `cvt.rn.satfinite.e4m3` of S * encode, or stochastic (`philox.py`).
  - Replay, 16/32-bit state (`replay_state_mma`): `S = hmma(x_j, bf16(B_j * c_j), acc = RN(state * total_decay))`,
    stored in the state dtype to nearest.
  - Output of a flushing call: `exp(cumAdt_t) * (bf16(S) . C_t) + sum_j CB_scaled[t, j] x_j + D x_t`,
    where S is the replayed FP32 state (8-bit: before encoding; 16/32-bit: as stored) and
    `CB_scaled[t, j] = bf16((C_t . B_j) * exp(cumAdt_t - cumAdt_j) * dt_j)` for j <= t.
  - Every `exp` above is `__expf` (`fast_expf`).
  - Output of a call without flush: `exp(total) * exp(cumAdt_t) * (C_t . S0) + CB_scaled x + CB_old x_old
    + D x_t` with `CB_old[t, i] = bf16((C_t . B_i) * exp(cumAdt_t + total - old_cumAdt_i) * old_dt_i)`;
    8-bit: `C_t . S0 = decode_scale * (C_t . code)` (codes are exact in bf16); 16/32-bit: `C_t . bf16(S0)`.
  - Outputs are stored in the input dtype (bf16).

`selective_state_update` (conventional decode; `kernel_selective_state_update_stp.cuh`, simple kernel)
  - `S = fma(S, __expf(A dt), (B dt) x)`; `y = D x + sum_n S_new C`; S stored in its dtype (fp16 stochastic
    when a seed is given; scaled int16: per row encode = rcp(amax) * 32767, codes `__float2int_rn` of the
    value clamped to +-32767). y comes from the unrounded new state.

What the compiled kernel computes (FlashInfer builds with `-use_fast_math`; the SASS of the ahead-of-time
int8 max_window=16 module, `cuobjdump -sass`), modelled here and fitted on a dump of the real kernel
(`fit.py`, FP32 states of the 16/32-bit replay matched bit for bit once `__expf` is right):
  - every `exp` is `__expf(v)` = ex2.approx.ftz.f32(RN(v * log2e)) (`fast_expf`);
  - the replay is one `HMMA.16816.F32.BF16` (m16n8k8 when max_window <= 8): products exact, aligned to the
    largest exponent among them and the accumulator (a product's exponent taken as the sum of its
    factors' exponents), each truncated toward zero 25 bits below it, summed exactly, the sum truncated to
    FP32 (`hmma`); the 8-bit state term is then one `FFMA(code, decode_scale * total_decay, mma)`;
  - encode = rcp.approx(amax) * QMAX, stored decode scale = rcp.approx(encode) (`MUFU.RCP`);
  - MUFU.EX2 and MUFU.RCP are sm_90's own functions, tabulated there and shipped as a compact exact model
    (`mufu.ex2_sm90`, `mufu.rcp_sm90`: 0.26 MB; RCP = RN(1/m) + a 2-bit correction per significand, EX2 =
    argument truncated to 2^-23, then a 2-bit correction to RN(2^x) per fraction).
With all of it, every decode scale and FP32 replayed state word of the H200 dump is reproduced bit for bit
(`fit.py`; the earlier models, 2^x toward zero and RN(1/x), `ex2_rz` / `rcp_rn`, left 29-33% of the scales
and 12% of the FP32 words an ulp or a few off). The output path's bf16 reductions are not modelled
separately; the outputs of the test slice's calls are all bit-identical.
"""

from __future__ import annotations

import torch

from ..errors import SsmquantError
from ..formats import E4M3, INT8, round_to_grid
from ..formats.codec import ieee_div
from . import mufu, philox

# Engine constraints, quoted from the sources (checked by `check_checkpointing_call`).
CKPT_8BIT_SHAPE = (64, 128)  # kernel_checkpointing_ssu_8bit.cuh: "int8 chain kernel requires DIM == 64", DSTATE 128
MAX_WINDOW = 16  # checkpointing_ssu.py: "checkpointing_ssu supports at most 16 cache tokens (max_window)"
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.int16: 32767.0}
EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)
WIDE = (torch.float32, torch.bfloat16, torch.float16)


class EngineConstraintError(SsmquantError, ValueError):
    """A call or layer the engine kernel cannot run (its own constraint is quoted)."""


def bf16(t: torch.Tensor) -> torch.Tensor:
    """Round FP32 to bf16 (RNE, as `cvt.rn.bf16x2.f32`) and back to FP32."""
    return t.to(torch.bfloat16).float()


LOG2E_F32 = 1.4426950408889634  # rounds to 0x3FB8AA3B, the FMUL constant of `__expf` in the SASS


def ex2_rz(v: torch.Tensor) -> torch.Tensor:
    """The earlier model of MUFU.EX2 (kept to measure against): 2^v rounded toward zero, below 2^-126 flushed.

    It agrees with the hardware on 74 of the dump's 96 decay arguments; `ex2_approx` on all of them.
    """
    e = torch.exp2(v.double())
    f = e.float()
    f = torch.where(f.double() > e, torch.nextafter(f, torch.zeros_like(f)), f)
    return torch.where(f < 2.0**-126, 0.0, f)


def ex2_approx(v: torch.Tensor) -> torch.Tensor:
    """ex2.approx.ftz.f32 (MUFU.EX2) on FP32 v, bit for bit as sm_90 computes it (`mufu.ex2_sm90`)."""
    return mufu.ex2_sm90(v)


def fast_expf(v: torch.Tensor) -> torch.Tensor:
    """`__expf(v)` as nvcc compiles it: ex2.approx.ftz.f32(RN(v * log2e)), FP32 in and out."""
    return ex2_approx(v.float() * LOG2E_F32)


def rcp_rn(x: torch.Tensor) -> torch.Tensor:
    """The earlier model of MUFU.RCP (kept to measure against): the correctly rounded FP32 reciprocal."""
    return ieee_div(1.0, x)


def rcp_approx(x: torch.Tensor) -> torch.Tensor:
    """rcp.approx.ftz.f32 (MUFU.RCP) on FP32 x, bit for bit as sm_90 computes it (`mufu.rcp_sm90`)."""
    return mufu.rcp_sm90(x)


def _exponent(v: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of FP32 v as int32 (zero: -1000, excluded from the alignment)."""
    e = ((v.view(torch.int32) >> 23) & 0xFF) - 127
    return torch.where(v == 0, -1000, e)


def _rz_from_f64(s: torch.Tensor) -> torch.Tensor:
    """FP64 -> FP32 rounded toward zero."""
    f = s.float()
    return torch.where(f.double().abs() > s.abs(), (f.view(torch.int32) - 1).view(torch.float32), f)


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2^e as FP64 from the exponent bits, for integer e (clamped to the normal range [-1022, 1023]).

    Exact on every device by construction; `torch.ldexp` is `x * pow(2, e)`, a libm / libdevice power whose
    exactness for integer e no specification promises. `hmma` only meets e < -1022 when every product and
    the accumulator are zero, where any non-zero quantum gives the same (zero) sum.
    """
    return ((e.long().clamp(-1022, 1023) + 1023) << 52).view(torch.float64)


HMMA_EXTRA_BITS = 2  # alignment width 24 + 2 bits: fitted on the dump's FP32 flushes (1 / 3 bits: 70% / 86%, 2: 100%)


def hmma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor-core MMA `c + a @ b` as sm_90 computes it for bf16 operands and FP32 accumulation.

    a [..., P, K] and b [..., K, N] hold bf16 values (as FP32), c [..., P, N] FP32 or None (a zero
    accumulator). Each product a_k b_k is exact; its exponent is taken as e(a_k) + e(b_k). All products
    and c are aligned to the largest exponent E among them, truncated toward zero to multiples of
    2^(E - 23 - HMMA_EXTRA_BITS), summed exactly, and the sum is truncated to FP32. Returns [..., P, N] FP32.
    """
    big = torch.tensor(-1000, dtype=torch.int32, device=a.device)
    ea, eb = _exponent(a), _exponent(b)
    emax = None if c is None else _exponent(c)
    for k in range(a.shape[-1]):
        e = torch.where((ea[..., :, k, None] > big) & (eb[..., k, None, :] > big), ea[..., :, k, None] + eb[..., k, None, :], big)
        emax = e if emax is None else torch.maximum(emax, e)
    quantum = pow2_f64(emax - 23 - HMMA_EXTRA_BITS)
    acc = torch.zeros(emax.shape, dtype=torch.float64, device=a.device)
    if c is not None:
        acc = torch.trunc(c.double() / quantum) * quantum
    for k in range(a.shape[-1]):
        prod = a[..., :, k, None].double() * b[..., k, None, :].double()
        acc = acc + torch.trunc(prod / quantum) * quantum
    return _rz_from_f64(acc)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """FP32 fused multiply-add a * b + c with one rounding (through FP64, as the `vllm` profile's FMA)."""
    return (a.double() * b.double() + c.double()).float()


def hs_scan(v: torch.Tensor) -> torch.Tensor:
    """Inclusive Hillis-Steele prefix sum over the last dim (<= 16 entries), FP32, the warp-shuffle order."""
    n = v.shape[-1]
    if n > 16:
        raise ValueError(f"the kernels scan at most 16 lanes, got {n}")
    val = v.float()
    off = 1
    while off < n:
        shifted = torch.nn.functional.pad(val[..., :-off], (off, 0))
        val = torch.where(torch.arange(n, device=v.device) >= off, val + shifted, val)
        off *= 2
    return val


def dequantize_state(state: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """FP32 values of a stored state [..., P, N] (codes times the per-row decode scale [..., P])."""
    s = state.float()
    return s if scale is None else s * scale[..., None]


def encode_rows(s: torch.Tensor, dtype: torch.dtype, chunk: torch.Tensor | None = None):
    """8-bit (or int16) per-row encode of FP32 values s [..., P, N]: (codes as FP32 values, decode scale [..., P]).

    encode = QMAX / amax (1 when amax == 0), decode = 1 / encode, IEEE divisions; RNE, or the kernels'
    stochastic conversion when `chunk` (16 random bits per element) is given. (The profiles' int16 store.)
    """
    qmax = QMAX[dtype]
    amax = s.abs().amax(-1)
    zero = amax == 0
    enc = torch.where(zero, 1.0, ieee_div(qmax, torch.where(zero, 1.0, amax)))
    dec = ieee_div(1.0, enc)
    return round_codes(s * enc[..., None], dtype, chunk), dec


def encode_rows_fast(s: torch.Tensor, dtype: torch.dtype, chunk: torch.Tensor | None = None):
    """The kernels' per-row encode of s [..., P, N] (8-bit checkpoints, int16 state): (codes as FP32 values, scale [..., P]).

    encode = rcp.approx(amax) * QMAX (1 when amax == 0), decode = rcp.approx(encode) (`rcp_approx`), as
    the fast-math build compiles `QUANT_MAX / a` and `1.f / encode` (kernel_checkpointing_ssu_8bit.cuh;
    `max / new_state_max` and `1.f / encode` in kernel_selective_state_update_stp.cuh).
    """
    qmax = QMAX[dtype]
    amax = s.abs().amax(-1)
    zero = amax == 0
    enc = torch.where(zero, 1.0, rcp_approx(torch.where(zero, 1.0, amax)) * qmax)
    dec = rcp_approx(enc)
    return round_codes(s * enc[..., None], dtype, chunk), dec


def round_codes(v: torch.Tensor, dtype: torch.dtype, chunk: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled FP32 values -> code values (FP32) of an int8 / fp8_e4m3 / int16 state: RNE, or SR with `chunk`."""
    if dtype is torch.float8_e4m3fn:
        return philox.sr_e4m3(v, chunk) if chunk is not None else round_to_grid(v, E4M3)
    if dtype is torch.int8:
        return philox.sr_int8(v, chunk) if chunk is not None else round_to_grid(v, INT8)
    qmax = QMAX[dtype]  # int16: clamp to +-32767, then round to nearest even (`__float2int_rn`)
    return torch.round(torch.clamp(v, -qmax, qmax))


def store_codes(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 code values -> the stored dtype (exact)."""
    return codes.to(dtype)


def replay_8bit(codes, dec, total_decay, xs, coef, bs):
    """8-bit replay of one head group: FP32 [..., P, N].

    codes [..., P, N] FP32 code values; dec [..., P]; total_decay [...]; xs [..., K, P] ring x (bf16
    values); coef [..., K] (0 beyond prev_k); bs [..., K, N] ring B. `hmma` from a zero accumulator, then
    fma(code, RN(dec * total_decay), mma).
    """
    a = bf16(xs * coef[..., None]).transpose(-1, -2)  # [..., P, K]
    mma = hmma(a, bs)
    ts = (dec * total_decay[..., None])[..., None]
    return fma_f32(codes, ts, mma)


def replay_wide(s0, total_decay, xs, coef, bs):
    """16/32-bit replay: `hmma` of x_j and bf16(B_j * c_j) onto the accumulator RN(s0 * total_decay), FP32 [..., P, N]."""
    b = bf16(bs * coef[..., None])  # [..., K, N]
    return hmma(xs.transpose(-1, -2), b, s0 * total_decay[..., None, None])


def check_checkpointing_call(state: torch.Tensor, x_cache: torch.Tensor, x: torch.Tensor) -> None:
    """Refuse what `checkpointing_ssu` refuses, quoting its constraint."""
    p, n = state.shape[-2:]
    window = x_cache.shape[2] - x.shape[1]
    if state.dtype in EIGHT_BIT and (p, n) != CKPT_8BIT_SHAPE:
        raise EngineConstraintError(
            f"FlashInfer checkpointing_ssu 8-bit state needs head_dim 64 and d_state 128 "
            f"(\"int8 chain kernel requires DIM == 64\"), got head_dim {p}, d_state {n}"
        )
    if state.dtype not in EIGHT_BIT + WIDE:
        raise EngineConstraintError(f"checkpointing_ssu stores fp32, bf16, fp16, int8 or fp8_e4m3 state, got {state.dtype}")
    if window > MAX_WINDOW or x.shape[1] > window:
        raise EngineConstraintError(
            f"checkpointing_ssu needs npredicted ({x.shape[1]}) <= max_window ({window}) <= {MAX_WINDOW}"
        )
    if x.element_size() != 2:
        raise EngineConstraintError(f"checkpointing_ssu needs 2-byte inputs (bf16 / fp16), got {x.dtype}")


@torch.no_grad()
def checkpointing_ssu_reference(
    state: torch.Tensor,
    state_scale: torch.Tensor | None,
    x_cache: torch.Tensor,
    B_cache: torch.Tensor,
    dt_cache: torch.Tensor,
    ring_start: torch.Tensor,
    prev_num_accepted: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    *,
    rand_seed: int | None = None,
    philox_rounds: int = philox.PHILOX_ROUNDS,
) -> torch.Tensor:
    """One `checkpointing_ssu` call (batch b in cache slot b), updating the caches in place like the kernel.

    state [S, H, P, N] (int8 / float8_e4m3fn / fp32 / bf16 / fp16); state_scale [S, H, P] fp32 (8-bit);
    x_cache [S, H, R, P] and B_cache [S, G, R, N] in the input dtype; dt_cache [S, H, R] fp32; ring_start,
    prev_num_accepted [S] int32; x [Bt, T, H, P]; dt [Bt, T, H] fp32 (already softplus'ed); A, D [H] fp32;
    B, C [Bt, T, G, N]. rand_seed: stochastic rounding (fp16 and 8-bit state) with FlashInfer's stream;
    the 8-bit stream is reproduced, fp16's is not (its per-thread word reuse is not modelled).
    Returns the output [Bt, T, H, P] in x's dtype. The host's ring bookkeeping is the caller's.
    """
    check_checkpointing_call(state, x_cache, x)
    bsz, tn, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    hpg = heads // groups
    ring = x_cache.shape[2]
    window = ring - tn
    dev = x.device
    out = torch.empty_like(x)
    a_h = A.float()
    d_h = D.float()
    for b in range(bsz):
        prev_k = int(prev_num_accepted[b])
        start = int(ring_start[b])
        must = prev_k + tn > window
        rows = [(start + j) % ring for j in range(prev_k)]
        old_x = x_cache[b][:, rows].float()  # [H, k, P]
        old_b = B_cache[b][:, rows].float().repeat_interleave(hpg, 0)  # [H, k, N]
        old_dt = dt_cache[b][:, rows].float()  # [H, k]
        old_cum = a_h[:, None] * hs_scan(old_dt) if prev_k else old_dt
        total = old_cum[:, -1] if prev_k else torch.zeros(heads, device=dev)
        total_decay = fast_expf(total) if prev_k else torch.ones(heads, device=dev)
        coef = fast_expf(total[:, None] - old_cum) * old_dt  # [H, k]
        dt_b = dt[b].float().T  # [H, T]
        cum = hs_scan(a_h[:, None] * dt_b)  # [H, T]
        xb = x[b].float().permute(1, 0, 2)  # [H, T, P]
        bb = B[b].float().repeat_interleave(hpg, 1).permute(1, 0, 2)  # [H, T, N]
        cb_ = C[b].float().repeat_interleave(hpg, 1).permute(1, 0, 2)  # [H, T, N]
        cbn = torch.einsum("htn,hjn->htj", cb_, bb)
        causal = torch.tril(torch.ones(tn, tn, dtype=torch.bool, device=dev))
        cb_scaled = bf16(cbn * fast_expf(cum[:, :, None] - cum[:, None, :]) * dt_b[:, None, :])
        cb_scaled = torch.where(causal, cb_scaled, 0.0)
        y = torch.einsum("htj,hjp->htp", cb_scaled, xb)
        eight = state.dtype in EIGHT_BIT
        s_in = state[b].float()
        if must:
            if eight:
                rep = replay_8bit(s_in, state_scale[b], total_decay, old_x, coef, old_b)
                chunk = None
                if rand_seed is not None:
                    # cache slot b: the kernel's Philox offset starts at b * state_stride_seq
                    chunk = philox.checkpoint_8bit_words(rand_seed, (1, heads, p, n), philox_rounds, dev, first_slot=b)[0]
                codes, dec = encode_rows_fast(rep, state.dtype, chunk)
                state[b] = store_codes(codes, state.dtype)
                state_scale[b] = dec
                y_state = torch.einsum("hpn,htn->htp", bf16(rep), cb_)
            else:
                if rand_seed is not None:
                    raise EngineConstraintError(
                        "the fp16 stochastic stream of checkpointing_ssu (per-thread word reuse) is not reproduced"
                    )
                rep = replay_wide(s_in, total_decay, old_x, coef, old_b)
                stored = rep.to(state.dtype)
                state[b] = stored
                y_state = torch.einsum("hpn,htn->htp", bf16(stored.float()), cb_)
            y = fast_expf(cum)[:, :, None] * y_state + y
        else:
            cbo = torch.einsum("htn,hkn->htk", cb_, old_b)
            w = fast_expf(cum[:, :, None] + total[:, None, None] - old_cum[:, None, :]) * old_dt[:, None, :]
            cb_old = bf16(cbo * w)  # [H, T, k]
            fac = fast_expf(total)[:, None] * fast_expf(cum)  # [H, T]
            if eight:
                raw = torch.einsum("htn,hpn->htp", cb_, s_in)
                y_state = raw * (fac[:, :, None] * state_scale[b][:, None, :])
            else:
                y_state = torch.einsum("htn,hpn->htp", cb_, bf16(s_in)) * fac[:, :, None]
            y = y_state + y + torch.einsum("htk,hkp->htp", cb_old, old_x)
        y = y + d_h[:, None, None] * xb
        out[b] = y.permute(1, 0, 2).to(x.dtype)
        # the call's tokens join the ring after the prev_k live rows
        for i in range(tn):
            row = (start + prev_k + i) % ring
            x_cache[b, :, row] = x[b, i]
            B_cache[b, :, row] = B[b, i]
            dt_cache[b, :, row] = dt[b, i].float()
    return out


@torch.no_grad()
def selective_state_update_reference(
    state: torch.Tensor,
    state_scale: torch.Tensor | None,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    *,
    rand_seed: int | None = None,
    philox_rounds: int = philox.PHILOX_ROUNDS,
) -> torch.Tensor:
    """One single-token `selective_state_update` call (batch b in cache slot b), state updated in place.

    state [Bt, H, P, N] fp32 / bf16 / fp16 / int16 (with state_scale [Bt, H, P]); x [Bt, H, P]; dt [Bt, H]
    fp32; A, D [H]; B, C [Bt, G, N]. rand_seed: fp16 stochastic rounding with the engine's stream.
    Returns y [Bt, H, P] in x's dtype.
    """
    bsz, heads, p = x.shape
    hpg = heads // B.shape[1]
    da = fast_expf(A.float()[None, :] * dt.float())  # [Bt, H]: `__expf(A_value * dt_value)`
    bb = B.float().repeat_interleave(hpg, 1)
    cc = C.float().repeat_interleave(hpg, 1)
    s = dequantize_state(state, state_scale)
    db = bb * dt.float()[..., None]  # B * dt, then times x
    # `state_value * dA + dB * x_value`, contracted by nvcc to fma(state, dA, dB * x) (fitted on the H200 dump)
    new = fma_f32(s, da[..., None, None].expand_as(s), db[:, :, None, :] * x.float()[..., None])
    y = D.float()[None, :, None] * x.float() + (new * cc[:, :, None, :]).sum(-1)
    if state.dtype is torch.int16:
        codes, dec = encode_rows_fast(new, torch.int16)
        state.copy_(codes.to(torch.int16))
        state_scale.copy_(dec)
    elif rand_seed is not None:
        if state.dtype is not torch.float16:
            raise EngineConstraintError(
                f"selective_state_update rounds stochastically only fp16 state (\"only supports fp16 state\"), got {state.dtype}"
            )
        words = philox.ssu_fp16_words(rand_seed, tuple(state.shape), philox_rounds, state.device)
        state.copy_(philox.sr_fp16(new, words).to(torch.float16))
    else:
        state.copy_(new.to(state.dtype))
    return y.to(x.dtype)
