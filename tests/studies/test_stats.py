"""The studies' statistics helpers: bootstrap intervals, pooled errors, rank-correlation permutation tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from studies.common.errors import Cube
from studies.common.stats import (
    bootstrap,
    pooled_rel_err,
    rank_correlation_test,
    resample_indices,
    resample_weights,
    spearman,
)


def test_resample_indices_stay_in_their_stratum_and_keep_counts():
    strata = np.array(["a", "a", "b", "b", "b", "c"])
    idx = resample_indices(strata, 500, np.random.default_rng(1))
    assert idx.shape == (500, 6)
    assert (strata[idx] == strata[None, :]).all()  # column j draws from unit j's stratum
    assert (idx[:, 5] == 5).all()  # a stratum of one unit can only redraw it
    assert set(np.unique(idx[:, :2])) == {0, 1}


def test_bootstrap_interval_of_a_mean_matches_the_normal_theory_interval():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=400)
    iv = bootstrap(lambda i: float(x[i].mean()), len(x), resamples=4000, seed=0)
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x))
    assert iv.estimate == pytest.approx(x.mean())
    assert iv.low == pytest.approx(x.mean() - half, abs=0.25 * half)
    assert iv.high == pytest.approx(x.mean() + half, abs=0.25 * half)
    assert iv.contains(3.0) and iv.units == 400 and iv.nonfinite == 0
    again = bootstrap(lambda i: float(x[i].mean()), len(x), resamples=4000, seed=0)
    assert (again.low, again.high) == (iv.low, iv.high)  # seeded


def test_bootstrap_coverage_is_near_nominal():
    """Over 200 independent samples of 30 normals, the 90% interval of the mean covers the true mean
    in 80-97% of them (the percentile bootstrap is a little narrow at n = 30)."""
    rng = np.random.default_rng(5)
    hits = 0
    for k in range(200):
        x = rng.normal(0.0, 1.0, size=30)
        iv = bootstrap(lambda i, x=x: float(x[i].mean()), len(x), resamples=400, level=0.9, seed=k)
        hits += iv.contains(0.0)
    assert 160 <= hits <= 194


def test_bootstrap_counts_nonfinite_resamples_and_rejects_bad_settings():
    x = np.array([1.0, 2.0, np.inf])
    iv = bootstrap(lambda i: float(x[i].mean()), 3, resamples=300, seed=0)
    assert iv.estimate == math.inf and 0 < iv.nonfinite < 300  # resamples without the inf are finite
    assert np.isfinite(iv.low) and np.isfinite(iv.high)
    with pytest.raises(ValueError, match="level"):
        bootstrap(lambda i: 0.0, 3, level=1.5)
    with pytest.raises(ValueError, match="strata has 2 labels for 3 units"):
        bootstrap(lambda i: 0.0, 3, strata=[0, 1])


def test_pooled_rel_err():
    err2 = np.array([[1.0, 3.0], [0.0, 0.0], [1.0, 0.0], [np.nan, 1.0]])
    ref2 = np.array([[2.0, 2.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    out = pooled_rel_err(err2, ref2, axis=1)
    assert out[0] == pytest.approx(1.0)  # sqrt(4 / 4)
    assert out[1] == 0.0 and out[2] == math.inf and math.isnan(out[3])


def test_cube_ratio_is_paired_over_sequences():
    """Two variants whose errors differ by exactly 2x on every sequence: the ratio's interval is [2, 2]
    although the sequences differ 100-fold."""
    rows = []
    for seq, scale in enumerate([1.0, 10.0, 100.0, 3.0]):
        for layer in (0, 1):
            for variant, e in (("a@conventional", 4.0), ("a@replay16", 1.0)):
                rows.append(
                    {"variant": variant, "layer": layer, "seed": 0, "sequence": seq, "out_err2_all": e * scale, "out_ref2_all": scale}
                )
    import pandas as pd

    cube = Cube.from_frame(pd.DataFrame(rows))
    iv = cube.ratio("a@conventional", "a@replay16")
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((2.0, 2.0, 2.0))
    assert cube.median_layer("a@replay16").estimate == pytest.approx(1.0)


def test_spearman_matches_scipy_with_ties():
    x = np.array([1, 2, 2, 3, 5, 4, 7, 7])
    y = np.array([2, 1, 3, 3, 6, 5, 9, 8])
    assert spearman(x, y) == pytest.approx(sps.spearmanr(x, y)[0])
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_exact_permutation_p_value_matches_scipy():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=6), rng.normal(size=6)
    y = y + x  # some association
    ours = rank_correlation_test(x, y)
    ref = sps.permutation_test(  # scipy enumerates all 720 pairings of x with y
        (x,),
        lambda a: sps.spearmanr(a, y)[0],
        permutation_type="pairings",
        n_resamples=np.inf,
        vectorized=False,
        alternative="two-sided",
    )
    assert ours.method == "exact" and ours.permutations == math.factorial(6)
    assert ours.statistic == pytest.approx(ref.statistic)
    assert ours.p_value == pytest.approx(ref.pvalue)


def test_perfect_order_of_four_has_exact_p_one_in_twelve():
    r = rank_correlation_test([1, 2, 3, 4], [10, 20, 30, 40])
    assert r.statistic == pytest.approx(1.0)
    assert r.p_value == pytest.approx(2 / 24)  # the identity and the reversal are as extreme
    assert r.p_floor == pytest.approx(1 / 24)


def test_monte_carlo_p_value_floor_and_null():
    x = np.arange(40.0)
    strong = rank_correlation_test(x, x**2, permutations=999, seed=0)
    assert strong.method == "monte carlo" and strong.p_value == pytest.approx(1 / 1000)
    noise = rank_correlation_test(x, np.random.default_rng(0).normal(size=40), permutations=999, seed=0)
    assert noise.p_value > 0.05


def test_within_group_permutation_ignores_differences_between_groups():
    """Groups differ in both x and y (a pooled correlation of ~1) but inside each group y is unrelated to
    x: the within-group statistic is near 0 and not significant."""
    rng = np.random.default_rng(2)
    groups = np.repeat(np.arange(5), 8)
    x = groups * 10 + rng.normal(size=40)
    y = groups * 10 + rng.normal(size=40)
    assert spearman(x, y) > 0.9
    r = rank_correlation_test(x, y, groups, permutations=1999, seed=1)
    assert abs(r.statistic) < 0.3 and r.p_value > 0.05
    same = rank_correlation_test(x, x + 0.01 * rng.normal(size=40), groups, permutations=1999, seed=1)
    assert same.statistic > 0.9 and same.p_value == pytest.approx(1 / 2000)


def test_rank_correlation_test_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="1-d arrays of one length"):
        rank_correlation_test([1, 2, 3], [1, 2])
    assert math.isnan(rank_correlation_test([1, 1, 1, 1], [1, 2, 3, 4]).p_value)


def test_vectorized_bootstrap_equals_the_loop_over_resamples():
    """The weights form (one matrix product for all resamples) draws the same resamples as the index form."""
    x = np.random.default_rng(4).lognormal(size=12)
    loop = bootstrap(lambda i: float(x[i].mean()), 12, resamples=300, seed=7)
    vec = bootstrap(lambda w: w @ x / w.sum(1), 12, resamples=300, seed=7, vectorized=True)
    assert (vec.estimate, vec.low, vec.high) == pytest.approx((loop.estimate, loop.low, loop.high), rel=1e-12)
    w = resample_weights(5, 50, strata=[0, 0, 1, 1, 1], seed=1)
    assert w.shape == (51, 5) and (w[0] == 1).all()
    assert (w[:, :2].sum(1) == 2).all() and (w[:, 2:].sum(1) == 3).all()  # strata keep their counts
