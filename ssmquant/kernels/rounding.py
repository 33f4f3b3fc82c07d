"""Shared @triton.jit helpers: rounding, random bits and block fake-quantization of every format.

Each helper follows its torch reference in `ssmquant.formats` operation for operation, using only
operations that are exact in FP32 or integer arithmetic (bit masks, power-of-two scaling, the 2^23
round-to-nearest trick, correctly rounded `div_rn`), so that the GPU and Triton's CPU interpreter give
the same bits as torch. Native float8 casts are not used: the interpreter's are wrong (ARCHITECTURE.md, "Testing").

Format codes (constexpr FMT): see `FORMAT_CODES`.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..formats import Encoding

# constexpr codes of the element encodings, read from each encoding's object (`formats.encodings`); the @triton.jit
# code below branches on these values (FMT == 3: fp8_e4m3, ...), which tests/kernels check against this table
FORMAT_CODES = {e: e.kernel_code for e in Encoding}
FMT_FP32, FMT_BF16, FMT_FP16, FMT_FP8, FMT_INT8, FMT_NVFP4, FMT_INT16 = (
    FORMAT_CODES[e]
    for e in (Encoding.FP32, Encoding.BF16, Encoding.FP16, Encoding.FP8_E4M3, Encoding.INT8, Encoding.NVFP4, Encoding.INT16)
)

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) has no libdevice; its arithmetic is numpy's, correctly
# rounded and never fused.
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

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
    u < fraction), scale back, restore the sign bit. Saturating grids round to nearest in one addition
    and one subtraction (`rne_with_distance`, the same values in fewer instructions); non-saturating ones
    keep the steps above, which also carry an infinite |v| through.
    """
    vb = v.to(tl.uint32, bitcast=True)
    a = tl.abs(v)
    if SATURATE:
        a = tl.minimum(a, MAXV)
    if SATURATE and not SR:
        out, _ = rne_with_distance(a, MBITS, EMIN)
        return (out.to(tl.uint32, bitcast=True) | (vb & 0x80000000)).to(tl.float32, bitcast=True)
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
def group_max(m, BR: tl.constexpr, GROUP: tl.constexpr):
    """Max of each group of GROUP consecutive entries of a per-row vector m [BR], broadcast back to its rows."""
    if GROUP > 1:
        g = tl.max(tl.reshape(m, [BR // GROUP, GROUP]), axis=1)
        m = tl.reshape(tl.broadcast_to(g[:, None], [BR // GROUP, GROUP]), [BR])
    return m


@triton.jit
def group_reduce_max(a, BN: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr):
    """Max over each group of GROUP consecutive rows of a tile [BN, BR] (state_dim x rows) -> [BR]
    (broadcast back to the group's rows)."""
    return group_max(tl.max(a, axis=0), BR, GROUP)


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
    KMAJOR: tl.constexpr = False,
):
    """Store-and-reload of a state tile in format FMT: the FP32 values that come back.

    The tile is transposed, s [BN, BR]: the state dim along axis 0 and rows along axis 1, the fast
    axis, so that every per-row reduction (amax over the state dim) stays inside a thread.
    static_scale: [BR] decode scale of each row's group (STATIC only); index: [BN, BR] flat element
    indices (SR counters); key: the write's stream key. GROUP rows share one scale (GROUP divides BR;
    a whole head is GROUP = BR). Padded rows / columns must hold zeros.
    KMAJOR: the tile's axis 0 holds state column 16 i + k at position k * (BN // 16) + i (nvfp4 block i,
    element k): with the default layout each thread then holds whole 16-element blocks (mamba2.py).
    Only nvfp4 looks at the order; every other format reduces over the whole state dim.
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
    elif KMAJOR:
        return _nvfp4_tile(tl.reshape(s, [16, BN // 16, BR]), static_scale, u, bits, BN, BR, GROUP, STATIC, SR, 0)
    else:
        return _nvfp4_tile(tl.reshape(s, [BN // 16, 16, BR]), static_scale, u, bits, BN, BR, GROUP, STATIC, SR, 1)


@triton.jit
def _nvfp4_tile(
    blocks,
    static_scale,
    u,
    bits,
    BN: tl.constexpr,
    BR: tl.constexpr,
    GROUP: tl.constexpr,
    STATIC: tl.constexpr,
    SR: tl.constexpr,
    BAXIS: tl.constexpr,
):
    """`fake_quant_tile` for nvfp4 on the tile's block view, blocks [NB, 16, BR] (BAXIS = 1) or [16, NB, BR]
    (BAXIS = 0): the FP32 values that come back, [BN, BR] in the tile's order.

    Per-block and per-row values keep the block view's rank (size-1 axes: [NB, 1, BR] / [1, NB, BR], [1, 1, BR]),
    so that they stay in the tile's register layout: reduced to a rank-2 [NB, BR], the delta-rule tile (whose lanes
    split each block in two) went through shared memory and a layout of its own for the row amax and back.
    """
    bamax = tl.max(tl.abs(blocks), axis=BAXIS, keep_dims=True)  # [NB, 1, BR] / [1, NB, BR]
    if STATIC:
        s2 = tl.reshape(static_scale, [1, 1, BR])
    else:  # the row amax is the max of its blocks' (max is exact: the same bits as over the elements)
        amax = tl.max(bamax, axis=1 - BAXIS, keep_dims=True)  # [1, 1, BR]
        if GROUP > 1:
            amax = tl.reshape(group_max(tl.reshape(amax, [BR]), BR, GROUP), [1, 1, BR])
        s2 = tl.math.div_rn(amax, tl.full([1, 1, BR], 2688.0, tl.float32))
        s2 = tl.where(s2 == 0.0, 1.0, s2)
    if SR:  # the draw compares the exact quotient's fraction: only the correctly rounded one will do
        bs = tl.math.div_rn(bamax, 6.0 * s2)
        bs = tl.where(bs == 0.0, 1.0, bs)
        bs = round_e4m3(tl.minimum(tl.maximum(bs, 0.001953125), 448.0), 0.0, False)
        d = bs * s2  # [NB, 1, BR] / [1, NB, BR]
        v = tl.math.div_rn(blocks, d)
        q = tl.reshape(round_element(tl.reshape(v, [BN, BR]), u, bits, 5, SR), blocks.shape)
    else:
        q, d = nvfp4_rne_blocks(blocks, bamax, s2, BR, BAXIS)
    return tl.reshape(q * d, [BN, BR])


# The nvfp4 RNE write without one correctly rounded division per element (`nvfp4_rne_blocks`): quotients by
# reciprocals, exact unless one lands near a rounding midpoint of its grid; margins in units of the grid spacing.
# E2M1 (x / d by x * approx_reciprocal(d)): the fast and the correctly rounded quotient differ by
# < 1.5 * 2^-22 |x / d| < 2^-19.4 spacings (|x / d| < 4 spacings of its binade); the margin keeps 2^-18 from a
# midpoint (the distance itself is rounded once, by < 2^-25 spacings: still inside the margin).
_E2M1_MARGIN = tl.constexpr(0.5 - 2.0**-18)
# E4M3 block scales (bamax * RN(1 / (6 s2))): < 1.5 * 2^-23 relative, < 2^-18.4 spacings (16 spacings at most);
# `rne_signed` measures their distance in quarter spacings (compared with a quarter of the margin).
_E4M3_MARGIN = tl.constexpr(0.5 - 2.0**-17)
# s2 in [2^-116, 2^116] keeps 6 s2 and every decode scale d = bs s2 (bs in [2^-9, 448]) in [2^-125, 2^125]:
# their reciprocals are normal numbers and the error bounds above hold.
_S2_MIN = tl.constexpr(2.0**-116)
_S2_MAX = tl.constexpr(2.0**116)
# A nonzero block scale quotient below this takes the exact path (it must not flush to zero on one path only).
_TINY = tl.constexpr(2.0**-100)
# `e2m1_rne_signed` without its clamp needs |quotient| <= 7 (checked per block, on its largest quotient)
_E2M1_UNCLAMPED_MAX = tl.constexpr(7.0)


@triton.jit
def rne_with_distance(a, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """RNE of a >= 0, already clamped to the grid's max, to the float grid (MBITS, EMIN), and |a - rounded| in
    units of the grid spacing (0.5 at a midpoint): (rounded, distance), both shaped like a.

    The values of `round_to_grid(a, 0, MBITS, EMIN, ...)`: with c = 2^23 x spacing (a power of two), a + c has
    an ulp of one spacing, so the FP32 addition rounds a to the grid, half to even, and (a + c) - c is exact.
    a - rounded is exact (at most half a spacing) and scaling it by 1 / spacing is exact.
    """
    eb = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, (EMIN + 127) << 23)  # biased exponent, at least EMIN
    c = (eb + ((23 - MBITS) << 23)).to(tl.float32, bitcast=True)
    out = (a + c) - c
    inv_spacing = ((((127 + MBITS) << 23) - eb) + (127 << 23)).to(tl.float32, bitcast=True)  # int32 constants
    return out, tl.abs(a - out) * inv_spacing


@triton.jit
def rne_signed(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """RNE of signed v to the float grid (MBITS, EMIN) without its clamp, for the fast paths of
    `nvfp4_rne_blocks`: (rounded, distance), where distance is |v - rounded| in units of 2^(MBITS - 1) grid
    spacings (E2M1: spacings; E4M3: quarter spacings), and rounded is v's grid value (nearest, unclamped)
    wherever distance x 2^(MBITS - 1) is below 1/2 (the margins of `nvfp4_rne_blocks` stay 2^-18 or more
    below). A zero comes back +0 (the reference keeps the sign of -0: no metric and no nonzero value sees it);
    NaN stays NaN.

    5 instructions per element (sm_90), against 7 for `rne_with_distance` on |v| plus the sign restore, and 3
    more for its distance. With 2^E the power of two at or below m = max(|v|, 1.5 x 2^EMIN), the grid's spacing
    about v is sp = 2^(E - MBITS), and c = m 2^(23 - MBITS) (exact) lies in [2^(E + 23 - MBITS), twice that),
    whose ulp is sp. t = RN(v + c) (one FMA: m 2^(23 - MBITS) is exact) then rounds v to a multiple of sp, and
    out = t - c (FMA, exact) is it, while v + c stays in c's binade:
      - |v| < 1.5 x 2^EMIN: c = 1.5 x 2^(EMIN + 23 - MBITS), centred in its binade: always.
      - v > 0: v + c = v (1 + 2^(MBITS - 23)) leaves it only when v's mantissa is within 2^(MBITS + 1) ulps of 2
        (v within 2^(MBITS - 22) relative below 2^(E + 1)); t then rounds to 2 sp, and out is 2^(E + 1) (right)
        or 2^(E + 1) - sp (as c / sp is even or odd; a distance of almost one spacing, flagged).
      - v < 0: c - |v| = |v| (2^(23 - MBITS) - 1) drops below c's binade only when |v| is within 2^MBITS ulps
        above 2^E; t rounds to sp / 2 there, and out = -2^E, the right value.
    So out is v's nearest multiple of sp, or a value flagged by its distance; its ties may break either way (c's
    mantissa is arbitrary), but a tie has distance 1/2 spacing and is flagged. A multiple of sp within half a
    spacing of v is a grid value (the grid holds every multiple of sp in [2^E, 2^(E + 1)], and of 2^(EMIN -
    MBITS) in [0, 2^EMIN]) below the grid's top binade's end: callers bound |v| (E2M1: <= 7; E4M3: <= 448).
    v - out is exact (multiples of ulp(v), |v - out| <= sp); 2^(1 - E) comes from m's exponent bits.
    """
    m = tl.maximum(tl.abs(v), 1.5 * 2.0**EMIN)
    t = tl.fma(m, 2.0 ** (23 - MBITS), v)
    out = tl.fma(m, -(2.0 ** (23 - MBITS)), t)
    inv = ((m.to(tl.int32, bitcast=True) & 0x7F800000) ^ 0x7F800000).to(tl.float32, bitcast=True)  # 2^(1 - E)
    return out, tl.abs(v - out) * inv


@triton.jit
def e2m1_rne_signed(v, CLAMP: tl.constexpr):
    """E2M1 RNE of signed quotients v (`rne_signed`; distance in spacings), clamped to [-6, 6] first under
    CLAMP (one FMNMX); without CLAMP, |v| must be at most 7: v in (6, 7) rounds to 6 (spacing 2), as the
    reference's clamp does, and v near 7 (a midpoint of spacing 2) is flagged. With the block amax, the quotient
    and the decode, 10 instructions per element (sm_90) against 14 for `rne_with_distance` on |v|, clamped."""
    if CLAMP:
        v = tl.clamp(v, -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL)
    return rne_signed(v, 1, 0)


@triton.jit
def approx_reciprocal(d):
    """1 / d within 2 ulps for |d| in [2^-126, 2^126]: PTX rcp.approx.ftz.f32, one MUFU.RCP; in the interpreter,
    the correctly rounded 1 / d. The same bits as libdevice's fast_dividef(1, d) (div.approx.f32, within 2 ulps)
    there: on sm_90 that is the same MUFU.RCP times 1.0 behind a range test and scaling (5 instructions), which
    only act below 2^-126. Flushing subnormals changes nothing in that range (d and 1 / d are normal)."""
    if INTERPRETING:
        return 1.0 / d
    else:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def nvfp4_rne_blocks(blocks, bamax, s2, BR: tl.constexpr, BAXIS: tl.constexpr):
    """NVFP4 RNE encode of 16-element blocks, as `formats.codec.encode`: (E2M1 values q shaped like blocks,
    decode scales d [NB, 1, BR] / [1, NB, BR]) of blocks [NB, 16, BR] (BAXIS = 1) or [16, NB, BR] (BAXIS = 0, the
    elements of a block along axis 0), with block amax bamax shaped like d and second-level scales s2 [1, 1, BR].

    The reference divides every block amax by 6 s2 and every element by its block's d, correctly rounded.
    Here one correctly rounded reciprocal per row and one approximate reciprocal per block replace those
    divisions, and the quotients are rounded with their distance to the nearest rounding midpoint. The two
    quotients (fast and correctly rounded) round alike unless a midpoint lies between them, which the margins
    above exclude. Where any quotient of the tile comes within its margin of a midpoint (about one tile write
    in 10^3 on Gaussian-like states), or a scale leaves the range where the bounds hold, the tile takes the
    reference's divisions. Elements are rounded signed and unclamped (`e2m1_rne_signed`) unless a block's
    largest quotient exceeds 7 (a static scale below the state's range, or a block scale in E4M3's subnormal
    range rounded far down: the tile then clamps). Largest quotient: RN(bamax * rcp) bounds every RN(x * rcp)
    of its block (rounding is monotonic). A NaN element comes back NaN.
    """
    den = 6.0 * s2  # [1, 1, BR]
    r6 = tl.math.div_rn(tl.full([1, 1, BR], 1.0, tl.float32), den)
    q6 = bamax * r6  # ~ div_rn(bamax, den)
    bs = tl.minimum(tl.maximum(tl.where(q6 == 0.0, 1.0, q6), 0.001953125), 448.0)
    bs, bs_dist = rne_signed(bs, 3, -6)  # bs_dist in quarter spacings
    d = bs * s2
    rcp = approx_reciprocal(d)
    v = blocks * rcp
    if tl.max(tl.max(tl.max((bamax * rcp > _E2M1_UNCLAMPED_MAX).to(tl.int32), axis=0), axis=0), axis=0) != 0:
        q, dist = e2m1_rne_signed(v, True)
    else:
        q, dist = e2m1_rne_signed(v, False)
    # one test per row, then per tile; axis 0 first: inside each thread in both block views
    blk_bad = (bs_dist > 0.25 * _E4M3_MARGIN) | ((bamax > 0.0) & (q6 < _TINY))
    row_bad = tl.max(tl.max(blk_bad.to(tl.int32), axis=0, keep_dims=True), axis=1, keep_dims=True) != 0
    row_bad = row_bad | ~((s2 >= _S2_MIN) & (s2 <= _S2_MAX))  # also NaN
    row_bad = row_bad | (tl.max(tl.max(dist, axis=0, keep_dims=True), axis=1, keep_dims=True) > _E2M1_MARGIN)
    if tl.max(tl.max(tl.max(row_bad.to(tl.int32), axis=0), axis=0), axis=0) != 0:
        bs = tl.math.div_rn(bamax, den)
        bs = tl.where(bs == 0.0, 1.0, bs)
        bs = round_e4m3(tl.minimum(tl.maximum(bs, 0.001953125), 448.0), 0.0, False)
        d = bs * s2
        q = round_to_grid(tl.math.div_rn(blocks, d), 0.0, 1, 0, 6.0, True, False)
    return q, d
