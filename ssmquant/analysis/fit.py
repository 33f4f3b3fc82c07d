"""Growth of the error over the decode horizon: a power law err(t) ~ a t^b fitted in log-log space.

The fit uses the recorded steps after the scheme's first write (the first step whose stored state was
rounded: 1 for conventional decoding, L for replay(L)) and from step 8 on, where the error has started
to accumulate. An exponent b ~ 0.5 is a random walk of independent rounding errors; b ~ 0 a bounded
error; b ~ 1 a systematic drift. Forecasts beyond the measured horizon extrapolate that fit and are
labelled as forecasts everywhere they appear.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_FIT_STEP = 8
MIN_FIT_POINTS = 4


@dataclass(frozen=True)
class PowerFit:
    """err(t) ~ a * t^b over steps [t_first, t_last]; r2 of the log-log regression; NaN when unfit."""

    a: float
    b: float
    r2: float
    t_first: int
    t_last: int
    points: int

    def predict(self, step: float) -> float:
        if not np.isfinite(self.b):
            return float("nan")
        return float(self.a * step**self.b)


NO_FIT = PowerFit(float("nan"), float("nan"), float("nan"), 0, 0, 0)


def fit_power_law(steps: np.ndarray, err: np.ndarray, first_write: int) -> PowerFit:
    """Least-squares fit of log err = log a + b log t over steps >= max(first_write, MIN_FIT_STEP).

    steps: 1-based recorded steps [R]; err: relative errors [R]. Steps with zero or non-finite error
    are left out (an fp32 variant has none left, and returns NO_FIT).
    """
    steps = np.asarray(steps, dtype=np.float64)
    err = np.asarray(err, dtype=np.float64)
    keep = (steps >= max(first_write, MIN_FIT_STEP)) & np.isfinite(err) & (err > 0)
    if keep.sum() < MIN_FIT_POINTS:
        return NO_FIT
    x, y = np.log(steps[keep]), np.log(err[keep])
    b, log_a = np.polyfit(x, y, 1)
    resid = y - (log_a + b * x)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (resid**2).sum() / total if total > 0 else 1.0
    return PowerFit(
        float(np.exp(log_a)), float(b), float(r2), int(steps[keep][0]), int(steps[keep][-1]), int(keep.sum())
    )
