"""Shared @triton.jit helpers: rounding, random bits and block fake-quantization of every format.

Each helper follows its torch reference in `ssmquant.formats` operation for operation, using only
operations that are exact in FP32 or integer arithmetic (bit masks, power-of-two scaling, the 2^23
round-to-nearest trick, correctly rounded `div_rn`), so that the GPU and Triton's CPU interpreter give
the same bits as torch. Native float8 casts are not used: the interpreter's are wrong (DESIGN.md §5).

Format codes (constexpr FMT): see `FORMAT_CODES`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import Encoding

# constexpr codes of the element encodings
FMT_FP32, FMT_BF16, FMT_FP16, FMT_FP8, FMT_INT8, FMT_NVFP4, FMT_INT16 = 0, 1, 2, 3, 4, 5, 6
FORMAT_CODES = {
    Encoding.FP32: FMT_FP32,
    Encoding.BF16: FMT_BF16,
    Encoding.FP16: FMT_FP16,
    Encoding.FP8_E4M3: FMT_FP8,
    Encoding.INT8: FMT_INT8,
    Encoding.NVFP4: FMT_NVFP4,
    Encoding.INT16: FMT_INT16,
}

# random-bit mixer constants (see ssmquant.formats.random)
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x1B873593
_STREAM_SALT = 0x3C6EF372


@triton.jit
def mix32(x):
    """The 32-bit avalanche mix of `ssmquant.formats.random.mix32` on uint32 values (wrapping)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x1B873593
    return x ^ (x >> 16)


@triton.jit
def stream_key(seed, stream):
    """Key of one (seed, stream) pair, as `formats.random.stream_key` (uint32 scalars)."""
    s = tl.cast(stream, tl.uint32) + 0x3C6EF372
    return mix32(tl.cast(seed, tl.uint32) ^ mix32(s))


@triton.jit
def keyed_bits(key, index):
    """32 random bits per element from a stream key and flat element indices (uint32)."""
    return mix32(mix32(index.to(tl.uint32) ^ key) + key)


