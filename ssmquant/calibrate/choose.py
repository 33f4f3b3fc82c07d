"""Evaluating candidate settings on a layer and choosing the cheapest one within the error budget.

Every candidate is simulated (`ssmquant.simulate`) over the layer's calibration inputs; its error is
the pooled relative error (Frobenius ratio over sequences and heads) of the chosen metric over the horizon
window (the last whole flush cycles of the run: the RMS over its steps, or its worst step for the *_max
metrics; `settings.horizon_errors`), never a single step that might fall on one phase of a flush cycle. The choice per layer minimises bytes per sequence (settings.py) among the
candidates with error <= budget, ties broken by lower error, then by name. A uniform setting is one
candidate applied to every layer (static ones with each layer's own scales); the global setting is the
cheapest uniform setting an engine can take that meets the budget on every layer, else the engine-takeable
one that comes closest (lowest worst-layer error, then cheapest).

Engine profile (`ssmquant.engines.profiles`): the candidates are emulated with the arithmetic of the profile
`calibrate --engine` names. A setting the profile refuses (the engine cannot run it, or its kernel's
arithmetic is not modelled for it) is not measured with another arithmetic: its row has no errors
(NaN), `runnable` False and the engine's own reason in `refusal`; it can never be chosen.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..engines.profiles import EngineError, check_variant
from ..kinds import LayerInputs
from ..simulate import simulate
from .settings import (
    METRICS,
    CalibrateError,
    LayerDims,
    Setting,
    horizon_errors,
    horizon_window,
    other_metric,
    setting_bytes,
)

MAX_VARIANTS_PER_CALL = 16
class BudgetError(CalibrateError):
    """No candidate meets the budget on some layer (or no uniform setting with --global).

    table: one row per layer with the best achievable setting and error; no recipe is written.
    """

    def __init__(self, message: str, table: pd.DataFrame):
        super().__init__(message)
        self.table = table


def evaluate_layer(
    layer: int,
    inputs: LayerInputs,
    settings: list[Setting],
    scales: dict,
    *,
    roles: dict[str, str] | None = None,
    backend: str = "auto",
    seed: int = 0,
    count_buffer: bool = True,
    chunk: int = MAX_VARIANTS_PER_CALL,
    engine: str = "ideal",
    count_cached_prompt: bool = False,
    on_chunk=None,
) -> pd.DataFrame:
    """Simulate every setting on one layer under the engine profile `engine`; one row per setting.

    scales: {Setting.scale_key: FP32 [H, rows]} for the static settings; roles: {setting name: "candidate" |
    "fallback"} (default candidate). Columns: layer, setting, role, encoding, scale_mode, rounding, scheme,
    buffer_len, calibration, state_bytes, buffer_bytes, bytes, the METRICS (out_rel_err, state_rel_err and
    their _max), per quantity the worst head (by window mean) and its error, engine (the profile), runnable
    and refusal (the engine's reason when the profile refuses the setting on this layer; its errors are NaN).
    on_chunk: optional callable(done, total) after each simulate call (settings simulated so far, of total).
    count_cached_prompt: bytes count one cached prompt state too (column cached_prompt_bytes; calibrate
    --prompt-store, where the prefix cache's copy is what a prompt store saves).
    """
    dims = LayerDims.of(inputs)
    steps = inputs.steps
    refusals = profile_refusals(engine, settings, inputs.kind, inputs.state_shape)
    runnable = [s for s in settings if s.name not in refusals]
    rows = []

    def base(s: Setting) -> dict:
        b = setting_bytes(s, dims, count_buffer=count_buffer, count_cached_prompt=count_cached_prompt)
        return {
            "layer": layer,
            "setting": s.name,
            "role": (roles or {}).get(s.name, "candidate"),
            "format": s.format.name,
            "encoding": s.encoding,
            "scale_mode": s.scale_mode,
            "rounding": s.rounding,
            "scheme": s.scheme.name,
            "buffer_len": s.buffer_len,
            "calibration": s.calibration_label,
            "state_bytes": b["state"],
            "buffer_bytes": b["buffer"],
            **({"cached_prompt_bytes": b["cached_prompt"]} if count_cached_prompt else {}),
            "bytes": b["total"],
            "engine": engine,
            "runnable": s.name not in refusals,
            "refusal": refusals.get(s.name, ""),
        }

    for start in range(0, len(runnable), chunk):
        part = runnable[start : start + chunk]
        variants = [
            s.variant(seed=seed, static_scale=scales.get(s.scale_key) if s.is_static else None, engine=engine)
            for s in part
        ]
        trace = simulate(inputs, variants, backend=backend, record_every=horizon_window(variants, steps))
        res = horizon_errors(trace)
        heads = horizon_errors(trace, per_head=True)  # [V, H]
        for i, s in enumerate(part):
            row = {**base(s), **{m: float(res[m][i]) for m in METRICS}}
            for q in ("out", "state"):
                h = heads[f"{q}_rel_err"][i]
                worst = int(np.nanargmax(h)) if np.isfinite(h).any() else -1
                row[f"worst_head_{q}"] = worst
                row[f"worst_head_{q}_rel_err"] = float(h[worst]) if worst >= 0 else float("nan")
            rows.append(row)
        if on_chunk is not None:
            on_chunk(start + len(part), len(runnable))
    nan = float("nan")
    for s in settings:
        if s.name in refusals:
            rows.append({**base(s), **{m: nan for m in METRICS}, **{f"worst_head_{q}": -1 for q in ("out", "state")},
                         **{f"worst_head_{q}_rel_err": nan for q in ("out", "state")}})  # fmt: skip
    order = {s.name: i for i, s in enumerate(settings)}
    return pd.DataFrame(rows).sort_values("setting", key=lambda c: c.map(order), kind="mergesort").reset_index(drop=True)


def profile_refusals(engine: str, settings: list[Setting], kind: str, state_shape) -> dict[str, str]:
    """{setting name: the engine's reason} for every setting the profile `engine` cannot emulate on a `kind`
    layer whose state is [..., rows, state_dim] (`ssmquant.engines.profiles.check_variant`'s messages)."""
    out = {}
    for s in settings:
        try:
            check_variant(engine, s.format, s.scheme, kind, tuple(state_shape))
        except EngineError as err:
            out[s.name] = str(err)
    return out


def _rank(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    err = df[metric].where(np.isfinite(df[metric]), math.inf)
    return df.assign(_err=err).sort_values(["bytes", "_err", "setting"], kind="mergesort").drop(columns="_err")


def _pool(df: pd.DataFrame, among) -> pd.Series:
    """Rows that may be chosen: the settings named in ``among``, or (None) the candidates."""
    return df["role"] == "candidate" if among is None else df["setting"].isin(set(among))


def choose_layer(df: pd.DataFrame, budget: float, metric: str, among=None) -> pd.Series | None:
    """Cheapest row with metric <= budget (ties: lower error, then name) among the settings named in ``among``
    (None: the candidates), or None."""
    ok = df[_pool(df, among) & (df[metric] <= budget)]
    if ok.empty:
        return None
    return _rank(ok, metric).iloc[0]


def best_layer(df: pd.DataFrame, metric: str, among=None) -> pd.Series:
    """The row with the lowest error (ties: cheaper, then name) among ``among`` (None: the candidates)."""
    cand = df[_pool(df, among)]
    err = cand[metric].where(np.isfinite(cand[metric]), math.inf)
    return cand.assign(_err=err).sort_values(["_err", "bytes", "setting"], kind="mergesort").iloc[0].drop("_err")


def uniform_table(evals: pd.DataFrame, budget: float, metric: str) -> pd.DataFrame:
    """One row per setting applied to every layer: total bytes, worst-layer error, meets_budget, per-layer errors."""
    rows = []
    layers = sorted(evals["layer"].unique().tolist())
    for name, g in evals.groupby("setting", sort=False):
        g = g.set_index("layer").reindex(layers)
        errs = g[metric].astype(float)
        worst = float(errs.max()) if np.isfinite(errs).all() else math.inf
        rows.append(
            {
                "setting": name,
                "role": g["role"].iloc[0],
                "bytes": int(g["bytes"].sum()),
                "state_bytes": int(g["state_bytes"].sum()),
                "buffer_bytes": int(g["buffer_bytes"].sum()),
                "max_error": worst,
                "meets_budget": bool(worst <= budget),
                "errors": {int(layer): float(e) for layer, e in errs.items()},
                "errors_other_metric": {
                    int(layer): float(e)
                    for layer, e in g[other_metric(metric)].items()
                },
            }
        )
    return pd.DataFrame(rows)


def choose_global(uniform: pd.DataFrame, takeable: dict[str, bool], among=None) -> tuple[pd.Series | None, str]:
    """(row, status) of the global setting among engine-takeable candidate settings, or (``among`` given) among
    the settings it names (calibrate's choice pool, fallbacks included).

    status: "meets_budget" (cheapest meeting the budget on every layer, ties lower worst error), "closest"
    (none meets it: the lowest worst-layer error, ties cheaper) or "none" (no candidate is engine-takeable).
    """
    if among is None:
        pool = uniform[(uniform["role"] == "candidate") & uniform["setting"].map(lambda n: takeable.get(n, False))]
    else:
        pool = uniform[uniform["setting"].isin(set(among))]
    if pool.empty:
        return None, "none"
    ok = pool[pool["meets_budget"]]
    if not ok.empty:
        return ok.sort_values(["bytes", "max_error", "setting"], kind="mergesort").iloc[0], "meets_budget"
    return pool.sort_values(["max_error", "bytes", "setting"], kind="mergesort").iloc[0], "closest"


def best_table(evals: pd.DataFrame, metric: str, budget: float, among=None) -> pd.DataFrame:
    """Per layer: the best achievable setting and error among ``among`` (None: the candidates), and whether one
    of them meets the budget."""
    rows = []
    for layer, g in evals.groupby("layer", sort=True):
        best = best_layer(g, metric, among)
        chosen = choose_layer(g, budget, metric, among)
        rows.append(
            {
                "layer": int(layer),
                "best_setting": best["setting"],
                f"best_{metric}": float(best[metric]),
                "budget": budget,
                "meets_budget": chosen is not None,
            }
        )
    return pd.DataFrame(rows)
