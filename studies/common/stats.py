"""Statistics of the study pages: bootstrap confidence intervals over sequences and permutation tests.

Units. Every error on the pages is a pooled relative error sqrt(sum err^2 / sum ref^2) over a set of
decode steps, heads and sequences. Sequences are the independent units: a bootstrap resample draws
sequences with replacement (optionally within strata, keeping every stratum's count) and recomputes the
whole statistic (pooled errors per layer, median over layers, ratios) from the resampled sequences. Variants that share inputs are resampled together (paired), so a ratio's interval reflects
only the variation that does not cancel between them. The interval is the percentile interval of the
resampled statistics.

Permutation tests replace asymptotic p-values on small samples: the p-value of a rank correlation is the
share of relabellings (all of them when there are few, else a seeded random subset, counting the
observed one) whose statistic is at least as extreme as the observed one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

DEFAULT_RESAMPLES = 2000
DEFAULT_PERMUTATIONS = 9999
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A statistic with its bootstrap percentile interval [low, high] at `level`, from `resamples` draws of
    `units` units (sequences). Non-finite draws (a diverged resample) are counted in `nonfinite`; the
    interval then covers the finite ones only and is NaN when none is finite."""

    estimate: float
    low: float
    high: float
    level: float
    resamples: int
    units: int
    nonfinite: int = 0

    def contains(self, value: float) -> bool:
        return bool(self.low <= value <= self.high)

    def excludes(self, value: float) -> bool:
        """True when the interval lies entirely on one side of `value` (a difference the data support)."""
        return bool(np.isfinite(self.low) and np.isfinite(self.high) and not self.contains(value))


