"""Growth of the error over the decode horizon: a power law err(t) ~ a t^b fitted in log-log space.

The fit uses the recorded steps after the scheme's first write (the first step whose stored state was
rounded: 1 for conventional decoding, L for replay(L)) and from step 8 on, where the error has started
to accumulate. An exponent b ~ 0.5 is a random walk of independent rounding errors; b ~ 0 a bounded
error; b ~ 1 a systematic drift. Forecasts beyond the measured horizon extrapolate that fit and are
labelled as forecasts everywhere they appear, with the fit's r^2. A forecast is withheld (NaN, with a
status saying why) when the fit explains less than MIN_FORECAST_R2 of the variance of log error
("unreliable": a flat or noisy curve, e.g. replay's saw-tooth, has no power law to extrapolate), or when
it reaches a relative error of 1 ("diverged": the error is as large as the signal, where a power law of
a relative error means nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_FIT_STEP = 8
MIN_FIT_POINTS = 4
MIN_FORECAST_R2 = 0.5
DIVERGED = 1.0  # relative error: the error is as large as the signal
FORECAST_STATUSES = ("ok", "unreliable", "diverged")


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


def forecast(fit: PowerFit, step: int, measured: float = float("nan")) -> tuple[float, str]:
    """(value, status) of the fit's forecast at ``step``: status "ok" with the value, else NaN and
    "diverged" (the forecast or the ``measured`` error at the horizon reaches DIVERGED) or "unreliable"
    (no fit, or r^2 < MIN_FORECAST_R2)."""
    value = fit.predict(step)
    if (np.isfinite(measured) and measured >= DIVERGED) or (np.isfinite(value) and value >= DIVERGED):
        return float("nan"), "diverged"
    if not np.isfinite(value) or not np.isfinite(fit.r2) or fit.r2 < MIN_FORECAST_R2:
        return float("nan"), "unreliable"
    return value, "ok"


def forecast_columns(quantity: str, fit: PowerFit, steps, measured: float) -> dict:
    """Summary columns forecast_<quantity>_<k>k and forecast_<quantity>_<k>k_status for each step."""
    out = {}
    for step in steps:
        value, status = forecast(fit, step, measured)
        out[f"forecast_{quantity}_{step // 1024}k"] = value
        out[f"forecast_{quantity}_{step // 1024}k_status"] = status
    return out


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
