"""Shared @triton.jit helpers: rounding, random bits and block fake-quantization of every format.

Each helper follows its torch reference in `ssmquant.formats` op for op, with operations exact in FP32 or integer
arithmetic only, so that the GPU and Triton's CPU interpreter give torch's bits. No native float8 casts: the
interpreter's are wrong (ARCHITECTURE.md, "Testing").

Format codes (constexpr FMT): see `FORMAT_CODES`.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..formats import Encoding
from ..formats.encodings import SPECS
from ..formats.grids import E2M1, E4M3, E4M3_MIN_SUBNORMAL

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests): no libdevice, numpy's arithmetic (never fused)
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def constant(value):
    """A module-level constant that @triton.jit code reads: a constexpr for the compiler; the plain number under the
    interpreter, whose tl.minimum / tl.maximum return a constexpr argument unconverted."""
    return value if INTERPRETING.value else tl.constexpr(value)


# constexpr codes of the element encodings: a kernel reads an encoding's facts from its code FMT at compile time
# (`fmt_layout`, `fmt_mbits`, ...), so a new encoding with a known layout needs no change here
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

# How an encoding stores its elements (``fmt_layout``): as is (fp32), on the bit pattern (bf16), on an unscaled
# grid (fp16), on a grid with one FP32 scale per row group (fp8, int8, int16), or NVFP4's two levels
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
    """Whether the element grid of ``fmt`` has spacing 1 wherever it is used (int8, int16)."""
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
    u < fraction), scale back, restore the sign bit. Saturating RNE takes `rne_with_distance` (the same values).
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

    s [BN, BR]: the transposed tile (state dim, rows); static_scale: [BR] decode scale of each row's group (STATIC
    only); index: [BN, BR] flat element indices (SR counters); key: the write's stream key. GROUP rows share one scale
    (GROUP divides BR; a whole head is GROUP = BR). Padded rows / columns must hold zeros.
    KMAJOR: axis 0 in `tile_columns`' k-major order, whole nvfp4 blocks per thread (only nvfp4 looks at the order).
    HEAD_SCALAR: a one-group nvfp4 tile takes its s2 as one scalar and clamps its quotients instead
    of checking its blocks (`nvfp4_blocks`' ONE_S2): on for the Mamba-2 tile only (lab/DESIGN_NOTES.md).
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

    Per-block and per-row values keep the block view's rank ([NB, 1, BR] / [1, NB, BR], [1, 1, BR]) so that they
    stay in the tile's register layout, off shared memory.
    """
    bamax = tl.max(tl.abs(blocks), axis=BAXIS, keep_dims=True)  # [NB, 1, BR] / [1, NB, BR]
    if STATIC:
        s2 = tl.reshape(static_scale, [1, 1, BR])
    elif GROUP == BR and HEAD_SCALAR:  # one group per tile: s2 one scalar
        s2 = _second_level_scale(_tile_max(bamax))
    else:  # the row amax is the max of its blocks' (max is exact: the same bits as over the elements)
        amax = tl.max(bamax, axis=1 - BAXIS, keep_dims=True)  # [1, 1, BR]
        if GROUP == BR:  # the tile is one group: its amax splat to the rows, no reshape
            amax = tl.broadcast_to(_tile_max(amax), [1, 1, BR])
        elif GROUP > 1:
            amax = tl.reshape(group_max(tl.reshape(amax, [BR]), BR, GROUP), [1, 1, BR])
        s2 = _second_level_scale(amax)
    # SR with row groups smaller than the tile takes the reference's divisions: beside group_max's reshapes the fast
    # quotients compile to a layout with the whole block view in every thread (lab/DESIGN_NOTES.md)
    exact_sr = SR and not STATIC and GROUP > 1 and GROUP < BR
    q, d = nvfp4_blocks(
        blocks, bamax, s2, index, key, BN, BR, BAXIS, STATIC, SR, GROUP == BR and HEAD_SCALAR and not STATIC, exact_sr
    )
    return tl.reshape(q * d, [BN, BR])


