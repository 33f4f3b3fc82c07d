"""The tensor-core MMA model (`flashinfer.hmma`) and the fast-math pieces, on hand-made sums."""

import torch

from ssmquant.engines import flashinfer as fi


def _mma(a_vals, b_vals, c=None):
    a = torch.tensor([a_vals], dtype=torch.float32)  # [P=1, K]
    b = torch.tensor(b_vals, dtype=torch.float32)[:, None]  # [K, N=1]
    cc = None if c is None else torch.tensor([[c]], dtype=torch.float32)
    return fi.hmma(a, b, cc).item()


def test_products_exact_and_small_terms_truncated_below_the_window():
    assert _mma([1.0, 2.0, 0.5, 0.0], [1.0, 4.0, 2.0, 3.0]) == 10.0
    # 4 terms of 2^-25 sit inside the 26-bit window of 1.0 (quantum 2^-25): kept, 1 + 2^-23
    assert _mma([1.0] + [2.0**-12] * 4, [1.0] + [2.0**-13] * 4) == 1.0 + 2.0**-23
    # 2^-26 is below the window: each term truncates to zero, whatever their number
    assert _mma([1.0] + [2.0**-13] * 8, [1.0] + [2.0**-13] * 8) == 1.0


def test_alignment_uses_the_exponent_sum_not_the_product_exponent():
    # 1.5 * 1.5 = 2.25 has exponent 1, but its factors' exponents sum to 0: the window is that of 1.0, so
    # eight 2^-25 terms (one ulp of 2.25 together) are kept; aligned to 2.25 they would truncate to zero
    assert _mma([1.5] + [2.0**-12] * 8, [1.5] + [2.0**-13] * 8) == 2.25 + 2.0**-22


def test_accumulator_takes_part_in_the_alignment_and_the_sum_truncates():
    # c = 16 sets the window (quantum 2^-21): 2^-22 products vanish, 2^-21 ones stay
    assert _mma([2.0**-11] * 4, [2.0**-11] * 4, c=16.0) == 16.0
    assert _mma([2.0**-10] * 2, [2.0**-11] * 2, c=16.0) == 16.0  # 2 * 2^-21 < ulp(16) = 2^-19: truncated
    assert _mma([2.0**-10] * 4, [2.0**-11] * 4, c=16.0) == 16.0 + 2.0**-19
    assert _mma([2.0**-10] * 6, [2.0**-11] * 6, c=16.0) == 16.0 + 2.0**-19  # 1.5 ulp, toward zero
    # negative terms truncate toward zero, the sum toward zero
    assert _mma([-1.0, 2.0**-12], [1.0, 2.0**-12], c=None) == -(1.0 - 2.0**-24)  # -1 + 2^-24 exactly representable
    assert _mma([1.0, -(2.0**-12)], [1.0, 2.0**-13]) == 1.0 - 2.0**-24  # 1 - 2^-25 truncated toward zero


def test_fast_math_pieces():
    v = torch.tensor([0.0, -1.0, -0.5, -200.0])
    e = fi.fast_expf(v)
    assert e[0] == 1.0 and e[3] == 0.0  # results below 2^-126 flush to zero (ftz)
    exact = torch.exp(v[:3].double())
    assert bool(((e[:3].double() - exact).abs() <= exact * 2.0**-22).all())
    # __expf = MUFU.EX2 of RN(v log2e): the exact model, not the correctly rounded or toward-zero 2^x
    assert torch.equal(e, fi.ex2_approx(v * fi.LOG2E_F32))
    x = torch.tensor([3.0, 0.1, 127.0, (1 + 1449 * 2.0**-23) * 2.0**-5])
    got = fi.rcp_approx(x).view(torch.int32) - fi.rcp_rn(x).view(torch.int32)
    assert got.tolist() == [0, 0, 0, -1]  # significand 1449 of MUFU.RCP is one ulp below RN(1/x) on the H200
