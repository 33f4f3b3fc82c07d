"""Error traces of a simulation: per recorded step, per variant, per (batch, head).

The raw metrics are sums of squares, so any aggregation can be formed exactly: the relative error of a
set of (batch, head) pairs is sqrt(sum err^2 / sum ref^2) over the set (a pooled Frobenius ratio),
and the SNR is -20 log10 of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from .naive import METRIC_NAMES

QUANTITIES = ("state", "out")


def _ratio(err2: np.ndarray, ref2: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(np.where(ref2 > 0, err2 / ref2, np.where(err2 > 0, np.inf, 0.0)))


def snr_db(rel_err: np.ndarray) -> np.ndarray:
    """Signal-to-noise ratio in dB of a relative error (inf where the error is 0)."""
    with np.errstate(divide="ignore"):
        return -20.0 * np.log10(rel_err)


@dataclass
class Trace:
    """Metrics of one simulated layer.

    variants: names, in order; steps: int64 [R] 1-based recorded steps; metrics: float64 [V, R, B, H, 4]
    (METRIC_NAMES along the last dim); meta: provenance (layer kind, shapes, backend, data source...).
    """

    variants: list[str]
    steps: np.ndarray
    metrics: np.ndarray
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_metrics(cls, variants, steps, metrics: torch.Tensor, meta: dict) -> Trace:
        return cls(list(variants), np.asarray(steps.cpu()), metrics.detach().double().cpu().numpy(), dict(meta))

    def _index(self, variant: str) -> int:
        try:
            return self.variants.index(variant)
        except ValueError:
            raise KeyError(f"unknown variant {variant!r}; this trace has: {', '.join(self.variants)}") from None

    def rel_err(self, quantity: str = "state", *, per_head: bool = False, per_batch: bool = False) -> np.ndarray:
        """Relative error, pooled over (batch, head) unless per_head / per_batch.

        Returns [V, R] (pooled), [V, R, H] (per_head), [V, R, B] (per_batch) or [V, R, B, H] (both).
        """
        if quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {QUANTITIES}, got {quantity!r}")
        e = 0 if quantity == "state" else 2
        err2, ref2 = self.metrics[..., e], self.metrics[..., e + 1]
        axes = tuple(ax for ax, keep in ((2, per_batch), (3, per_head)) if not keep)
        return _ratio(err2.sum(axis=axes), ref2.sum(axis=axes))

    def final(self, quantity: str = "state") -> dict[str, float]:
        """Pooled relative error at the last recorded step, per variant."""
        r = self.rel_err(quantity)[:, -1]
        return dict(zip(self.variants, r.tolist()))

    def to_frame(self, *, per_head: bool = False) -> pd.DataFrame:
        """Long table: one row per (variant, step[, head]) with state/out relative error and SNR (dB)."""
        s = self.rel_err("state", per_head=per_head)
        o = self.rel_err("out", per_head=per_head)
        nv, nr = s.shape[0], s.shape[1]
        cols = {
            "variant": np.repeat(np.array(self.variants, dtype=object), nr * (s.shape[2] if per_head else 1)),
            "step": np.tile(np.repeat(self.steps, s.shape[2] if per_head else 1), nv),
        }
        if per_head:
            cols["head"] = np.tile(np.arange(s.shape[2]), nv * nr)
        cols["state_rel_err"] = s.reshape(-1)
        cols["out_rel_err"] = o.reshape(-1)
        cols["state_snr_db"] = snr_db(cols["state_rel_err"])
        cols["out_snr_db"] = snr_db(cols["out_rel_err"])
        return pd.DataFrame(cols)


__all__ = ["METRIC_NAMES", "QUANTITIES", "Trace", "snr_db"]