@triton.jit
def _tile_max(x):
    """The max of a rank-3 block-view value over all its axes, a scalar; axis 0 (in-thread in both block views)
    first (lab/DESIGN_NOTES.md)."""
    return tl.max(tl.max(tl.max(x, axis=0), axis=0), axis=0)


@triton.jit
def _second_level_scale(amax):
    """NVFP4's second-level scale of a group amax (any shape): amax / (6 x 448) correctly rounded, 1 where 0."""
    s2 = tl.math.div_rn(amax, tl.zeros_like(amax) + NVFP4_MAX_CODE)
    return tl.where(s2 == 0.0, 1.0, s2)


# The s2 range within which `nvfp4_blocks`' reciprocal quotients (`quotient_rn`) equal the reference's divisions:
# it keeps d = bs s2 in [2^-77, 2^99] and 6 s2 in [2^-65, 2^93], where element quotients >= 2^-26 and block scale
# quotients >= 2^-9 are exact. A block scale quotient below 2^-100 may not be, but the block's elements round to 0
# under RNE with either scale (SR: `nvfp4_blocks`' check).
_S2_MIN = tl.constexpr(2.0**-68)
_S2_MAX = tl.constexpr(2.0**90)


@triton.jit
def rne_with_distance(a, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """RNE of a >= 0, already clamped to the grid's max, to the float grid (MBITS, EMIN), and |a - rounded| in
    units of the grid spacing: (rounded, distance), both shaped like a; `round_to_grid`'s values.

    With c = 2^23 x spacing, a + c has an ulp of one spacing, so (a + c) - c rounds a half to even, exactly.
    """
    eb = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, (EMIN + 127) << 23)  # biased exponent, at least EMIN
    c = (eb + ((23 - MBITS) << 23)).to(tl.float32, bitcast=True)
    out = (a + c) - c
    inv_spacing = ((((127 + MBITS) << 23) - eb) + (127 << 23)).to(tl.float32, bitcast=True)  # int32 constants
    return out, tl.abs(a - out) * inv_spacing


