"""Stochastic rounding: neighbours only, unbiased (statistically), reproducible by seed."""

import pytest
import torch

from ssmquant import formats as F
from ssmquant.formats.codec import encode

SR_SPECS = ["fp8_e4m3:sr", "int8:sr", "nvfp4:sr", "bf16:sr", "fp16:sr"]


def test_bits_are_a_pure_function_of_seed_stream_index():
    idx = torch.arange(1000)
    a = F.random_bits(7, 3, idx)
    assert torch.equal(a, F.random_bits(7, 3, idx))
    assert torch.equal(a[500:], F.random_bits(7, 3, idx[500:]))  # order- and chunk-independent
    assert not torch.equal(a, F.random_bits(8, 3, idx))
    assert not torch.equal(a, F.random_bits(7, 4, idx))
    assert int(a.min()) >= 0 and int(a.max()) < 2**32


def test_uniform_bits_are_uniform():
    u = F.uniform_from_bits(F.random_bits(0, 0, torch.arange(1_000_000)))
    hist = torch.histc(u, bins=16, min=0, max=1)
    # chi-square with 15 dof: the 99.99% quantile is ~44
    expected = 1_000_000 / 16
    assert float(((hist - expected) ** 2 / expected).sum()) < 44


def neighbours(fmt, x):
    """(down, up): the two grid neighbours around x, from SR with the random draw pinned to its
    extremes (u = 0 always rounds up unless x is on the grid; u = 1 - 2^-24 always rounds down)."""
    shape = x.shape
    zeros = torch.zeros(shape)
    ones = torch.full(shape, 1.0 - 2.0**-24)
    up = encode(fmt, x, uniform=zeros, bits=torch.full(shape, 0xFFFF, dtype=torch.int64)).decode(fmt)
    down = encode(fmt, x, uniform=ones, bits=torch.zeros(shape, dtype=torch.int64)).decode(fmt)
    return down, up


@pytest.mark.parametrize("spec", SR_SPECS)
def test_sr_is_unbiased_and_lands_on_a_neighbour(spec):
    """Each draw is one of the two neighbours; the count of round-ups per element is binomial with
    p = (x - down) / (up - down). A biased rounding (RNE, or up with any other probability) fails."""
    fmt = F.parse(spec)
    x = torch.randn(1, 16, 32) * 3
    down, up = neighbours(fmt, x)
    # x lies between its neighbours (up to the decode scale's rounding: s = 1 / m is inexact),
    # except where nvfp4 saturates: a block scale rounded down to E4M3 clips the block's amax to 6.
    lo, hi = torch.minimum(down, up), torch.maximum(down, up)
    slack = 1e-6 * x.abs()
    inside = (lo - slack <= x) & (x <= hi + slack)
    assert bool(inside.all()) or (spec.startswith("nvfp4") and float(inside.float().mean()) > 0.97)
    n = 300
    draws = torch.stack([fmt.fake_quant(x, seed=s) for s in range(n)])
    is_up, is_down = draws == up, draws == down
    assert bool((is_up | is_down).all()), "a draw left the two neighbours"
    gap = up - down
    varying = gap != 0
    p = torch.where(varying, (x - down) / torch.where(varying, gap, 1.0), 0.0).clamp(0, 1)[varying].double()
    k = is_up.sum(0)[varying].double()
    var = n * p * (1 - p)
    # per element: within 6 sigma (+2 for tiny p); all elements pooled: |z| < 5
    assert bool(((k - n * p).abs() <= 6 * var.sqrt() + 2).all())
    z = float((k - n * p).sum() / var.sum().sqrt())
    assert abs(z) < 5, z
    # the same per-element check rejects round-to-nearest, a biased rounding
    rne = F.parse(spec.replace(":sr", "")).fake_quant(x)
    k_rne = n * (rne == up)[varying].double()
    assert not bool(((k_rne - n * p).abs() <= 6 * var.sqrt() + 2).all())


def test_sr_values_are_the_two_neighbours_for_int8():
    x = torch.full((1, 1, 4096), 0.3)
    x[0, 0, 0] = 127.0  # pins amax so that the multiplier is 127 / 127 = 1: v = x
    y = F.parse("int8:sr").quantize(x, seed=3).codes[0, 0, 1:].float()
    assert set(y.unique().tolist()) == {0.0, 1.0}
    assert abs(float(y.mean()) - 0.3) < 0.03


def test_same_seed_same_result_different_seed_differs():
    x = torch.randn(2, 8, 64)
    fmt = F.parse("fp8_e4m3:sr")
    assert torch.equal(fmt.fake_quant(x, seed=5), fmt.fake_quant(x, seed=5))
    assert not torch.equal(fmt.fake_quant(x, seed=5), fmt.fake_quant(x, seed=6))
    assert not torch.equal(fmt.fake_quant(x, seed=5, stream=1), fmt.fake_quant(x, seed=5, stream=2))


def test_bad_seed():
    with pytest.raises(ValueError, match="seed must be an integer"):
        F.parse("int8:sr").quantize(torch.randn(2, 4), seed=-1)
