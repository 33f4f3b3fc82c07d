"""The nvfp4 RNE write's signed roundings (`rounding.rne_signed`: E2M1 elements, E4M3 block scales) against
`formats.grids`, bit for bit.

The fast path rounds quotients v = x * rcp(d) (and block scale quotients) signed and unclamped by one
magic-number addition and returns each one's distance to a rounding midpoint; `nvfp4_rne_blocks` trusts a tile only where every distance stays
within `_E2M1_MARGIN`, and takes the reference's divisions elsewhere. So two properties make it exact:
- every unflagged value is the reference's E2M1 value of v (`grids.round_to_grid`, which clamps at 6);
- every v within 2^-19 spacings of a midpoint of the reference grid is flagged (the fast and the correctly
  rounded quotient differ by less than 2^-19.4 spacings, so only those could round differently).
Both are checked on every FP32 value within 256 ulps of each E2M1 value, midpoint, binade edge (including the
places where v + c leaves c's binade: mantissas next to 1 and 2) and of 6.5 and 7, on both signs, and on random
values, for the unclamped path (|v| <= 7) and the clamped one (any v). Then whole tiles whose quotients exceed 7
(the clamp branch): block scales in E4M3's subnormal range rounded far down, and static scales below the state.
"""

import pytest
import torch
import triton
import triton.language as tl

from ssmquant import formats
from ssmquant.formats.codec import encode, expand_groups
from ssmquant.formats.grids import E2M1, E4M3, round_to_grid
from ssmquant.kernels import fake_quant_triton
from ssmquant.kernels.rounding import _E2M1_MARGIN, e2m1_rne_signed, rne_signed
from ssmquant.simulate import triton_interpreting

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]

MARGIN = float(_E2M1_MARGIN.value if hasattr(_E2M1_MARGIN, "value") else _E2M1_MARGIN)
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
BLOCK = 4096


@triton.jit
def _round_kernel(v_ptr, out_ptr, dist_ptr, n, E4M3: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    if E4M3:
        out, dist = rne_signed(v, 3, -6)
        dist = dist * 4.0  # in spacings
    else:
        out, dist = e2m1_rne_signed(v, CLAMP)
    tl.store(out_ptr + offs, out, mask=ok)
    tl.store(dist_ptr + offs, dist, mask=ok)


def fast_round(v: torch.Tensor, clamp: bool, e4m3: bool = False):
    """(rounded, distance in spacings) of the fast E2M1 rounding (clamped or not), or of E4M3's."""
    v = v.contiguous().to(DEVICE)
    out, dist = torch.empty_like(v), torch.empty_like(v)
    _round_kernel[(triton.cdiv(v.numel(), BLOCK),)](v, out, dist, v.numel(), E4M3=e4m3, CLAMP=clamp, BLOCK=BLOCK)
    return out.cpu(), dist.cpu()


def neighbours(points, ulps=256) -> torch.Tensor:
    """Every FP32 value within `ulps` ulps of each point, both signs."""
    bits = torch.tensor(points, dtype=torch.float32).view(torch.int32)
    near = (bits[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)).reshape(-1).view(torch.float32)
    near = near[torch.isfinite(near) & (near >= 0)]
    return torch.cat([near, -near])


def sample_values(limit: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    grid = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    edges = [2.0**k for k in range(-30, 3)] + [6.5, 7.0, 1.5 * 2**-1, 2.0**-126, 2.0**-149 * 300]
    pts = neighbours(list(MIDPOINTS) + grid + edges)
    rand = torch.exp2(torch.rand(1 << 18, generator=g) * 34 - 31) * torch.where(torch.rand(1 << 18, generator=g) < 0.5, -1.0, 1.0)
    uni = (torch.rand(1 << 18, generator=g) * 2 - 1) * 7
    special = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-149), 1e-40, -1e-40])
    v = torch.cat([pts, rand, uni, special])
    return v[v.abs() <= limit]


