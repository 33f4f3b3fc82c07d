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
from ..formats.encodings import SPECS
from ..formats.grids import E2M1, E4M3, E4M3_MIN_SUBNORMAL

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) has no libdevice; its arithmetic is numpy's, correctly
# rounded and never fused.
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def constant(value):
    """A module-level constant that @triton.jit code reads: a constexpr for the compiler; the plain number under the
    interpreter, whose tl.minimum / tl.maximum return a constexpr argument unconverted."""
    return value if INTERPRETING.value else tl.constexpr(value)


# constexpr codes of the element encodings, read from each encoding's object (`formats.encodings`): a kernel takes
# one code FMT and reads the encoding's facts from it at compile time (`fmt_layout`, `fmt_mbits`, ...), so that a
# new encoding with a known layout needs no change here
FORMAT_CODES = {e: e.kernel_code for e in Encoding}
FMT_FP32, FMT_BF16, FMT_FP16, FMT_FP8, FMT_INT8, FMT_NVFP4, FMT_INT16 = (
    FORMAT_CODES[e]
    for e in (
        Encoding.FP32,
        Encoding.BF16,
        Encoding.FP16,
        Encoding.FP8_E4M3,
        Encoding.INT8,
        Encoding.NVFP4,
        Encoding.INT16,
    )
)
_SPEC_OF_CODE = {spec.kernel_code: spec for spec in SPECS.values()}
assert len(_SPEC_OF_CODE) == len(SPECS), "two encodings share a kernel code"

# How an encoding stores its elements, as the kernels branch on it (``fmt_layout``): kept as is (fp32), rounded on
# the bit pattern (bf16), rounded to a float grid without a scale (fp16, plain casts), on a grid with one FP32
# scale per row group (fp8, int8, int16), or NVFP4's two levels.
_LAYOUTS = {"exact": 0, "pattern": 1, "grid": 2, "group": 3, "two-level": 4}
LAYOUT_EXACT = constant(_LAYOUTS["exact"])
LAYOUT_PATTERN = constant(_LAYOUTS["pattern"])
LAYOUT_GROUP = constant(_LAYOUTS["group"])
LAYOUT_TWO_LEVEL = constant(_LAYOUTS["two-level"])


@triton.constexpr_function
def encoding_of_code(fmt):
    """The `EncodingSpec` of a kernel format code, at compile time or on the host."""
    return _SPEC_OF_CODE[int(fmt)]


@triton.constexpr_function
def fmt_layout(fmt):
    """The LAYOUT_* code of format code ``fmt``."""
    spec = encoding_of_code(fmt)
    if spec.scale_layout != "none":
        return _LAYOUTS[spec.scale_layout]
    if spec.pattern_bits is not None:
        return _LAYOUTS["pattern"]
    return _LAYOUTS["grid"] if spec.grid is not None else _LAYOUTS["exact"]


@triton.constexpr_function
def fmt_mbits(fmt):
    """Mantissa bits of the element grid of format code ``fmt``."""
    return encoding_of_code(fmt).grid.mantissa_bits


@triton.constexpr_function
def fmt_emin(fmt):
    """Exponent of the smallest normal binade of the element grid of ``fmt``."""
    return encoding_of_code(fmt).grid.min_exponent


@triton.constexpr_function
def fmt_grid_max(fmt):
    """Largest magnitude of the element grid of ``fmt``."""
    return encoding_of_code(fmt).grid.max_value


@triton.constexpr_function
def fmt_saturates(fmt):
    """Whether the element grid of ``fmt`` clamps to its largest magnitude (else it overflows to inf)."""
    return encoding_of_code(fmt).grid.saturating


@triton.constexpr_function
def fmt_max_code(fmt):
    """The grid magnitude a scale group's amax maps onto (scaled formats)."""
    return encoding_of_code(fmt).max_code


@triton.constexpr_function
def fmt_integer_grid(fmt):
    """Whether the element grid of ``fmt`` has spacing 1 wherever it is used (int8, int16: its smallest normal
    binade starts at 2^mantissa_bits)."""
    grid = encoding_of_code(fmt).grid
    return grid.min_exponent == grid.mantissa_bits


