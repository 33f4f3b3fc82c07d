"""Growth of the error over the decode horizon: a power law err(t) ~ a t^b fitted in log-log space.

The fit uses the recorded steps after the scheme's first write (the first step whose stored state was
rounded: 1 for conventional decoding, L for replay(L)) and from step 8 on, where the error has started
to accumulate. An exponent b ~ 0.5 is a random walk of independent rounding errors; b ~ 0 a bounded
error; b ~ 1 a systematic drift. Forecasts beyond the measured horizon extrapolate that fit and are
labelled as forecasts everywhere they appear, with the fit's r^2. A forecast is withheld (NaN, with a
status saying why, ``forecast``) when the run already diverged, when there is no fit, when the fit explains less
than MIN_FORECAST_R2 of the variance of log error ("unreliable": a flat or noisy curve, e.g. replay's saw-tooth, has
no power law to extrapolate), or when it reaches a relative error of 1 (">=1": the error as large as the signal,
where a power law of a relative error means nothing).

The budget verdict of `analyze --budget` (the end of this module) reads the same fit, of the windows' worst steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_FIT_STEP = 8
MIN_FIT_POINTS = 4
MIN_FORECAST_R2 = 0.5
DIVERGED = 1.0  # relative error: the error is as large as the signal
# "ok": a forecast; "diverged": the measured error already reached DIVERGED (or is not finite); "no fit": too few
# recorded steps past the first write; "unreliable": a fit with r^2 < MIN_FORECAST_R2; ">=1": a reliable fit whose
# forecast reaches DIVERGED (a power law of a relative error means nothing beyond it). Checked in that order: an
# unreliable fit says nothing, not even that it crosses 1.
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
    """(value, status) of the fit's forecast at ``step``: status "ok" with the value, else NaN and, in this order,
    "diverged" (the ``measured`` error at the horizon reached DIVERGED), "no fit", "unreliable" (r^2 <
    MIN_FORECAST_R2) or ">=1" (a reliable fit whose forecast reaches DIVERGED)."""
    if np.isfinite(measured) and measured >= DIVERGED:
        return float("nan"), "diverged"
    value = fit.predict(step)
    if not np.isfinite(fit.r2) or fit.points == 0:
        return float("nan"), "no fit"
    if fit.r2 < MIN_FORECAST_R2 or np.isnan(value):
        return float("nan"), "unreliable"
    if not np.isfinite(value) or value >= DIVERGED:
        return float("nan"), ">=1"
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


# -- The budget verdict -------------------------------------------------------------------------------------------
#
# `analyze --budget B` says, per layer and variant, whether the output error stays under B over the measured horizon
# and up to the 32K / 128K forecasts. The statistic is the worst step: the largest per-step relative output error
# (pooled over sequences and heads) of every window, so nothing is sampled and replay's saw-tooth is judged at its
# peaks (the step before each flush), not at a flush step. Up to step t the layer is, in this order of precedence
# (the first that applies):
#   "diverged" the measured error reached DIVERGED or is not finite (NaN / inf): the run broke down, which is not
#              "over"; a measurement, never a forecast;
#   "over"     the measured worst step so far exceeds B;
#   "over"     (forecasts only) measured under B, and the reliable fit's forecast exceeds B (also where it reaches
#              DIVERGED: that is over any budget, not a divergence seen);
#   "unknown"  (forecasts only) measured under B, but the fit is withheld: no fit (too few windows past the first
#              write) or r^2 < MIN_FORECAST_R2;
#   "under"    otherwise.
# A forecast step holds the measured worst step too ("stays under to 32K"): a layer over B within the horizon is
# over at 32K and 128K whatever its fit says.
#
# DEFAULT_BUDGET = 0.02, from studies/e2e_horizon (the three shipped tiny models on the tiny-model corpus' held-out
# documents; 4096 decode steps after prompts of 0 and 2048 tokens; fp8_e4m3, int8, nvfp4 x conventional, replay16;
# 8 sequences each): the statistic (the worst layer's worst step, `analyze` at 4096 steps) beside `eval`'s
# end-to-end effect over the same horizon, "harmless" fixed before the data as a 95% upper bound of the top-1 flip
# rate <= 0.5% and of the mean KL <= 1e-3 nats:
#   statistic < 0.02 (6 of 36): all harmless (flip rate 0.06-0.16%, KL <= 1e-5 nats);
#   0.025 - 0.043 (8): harmless too; from 0.0598 on (22): harmful.
# 0.02 lies 3x below the smallest harmful statistic, which leaves room for the statistic's growth beyond the
# measured horizon and for larger models; it is also `ssmquant calibrate`'s default budget (whose metric is the
# horizon window's RMS, a lower number than the worst step: the verdict is the stricter reading of the same budget).
# The link rests on tiny models: a budget for a real checkpoint should come from its own `ssmquant eval`.
DEFAULT_BUDGET = 0.02
def peak_verdict(peak: float, budget: float) -> str:
    """'under' / 'over' / 'diverged' of a measured worst step against ``budget``."""
    if not np.isfinite(peak) or peak >= DIVERGED:
        return "diverged"
    return "under" if peak <= budget else "over"


def forecast_verdict(measured: str, value: float, status: str, budget: float) -> str:
    """The verdict up to a forecast step. ``status`` 'measured' (the run reached the step; ``value`` is its worst
    step up to there): that value decides. Else ``measured`` (``peak_verdict`` over the horizon) unless it is
    'under'; then the forecast of the worst step (``value``, ``status`` of ``forecast``) decides: a reliable
    forecast above the budget (">=1" included) is 'over', a withheld one ('no fit', 'unreliable') 'unknown'."""
    if status == "measured":
        return peak_verdict(value, budget)
    if measured != "under":
        return measured
    if status == "diverged":  # measured at the horizon: not reached when ``measured`` is "under"
        return "diverged"
    if status == ">=1":
        return "over"
    if status != "ok":  # "no fit", "unreliable"
        return "unknown"
    return peak_verdict(value, budget)
