"""The nvfp4 write's arithmetic (`rounding.nvfp4_blocks`) piece by piece, bit for bit.

The write needs the reference's correctly rounded quotients (block amax / 6 s2, element / d) and their E4M3 /
E2M1 roundings. It gets the quotients from one correctly rounded reciprocal per row and block by Markstein's
correction (`quotient_rn`) and rounds them with a centred magic-number addition (`rne_centered`) or with SR's draws;
under RNE no element's value decides a branch (under SR one check per block of its elements' magnitudes does).
Checked here:
- `rne_centered` against `formats.grids.round_to_grid` on every FP32 value within 256 ulps of each grid value,
  midpoint and binade edge of E2M1 and E4M3 (both signs), and on random values: equal everywhere (a -0 may come
  back +0, which torch.equal, like every metric, does not tell apart);
- the `quotient_rn` sequence (RN(a y), the residual FMA, the corrected FMA), computed in exact rational
  arithmetic with one rounding to FP32 per operation, against the correctly rounded quotient, on quotients steered
  onto every E2M1 and E4M3 rounding midpoint and 1-3 ulps beside them, for every E4M3 block scale at second-level
  scales spanning the write's fast range, and on small quotients at the range's bottom;
- the same sequence compiled for the GPU against torch's division (GPU only: the interpreter divides);
- whole tiles through the paths that need more than the fast one: quotients above 6 (the clamp), static scales
  far from the state, rows outside the fast range, blocks far below their row, SR on near-underflow quotients and
  on a block whose scale quotient underflows, each at a zero draw.
"""

import functools
import math
from fractions import Fraction

import pytest
import torch
import triton
import triton.language as tl

from ssmquant import formats
from ssmquant.formats import random
from ssmquant.formats.codec import encode, expand_groups
from ssmquant.formats.grids import E2M1, E4M3, round_to_grid
from ssmquant.kernels import fake_quant_triton
from ssmquant.kernels.rounding import quotient_rn, reciprocal_rn, rne_centered
from ssmquant.simulate import triton_interpreting

from .exact_fp32 import quotient_sequence, rn32

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
BLOCK = 4096


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, E4M3: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    if E4M3:
        out = rne_centered(tl.clamp(v, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL), 3, -6)
    else:
        out = rne_centered(tl.clamp(v, -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL), 1, 0)
    tl.store(out_ptr + offs, out, mask=ok)


@triton.jit
def _quotient_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    a = tl.load(a_ptr + offs, mask=ok, other=1.0)
    b = tl.load(b_ptr + offs, mask=ok, other=1.0)
    tl.store(out_ptr + offs, quotient_rn(a, b, reciprocal_rn(b)), mask=ok)


@triton.jit
def _reciprocal_kernel(b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, reciprocal_rn(tl.load(b_ptr + offs, mask=ok, other=1.0)), mask=ok)


def centred_round(v: torch.Tensor, e4m3: bool = False) -> torch.Tensor:
    """The kernels' rounding of v (clamped to the grid's top first, as the write does) to E2M1, or E4M3's."""
    v = v.contiguous().to(DEVICE)
    out = torch.empty_like(v)
    _round_kernel[(triton.cdiv(v.numel(), BLOCK),)](v, out, v.numel(), E4M3=e4m3, BLOCK=BLOCK)
    return out.cpu()


def neighbours(points, ulps=256) -> torch.Tensor:
    """Every FP32 value within `ulps` ulps of each point, both signs."""
    bits = torch.tensor(points, dtype=torch.float32).view(torch.int32)
    near = (bits[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)).reshape(-1).view(torch.float32)
    near = near[torch.isfinite(near) & (near >= 0)]
    return torch.cat([near, -near])