def resample_indices(strata, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap indices [resamples, n]: each row draws, within every stratum, as many units as it holds.

    strata: [n] labels (any hashable values; one label = plain bootstrap). Column j of a row belongs to the
    same stratum as unit j, so a row is a resample of the same design.
    """
    strata = np.asarray(strata)
    n = len(strata)
    if n == 0:
        raise ValueError("no units to resample")
    out = np.empty((resamples, n), dtype=np.int64)
    for label in dict.fromkeys(strata.tolist()):
        members = np.flatnonzero(strata == label)
        out[:, members] = rng.choice(members, size=(resamples, len(members)), replace=True)
    return out


def resample_weights(units: int, resamples: int, *, strata=None, seed: int = 0) -> np.ndarray:
    """[1 + resamples, units] float64: how often each unit is drawn in each resample, row 0 all ones (the
    sample itself). A statistic that is a function of weighted sums over units (pooled errors, means) is
    evaluated for every resample at once by one matrix product with these weights."""
    strata = np.zeros(units, dtype=np.int64) if strata is None else np.asarray(strata)
    if len(strata) != units:
        raise ValueError(f"strata has {len(strata)} labels for {units} units")
    idx = resample_indices(strata, resamples, np.random.default_rng(seed))
    w = np.zeros((resamples + 1, units))
    w[0] = 1.0
    np.add.at(w, (np.repeat(np.arange(1, resamples + 1), units), idx.reshape(-1)), 1.0)
    return w


def percentile_interval(estimate: float, draws: np.ndarray, level: float, units: int) -> Interval:
    """The percentile interval of the finite bootstrap draws (NaN bounds when none is finite)."""
    draws = np.asarray(draws, dtype=np.float64)
    finite = draws[np.isfinite(draws)]
    if len(finite) == 0:
        low = high = math.nan
    else:
        tail = (1 - level) / 2 * 100
        low, high = (float(x) for x in np.percentile(finite, [tail, 100 - tail]))
    return Interval(float(estimate), low, high, level, len(draws), units, int(len(draws) - len(finite)))


def bootstrap(
    statistic: Callable[[np.ndarray], float],
    units: int,
    *,
    strata=None,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
    vectorized: bool = False,
) -> Interval:
    """Percentile bootstrap of a statistic over units drawn with replacement (within strata if given).

    statistic: maps an index array [units] (which units, with repeats) to a float; it is called once with
    arange(units) for the estimate, then once per resample. vectorized=True: it maps the weights
    [1 + resamples, units] of `resample_weights` to the statistic of every row at once ([1 + resamples];
    row 0 is the estimate). strata: optional [units] stratum labels (resample_indices).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    n = int(units)
    if vectorized:
        values = np.asarray(statistic(resample_weights(n, resamples, strata=strata, seed=seed)), dtype=np.float64)
        return percentile_interval(values[0], values[1:], level, n)
    strata = np.zeros(n, dtype=np.int64) if strata is None else np.asarray(strata)
    if len(strata) != n:
        raise ValueError(f"strata has {len(strata)} labels for {n} units")
    estimate = float(statistic(np.arange(n)))
    idx = resample_indices(strata, resamples, np.random.default_rng(seed))
    return percentile_interval(estimate, np.array([statistic(row) for row in idx]), level, n)


def pooled_rel_err(err2: np.ndarray, ref2: np.ndarray, axis=None) -> np.ndarray:
    """sqrt(sum err2 / sum ref2) over `axis`: the pooled relative error (inf when only ref2 sums to 0,
    NaN when err2 is NaN: a diverged run)."""
    e = np.sum(err2, axis=axis)
    r = np.sum(ref2, axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(np.where(r > 0, e / r, np.where(e > 0, np.inf, 0.0)))


def spearman(x, y) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    rx, ry = rankdata(x), rankdata(y)
    if np.ptp(rx) == 0 or np.ptp(ry) == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


@dataclass(frozen=True)
class PermutationResult:
    """statistic, its two-sided permutation p-value, how it was computed ("exact": every relabelling;
    "monte carlo": `permutations` random ones plus the observed one), and the smallest p it could give."""

    statistic: float
    p_value: float
    method: str
    permutations: int

    @property
    def p_floor(self) -> float:
        return 1.0 / self.permutations if self.method == "exact" else 1.0 / (self.permutations + 1)


def _centered_ranks(v: np.ndarray) -> np.ndarray | None:
    """Ranks minus their mean, scaled to unit norm; None when constant (no correlation defined)."""
    r = rankdata(v)
    r = r - r.mean()
    norm = math.sqrt(float((r * r).sum()))
    return None if norm == 0 else r / norm


def rank_correlation_test(
    x, y, groups=None, *, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0
) -> PermutationResult:
    """Spearman correlation of x and y with a two-sided permutation p-value.

    groups: optional [n] labels; the statistic is then the mean of the within-group correlations (groups
    with fewer than 3 units or a constant side are left out) and y is permuted only within groups, so
    differences between groups neither create nor hide an association. Exact (every relabelling) when
    there are at most `permutations` of them, else Monte Carlo with p = (1 + #{|stat*| >= |stat|}) /
    (1 + permutations).
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-d arrays of one length, got {x.shape} and {y.shape}")
    groups = np.zeros(len(x), dtype=np.int64) if groups is None else np.asarray(groups)
    parts = []  # (centered x ranks, centered y ranks) per usable group
    for g in dict.fromkeys(groups.tolist()):
        m = groups == g
        if m.sum() < 3:
            continue
        rx, ry = _centered_ranks(x[m]), _centered_ranks(y[m])
        if rx is not None and ry is not None:
            parts.append((rx, ry))
    if not parts:
        return PermutationResult(math.nan, math.nan, "n/a", 0)
    # Permuting y permutes its ranks, so each group's correlation under a relabelling p is rx . ry[p].
    observed = float(np.mean([rx @ ry for rx, ry in parts]))
    total = math.prod(math.factorial(len(rx)) for rx, _ in parts)
    rng = np.random.default_rng(seed)
    if total <= permutations:
        method = "exact"
        per_group = [np.array(list(itertools.permutations(range(len(rx))))) for rx, _ in parts]
        null = np.zeros(total)
        for k, combo in enumerate(itertools.product(*[range(len(p)) for p in per_group])):
            null[k] = np.mean([rx @ ry[pg[c]] for (rx, ry), pg, c in zip(parts, per_group, combo)])
    else:
        method = "monte carlo"
        null = np.zeros(permutations)
        for rx, ry in parts:
            orders = rng.permuted(np.tile(np.arange(len(rx)), (permutations, 1)), axis=1)
            null += ry[orders] @ rx
        null /= len(parts)
    extreme = int(np.sum(np.abs(null) >= abs(observed) - 1e-12))
    if method == "exact":
        return PermutationResult(observed, extreme / total, method, total)
    return PermutationResult(observed, (1 + extreme) / (1 + permutations), method, permutations)


__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_PERMUTATIONS",
    "DEFAULT_RESAMPLES",
    "Interval",
    "PermutationResult",
    "bootstrap",
    "percentile_interval",
    "pooled_rel_err",
    "rank_correlation_test",
    "resample_indices",
    "resample_weights",
    "spearman",
]
