"""Bit-exact rounding against torch's own casts and hand-written tables (atol=0, rtol=0)."""

import numpy as np
import pytest
import torch

from ssmquant.formats import E2M1, E4M3, FP16, INT8, Rounding, round_integer, round_to_bf16, round_to_grid


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


def all_finite_e4m3() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)]


def many_binades(n: int, lo: int, hi: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g) + 1.0
    exp = torch.randint(lo, hi, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return sign * mant * torch.exp2(exp)


def test_e4m3_every_finite_value_is_fixed():
    v = all_finite_e4m3()
    assert v.numel() == 254
    assert torch.equal(bits(round_to_grid(v, E4M3)), bits(v))


def test_e4m3_midpoints_round_to_even_like_torch():
    pos = torch.unique(all_finite_e4m3().abs())
    mids = (pos[:-1] + pos[1:]) / 2  # exact in FP32
    mids = torch.cat([mids, -mids])
    ref = mids.to(torch.float8_e4m3fn).float()
    got = round_to_grid(mids, E4M3)
    assert torch.equal(bits(got), bits(ref))
    # a tie rounds to the code with an even mantissa: e.g. 1.0625 -> 1.0, 1.1875 -> 1.25
    assert round_to_grid(torch.tensor([1.0625, 1.1875, 7.75, 15.0 / 1024]), E4M3).tolist() == [1.0, 1.25, 8.0, 0.015625]


def test_e4m3_random_values_over_many_binades():
    x = many_binades(1_000_000, -14, 10)  # subnormals (< 2^-6) through saturation (> 448)
    ref = torch.clamp(x, -448.0, 448.0).to(torch.float8_e4m3fn).float()
    assert torch.equal(bits(round_to_grid(x, E4M3)), bits(ref))


def test_e4m3_carry_across_power_of_two():
    # the interpreter's native cast loses this carry (ARCHITECTURE.md, "Formats"); arithmetic rounding must not
    x = torch.tensor([7.79, 15.9, 31.5, 0.0155, 447.0, 460.0, 1e6])
    assert round_to_grid(x, E4M3).tolist() == [8.0, 16.0, 32.0, 0.015625, 448.0, 448.0, 448.0]


def test_e4m3_subnormals():
    sub = torch.arange(0, 8, dtype=torch.float32) * 2.0**-9  # 0 and the 7 subnormals
    assert torch.equal(round_to_grid(sub, E4M3), sub)
    assert round_to_grid(torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-11]), E4M3).tolist() == [0.0, 2.0**-9, 0.0]


def test_fp16_matches_torch_cast_including_overflow_and_subnormals():
    x = torch.cat([many_binades(500_000, -28, 18, seed=1), torch.tensor([65504.0, 65519.0, 65520.0, -70000.0])])
    ref = x.to(torch.float16).float()
    got = round_to_grid(x, FP16)
    assert torch.equal(bits(got), bits(ref))
    assert torch.isinf(got[-2:]).all()


def test_bf16_matches_torch_cast():
    x = torch.cat([many_binades(500_000, -140, 120, seed=2), torch.tensor([0.0, -0.0, 3.0e38, 1e-45])])
    assert torch.equal(bits(round_to_bf16(x)), bits(x.to(torch.bfloat16).float()))


# E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}: a hand-written RNE table with every tie.
E2M1_TABLE = [
    (0.0, 0.0), (0.2, 0.0), (0.25, 0.0), (0.26, 0.5), (0.5, 0.5), (0.74, 0.5), (0.75, 1.0), (1.0, 1.0),
    (1.25, 1.0), (1.26, 1.5), (1.5, 1.5), (1.75, 2.0), (2.0, 2.0), (2.49, 2.0), (2.5, 2.0), (2.51, 3.0),
    (3.0, 3.0), (3.5, 4.0), (4.0, 4.0), (4.99, 4.0), (5.0, 4.0), (5.01, 6.0), (6.0, 6.0), (7.0, 6.0), (1e9, 6.0),
]  # fmt: skip


@pytest.mark.parametrize("x,expected", E2M1_TABLE)
def test_e2m1_table(x, expected):
    got = round_to_grid(torch.tensor([x, -x]), E2M1)
    assert got.tolist() == [expected, -expected]


def test_int8_rne_matches_numpy_rint():
    v = torch.randn(100_000) * 80
    v = torch.cat([v, torch.arange(-130, 131, dtype=torch.float32) + 0.5])  # every tie
    ref = np.clip(np.rint(v.numpy()), -127, 127)  # numpy rounds half to even
    got = round_integer(torch.clamp(v, -127, 127), Rounding.RNE, None)
    assert np.array_equal(got.numpy(), ref)
    assert np.array_equal(round_to_grid(v, INT8).numpy(), ref)  # the grid form the codec uses


def all_finite_e5m2() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).float()
    return v[torch.isfinite(v)]


def test_e5m2_matches_the_saturating_cast_bit_for_bit():
    """E5M2 (issue 43: the fp8_e5m2 state of FlashInfer's GDN prefill): every finite code is fixed, midpoints round to
    even, and values over 18 binades, subnormals (< 2^-14) to saturation (> 57344), round as torch's float8_e5m2 cast
    of the clamped value (the engines' cvt.rn.satfinite clamps; torch's own cast overflows to inf)."""
    from ssmquant.formats.grids import E5M2

    v = all_finite_e5m2()
    assert v.numel() == 248 and torch.equal(bits(round_to_grid(v, E5M2)), bits(v))
    pos = torch.unique(v.abs())
    mids = torch.cat([(pos[:-1] + pos[1:]) / 2, -(pos[:-1] + pos[1:]) / 2])
    assert torch.equal(bits(round_to_grid(mids, E5M2)), bits(mids.to(torch.float8_e5m2).float()))
    x = many_binades(1_000_000, -20, 18)
    ref = torch.clamp(x, -57344.0, 57344.0).to(torch.float8_e5m2).float()
    assert torch.equal(bits(round_to_grid(x, E5M2)), bits(ref))
    for r in (Rounding.RNE, Rounding.SR):
        u = torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
        assert float(round_to_grid(torch.tensor([1e9, -1e9]), E5M2, r, u[:2]).abs().max()) == 57344.0


@pytest.mark.parametrize("name,dtype,top", [("fp8_e4m3_cast", torch.float8_e4m3fn, 448.0),
                                            ("fp8_e5m2_cast", torch.float8_e5m2, 57344.0)])  # fmt: skip
def test_a_plain_cast_state_is_the_saturating_cast_without_a_scale(name, dtype, top):
    from ssmquant.formats import dequantize, parse, quantize

    x = many_binades(4096, -22, 20).reshape(2, 4, 8, 64)
    q = quantize(parse(name), x)
    assert q.scale is None and q.codes.dtype == dtype
    assert torch.equal(bits(dequantize(q)), bits(torch.clamp(x, -top, top).to(dtype).float()))
