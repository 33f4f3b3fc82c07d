"""The nvfp4 RNE write's fast quotients (`rounding.nvfp4_rne_blocks`) against `formats.codec`, bit for bit.

The fast path multiplies by one reciprocal per row for the block scales and one per 16-element block for
the elements instead of dividing each, and falls back to the correctly rounded divisions for a tile where
any quotient comes near a rounding midpoint of its grid (E4M3 for block scales, E2M1 for elements). Random
states almost never come near one, so these tests steer elements onto the E2M1 midpoints (0.25, 0.75,
1.25, 1.75, 2.5, 3.5, 5) times their block's scale, and block maxima onto E4M3 midpoints times 6 s2, and
one or two ulps beside them, where a quotient off by an ulp rounds the other way: without the fallback
they fail.
"""

import pytest
import torch

from ssmquant import formats
from ssmquant.formats.codec import encode, expand_groups, ieee_div
from ssmquant.kernels import fake_quant_triton
from ssmquant.simulate import triton_interpreting

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]

MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def steered_state(fmt, shape, seed, share):
    """A random state whose non-maximal elements (a share of them) are moved to +-(midpoint x d), nudged by
    -2..2 ulps, d being each block's decode scale; returns the state and how many of its quotients are ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-10, 10, (*shape[:-1], 1), generator=g).float())
    enc = encode(fmt, x)
    d = enc.block_scale * expand_groups(fmt, enc.group_scale, shape[-2])  # [..., rows, nblocks]
    d = d.repeat_interleave(16, -1)  # per element
    blocks = x.abs().reshape(*shape[:-1], -1, 16)
    is_max = (blocks == blocks.amax(-1, keepdim=True)).reshape(shape)
    pick = (torch.rand(shape, generator=g) < share) & ~is_max
    m = MIDPOINTS[torch.randint(0, len(MIDPOINTS), shape, generator=g)]
    target = (m * d) * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    ulps = torch.randint(-2, 3, shape, generator=g, dtype=torch.int32)
    nudged = (target.view(torch.int32) + ulps).view(torch.float32)
    x = torch.where(pick, nudged, x)
    ties = int((pick & (torch.div(x, d).abs().unsqueeze(-1) == MIDPOINTS).any(-1)).sum())  # IEEE quotients
    assert torch.equal(encode(fmt, x).block_scale, enc.block_scale)  # block maxima kept: same scales
    return x, ties


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:head", "nvfp4:rows4"])
@pytest.mark.parametrize("share", [0.1, 0.5])
def test_nvfp4_rne_write_is_bit_exact_at_rounding_midpoints(spec, share, kmajor):
    fmt = formats.parse(spec)
    shape = (4, 64, 128) if GPU else (2, 8, 48)
    x, ties = steered_state(fmt, shape, seed=5, share=share)
    assert ties > 0  # the steering reached exact ties
    x = x.to(DEVICE)
    assert torch.equal(fake_quant_triton(fmt, x, kmajor=kmajor), fmt.fake_quant(x))


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:sr", "nvfp4:head:sr", "nvfp4:rows4"])
def test_nvfp4_kmajor_tile_is_bit_exact(spec):
    """The Mamba-2 kernel's k-major tile (whole blocks per lane) encodes like the column-ordered one and codec."""
    fmt = formats.parse(spec)
    g = torch.Generator().manual_seed(3)
    shape = (4, 64, 128) if GPU else (2, 8, 48)
    x = torch.randn(shape, generator=g)
    exps = torch.randint(-12, 12, (*shape[:-1], shape[-1] // 16), generator=g).float()  # one per 16-element block
    x = (x * torch.exp2(exps).repeat_interleave(16, -1)).to(DEVICE)  # block maxima spanning 2^24
    want = fmt.fake_quant(x, seed=7)
    assert torch.equal(fake_quant_triton(fmt, x, seed=7, kmajor=True), want)
    assert torch.equal(fake_quant_triton(fmt, x, seed=7), want)


def test_nvfp4_static_scale_far_from_the_state_is_bit_exact():
    """Static scales 2^100 above the state's own: 1 / d near the bottom of FP32's normal range."""
    fmt = formats.parse("nvfp4:static")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 8, 48, generator=g)
    for exp in (-100.0, 0.0, 100.0):
        scale = torch.full((2, 8), 2.0**exp) * 0.37  # one decode scale per row
        got = fake_quant_triton(fmt, x.to(DEVICE), scale=scale.to(DEVICE))
        assert torch.equal(got, fmt.fake_quant(x.to(DEVICE), scale=scale.to(DEVICE))), exp


def e4m3_midpoints():
    """Midpoints between neighbouring E4M3 values in [2^-9, 448]: subnormal spacing 2^-9, then 8 per binade."""
    sub = [(k + 0.5) * 2.0**-9 for k in range(1, 8)]
    normal = [(1 + (m + 0.5) / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    return torch.tensor([v for v in sub + normal if v < 448.0])


def steered_block_scales(shape, seed):
    """A state [..., rows, state_dim] (per-row nvfp4) whose first block holds the row amax and whose other
    blocks' amax sit at (E4M3 midpoint x 6 s2) nudged by -2..2 ulps; returns it and the count of exact ties."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (*shape[:-1], 1), generator=g).float())
    x = (torch.rand(shape, generator=g) * 2 - 1) * scale * 0.9
    x[..., 0] = scale[..., 0] * torch.where(torch.rand(shape[:-1], generator=g) < 0.5, -1.0, 1.0)  # the row amax
    den = 6.0 * ieee_div(scale, 2688.0)  # [..., rows, 1]: 6 s2, as the reference computes it
    mids = e4m3_midpoints()
    nb = shape[-1] // 16
    m = mids[torch.randint(0, len(mids), (*shape[:-1], nb - 1), generator=g)]
    target = m * den  # [..., rows, nb - 1]
    target = (target.view(torch.int32) + torch.randint(-2, 3, target.shape, generator=g, dtype=torch.int32)).view(
        torch.float32
    )
    blocks = x[..., 16:].reshape(*shape[:-1], nb - 1, 16)
    blocks = blocks.abs() / scale[..., None] * target[..., None] * 0.9 * torch.sign(blocks)
    pos = torch.randint(0, 16, (*shape[:-1], nb - 1, 1), generator=g)
    sign = torch.where(torch.rand(pos.shape, generator=g) < 0.5, -1.0, 1.0)
    blocks = blocks.scatter(-1, pos, target[..., None] * sign)
    x[..., 16:] = blocks.reshape(*shape[:-1], -1)
    ties = int((ieee_div(target, den)[..., None] == mids).any(-1).sum())
    return x, ties


@pytest.mark.parametrize("kmajor", [False, True])
def test_nvfp4_rne_write_is_bit_exact_at_block_scale_midpoints(kmajor):
    fmt = formats.parse("nvfp4")
    shape = (8, 64, 128) if GPU else (2, 8, 64)
    x, ties = steered_block_scales(shape, seed=11)
    assert ties > 0  # the steering reached exact ties
    x = x.to(DEVICE)
    assert torch.equal(fake_quant_triton(fmt, x, kmajor=kmajor), fmt.fake_quant(x))