def near_midpoint(v: torch.Tensor) -> torch.Tensor:
    """|v| within 2^-19 spacings of a midpoint of the E2M1 grid (float64, exact for FP32 v): more than the
    quotients' error (2^-19.4 spacings) and the rounding of the distance (2^-25)."""
    a = v.double().abs()
    mids = torch.tensor(MIDPOINTS, dtype=torch.float64)
    sp = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0], dtype=torch.float64)
    return ((a[:, None] - mids).abs() <= 2.0**-19 * sp).any(-1)


@pytest.mark.parametrize("clamp", [False, True])
def test_e2m1_rne_signed_is_exact_or_flagged(clamp):
    v = sample_values(3.0e38 if clamp else 7.0)
    if clamp:
        big = torch.tensor([6.0001, 7.5, 8.0, 1e3, 3.0e38, float("inf")])
        v = torch.cat([v, big, -big])
    out, dist = fast_round(v, clamp)
    want = round_to_grid(v, E2M1)
    trusted = dist <= MARGIN
    assert torch.equal(out[trusted], want[trusted])
    near = near_midpoint(v)
    assert near.sum() > 500  # the neighbourhoods reached the midpoints
    assert bool((dist[near] > MARGIN).all()), v[near & trusted][:8]
    # the fast path is taken almost everywhere off the midpoints (random values: flagged about 2^-20 of them)
    off = ~near & (v.abs() < 6.9)
    assert float((dist[off] > MARGIN).float().mean()) < 2e-3


def e4m3_values() -> torch.Tensor:
    """E4M3's values (both signs) and midpoints below 448 with 256 ulps about each, binade edges, random values."""
    sub = [k * 2.0**-9 for k in range(1, 9)] + [(k + 0.5) * 2.0**-9 for k in range(0, 8)]
    normal = [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    normal += [(1 + (m + 0.5) / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    pts = [p for p in sub + normal if p <= 448.0] + [2.0**k for k in range(-30, 9)]
    g = torch.Generator().manual_seed(2)
    rand = torch.exp2(torch.rand(1 << 18, generator=g) * 40 - 31) * torch.where(torch.rand(1 << 18, generator=g) < 0.5, -1.0, 1.0)
    v = torch.cat([neighbours(pts), rand, torch.tensor([0.0, -0.0, 2.0**-149, 1e-40])])
    return v[v.abs() <= 448.0]


def test_e4m3_rne_signed_is_exact_or_flagged():
    """The block scales' rounding (positive there, both signs here), against E4M3's, near its midpoints."""
    v = e4m3_values()
    out, dist = fast_round(v, False, e4m3=True)
    want = round_to_grid(v, E4M3)
    trusted = dist <= MARGIN
    assert torch.equal(out[trusted], want[trusted])
    a = v.double().abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0**-6)))
    sp = torch.exp2(e - 3)
    frac = a / sp - torch.floor(a / sp)
    near = (frac - 0.5).abs() <= 2.0**-19
    assert near.sum() > 500
    assert bool((dist[near] > MARGIN).all()), v[near & trusted][:8]
    # random block scale quotients are flagged rarely (the neighbourhoods above gather the rare cases: values
    # near 2^k whose v + c leaves c's binade)
    g = torch.Generator().manual_seed(4)
    _, dist = fast_round(torch.exp2(torch.rand(1 << 18, generator=g) * 18 - 9), False, e4m3=True)
    assert float((dist > MARGIN).float().mean()) < 1e-4


def test_e2m1_rne_signed_nan_stays_nan():
    v = torch.tensor([float("nan"), 1.0, -float("nan")])
    for clamp in (False, True):
        out, _ = fast_round(v, clamp)
        assert torch.isnan(out[0]) and torch.isnan(out[2]) and out[1] == 1.0


def subnormal_block_state(shape, seed):
    """Per-row nvfp4 states whose blocks after the first have amax q x 6 s2 with q in [2^-9, 2^-7) (E4M3's
    subnormal block scales, rounded down by up to a third): quotients up to 9, the write's clamp branch."""
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
    assert max_quotient(formats.parse("nvfp4"), x) > 7.0  # the clamp branch is needed
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