def e2m1_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    grid = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    edges = [2.0**k for k in range(-30, 3)] + [6.5, 7.0, 2.0**-126, 2.0**-149 * 300]
    pts = neighbours(list(MIDPOINTS) + grid + edges)
    rand = torch.exp2(torch.rand(1 << 18, generator=g) * 34 - 31) * torch.where(torch.rand(1 << 18, generator=g) < 0.5, -1.0, 1.0)
    uni = (torch.rand(1 << 18, generator=g) * 2 - 1) * 7
    special = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-149), 1e-40, -1e-40, 1e3, -3.0e38, float("inf"), -float("inf")])
    return torch.cat([pts, rand, uni, special])


def e4m3_values() -> torch.Tensor:
    """E4M3's values (both signs) and midpoints below 448 with 256 ulps about each, binade edges, random values."""
    sub = [k * 2.0**-9 for k in range(1, 9)] + [(k + 0.5) * 2.0**-9 for k in range(0, 8)]
    normal = [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    normal += [(1 + (m + 0.5) / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    pts = [p for p in sub + normal if p <= 448.0] + [2.0**k for k in range(-30, 9)]
    g = torch.Generator().manual_seed(2)
    rand = torch.exp2(torch.rand(1 << 18, generator=g) * 40 - 31) * torch.where(torch.rand(1 << 18, generator=g) < 0.5, -1.0, 1.0)
    return torch.cat([neighbours(pts), rand, torch.tensor([0.0, -0.0, 2.0**-149, 1e-40, 500.0, -1e9])])


def test_e2m1_centred_rounding_is_exact():
    v = e2m1_values()
    assert torch.equal(centred_round(v), round_to_grid(v, E2M1))


def test_e4m3_centred_rounding_is_exact():
    """The block scales' rounding (positive there, both signs here)."""
    v = e4m3_values()
    assert torch.equal(centred_round(v, e4m3=True), round_to_grid(v, E4M3))


def test_centred_rounding_keeps_nan():
    out = centred_round(torch.tensor([float("nan"), 1.0, -float("nan")]))
    assert torch.isnan(out[0]) and torch.isnan(out[2]) and out[1] == 1.0


# -- quotient_rn's sequence in exact arithmetic ------------------------------------------------------------------------
def steered_quotients(targets, divisors, ulps=3, seed=0):
    """(a, b) pairs with a = RN(target x b) nudged by -ulps..ulps, for every target and divisor."""
    out = []
    for b in divisors:
        for m in targets:
            base = torch.tensor(rn32(m * b), dtype=torch.float32).view(torch.int32)
            for k in range(-ulps, ulps + 1):
                out.append((float((base + k).view(torch.float32)), b))
    return out


def e4m3_scales():
    sub = [k * 2.0**-9 for k in range(1, 8)]
    return sub + [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8) if (1 + m / 8) * 2.0**e <= 448.0]


S2_SAMPLES = (2.0**-68 * 1.37, 3.1e-9, 0.77, 1.0 / 2688, 4.2e11, 2.0**90 * 0.93)


def test_quotient_sequence_is_correctly_rounded_at_e2m1_midpoints():
    """Element quotients x / d at every E2M1 midpoint, d = RN(bs s2) for every E4M3 block scale bs."""
    divisors = [rn32(bs * s2) for bs in e4m3_scales() for s2 in S2_SAMPLES]
    pairs = steered_quotients(MIDPOINTS, divisors)
    wrong = [(a, b) for a, b in pairs if quotient_sequence(a, b) != rn32(Fraction(a) / Fraction(b))]
    assert not wrong, wrong[:5]
    ties = sum(Fraction(a) / Fraction(b) in {Fraction(m) for m in MIDPOINTS} for a, b in pairs)
    assert ties > 100  # the steering reached exact midpoints


def test_quotient_sequence_is_correctly_rounded_at_e4m3_midpoints():
    """Block scale quotients bamax / (6 s2) at every E4M3 midpoint in [2^-9, 448]."""
    mids = [(k + 0.5) * 2.0**-9 for k in range(1, 8)]
    mids += [(1 + (m + 0.5) / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    mids = [m for m in mids if m < 448.0]
    pairs = steered_quotients(mids, [rn32(6.0 * rn32(s2)) for s2 in S2_SAMPLES])
    wrong = [(a, b) for a, b in pairs if quotient_sequence(a, b) != rn32(Fraction(a) / Fraction(b))]
    assert not wrong, wrong[:5]


def test_quotient_sequence_is_correctly_rounded_for_small_quotients_at_the_bottom_of_the_range():
    """|a / b| down to 2^-26 with b down to 2^-77 (s2 = 2^-68 and the smallest block scale): the residual stays exact."""
    g = torch.Generator().manual_seed(8)
    q = torch.exp2(torch.rand(4000, generator=g) * 26 - 26) * (1 + torch.rand(4000, generator=g))
    b = torch.exp2(-77 + torch.rand(4000, generator=g) * 4)
    pairs = [(rn32(x * y), rn32(y)) for x, y in zip(q.tolist(), b.tolist())]
    wrong = [(a, bb) for a, bb in pairs if quotient_sequence(a, bb) != rn32(Fraction(a) / Fraction(bb))]
    assert not wrong, wrong[:5]


@pytest.mark.skipif(not GPU, reason="the interpreter's quotient_rn is the division itself")
def test_compiled_quotient_equals_the_division():
    g = torch.Generator().manual_seed(6)
    n = 1 << 24
    b = torch.tensor(e4m3_scales())[torch.randint(0, len(e4m3_scales()), (n,), generator=g)]
    b = (b * torch.exp2(torch.rand(n, generator=g) * 158 - 68)).float()  # d = bs s2, s2 in the fast range
    m = torch.tensor(MIDPOINTS)[torch.randint(0, len(MIDPOINTS), (n,), generator=g)]
    a = (m * b).view(torch.int32) + torch.randint(-3, 4, (n,), generator=g, dtype=torch.int32)
    a = torch.where(torch.rand(n, generator=g) < 0.5, a.view(torch.float32), torch.randn(n, generator=g) * b * 3)
    a, b = a.cuda(), b.cuda()
    out = torch.empty_like(a)
    _quotient_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)
    assert torch.equal(out, a / b)


def _rn32_of_f64_sum(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """RN32(hi + lo) for FP64 hi, lo whose exact sum FP64 may not hold: the FP64 sum rounded to FP32, exact unless
    that sum lies within its own rounding error of an FP32 rounding midpoint (returned as NaN, for a closer look)."""
    s = hi + lo
    out = s.float()
    mid = (out.double() + torch.nextafter(out, torch.where(s > out.double(), torch.inf, -torch.inf)).double()) / 2
    return torch.where((s - mid).abs() <= s.abs() * 2.0**-52, torch.nan, out)


def test_reciprocal_sequence_is_correctly_rounded_for_every_significand():
    """`reciprocal_rn`'s GPU sequence on every FP32 significand m in [1, 2): MUFU.RCP as the H200 computes it
    (`engines.mufu.rcp_sm90`, its measured table), then y0 - y0 (m y0 - 1) with each FMA rounded once, equals the
    correctly rounded 1 / m. MUFU.RCP of m 2^e is its value for m times 2^-e and the Newton step scales with it, so
    this covers every b in the write's range."""
    from ssmquant.engines.mufu import ieee_rcp, rcp_sm90

    m = (torch.arange(1 << 23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    y0 = rcp_sm90(m)
    e = (m.double() * y0.double() - 1.0).float()  # m y0 exact in FP64 (48 bits), minus 1 exact: one rounding
    y = _rn32_of_f64_sum(y0.double(), -(e.double() * y0.double()))  # e y0 exact; the sum checked below
    unsure = torch.isnan(y).nonzero().flatten().tolist()
    for i in unsure:  # exact rational arithmetic where FP64 could not decide
        y[i] = float(rn32(Fraction(y0[i].item()) - Fraction(e[i].item()) * Fraction(y0[i].item())))
    assert len(unsure) < 1000
    assert torch.equal(y, ieee_rcp(m))
    assert int((y0 != ieee_rcp(m)).sum()) > 10**5  # MUFU.RCP alone is not correctly rounded: the step matters


@pytest.mark.skipif(not GPU, reason="the interpreter's reciprocal_rn is the division itself")
def test_compiled_reciprocal_is_correctly_rounded_for_every_mantissa():
    """Every FP32 significand (2^23, both signs) at exponents across the write's range [2^-77, 2^99] and beyond."""
    mant = torch.arange(1 << 23, dtype=torch.int32, device="cuda")
    for e in (-120, -77, -66, -30, -1, 0, 1, 29, 64, 99, 120):
        b = ((mant | ((e + 127) << 23)).view(torch.float32)).contiguous()
        for sign in (1.0, -1.0):
            x = b * sign
            out = torch.empty_like(x)
            _reciprocal_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), BLOCK=BLOCK)
            assert torch.equal(out, torch.ones_like(x) / x), e


# -- whole tiles ---------------------------------------------------------------------------------------------------------
def subnormal_block_state(shape, seed):
    """Per-row nvfp4 states whose blocks after the first have amax q x 6 s2 with q in [2^-9, 2^-7) (E4M3's
    subnormal block scales, rounded down by up to a third): quotients up to 9, which the write clamps to 6."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    amax = x.abs().amax(-1, keepdim=True)
    nb = shape[-1] // 16
    q = (torch.randint(2, 4, (*shape[:-1], nb - 1), generator=g).float() + 0.45 + 0.1 * torch.rand((*shape[:-1], nb - 1), generator=g)) * 2.0**-9
    blocks = x[..., 16:].reshape(*shape[:-1], nb - 1, 16)
    blocks = blocks / blocks.abs().amax(-1, keepdim=True) * (q * 6.0 / 2688.0 * amax)[..., None]
    x[..., 16:] = blocks.reshape(*shape[:-1], -1)
    x[..., 0] = amax[..., 0]  # the row amax stays in the first block
    return x


def max_quotient(fmt, x, scale=None):
    enc = encode(fmt, x, static_scale=None if scale is None else expand_groups(fmt, scale, x.shape[-2]).squeeze(-1))
    d = (enc.block_scale * expand_groups(fmt, enc.group_scale, x.shape[-2])).repeat_interleave(16, -1)
    return float((x / d).abs().max())


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:head"])
def test_nvfp4_write_with_quotients_above_7_is_bit_exact(spec, kmajor):
    fmt = formats.parse(spec)
    shape = (4, 64, 128) if GPU else (2, 8, 64)
    x = subnormal_block_state(shape, seed=13)
    assert max_quotient(formats.parse("nvfp4"), x) > 7.0  # the clamp is needed
    x = x.to(DEVICE)
    assert torch.equal(fake_quant_triton(fmt, x, kmajor=kmajor), fmt.fake_quant(x))


@pytest.mark.parametrize("kmajor", [False, True])
def test_nvfp4_static_scale_below_the_state_is_bit_exact(kmajor):
    """Static scales 2^-4 .. 2^-12 of the state's own: block scales saturate at 448, quotients up to ~2^12."""
    fmt = formats.parse("nvfp4:static")
    g = torch.Generator().manual_seed(17)
    shape = (2, 8, 64)
    x = torch.randn(shape, generator=g)
    for exp in (-4.0, -12.0):
        scale = x.abs().amax(-1) / 2688.0 * 2.0**exp  # [2, 8], one per row
        assert max_quotient(fmt, x, scale) > 7.0
        got = fake_quant_triton(fmt, x.to(DEVICE), scale=scale.to(DEVICE), kmajor=kmajor)
        assert torch.equal(got, fmt.fake_quant(x.to(DEVICE), scale=scale.to(DEVICE))), exp


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("spec", ["nvfp4:static", "nvfp4:static:sr"])
def test_nvfp4_static_quotients_beyond_fp32_are_bit_exact(spec, kmajor):
    """A static scale 2^-60 (inside the fast range) under elements up to 10^24: block scales saturate at 448 and
    x / d reaches 2.6 x 10^39, beyond FP32 (the reference's division gives inf, clamped to 6). The fast quotient would
    give NaN there (RN(x y) = inf, then inf - inf); such blocks divide. GPU only in effect: the interpreter divides."""
    fmt = formats.parse(spec)
    g = torch.Generator().manual_seed(41)
    x = torch.randn((2, 8, 64), generator=g)
    x[0, 3, 5] = -1e24
    x[1, 6, 40] = 3e38
    scale = torch.full((2, 8), 2.0**-60)
    x, scale = x.to(DEVICE), scale.to(DEVICE)
    want = fmt.fake_quant(x, scale=scale, seed=3)
    assert float(want[0, 3, 5]) == -6 * 448 * 2.0**-60  # saturated, the sign kept
    assert torch.equal(fake_quant_triton(fmt, x, scale=scale, seed=3, kmajor=kmajor), want)


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:sr", "nvfp4:head"])
def test_nvfp4_rows_outside_the_fast_range_are_bit_exact(spec):
    """Rows whose amax puts s2 below 2^-68 or above 2^90 (the reference's divisions), beside ordinary rows."""
    fmt = formats.parse(spec)
    g = torch.Generator().manual_seed(19)
    shape = (2, 8, 64)
    x = torch.randn(shape, generator=g)
    x[0, 1] *= 1e-19  # s2 ~ 2^-73
    x[1, 3] *= 1e31  # s2 ~ 2^92
    x[1, 5] *= 2.0**-140 / x[1, 5].abs().max()  # subnormal elements only
    x = x.to(DEVICE)
    assert torch.equal(fake_quant_triton(fmt, x, seed=3), fmt.fake_quant(x, seed=3))


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("spec", ["nvfp4:head", "nvfp4:head:sr"])
@pytest.mark.parametrize("scale", [1e-19, 1e31])
def test_nvfp4_heads_outside_the_fast_range_are_bit_exact(spec, scale, kmajor):
    """A whole head whose amax puts its s2 outside [2^-68, 2^90] beside ordinary heads (kmajor: the Mamba-2 tile,
    whose per-head write decides on that scalar alone)."""
    fmt = formats.parse(spec)
    g = torch.Generator().manual_seed(29)
    x = torch.randn((3, 8, 64), generator=g)
    x[1] *= scale
    x = x.to(DEVICE)
    assert torch.equal(fake_quant_triton(fmt, x, seed=3, kmajor=kmajor), fmt.fake_quant(x, seed=3))


@functools.cache
def _zero_draw(shape: tuple[int, ...], seed: int) -> tuple[int, tuple[int, ...]]:
    """(stream, index into a state of this shape) of an element whose SR draw is 0 (its top 24 random bits are 0,
    one element in 2^24): there SR rounds any nonzero quotient below the first grid step up, and a zero one not."""
    index = torch.arange(math.prod(shape), dtype=torch.int64)
    for stream in range(1 << 16):
        hits = ((random.random_bits(seed, stream, index) >> 8) == 0).nonzero()
        if len(hits):
            return stream, tuple(int(i) for i in torch.unravel_index(hits[0, 0], shape))
    raise AssertionError("no zero draw in 2^16 streams")


def _decode_scale(row: torch.Tensor, block: slice) -> float:
    """The reference's decode scale d = bs s2 of one block of a row (`formats.codec.encode`: each step rounded to
    FP32; torch's CPU division and product are correctly rounded)."""
    s2 = row.abs().amax() / 2688.0
    bs = round_to_grid(row[block].abs().amax() / (6.0 * s2), E4M3)
    return float(bs * s2)


def _fast_quotient_misses_zero(d: float) -> float | None:
    """An element x (FP32) whose quotient x / d lies beside 2^-150, where the fast quotient (`quotient_sequence`)
    and the correctly rounded one disagree on being 0 (the case the exact path exists for), or None where none of
    the 16 FP32 values nearest 2^-150 d does (whether one does depends on d). It takes a subnormal x (d < 2^24):
    then the residual x - q d rounds to FP32's subnormal grid."""
    x = torch.tensor(rn32(Fraction(2) ** -150 * Fraction(d)), dtype=torch.float32)
    for _ in range(8):
        x = torch.nextafter(x, torch.tensor(0.0))
    for _ in range(16):
        v = float(x)
        if v != 0 and (quotient_sequence(v, d) == 0) != (rn32(Fraction(v) / Fraction(d)) == 0):
            return v
        x = torch.nextafter(x, torch.tensor(1.0))
    return None


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("quotient", ["beside 2^-150", 2.0**-148, 2.0**-100])
def test_nvfp4_sr_quotient_near_underflow_with_a_zero_draw(quotient, kmajor):
    """SR rounds a quotient below the first grid step up when its draw is 0 and it is nonzero, so only a zero draw
    sees how a tiny quotient was computed. The fast quotient is exact down to 2^-25 and keeps a quotient's zero-ness
    except beside 2^-150, where the correctly rounded one turns 0: there a block with a nonzero element below
    d 2^-126 takes the exact path. At an element whose draw is 0: a subnormal element whose fast quotient gets its
    zero-ness wrong (found with exact arithmetic; block scales ~10^2), and in a row scaled so that its block scales
    are ~10^19, one whose quotient is ~2^-148 (below d 2^-126: the exact path; its fast quotient would be right too)
    and one at ~2^-100 (the fast path). Triton's interpreter divides instead of taking the reciprocals
    (`quotient_rn`), so on the CPU the first case passes with or without the check; compiled for a GPU it fails
    without it."""
    fmt = formats.parse("nvfp4:sr")
    shape = (2, 8, 64)
    stream, (m, r, n) = _zero_draw(shape, seed=5)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(31))
    block = slice(n - n % 16, n - n % 16 + 16)
    x[m, r, n] = 0.0  # the block's scales without the element (too small to change them)
    row = x[m, r].clone()
    beside = quotient == "beside 2^-150"
    for step in range(64):  # row scales until one gives a d for which some element beside 2^-150 d misses
        x[m, r] = row * ((1e3 if beside else 1e20) * (1 + step / 64))
        d = _decode_scale(x[m, r], block)
        value = _fast_quotient_misses_zero(d) if beside else quotient * d
        if value is not None:
            break
    assert value is not None, "no row scale gave an element whose fast quotient misses zero-ness"
    x[m, r, n] = value
    assert x[m, r, n] != 0 and _decode_scale(x[m, r], block) == d
    x = x.to(DEVICE)
    got = fake_quant_triton(fmt, x, seed=5, stream=stream, kmajor=kmajor)
    want = fmt.fake_quant(x, seed=5, stream=stream)
    if not beside:
        assert want[m, r, n] != 0  # the zero draw rounds the nonzero quotient up
    assert torch.equal(got, want)


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("spec", ["nvfp4:sr", "nvfp4:head:sr"])
def test_nvfp4_sr_block_whose_scale_underflows_with_a_zero_draw(spec, kmajor):
    """A block holding one subnormal element, 3 x 2^-149, in a row (and head) of amax 2688, so s2 = 1: the block amax
    over 6 s2 underflows to 0, the reference takes a block scale of 1 and its zero draw rounds the element up to 0.5;
    the fast path's block scale is clamped to 2^-9, which would give 2^-10. The SR check (an element below d 2^-126)
    sends the tile to the reference's divisions. The fast path's clamp runs in the interpreter too, so this fails on
    the CPU as well without the check (kmajor with per-head scales: the Mamba-2 tile's one scalar s2)."""
    fmt = formats.parse(spec)
    shape = (2, 8, 64)
    stream, (m, r, n) = _zero_draw(shape, seed=5)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(37))
    start = n - n % 16
    x[m, r, start : start + 16] = 0.0
    x[m, r, n] = 3 * 2.0**-149
    x[m, r, (start + 16) % 64] = 2688.0  # in another block of the row: the row's and the head's amax, s2 = 1
    x = x.to(DEVICE)
    want = fmt.fake_quant(x, seed=5, stream=stream)
    assert float(want[m, r, n]) == 0.5  # the reference's block scale 1, the element rounded up by its zero draw
    assert torch.equal(fake_quant_triton(fmt, x, seed=5, stream=stream, kmajor=kmajor), want)


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:sr"])
def test_nvfp4_blocks_far_below_their_row_are_bit_exact(spec):
    """A block 10^35 below its row's amax (its scale quotient under 2^-100), a block whose scale quotient underflows
    to 0 (the reference's block scale is then 1, the fast path's 2^-9: both round its elements to 0), and SR
    quotients near underflow."""
    fmt = formats.parse(spec)
    g = torch.Generator().manual_seed(23)
    shape = (2, 8, 64)
    x = torch.randn(shape, generator=g)
    x[0, 2, 16:32] *= 1e-35
    x[0, 5] *= 1e29  # s2 ~ 10^26, inside the fast range
    x[0, 5, 32:48] = torch.randn(16, generator=g) * 1e-44  # subnormals: bamax / (6 s2) underflows to 0
    x[1, 4, 40] = 3e-44  # one subnormal element in an ordinary block: its quotient ~ 2^-143
    x = x.to(DEVICE)
    assert torch.equal(fake_quant_triton(fmt, x, seed=5), fmt.fake_quant(x, seed=5))


@pytest.mark.parametrize("kmajor", [False, True])
def test_nvfp4_head_blocks_beside_e4m3s_lowest_normal_block_scale_are_bit_exact(kmajor):
    """Per-head scales (the delta-rule tile's whole-head path, and the Mamba-2 tile's with kmajor), one head per case:
    blocks whose scale quotient bamax / (6 s2) sits at, just above or just below 2^-6, E4M3's lowest normal (at or
    above it a block scale rounds down by at most 1/16, so every quotient stays under 6.4 and passes the write's
    per-block "above 6.5" check; only below it can a block fail that check), a head of zero blocks beside ordinary
    ones, and subnormal block scales rounded down (quotients above 7: the exact path, or with kmajor the clamp).
    Every block's elements include its amax and E2M1 midpoints times its scale, negated."""
    fmt = formats.parse("nvfp4:head")
    g = torch.Generator().manual_seed(29)
    heads, rows, n = 6, 8, 64
    x = torch.randn((heads, rows, n), generator=g)
    amax = 100.0
    x[:, 0, 0] = amax  # every head's amax (the first block of each head keeps ordinary values)
    s2 = torch.tensor(amax / 2688.0, dtype=torch.float32)
    den = float(6.0 * s2)
    ratios = {
        1: 2.0**-6 * 1.0624,  # E4M3 normal, rounded down by almost 1/16: quotients up to 6.37
        2: 2.0**-6,  # exactly at the bound
        3: 2.0**-6 * (1 - 2.0**-20),  # just below it: E4M3 subnormal, rounded up to 2^-6 (quotients under 6)
        4: 2.0**-8 * 1.24,  # E4M3 subnormal 2.48 x 2^-9 rounded to 2 x 2^-9: quotients up to 7.44, exact path
    }
    midpoints = torch.tensor(MIDPOINTS)
    for h, r in ratios.items():
        bamax = r * den
        blocks = x[h, :, 16:].reshape(rows, -1, 16)
        blocks /= blocks.abs().amax(-1, keepdim=True)
        blocks *= bamax * 0.9
        blocks[..., 0] = bamax  # the block amax, once per block
        blocks[..., 1:8] = -midpoints * (bamax / 6.0)  # near the midpoints of the quotient grid
        x[h, :, 16:] = blocks.reshape(rows, -1)
    x[5, :, 16:] = 0.0  # zero blocks: no block scale to check
    assert max_quotient(fmt, x[4:5]) > 7.0 and max_quotient(fmt, x[1:4]) < 6.5
    x = x.to(DEVICE)
    assert torch.equal(fake_quant_triton(fmt, x, kmajor=kmajor), fmt.fake_quant(x))