@triton.jit
def rne_centered(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """RNE of signed v to the float grid (MBITS <= 21, EMIN), |v| at most the grid's top value (callers clamp):
    `round_to_grid`'s values in 4 instructions, except that a zero comes back +0 (no metric sees a zero's sign);
    NaN stays NaN.

    With 2^E the power of two at or below max(|v|, 2^EMIN), v + c for c = 1.5 x 2^(E + 23 - MBITS) stays in a binade
    whose ulp is the grid's spacing about v, so RN(v + c) - c is v rounded half to even, exactly.
    """
    m = tl.maximum(tl.abs(v), 2.0**EMIN)
    p = (m.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2^E
    t = tl.fma(p, 1.5 * 2.0 ** (23 - MBITS), v)
    return tl.fma(p, -1.5 * 2.0 ** (23 - MBITS), t)


@triton.jit
def reciprocal_rn(b):
    """1 / b correctly rounded, for |b| in [2^-120, 2^120]: the fast path of CUDA's __frcp_rn, MUFU.RCP then one
    Newton-Raphson step, y0 + y0 (1 - b y0), in three instructions. In the interpreter, the division."""
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

    By Markstein's theorem (Handbook of Floating-Point Arithmetic, 2nd ed., 4.7), q = RN(a y), r = a - b q (exact,
    one FMA), RN(q + r y) = RN(a / b) while nothing underflows: for |a / b| >= 2^-26 when b >= 2^-77 (the bounds
    `nvfp4_blocks` checks); smaller quotients come within a few ulps, sign and zero kept. In the interpreter, the
    division. Pinned by tests/kernels/test_nvfp4_fast_round.py.
    """
    if INTERPRETING:
        return tl.math.div_rn(a, b)
    else:
        q = a * y
        r = tl.fma(-q, b, a)
        return tl.fma(r, y, q)


@triton.jit
def _sr_e2m1(quotients, index, key):
    """Quotients in a block view rounded to E2M1 stochastically (saturating at 6), each with its draw from its
    counter in index [BN, BR] (the tile's order) and the write's key. Drawn here, in the block view, so that the
    draws are not held beside the tile through the write nor the quotients reshaped for them."""
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
    scales d [NB, 1, BR] / [1, NB, BR]) of blocks [NB, 16, BR] (BAXIS = 1) or [16, NB, BR] (BAXIS = 0), with block
    amax bamax shaped like d and second-level scales s2 [1, 1, BR] (ONE_S2: one dynamic scalar for the tile);
    index [BN, BR], key: SR's element counters (tile order) and stream key; STATIC: s2 is a static scale;
    EXACT_SR: SR by the reference's divisions alone (`_nvfp4_tile`).

    The reference's correctly rounded divisions (block amax / 6 s2, element / d) come from one reciprocal per row and
    per block (`quotient_rn`), rounded by `rne_centered` (RNE) or `round_to_grid` (SR). A tile takes the reference's
    divisions where the two could differ: a row's s2 outside _S2_MIN.._S2_MAX; with dynamic RNE scales, a block
    quotient above 6.5 (`rne_centered` needs |v| < 7; a block scale in E4M3's subnormal range rounded far down); with
    static scales, one above 2^126 (the fast quotient turns NaN); under SR, a nonzero element below d 2^-126 (whether
    its quotient is 0 counts, which the fast one loses at FP32's underflow). With ONE_S2, RNE clamps its quotients
    instead of checking blocks, so that the branch waits on the scalar s2 alone. A NaN element comes back NaN.
    """
    if ONE_S2:  # the scalar decides the branch; the arithmetic takes it splat to the tile's rows
        take_exact = ~((s2 >= _S2_MIN) & (s2 <= _S2_MAX))  # also NaN
        s2 = tl.broadcast_to(s2, [1, 1, BR])
    den = E2M1_MAX * s2  # [1, 1, BR]
    if EXACT_SR:
        d = _reference_decode_scales(bamax, den, s2)
        return _sr_e2m1(tl.math.div_rn(blocks, d), index, key), d
    # a zero block scale quotient is clamped to 2^-9 where the reference takes 1: the same q d under RNE (_S2_MIN),
    # and under SR its nonzero elements fall below d 2^-126, which sends the tile to the exact path
    bs = tl.minimum(tl.maximum(quotient_rn(bamax, den, reciprocal_rn(den)), BLOCK_SCALE_MIN), E4M3_MAX)
    d = rne_centered(bs, 3, -6) * s2
    rd = reciprocal_rn(d)
    if not ONE_S2:
        bad = ~((s2 >= _S2_MIN) & (s2 <= _S2_MAX))  # [1, 1, BR]; also NaN
        if not STATIC and not SR:
            bad = bad | (bamax * rd > 6.5)  # [NB, 1, BR] / [1, NB, BR]
        if STATIC:
            bad = bad | (bamax * rd > 2.0**126)
        take_exact = _tile_max(bad.to(tl.int32)) != 0
    if SR:
        # 2 bits(x) - 1 (sign shifted out, a zero wrapping to the top) is ordered as |x|: below 2 bits(t) - 1 exactly
        # when 0 < |x| < t = d 2^-126
        xb = blocks.to(tl.uint32, bitcast=True)
        lowest = tl.min(xb + xb - 1, axis=BAXIS, keep_dims=True)  # shaped like d
        tb = tl.maximum((d * 2.0**-126).to(tl.uint32, bitcast=True), 1)
        tiny = lowest < tb + tb - 1
        take_exact = take_exact | (_tile_max(tiny.to(tl.int32)) != 0)
    # one flag per tile, decided before any element is divided, so that only one branch's values are live
    # (lab/DESIGN_NOTES.md)
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
