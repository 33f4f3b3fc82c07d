"""Pooled errors from the per-sequence tables, and their bootstrap intervals over sequences.

A `Cube` holds, for one model, the sums err2 / ref2 of every (variant, layer, unit), a unit being one
sequence of one seed. The pages' statistics are functions of the per-layer pooled errors [V, L] (median
over layers, worst layer, ratios of two variants), and `Cube.interval` bootstraps any such function over
the units (`stats.bootstrap`: (seed, sequence) pairs drawn with replacement from all of them, so the
interval covers the variation between sequences and between seeds); variants and layers share the units,
so ratios are paired.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .stats import DEFAULT_RESAMPLES, Interval, bootstrap, pooled_rel_err


@dataclass
class Cube:
    variants: list[str]
    layers: list[int]
    units: list[tuple[int, int]]  # (seed, sequence)
    err2: np.ndarray  # [V, L, U]
    ref2: np.ndarray  # [V, L, U]

    @classmethod
    def from_frame(
        cls, df: pd.DataFrame, quantity: str = "out", window: str = "all", variants: list[str] | None = None
    ) -> Cube:
        """df: rows of one model with variant, layer, seed, sequence and `{quantity}_{err2,ref2}_{window}`."""
        variants = list(dict.fromkeys(df["variant"])) if variants is None else list(variants)
        layers = sorted(df["layer"].unique().tolist())
        units = sorted({(int(s), int(q)) for s, q in zip(df["seed"], df["sequence"])})
        shape = (len(variants), len(layers), len(units))
        err2, ref2 = np.full(shape, np.nan), np.full(shape, np.nan)
        vi = {v: i for i, v in enumerate(variants)}
        li = {la: i for i, la in enumerate(layers)}
        ui = {u: i for i, u in enumerate(units)}
        e, r = f"{quantity}_err2_{window}", f"{quantity}_ref2_{window}"
        for row in df[df["variant"].isin(vi)].itertuples(index=False):
            d = row._asdict()
            k = (vi[d["variant"]], li[d["layer"]], ui[(int(d["seed"]), int(d["sequence"]))])
            err2[k], ref2[k] = d[e], d[r]
        return cls(variants, layers, units, err2, ref2)

    def index(self, variant: str) -> int:
        return self.variants.index(variant)

    def layer_errors(self, weights: np.ndarray | None = None) -> np.ndarray:
        """Pooled relative error of each layer: [V, L] over all units, or [V, L, R] for unit weights [R, U]
        (`stats.resample_weights`: each row a resample)."""
        if weights is None:
            return pooled_rel_err(self.err2, self.ref2, axis=2)
        with np.errstate(invalid="ignore"):  # an inf (diverged) unit drawn 0 times gives NaN: still non-finite
            e, r = self.err2 @ weights.T, self.ref2 @ weights.T
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.sqrt(np.where(r > 0, e / r, np.where(e > 0, np.inf, 0.0)))

    def interval(
        self, fn: Callable[[np.ndarray], np.ndarray], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
    ) -> Interval:
        """Bootstrap interval of fn over the units; fn maps layer errors [V, L, R] to one value per resample
        [R] (e.g. `np.median(e[i], axis=0)`)."""
        return bootstrap(
            lambda w: fn(self.layer_errors(w)), len(self.units), resamples=resamples, seed=seed, vectorized=True
        )

    def median_layer(self, variant: str, **kw) -> Interval:
        i = self.index(variant)
        return self.interval(lambda e: np.median(e[i], axis=0), **kw)

    def worst_layer(self, variant: str, **kw) -> Interval:
        i = self.index(variant)
        return self.interval(lambda e: np.max(e[i], axis=0), **kw)

    def ratio(self, num: str, den: str, **kw) -> Interval:
        """median-layer error of `num` / that of `den` (e.g. conventional / replay16)."""
        i, j = self.index(num), self.index(den)
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.interval(lambda e: np.median(e[i], axis=0) / np.median(e[j], axis=0), **kw)


def cubes(seqs: pd.DataFrame, quantity: str = "out", window: str = "all") -> dict[str, Cube]:
    """One Cube per model of a sequences table."""
    return {m: Cube.from_frame(g, quantity, window) for m, g in seqs.groupby("model", sort=False)}
