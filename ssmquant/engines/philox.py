"""FlashInfer's stochastic-rounding stream, in torch: Philox-4x32 and the kernels' SR conversions.

Every function here is integer or exactly rounded FP32 arithmetic, so it gives the kernels' bits on any
device. Sources (flashinfer-python 0.7.2.post1, `flashinfer/data/include/flashinfer/mamba/`):

- `conversion.cuh` `philox_randint4x`: Philox-4x32 with key (seed low, seed high) and counter
  (offset low, offset high, 0, 0); the same stream as Triton's `tl.randint4x(seed, offset)`.
- `conversion.cuh` `cvt_rs_sat_s8x4_f32` (int8), `cvt_rs_e4m3_sw` (fp8 e4m3, the software path that
  compiles on Hopper; sm_100a+ uses the `cvt.rs` instruction, verified equal by FlashInfer),
  `cvt_rs_f16_sw` (fp16).
- `kernel_checkpointing_ssu_8bit.cuh` `encode_state_replay_8bit`: which random word and which 16-bit
  chunk each int8 / fp8 state element of `checkpointing_ssu` uses (`checkpoint_8bit_words`).
- `kernel_selective_state_update_stp.cuh` (simple algorithm): the word of each fp16 state element of
  `selective_state_update` (`ssu_fp16_words`).

Random words are uint32 values held in int64 tensors.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_ROUNDS = 10  # FlashInfer's default `philox_rounds`


def engine_seed(seed: int, step: int) -> int:
    """The int64 `rand_seed` of the call at 0-based `step`: `seed` in the high word, the step in the low.

    Engines pass one seed tensor per call and choose its schedule themselves (a constant seed would reuse
    each element's random word at every write); the oracle and the flashinfer profile use this one.
    """
    return ((seed & 0x7FFFFFFF) << 32) | (step & 0xFFFFFFFF)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product a * b (a: uint32 constant, b: uint32 in int64).

    The product of two uint32 values needs 64 unsigned bits; torch's int64 multiply keeps its low 64 bits (two's
    complement wrap-around), which are the same bit pattern, so the halves are two masks and a shift of it (the
    arithmetic shift's sign bits are masked off). Half the work of splitting b into 16-bit halves; the Philox
    tests hold the words to the engines' known answers."""
    p = b * a
    return (p >> 32) & MASK32, p & MASK32


def philox4x32(seed: int, offset: torch.Tensor, rounds: int = PHILOX_ROUNDS) -> torch.Tensor:
    """Four uint32 words per offset: int64 [..., 4] (FlashInfer `philox_randint4x`, Triton `randint4x`).

    seed: the int64 `rand_seed` (its two 32-bit halves are the key); offset: int64 tensor of counters.
    """
    s = seed & 0xFFFFFFFFFFFFFFFF
    k0, k1 = s & MASK32, s >> 32
    off = offset.to(torch.int64)
    c0 = off & MASK32
    c1 = (off >> 32) & MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & MASK32, (k1 + _KEY_B) & MASK32
    return torch.stack([c0, c1, c2, c3], -1)


def bitrev16(x: torch.Tensor) -> torch.Tensor:
    """Reverse the low 16 bits (`__brev(x) >> 16`)."""
    out = torch.zeros_like(x)
    for i in range(16):
        out |= ((x >> i) & 1) << (15 - i)
    return out


# --- element -> random word maps ----------------------------------------------------------------------


def checkpoint_8bit_words(
    seed: int, shape: tuple[int, ...], rounds: int, device=None, first_slot: int = 0
) -> torch.Tensor:
    """The 16-bit SR chunk of every element of an int8 / fp8 `checkpointing_ssu` state write.

    shape: [cache_slots, H, P, N] with P == 64, N == 128 (the kernel's only 8-bit shape). Per 64-row head
    tile, warp w owns rows 16w..16w+15; lane l holds rows r_lo = 16w + l // 4 and r_lo + 8, columns
    c0 = 8n + 2 (l % 4) and c0 + 1 of pass n. One Philox call at pass n = 4m (offset = element index of
    (r_lo, 32m + 2 (l % 4)) in the cache) feeds passes 4m..4m+3 (word n % 4); the low 16 bits go to row
    r_lo, the high 16 to r_lo + 8; column c0 takes the chunk, c0 + 1 its bit reversal.
    The offset counts from the start of the whole cache (`state_ptr_offset = cache_slot * state_stride_seq
    + head * DIM * DSTATE`, kernel_checkpointing_ssu_8bit.cuh), so the words of cache slot s are those of
    `first_slot=s`; shape[0] slots are taken from first_slot on. Returns int64 [*shape] in [0, 2^16).
    """
    slots, heads, p, n = shape
    r = torch.arange(p, device=device)
    c = torch.arange(n, device=device)
    hi_row = (r % 16) >= 8  # [P]
    r_lo = r - 8 * hi_row.long()
    m, k = c // 32, (c // 8) % 4
    pair_col = 32 * m + 2 * ((c % 8) // 2)  # [N]
    base = ((torch.arange(slots * heads, device=device) + first_slot * heads) * (p * n)).reshape(slots, heads, 1, 1)
    offset = base + (r_lo * n)[:, None] + pair_col[None, :]
    words = philox4x32(seed, offset, rounds)  # [..., P, N, 4]
    word = torch.gather(words, -1, k.expand(slots, heads, p, n)[..., None])[..., 0]
    chunk = torch.where(hi_row[:, None], word >> 16, word & 0xFFFF)
    return torch.where((c % 2 == 1)[None, :], bitrev16(chunk), chunk)


def ssu_fp16_words(seed: int, shape: tuple[int, ...], rounds: int, device=None, load_count: int = 8) -> torch.Tensor:
    """The random word of every element of an fp16 `selective_state_update` state write (simple kernel).

    shape: [cache_slots, H, P, N]. Element (d, c) of a head uses word c % 4 of the Philox call at offset
    (head base + d * N + c - c % 4) when each lane loads `load_count` >= 4 elements (16-byte loads of
    fp16: 8). Returns int64 [*shape] (uint32 words; the conversion uses the low 13 bits).
    """
    if load_count < 4 or load_count % 4:
        raise ValueError(f"load_count must be a multiple of 4, got {load_count}")
    slots, heads, p, n = shape
    c = torch.arange(n, device=device)
    base = (torch.arange(slots * heads, device=device) * (p * n)).reshape(slots, heads, 1, 1)
    offset = base + (torch.arange(p, device=device) * n)[:, None] + (c - c % 4)[None, :]
    words = philox4x32(seed, offset, rounds)
    return torch.gather(words, -1, (c % 4).expand(slots, heads, p, n)[..., None])[..., 0]


# --- the kernels' SR conversions ----------------------------------------------------------------------


def sr_int8(v: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """`cvt_rs_sat_s8x4_f32`: clamp(floor(v + chunk / 2^16), -127, 127), as FP32 (v: already scaled)."""
    r = chunk.to(torch.float32) * (1.0 / 65536.0)
    return torch.clamp(torch.floor(v.float() + r), -127.0, 127.0)


def _f32_bits(v: torch.Tensor) -> torch.Tensor:
    return v.float().view(torch.int32).to(torch.int64) & MASK32


def sr_e4m3(v: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """`cvt_rs_e4m3_sw` (satfinite): the E4M3 value, as FP32, of v with 16 random bits `chunk`.

    The random bits sit at the top of the discarded mantissa (20 bits dropped in the normal range) and
    the sum is truncated; finite inputs only (the emulation never stores NaN/Inf).
    """
    bits = _f32_bits(v)
    sign = bits >> 31
    exp = (bits >> 23) & 0xFF
    mant24 = 0x800000 | (bits & 0x7FFFFF)
    unbiased = exp - 127
    normal = unbiased >= -6
    shift = torch.where(normal, torch.full_like(exp, 20), 14 - unbiased)
    rand = chunk & 0xFFFF
    contrib = torch.where(shift - 16 < 56, rand << (shift - 16).clamp(0, 55), torch.zeros_like(rand))
    total = mant24 + contrib
    ip = torch.where(shift >= 64, torch.zeros_like(total), total >> shift.clamp(max=63))
    # normal start: int_part in [8, 16]; 16 moves to the next binade
    e_n = unbiased + 7 + (ip >= 16).long()
    ip_n = torch.where(ip >= 16, ip >> 1, ip)
    # subnormal start: int_part in [0, 9]; 8 and 9 are the smallest normal binade
    e_s = torch.where(ip >= 8, torch.ones_like(ip), torch.zeros_like(ip))
    e = torch.where(normal, e_n, e_s)
    frac = torch.where(normal, ip_n, ip) & 0x7
    sat = (e > 15) | ((e == 15) & (frac == 7))
    # value: e == 0 -> frac * 2^-9; else (8 + frac) * 2^(e - 10)
    mag = torch.where(e == 0, frac.float() * 2.0**-9, (8 + frac).float() * torch.exp2((e - 10).float()))
    mag = torch.where(sat, torch.full_like(mag, 448.0), mag)
    mag = torch.where(exp == 0, torch.zeros_like(mag), mag)
    return torch.where(sign == 1, -mag, mag)


def sr_fp16(v: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """`cvt_rs_f16_sw`: add the low 13 bits of `word` below the fp16 mantissa and truncate, as FP32.

    Magnitudes below 2^-14 (fp16 subnormals) become zero and those at or above 2^16 infinity, as in
    the kernel's software path.
    """
    bits = _f32_bits(v)
    sign = bits >> 31
    a = (bits & 0x7FFFFFFF) + (word & 0x1FFF)
    exp = (a >> 23) & 0xFF
    kept = (a >> 13) << 13  # truncate to the fp16 mantissa
    out = kept.to(torch.int32).view(torch.float32)
    out = torch.where(exp > 142, torch.full_like(out, float("inf")), out)
    out = torch.where(exp < 113, torch.zeros_like(out), out)
    return torch.where(sign == 1, -out, out)
