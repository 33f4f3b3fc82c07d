"""Number formatting, markdown tables and the files every page shares (tables as .md + .csv, provenance)."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pandas as pd

from .stats import Interval, PermutationResult

# An error above this (the error exceeds the signal) or a non-finite one: the variant diverged, and a ratio
# against it is reported as "diverged", not as a number.
DIVERGED = 1.0
CSV_FLOAT = "%.6g"


def num(x, digits: int = 3) -> str:
    """A number for a markdown table: 3 significant digits, 'inf' / 'n/a' for non-finite."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return f"{int(x):,}"
    x = float(x)
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < 1e7:
        return f"{int(x):,}"
    if abs(x) >= 1e7:
        return f"{x:.{digits - 1}e}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) < 1e-4:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def times(x) -> str:
    """A ratio as '4.1x' ('n/a' when not finite)."""
    if x is None or not np.isfinite(x):
        return "n/a"
    return f"{x:.3g}x" if x < 10 else f"{x:.0f}x"


def diverged(err) -> bool:
    """An error that is non-finite or larger than the signal (DIVERGED)."""
    return err is None or not np.isfinite(err) or err > DIVERGED


def span(values, unit: str = "x") -> str:
    """'a-b' (or 'a' when equal; 'a to b' when a < 0) of the finite values, with a unit suffix."""
    v = [float(x) for x in values if x is not None and np.isfinite(x)]
    if not v:
        return "n/a"
    lo, hi = min(v), max(v)

    def f(z):
        return f"{z:.3g}" if abs(z) < 10 else f"{z:.0f}"

    if f(lo) == f(hi):
        return f"{f(lo)}{unit}"
    return f"{f(lo)} to {f(hi)}{unit}" if lo < 0 else f"{f(lo)}-{f(hi)}{unit}"


def ci(interval: Interval | None, fmt=num, unit: str = "") -> str:
    """'est [low, high]' of a bootstrap interval ('n/a' when missing)."""
    if interval is None or not np.isfinite(interval.estimate):
        return "n/a"
    return f"{fmt(interval.estimate)}{unit} [{fmt(interval.low)}, {fmt(interval.high)}]"


def ratio_ci(interval: Interval | None, numerator_err=None) -> str:
    """A ratio with its interval, or 'diverged' when the numerator's error diverged (see DIVERGED)."""
    if numerator_err is not None and diverged(numerator_err):
        return "diverged"
    if interval is None or not np.isfinite(interval.estimate):
        return "n/a"
    return f"{interval.estimate:.3g}x [{interval.low:.3g}, {interval.high:.3g}]"


def p_text(test: PermutationResult) -> str:
    """A permutation p-value, saying when it is the smallest value the test can give."""
    if not np.isfinite(test.p_value):
        return "p = n/a"
    floor = " (the test's floor: no relabelling as extreme)" if test.p_value <= test.p_floor * (1 + 1e-9) else ""
    what = "every relabelling" if test.method == "exact" else "random relabellings"
    return f"p = {test.p_value:.2g}{floor}, {test.method} ({test.permutations} {what})"


def markdown(df: pd.DataFrame) -> str:
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(v if isinstance(v, str) else num(v) for v in row.tolist()) + " |")
    return "\n".join(lines)


def save_table(df: pd.DataFrame, folder: pathlib.Path, stem: str, shown: pd.DataFrame | None = None) -> str:
    """Write the table as CSV (full precision) and markdown (rounded, or `shown`); return the markdown."""
    df.to_csv(folder / f"{stem}.csv", index=False, float_format=CSV_FLOAT)
    text = markdown(df if shown is None else shown)
    (folder / f"{stem}.md").write_text(text + "\n")
    return text


def write_data(df: pd.DataFrame, folder: pathlib.Path, stem: str) -> None:
    """A summary table the page is built from (committed): CSV with 6 significant digits."""
    folder.mkdir(parents=True, exist_ok=True)
    df.to_csv(folder / f"{stem}.csv", index=False, float_format=CSV_FLOAT)


def read_data(folder: pathlib.Path, stem: str) -> pd.DataFrame | None:
    path = folder / f"{stem}.csv"
    return pd.read_csv(path) if path.is_file() else None


def write_runs(folder: pathlib.Path, runs: list[dict], scale: str) -> None:
    """runs.json: how the data were made (scale, settings, data source, versions, seconds) per run."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "runs.json").write_text(json.dumps({"scale": scale, "runs": runs}, indent=1, default=str) + "\n")


def read_runs(folder: pathlib.Path) -> dict:
    path = folder / "runs.json"
    return json.loads(path.read_text()) if path.is_file() else {"scale": None, "runs": []}


def env_text(env: dict) -> str:
    dev = env.get("gpu") or ("CPU" if str(env.get("device", "")).startswith("cpu") else env.get("device", "?"))
    parts = [dev, f"torch {env.get('torch')}"]
    if env.get("backend"):
        parts.append(f"backend {env['backend']}")
    return ", ".join(parts)


def source_text(src: dict | None) -> str:
    """What the inputs were: synthetic (with its profile) or a trained model on real text."""
    src = src or {}
    if src.get("kind") == "synthetic":
        profile = src.get("synthetic_profile", "init")
        if profile and profile != "init":
            return f"synthetic inputs, **{profile} stress profile** ({src.get('synthetic_profile_description')})"
        return "synthetic inputs (preset shapes, the family's initialisation distributions, no weights)"
    text = src.get("text", {}) or {}
    return f"shipped trained model, real text ({text.get('origin')}, {text.get('split')} split)"


def short_source(src: dict | None) -> str:
    src = src or {}
    if src.get("kind") == "synthetic":
        p = src.get("synthetic_profile", "init")
        return "synthetic" if p in (None, "init") else f"synthetic, {p} profile"
    return "shipped, real text"


def settings_text(run: dict) -> str:
    s = run["settings"]
    seeds = s.get("seeds", [0])
    return (
        f"layers {s.get('layers')}, {s['batch']} sequences x {len(seeds)} seed(s) {seeds}, {s['steps']} steps, "
        f"window {s.get('window')} steps"
    )


def run_line(run: dict) -> str:
    return (
        f"- **{run['run']}**: {source_text(run.get('data_source'))}; {settings_text(run)}; "
        f"{env_text(run.get('environment', {}))}; {run.get('elapsed_s')} s"
    )