# NVFP4's constants, from its grids: E2M1 elements, E4M3 block scales clamped to [2^-9, 448], and the
# second-level scale amax / (6 x 448)
_NVFP4 = SPECS[Encoding.NVFP4.value]
E2M1_MBITS = constant(E2M1.mantissa_bits)
E2M1_EMIN = constant(E2M1.min_exponent)
E2M1_MAX = constant(E2M1.max_value)
E4M3_MBITS = constant(E4M3.mantissa_bits)
E4M3_EMIN = constant(E4M3.min_exponent)
E4M3_MAX = constant(E4M3.max_value)
BLOCK_SCALE_MIN = constant(E4M3_MIN_SUBNORMAL)
NVFP4_MAX_CODE = constant(_NVFP4.max_code)
assert _NVFP4.grid is E2M1 and _NVFP4.max_code == E2M1.max_value * E4M3.max_value



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
    return round_to_grid(v, u, E4M3_MBITS, E4M3_EMIN, E4M3_MAX, True, SR)


@triton.jit
def round_element(v, u, bits, FMT: tl.constexpr, SR: tl.constexpr):
    """Round elements already divided by their scale to the element grid of FMT."""
    if fmt_layout(FMT) == LAYOUT_PATTERN:
        return round_to_bf16(v, bits, SR)
    elif fmt_layout(FMT) != LAYOUT_EXACT:
        return round_to_grid(v, u, fmt_mbits(FMT), fmt_emin(FMT), fmt_grid_max(FMT), fmt_saturates(FMT), SR)
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
def tile_columns(BN: tl.constexpr, KMAJOR: tl.constexpr):
    """The state column each position of a tile's axis 0 holds [BN]: 0..BN-1, or with KMAJOR column 16 i + k at
    position k * (BN // 16) + i (nvfp4 block i, element k: `fake_quant_tile`)."""
    pos = tl.arange(0, BN)
    if KMAJOR:
        return (pos % (BN // 16)) * 16 + pos // (BN // 16)
    else:
        return pos


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
    HEAD_SCALAR: tl.constexpr = False,
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
    HEAD_SCALAR: an nvfp4 tile that is one scale group (GROUP = BR, per-head scales) takes its s2 as one scalar and
    clamps its quotients instead of checking its blocks (`nvfp4_blocks`, ONE_S2): faster for the Mamba-2 tile, not for
    the delta-rule kernel's, which leaves it off (lab/DESIGN_NOTES.md).
    """
    if fmt_layout(FMT) == LAYOUT_EXACT:
        return s
    if fmt_layout(FMT) == LAYOUT_TWO_LEVEL:  # nvfp4 draws its SR bits where it rounds (`nvfp4_blocks`)
        if KMAJOR:
            return _nvfp4_tile(
                tl.reshape(s, [16, BN // 16, BR]), static_scale, index, key, BN, BR, GROUP, STATIC, SR, 0, HEAD_SCALAR
            )
        else:
            return _nvfp4_tile(
                tl.reshape(s, [BN // 16, 16, BR]), static_scale, index, key, BN, BR, GROUP, STATIC, SR, 1, HEAD_SCALAR
            )
    u = 0.0
    bits = 0
    if SR:
        bits = keyed_bits(key, index)
        u = uniform_from_bits(bits)
    if fmt_layout(FMT) != LAYOUT_GROUP:  # unscaled: bf16, fp16, plain casts
        return round_element(s, u, bits, FMT, SR)
    else:  # one scale per row group: fp8, int8, int16
        if STATIC:
            dec = static_scale
            mult = tl.math.div_rn(tl.full([BR], 1.0, tl.float32), dec)
        else:
            amax = group_reduce_max(tl.abs(s), BN, BR, GROUP)
            max_code = tl.full([BR], fmt_max_code(FMT), tl.float32)
            mult = tl.math.div_rn(max_code, tl.where(amax == 0.0, 1.0, amax))
            # amax 0, or so small that the multiplier overflows: 1, as formats.codec.scales_from_amax
            mult = tl.where((amax == 0.0) | (mult > 3.4028234663852886e38), 1.0, mult)
            dec = tl.math.div_rn(tl.full([BR], 1.0, tl.float32), mult)
        q = round_element(s * mult[None, :], u, bits, FMT, SR)
        return q * dec[None, :]


@triton.jit
def _nvfp4_tile(
    blocks,
    static_scale,
    index,
    key,
    BN: tl.constexpr,
    BR: tl.constexpr,
    GROUP: tl.constexpr,
    STATIC: tl.constexpr,
    SR: tl.constexpr,
    BAXIS: tl.constexpr,
    HEAD_SCALAR: tl.constexpr,
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
    elif GROUP == BR and HEAD_SCALAR:  # one scale group per tile (a whole head): s2 is one scalar, every lane's
        s2 = _second_level_scale(_tile_max(bamax))
    else:  # the row amax is the max of its blocks' (max is exact: the same bits as over the elements)
        amax = tl.max(bamax, axis=1 - BAXIS, keep_dims=True)  # [1, 1, BR]
        if GROUP == BR:  # the tile is one group: its amax splat to the rows, no reshape
            amax = tl.broadcast_to(_tile_max(amax), [1, 1, BR])
        elif GROUP > 1:
            amax = tl.reshape(group_max(tl.reshape(amax, [BR]), BR, GROUP), [1, 1, BR])
        s2 = _second_level_scale(amax)
    # SR with rows groups smaller than the tile takes the reference's divisions: with the fast quotients beside
    # group_max's reshapes, Triton (3.6 and 3.9) laid the block view out whole in every thread (make_llir ran for
    # minutes); whole-tile groups reduce without a reshape and keep them
    exact_sr = SR and not STATIC and GROUP > 1 and GROUP < BR
    q, d = nvfp4_blocks(
        blocks, bamax, s2, index, key, BN, BR, BAXIS, STATIC, SR, GROUP == BR and HEAD_SCALAR and not STATIC, exact_sr
    )
    return tl.reshape(q * d, [BN, BR])


@triton.jit
def _tile_max(x):
    """The max of a block-view value (rank 3: blocks, per-block or per-row values) over all its axes, a scalar;
    axis 0 first, which lies inside each thread in both block views (faster than one pass over the flattened value:
    lab/DESIGN_NOTES.md)."""
    return tl.max(tl.max(tl.max(x, axis=0), axis=0), axis=0)


@triton.jit
def _second_level_scale(amax):
    """NVFP4's second-level scale of a group amax (any shape): amax / (6 x 448) correctly rounded, 1 where 0."""
    s2 = tl.math.div_rn(amax, tl.zeros_like(amax) + NVFP4_MAX_CODE)
    return tl.where(s2 == 0.0, 1.0, s2)


# The nvfp4 write divides every block amax by 6 s2 and every element by its block's decode scale d, correctly
# rounded (`formats.codec.encode`). `nvfp4_blocks` gets the same quotients from one correctly rounded reciprocal
# per row and per block (`quotient_rn`), exact while its intermediates stay in FP32's normal range; these bounds
# keep them there. s2 in [2^-68, 2^90] puts every d = bs s2 (bs in [2^-9, 448]) in [2^-77, 2^99] and 6 s2 in
# [2^-65, 2^93]: element quotients of magnitude >= 2^-26 (RNE only looks at those >= 0.25) and block scale quotients
# >= 2^-9 (smaller ones are clamped to 2^-9) come back exact. A block scale quotient below 2^-100 may come back
# inexact or 0 (the reference turns an underflow to 0 into a block scale of 1, not 2^-9), but every element of such
# a block is at most 6 x 2^9 x 2^-100 times its d either way and rounds to 0 under RNE: the same values, so no check
# (under SR a zero draw tells them apart; `nvfp4_blocks`' SR check covers those elements).
_S2_MIN = tl.constexpr(2.0**-68)
_S2_MAX = tl.constexpr(2.0**90)


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
def rne_centered(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """RNE of signed v to the float grid (MBITS, EMIN), |v| at most the grid's top value (callers clamp): the
    values of `round_to_grid` in 4 instructions (sm_90) with no sign restore; a zero comes back +0 (the reference
    keeps the sign of a -0, which no metric and no nonzero value sees); NaN stays NaN.

    With 2^E the power of two at or below m = max(|v|, 2^EMIN), the grid's spacing about v is sp = 2^(E - MBITS).
    c = 1.5 x 2^(E + 23 - MBITS) (m's power of two times a constant: exact) sits in the middle of the binade
    [2^(E + 23 - MBITS), 2^(E + 24 - MBITS)), whose ulp is sp, and v + c stays inside it for every |v| < 2^(E + 1)
    (the distance to either end, 2^(E + 22 - MBITS), is at least 2^(E + 1) for MBITS <= 21). So t = RN(v + c)
    (one FMA) is c plus v rounded to a multiple of sp, ties to an even multiple (c / sp is even), and t - c (FMA,
    exact) is that multiple: v's nearest grid value (the grid holds every multiple of sp in [2^E, 2^(E + 1)], and
    of 2^(EMIN - MBITS) below 2^EMIN), ties to the even mantissa.
    """
    m = tl.maximum(tl.abs(v), 2.0**EMIN)
    p = (m.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2^E
    t = tl.fma(p, 1.5 * 2.0 ** (23 - MBITS), v)
    return tl.fma(p, -1.5 * 2.0 ** (23 - MBITS), t)


@triton.jit
def reciprocal_rn(b):
    """1 / b correctly rounded, for |b| in [2^-120, 2^120]: the fast path of CUDA's __frcp_rn (its slow path takes
    the ends of the exponent range only): y0 = rcp.approx.ftz.f32(b) (MUFU.RCP, within one ulp), then one
    Newton-Raphson step with FMAs, y0 + y0 (1 - b y0), which rounds correctly. Three instructions (sm_90) against
    about ten for `div_rn(1, b)` with its range check. In the interpreter, the division."""
    if INTERPRETING:
        return tl.math.div_rn(tl.full(b.shape, 1.0, tl.float32), b)
    else:
        y0 = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [b], dtype=tl.float32, is_pure=True, pack=1
        )
        return tl.fma(-tl.fma(b, y0, -1.0), y0, y0)


@triton.jit
def quotient_rn(a, b, y):
    """a / b correctly rounded, given y = RN(1 / b) (`reciprocal_rn`): three instructions instead of a division.

    Markstein's theorem (Handbook of Floating-Point Arithmetic, 2nd ed., section 4.7): with y within half an ulp
    of 1 / b and q = RN(a y) within one ulp of a / b, the residual r = a - b q is exact (one FMA) and
    RN(q + r y) = RN(a / b), provided nothing underflows or overflows. For normal b and y, the residual
    (|r| ~ 2^-23 |a|, a multiple of ulp(q) ulp(b)) stays exact while ulp(q) ulp(b) >= 2^-149: for |a / b| >= 2^-26
    when b >= 2^-77 (the bounds `nvfp4_blocks` checks). Smaller quotients are within a few ulps of a / b, their
    sign and zero kept, except within a few ulps of FP32's underflow. In the interpreter (numpy: no fused
    multiply-add), the division itself. tests/kernels/test_nvfp4_fast_round.py checks the sequence against exact
    rational arithmetic at the midpoints that matter, and on the GPU against the division.
    """
    if INTERPRETING:
        return tl.math.div_rn(a, b)
    else:
        q = a * y
        r = tl.fma(-q, b, a)
        return tl.fma(r, y, q)


@triton.jit
def _sr_e2m1(quotients, index, key):
    """Quotients in a block view rounded to E2M1 stochastically (saturating at 6), each element with its draw from
    its counter in index [BN, BR] (the tile's order, reshaped to the block view as the tile was) and the write's key.
    The draws are made here, where they are used, so that they are not held beside the tile through the write, and
    in the block view, so that the quotients are not reshaped back and forth for them."""
    u = uniform_from_bits(keyed_bits(key, tl.reshape(index, quotients.shape)))
    return round_to_grid(quotients, u, E2M1_MBITS, E2M1_EMIN, E2M1_MAX, True, True)


@triton.jit
def _reference_decode_scales(bamax, den, s2):
    """The blocks' decode scales d = bs s2 as `formats.codec.encode` computes them: the block scale bs is
    bamax / den (den = 6 s2) correctly rounded, 1 where 0, clamped to [2^-9, 448] and rounded to E4M3."""
    bs = tl.math.div_rn(bamax, den)
    bs = tl.where(bs == 0.0, 1.0, bs)
    return round_e4m3(tl.minimum(tl.maximum(bs, BLOCK_SCALE_MIN), E4M3_MAX), 0.0, False) * s2


@triton.jit
def nvfp4_blocks(
    blocks,
    bamax,
    s2,
    index,
    key,
    BN: tl.constexpr,
    BR: tl.constexpr,
    BAXIS: tl.constexpr,
    STATIC: tl.constexpr,
    SR: tl.constexpr,
    ONE_S2: tl.constexpr = False,
    EXACT_SR: tl.constexpr = False,
):
    """NVFP4 encode of 16-element blocks, as `formats.codec.encode`: (E2M1 values q shaped like blocks, decode
    scales d [NB, 1, BR] / [1, NB, BR]) of blocks [NB, 16, BR] (BAXIS = 1) or [16, NB, BR] (BAXIS = 0, the
    elements of a block along axis 0), with block amax bamax shaped like d and second-level scales s2 [1, 1, BR]
    (ONE_S2: one dynamic scalar s2 for the whole tile); index [BN, BR], key: SR's element counters in the tile's order
    and stream key (`keyed_bits`; SR only: the uniforms are drawn where the quotients are rounded, so that they are
    not held beside the tile through the write); STATIC: s2 is a static scale; EXACT_SR: SR by the reference's
    divisions alone (see `_nvfp4_tile`).

    The reference divides every block amax by 6 s2 and every element by its block's d, correctly rounded. Here one
    correctly rounded reciprocal per row (of 6 s2) and one per block (of d) give the same quotients (`quotient_rn`);
    RNE rounds them by `rne_centered`, SR by `round_to_grid` with the element's draw. The reciprocals give exact
    quotients only within _S2_MIN.._S2_MAX; a tile where a row leaves that range (a row amax below about 10^-17 or
    above 10^30) takes the reference's divisions instead, and so does, with dynamic RNE scales, a tile with a block
    quotient above 6.5 (`rne_centered` needs |v| < 7; SR and static scales clamp at 6 as the reference does), and
    with static scales one with a block quotient above 2^126 (near FP32's overflow the fast quotient is NaN). SR
    also compares quotients far below the first grid step with its draw, where only whether a quotient is 0 counts
    (a draw of 0 rounds any nonzero one up): the fast quotient keeps that except beside FP32's underflow, so a tile
    with a nonzero element below d 2^-126 (a quotient in FP32's subnormal range) takes the reference's divisions too;
    that also covers a block whose scale quotient underflows (its elements are below 6 s2 2^-150). With ONE_S2
    (per-head scales: the tile is one group) RNE clamps its quotients too (two instructions per element) instead of
    checking blocks, so that the branch waits on the scalar s2 alone rather than on a second reduction across the
    warps of the head. Every check reads per-row, per-block or per-element values before any quotient is taken, and
    each branch turns the blocks into q in place. A NaN element comes back NaN.
    """
    if ONE_S2:  # the scalar decides the branch; the arithmetic takes it splat to the tile's rows
        take_exact = ~((s2 >= _S2_MIN) & (s2 <= _S2_MAX))  # also NaN
        s2 = tl.broadcast_to(s2, [1, 1, BR])
    den = E2M1_MAX * s2  # [1, 1, BR]
    if EXACT_SR:
        d = _reference_decode_scales(bamax, den, s2)
        return _sr_e2m1(tl.math.div_rn(blocks, d), index, key), d
    # a zero quotient (a zero block, or an underflow) is clamped to 2^-9 like a tiny one, where the reference takes 1:
    # under RNE every element of such a block rounds to 0 with either scale (see _S2_MIN), and q d is 0 either way;
    # under SR a zero draw rounds a nonzero element up to 0.5 d, which differs, but such an element (at most
    # 6 s2 2^-150) lies below d 2^-126 with either d, so the SR check below sends its tile to the exact path
    bs = tl.minimum(tl.maximum(quotient_rn(bamax, den, reciprocal_rn(den)), BLOCK_SCALE_MIN), E4M3_MAX)
    d = rne_centered(bs, 3, -6) * s2
    rd = reciprocal_rn(d)
    if not ONE_S2:
        bad = ~((s2 >= _S2_MIN) & (s2 <= _S2_MAX))  # [1, 1, BR]; also NaN
        if not STATIC and not SR:
            # dynamic scales put every quotient at or below 6 (x 16/15 where the block scale rounds down), except for
            # a block scale in E4M3's subnormal range rounded far down (a block ~3 x 10^4 below its row's amax): a
            # block whose largest quotient (RN(bamax rd) bounds every element's, within an ulp) exceeds 6.5 takes the
            # exact path, and the others need no clamp (`rne_centered` is exact for |v| < 7, rounds (6, 7) to 6);
            # SR clamps every quotient as the reference does
            bad = bad | (bamax * rd > 6.5)  # [NB, 1, BR] / [1, NB, BR]
        if STATIC:
            # a static scale far below the state can put a quotient beyond FP32's range: the reference's division
            # gives inf, clamped to 6, where RN(x y) = inf makes the corrected quotient inf - inf = NaN; such blocks
            # (RN(bamax rd) above 2^126, every quotient of the block within an ulp of it or below) divide
            bad = bad | (bamax * rd > 2.0**126)
        take_exact = _tile_max(bad.to(tl.int32)) != 0
    if SR:
        # SR rounds a quotient in (0, 2^-25) up to 0.5 exactly when its draw is 0, so there only whether it is 0
        # counts, which the fast quotient keeps except near 2^-150, where RN(x / d) turns 0: a block with a nonzero
        # element below t = d 2^-126 (its quotient under 2^-126) takes the exact path. One unsigned compare per block
        # of per-element values that cost one integer add each: 2 bits(x) - 1 (the sign shifted out, a zero wrapping
        # to the top) is ordered as |x| is, and below 2 bits(t) - 1 exactly when 0 < |x| < t (t's bits at least 1:
        # a t that underflows to 0 admits no x)
        xb = blocks.to(tl.uint32, bitcast=True)
        lowest = tl.min(xb + xb - 1, axis=BAXIS, keep_dims=True)  # shaped like d
        tb = tl.maximum((d * 2.0**-126).to(tl.uint32, bitcast=True), 1)
        tiny = lowest < tb + tb - 1
        take_exact = take_exact | (_tile_max(tiny.to(tl.int32)) != 0)
    # one flag per tile from per-block and per-row values (axis 0 first: inside each thread in both block views),
    # decided before any element is divided: each branch turns the blocks into q in place, where computing q first
    # and the exact path after kept both alive (64 more registers per thread at the Mamba-2 tiling: 247 against
    # fp8's 214, one warp fewer per SM)
    if take_exact:
        d = _reference_decode_scales(bamax, den, s2)
        if SR:
            q = _sr_e2m1(tl.math.div_rn(blocks, d), index, key)
        else:
            q = round_to_grid(tl.math.div_rn(blocks, d), 0.0, E2M1_MBITS, E2M1_EMIN, E2M1_MAX, True, False)
    else:
        quotients = quotient_rn(blocks, d, rd)
        if SR:
            q = _sr_e2m1(quotients, index, key)
        elif (
            STATIC or ONE_S2
        ):  # quotients of any size (a static scale below the state's range), clamped as the reference
            q = rne_centered(
                tl.clamp(quotients, -E2M1_MAX, E2M1_MAX, propagate_nan=tl.PropagateNan.ALL), E2M1_MBITS, E2M1_EMIN
            )
        else:
            q = rne_centered(quotients, 1, 0)
    return q, d