@triton.jit
def uniform_from_bits(bits):
    """Top 24 bits -> FP32 uniform in [0, 1), exactly k * 2^-24."""
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def round_to_grid(
    v, u, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr, SATURATE: tl.constexpr, SR: tl.constexpr
):
    """Round FP32 values to a sign-magnitude float grid (E4M3, E2M1, FP16, the INT8 / INT16 grids), exactly.

    Mirrors `ssmquant.formats.grids.round_to_grid`: clamp |v| (saturating grids), spacing
    2^(max(e, EMIN) - MBITS), round |v| / spacing to an integer (RNE via the 2^23 trick, or up iff
    u < fraction), scale back, restore the sign bit.
    """
    vb = v.to(tl.uint32, bitcast=True)
    a = tl.abs(v)
    if SATURATE:
        a = tl.minimum(a, MAXV)
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.maximum(e, EMIN)
    spacing = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    inv_spacing = ((MBITS - e + 127) << 23).to(tl.float32, bitcast=True)
    r = a * inv_spacing  # exact, 0 <= r < 2^(MBITS + 1)
    n = (r + 8388608.0) - 8388608.0  # round half to even (r < 2^22)
    if SR:
        fl = n - tl.where(n > r, 1.0, 0.0)  # floor(r)
        n = fl + tl.where(u < r - fl, 1.0, 0.0)
    out = n * spacing
    if not SATURATE:
        out = tl.where(out > MAXV, float("inf"), out)
    return (out.to(tl.uint32, bitcast=True) | (vb & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(v, bits, SR: tl.constexpr):
    """FP32 -> BF16 value (as FP32) on the bit pattern, as `formats.grids.round_to_bf16`."""
    b = v.to(tl.uint32, bitcast=True)
    if SR:
        add = bits & 0xFFFF
    else:
        add = 0x7FFF + ((b >> 16) & 1)
    return (((b + add) >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(v, u, SR: tl.constexpr):
    return round_to_grid(v, u, 3, -6, 448.0, True, SR)


@triton.jit
def round_element(v, u, bits, FMT: tl.constexpr, SR: tl.constexpr):
    """Round elements already divided by their scale to the element grid of FMT."""
    if FMT == 1:
        return round_to_bf16(v, bits, SR)
    elif FMT == 2:
        return round_to_grid(v, u, 10, -14, 65504.0, False, SR)
    elif FMT == 3:
        return round_to_grid(v, u, 3, -6, 448.0, True, SR)
    elif FMT == 4:
        return round_to_grid(v, u, 7, 7, 127.0, True, SR)
    elif FMT == 5:
        return round_to_grid(v, u, 1, 0, 6.0, True, SR)
    elif FMT == 6:
        return round_to_grid(v, u, 15, 15, 32767.0, True, SR)
    else:
        return v


@triton.jit
def group_reduce_max(a, BN: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr):
    """Max over each group of GROUP consecutive rows of a tile [BN, BR] (state_dim x rows) -> [BR]
    (broadcast back to the group's rows)."""
    m = tl.max(a, axis=0)  # [BR]
    if GROUP > 1:
        g = tl.max(tl.reshape(m, [BR // GROUP, GROUP]), axis=1)
        m = tl.reshape(tl.broadcast_to(g[:, None], [BR // GROUP, GROUP]), [BR])
    return m


@triton.jit
def fake_quant_tile(
    s,
    static_scale,
    index,
    key,
    BN: tl.constexpr,
    BR: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    STATIC: tl.constexpr,
    SR: tl.constexpr,
):
    """Store-and-reload of a state tile in format FMT: the FP32 values that come back.

    The tile is transposed, s [BN, BR]: the state dim along axis 0 and rows along axis 1, the fast
    axis, so that every per-row reduction (amax over the state dim) stays inside a thread.
    static_scale: [BR] decode scale of each row's group (STATIC only); index: [BN, BR] flat element
    indices (SR counters); key: the write's stream key. GROUP rows share one scale (GROUP divides BR;
    a whole head is GROUP = BR). Padded rows / columns must hold zeros.
    """
    if FMT == 0:
        return s
    u = 0.0
    bits = 0
    if SR:
        bits = keyed_bits(key, index)
        u = uniform_from_bits(bits)
    if FMT == 1 or FMT == 2:
        return round_element(s, u, bits, FMT, SR)
    elif FMT == 3 or FMT == 4 or FMT == 6:
        if STATIC:
            dec = static_scale
            mult = tl.math.div_rn(tl.full([BR], 1.0, tl.float32), dec)
        else:
            amax = group_reduce_max(tl.abs(s), BN, BR, GROUP)
            if FMT == 3:
                max_code = tl.full([BR], 448.0, tl.float32)
            elif FMT == 4:
                max_code = tl.full([BR], 127.0, tl.float32)
            else:
                max_code = tl.full([BR], 32767.0, tl.float32)
            mult = tl.math.div_rn(max_code, tl.where(amax == 0.0, 1.0, amax))
            # amax 0, or so small that the multiplier overflows: 1, as formats.codec.scales_from_amax
            mult = tl.where((amax == 0.0) | (mult > 3.4028234663852886e38), 1.0, mult)
            dec = tl.math.div_rn(tl.full([BR], 1.0, tl.float32), mult)
        q = round_element(s * mult[None, :], u, bits, FMT, SR)
        return q * dec[None, :]
    else:
        if STATIC:
            s2 = static_scale
        else:
            amax = group_reduce_max(tl.abs(s), BN, BR, GROUP)
            s2 = tl.math.div_rn(amax, tl.full([BR], 2688.0, tl.float32))
            s2 = tl.where(s2 == 0.0, 1.0, s2)
        blocks = tl.reshape(s, [BN // 16, 16, BR])
        bamax = tl.max(tl.abs(blocks), axis=1)  # [BN // 16, BR]
        bs = tl.math.div_rn(bamax, 6.0 * s2[None, :])
        bs = tl.where(bs == 0.0, 1.0, bs)
        bs = tl.minimum(tl.maximum(bs, 0.001953125), 448.0)
        bs = round_e4m3(bs, 0.0, False)
        d = bs * s2[None, :]  # [BN // 16, BR]
        if SR:  # the draw compares the exact quotient's fraction: only the correctly rounded one will do
            v = tl.math.div_rn(blocks, d[:, None, :])
            q = round_element(tl.reshape(v, [BN, BR]), u, bits, 5, SR)
        else:
            q = e2m1_quotient_rne(blocks, d, BN, BR)
        return tl.reshape(tl.reshape(q, [BN // 16, 16, BR]) * d[:, None, :], [BN, BR])


# Margin (in units of the E2M1 spacing) that a fast quotient must keep from every rounding midpoint; see
# `e2m1_quotient_rne`. The fast and the correctly rounded quotient differ by < 2^-20 spacings.
_E2M1_MARGIN = tl.constexpr(0.5 - 2.0**-18)
_FP32_MIN_NORMAL = tl.constexpr(2.0**-126)


@triton.jit
def e2m1_rne_with_distance(v):
    """round_to_grid(v, 0, 1, 0, 6.0, SATURATE, RNE) op for op (the E2M1 grid), and |r - round(r)| for r = |v|
    in units of the grid spacing (0.5 at a midpoint): (rounded, distance), both shaped like v."""
    vb = v.to(tl.uint32, bitcast=True)
    a = tl.minimum(tl.abs(v), 6.0)
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.maximum(e, 0)
    spacing = ((e - 1 + 127) << 23).to(tl.float32, bitcast=True)
    inv_spacing = ((1 - e + 127) << 23).to(tl.float32, bitcast=True)
    r = a * inv_spacing
    n = (r + 8388608.0) - 8388608.0
    out = (n * spacing).to(tl.uint32, bitcast=True) | (vb & 0x80000000)
    return out.to(tl.float32, bitcast=True), tl.abs(r - n)


@triton.jit
def e2m1_quotient_rne(blocks, d, BN: tl.constexpr, BR: tl.constexpr):
    """E2M1 RNE codes (as FP32) of div_rn(blocks, d): blocks [BN // 16, 16, BR], d [BN // 16, BR] -> [BN, BR].

    Bit-exact without one correctly rounded division per element: v = x * div_rn(1, d) (one division per
    16-element block) is within 2^-22.9 |x / d| of x / d, and div_rn(x, d) within 2^-24 |x / d|; both
    have the same E2M1 rounding unless a midpoint (0.25, 0.75, ..., 5) lies between them, i.e. unless
    v lies within 2^-20 spacings of one (the spacing is >= |v| / 4). Where any element of the tile comes
    within 2^-18 spacings of a midpoint, or 1 / d is not a normal FP32 number, the tile takes the exact
    division (about one tile write in 10^3 on Gaussian-like states). A NaN or infinite element (a state
    that diverged) gives the same code either way: both quotients are NaN, or both overflow or saturate.
    """
    r = tl.math.div_rn(tl.full([BN // 16, BR], 1.0, tl.float32), d)
    q, dist = e2m1_rne_with_distance(tl.reshape(blocks * r[:, None, :], [BN, BR]))
    r_bad = tl.where((r >= _FP32_MIN_NORMAL) & (r < float("inf")), 0, 1)  # also NaN
    near = tl.where(tl.max(tl.reshape(dist, [BN * BR]), axis=0) > _E2M1_MARGIN, 1, 0)
    if near + tl.max(tl.reshape(r_bad, [(BN // 16) * BR]), axis=0) != 0:
        v = tl.math.div_rn(blocks, d[:, None, :])
        q = round_to_grid(tl.reshape(v, [BN, BR]), 0.0, 1, 0, 6.0, True, False)
    return q
