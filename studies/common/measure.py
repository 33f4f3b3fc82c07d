"""Measurement for the studies: run variants over a model's layers and reduce each Trace to compact tables.

Every decode step is measured (`ssmquant.simulate` keeps window statistics, never samples), and a
run is reduced to three tables that the pages are built from:

- per sequence (`sequences`): for every (layer, variant, sequence) the sums over all steps and over the
  horizon window of the per-step squared errors and squared reference norms of the state and the output
  (`{out,state}_{err2,ref2}_{all,horizon}`), pooled over heads. Any pooled relative error over a set of
  sequences is sqrt(sum err2 / sum ref2), so the pages can bootstrap over sequences;
- per window (`windows`): the pooled relative error of every window (mean over its steps, and its worst
  step) per (layer, variant), over all sequences: the drift curves and the growth fits;
- per head (`heads`, optional): the horizon-window sums per (layer, variant, sequence, head).

The horizon window is the last HORIZON_FRACTION of the run rounded up to whole windows, and windows hold
whole flush cycles of every variant (`ssmquant.replay.cycle_window`), so every phase of a replay cycle
weighs the same.
"""

from __future__ import annotations

import math
import pathlib
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ssmquant.analysis.fit import fit_power_law
from ssmquant.analysis.run import AnalyzeConfig, build_variants, first_write_step
from ssmquant.analysis.sources import open_source, resolve_device
from ssmquant.kinds import Mamba2Inputs
from ssmquant.provenance import environment
from ssmquant.replay import Variant, cycle_window, parse_variant
from ssmquant.replay.trace import Trace
from ssmquant.simulate import simulate

HORIZON_FRACTION = 0.1
MAX_WINDOWS = 32
QUANTITIES = ("out", "state")
SUM_COLUMNS = [f"{q}_{k}_{w}" for w in ("all", "horizon") for q in QUANTITIES for k in ("err2", "ref2")]


def variant_name(v: Variant) -> str:
    """format@scheme without the SR seed suffix, so that runs with different seeds share names."""
    return f"{v.format.name}@{v.scheme.name}"


def analyze_variants(formats, schemes, rounding=("rne",), seed: int = 0) -> list[Variant]:
    """formats x roundings x schemes, built exactly as `ssmquant analyze` builds them."""
    return build_variants(
        AnalyzeConfig(formats=list(formats), schemes=list(schemes), rounding=list(rounding), seed=seed)
    )


def horizon_windows(trace: Trace, fraction: float = HORIZON_FRACTION) -> np.ndarray:
    """Boolean [R]: the windows of the horizon (the last `fraction` of steps, whole windows, the shorter
    last window included only together with the full ones before it)."""
    steps = int(trace.steps[-1])
    start = steps - max(1, math.ceil(fraction * steps)) + 1
    return trace.window_starts >= trace.window_starts[trace.window_starts <= start].max()


def sequence_sums(trace: Trace, names: list[str], *, per_head: bool = False) -> pd.DataFrame:
    """Per (variant, sequence[, head]): the SUM_COLUMNS sums (see the module docstring)."""
    lengths = (trace.steps - trace.window_starts + 1).astype(np.float64)  # [R]
    sums = trace.mean * lengths[None, :, None, None, None]  # [V, R, B, H, 4]: per-window sums
    if not per_head:
        sums = sums.sum(axis=3, keepdims=True)
    hz = horizon_windows(trace)
    parts = {"all": sums.sum(axis=1), "horizon": sums[:, hz].sum(axis=1)}  # [V, B, H', 4]
    nv, nb, nh = parts["all"].shape[:3]
    cols = {
        "variant": np.repeat(np.array(names, dtype=object), nb * nh),
        "sequence": np.tile(np.repeat(np.arange(nb), nh), nv),
    }
    if per_head:
        cols["head"] = np.tile(np.arange(nh), nv * nb)
    order = {"state_err2": 0, "state_ref2": 1, "out_err2": 2, "out_ref2": 3}  # METRIC_NAMES
    for c in SUM_COLUMNS:
        q, k, w = c.split("_")
        cols[c] = parts[w][..., order[f"{q}_{k}"]].reshape(-1)
    return pd.DataFrame(cols)


def window_frame(trace: Trace, names: list[str]) -> pd.DataFrame:
    """Per (variant, window): pooled relative errors (mean over the window's steps, and its worst step)."""
    nv, nr = len(names), len(trace.steps)
    cols = {
        "variant": np.repeat(np.array(names, dtype=object), nr),
        "step": np.tile(trace.steps, nv),
        "window_start": np.tile(trace.window_starts, nv),
    }
    for q in QUANTITIES:
        cols[f"{q}_rel_err"] = trace.rel_err(q).reshape(-1)
        cols[f"{q}_rel_err_max"] = trace.rel_err(q, stat="max").reshape(-1)
    return pd.DataFrame(cols)


def sequence_window_frame(trace: Trace, names: list[str]) -> pd.DataFrame:
    """Per (variant, sequence, window): the relative error of the output and the state (window means)."""
    nv, nr = len(names), len(trace.steps)
    out = trace.rel_err("out", per_batch=True)  # [V, R, B]
    state = trace.rel_err("state", per_batch=True)
    nb = out.shape[2]
    return pd.DataFrame(
        {
            "variant": np.repeat(np.array(names, dtype=object), nr * nb),
            "step": np.tile(np.repeat(trace.steps, nb), nv),
            "window_start": np.tile(np.repeat(trace.window_starts, nb), nv),
            "sequence": np.tile(np.arange(nb), nv * nr),
            "out_rel_err": out.reshape(-1),
            "state_rel_err": state.reshape(-1),
        }
    )


def head_decays(inputs) -> pd.DataFrame:
    """Per head: mean decay a_t (Mamba-2 exp(dt A), GDN exp(g)), mean log decay, the half-life
    ln 2 / -mean(ln a_t) in tokens, and the share of steps with a_t > 0.99, over all sequences and steps."""
    a = torch.exp(inputs.dt.float() * inputs.A.float()) if isinstance(inputs, Mamba2Inputs) else torch.exp(inputs.g.float())
    log_a = torch.log(a.clamp(min=1e-30))
    mean_log = log_a.mean(dim=(0, 1)).double().cpu().numpy()
    with np.errstate(divide="ignore"):
        half = np.where(mean_log < 0, math.log(2) / -mean_log, np.inf)
    return pd.DataFrame(
        {
            "head": np.arange(a.shape[2]),
            "mean_decay": a.mean(dim=(0, 1)).double().cpu().numpy(),
            "mean_log_decay": mean_log,
            "half_life_tokens": half,
            "frac_above_0.99": (a > 0.99).float().mean(dim=(0, 1)).double().cpu().numpy(),
        }
    )


@dataclass
class RunSpec:
    """One model's runs: the variants over the selected layers, for each seed.

    synthetic / profile: synthetic inputs with that dynamics profile (`ssmquant.models.synthetic`);
    seeds: one run per seed (text: the passages; synthetic: another draw of the layer's parameters);
    head_variants: variants whose per-head sums are kept; decays: keep per-head decay statistics;
    sequence_windows: keep each sequence's window errors (`sequence_window_frame`); keep_windows: store
    the pooled window table (drift curves and growth fits) with the run's data.
    """

    name: str
    model: str
    variants: list
    steps: int
    batch: int
    seeds: list[int] = field(default_factory=lambda: [0])
    layers: list[int] | None = None
    synthetic: bool = False
    profile: str = "init"
    head_variants: list[str] = field(default_factory=list)
    decays: bool = False
    sequence_windows: bool = False
    keep_windows: bool = True


@dataclass
class RunResult:
    sequences: pd.DataFrame
    windows: pd.DataFrame
    heads: pd.DataFrame
    decays: pd.DataFrame
    provenance: dict
    sequence_windows: pd.DataFrame = field(default_factory=pd.DataFrame)


def run(spec: RunSpec, *, device: str = "cpu", backend: str = "auto", log=print) -> RunResult:
    """Simulate `spec` and reduce it (module docstring). Windows are pooled over every seed's sequences."""
    t0 = time.time()
    dev = resolve_device(device)
    seqs, wins, heads, decays, seq_wins = [], [], [], [], []
    describe, layers_used = None, None
    for seed in spec.seeds:
        variants = [parse_variant(v, seed=seed) if isinstance(v, str) else v for v in spec.variants]
        names = [variant_name(v) for v in variants]
        record_every = cycle_window([v.scheme.buffer_len for v in variants], spec.steps, MAX_WINDOWS)
        src = open_source(
            spec.model,
            synthetic=spec.synthetic,
            batch=spec.batch,
            steps=spec.steps,
            seed=seed,
            device=dev,
            synthetic_profile=spec.profile,
        )
        describe = {**src.describe, "layer_kind": src.layer_kind, "state_shape": list(src.state_shape)}
        if "location" in describe:  # a shipped model's directory: relative to the repository, not this machine
            describe["location"] = _relative(describe["location"])
        layers_used = src.select(spec.layers)
        src.check_formats([v.format for v in variants])
        for layer, inputs in src.iter_layers(layers_used):
            t1 = time.time()
            inputs = inputs.to(dev)
            trace = simulate(inputs, variants, backend=backend, record_every=record_every)
            key = {"model": spec.name, "seed": seed, "layer": layer}
            seqs.append(sequence_sums(trace, names).assign(**key))
            w = window_frame(trace, names)
            # keep the per-window sums so that windows can be pooled over seeds below
            lengths = (trace.steps - trace.window_starts + 1).astype(np.float64)
            m = trace.mean.sum(axis=(2, 3)) * lengths[None, :, None]  # [V, R, 4]
            for i, c in enumerate(("state_err2", "state_ref2", "out_err2", "out_ref2")):
                w[c] = m[..., i].reshape(-1)
            wins.append(w.assign(**key))
            if spec.head_variants:
                keep = [i for i, n in enumerate(names) if n in spec.head_variants]
                h = sequence_sums(trace, names, per_head=True)
                h = h[h["variant"].isin([names[i] for i in keep])]
                heads.append(h.drop(columns=[c for c in SUM_COLUMNS if c.endswith("_all")]).assign(**key))
            if spec.decays:
                decays.append(head_decays(inputs).assign(**key))
            if spec.sequence_windows:
                seq_wins.append(sequence_window_frame(trace, names).assign(**key))
            log(f"  {spec.name} seed {seed} layer {layer}: {len(variants)} variants, {time.time() - t1:.1f} s")
            del inputs, trace
    windows = _pool_windows(pd.concat(wins, ignore_index=True))
    backend_used = "triton" if (backend == "auto" and dev.type == "cuda") else ("torch" if backend == "auto" else backend)
    provenance = {
        "run": spec.name,
        "model": spec.model,
        "data_source": describe,
        "settings": {
            "variants": names,
            "steps": spec.steps,
            "batch": spec.batch,
            "seeds": list(spec.seeds),
            "layers": layers_used,
            "synthetic": spec.synthetic,
            "synthetic_profile": spec.profile if spec.synthetic else None,
            "window": record_every,
            "horizon_fraction": HORIZON_FRACTION,
        },
        "environment": environment(dev, backend=backend_used),
        "elapsed_s": round(time.time() - t0, 1),
    }
    return RunResult(
        pd.concat(seqs, ignore_index=True),
        windows,
        pd.concat(heads, ignore_index=True) if heads else pd.DataFrame(),
        pd.concat(decays, ignore_index=True) if decays else pd.DataFrame(),
        provenance,
        pd.concat(seq_wins, ignore_index=True) if seq_wins else pd.DataFrame(),
    )


def _relative(path: str) -> str:
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        return str(pathlib.Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def _pool_windows(w: pd.DataFrame) -> pd.DataFrame:
    """Pool the per-seed window rows: relative errors from the summed squares; the worst step over seeds."""
    keys = ["model", "layer", "variant", "step", "window_start"]
    g = w.groupby(keys, sort=False)
    out = g[["state_err2", "state_ref2", "out_err2", "out_ref2"]].sum()
    out = out.join(g[["out_rel_err_max", "state_rel_err_max"]].max())
    with np.errstate(divide="ignore", invalid="ignore"):
        for q in QUANTITIES:
            out[f"{q}_rel_err"] = np.sqrt(out[f"{q}_err2"] / out[f"{q}_ref2"])
    return out.drop(columns=["state_err2", "state_ref2", "out_err2", "out_ref2"]).reset_index()


def growth_fits(windows: pd.DataFrame, keys=("model", "layer", "variant")) -> pd.DataFrame:
    """Per `keys` group of window rows: the power-law fit err ~ a t^b (`ssmquant.analysis.fit`) of the output
    and state window means, over the whole run past the first write (b_out, b_state) and over its second
    half only (b_out_late, b_state_late: is the error still growing at the end, after the build-up of the
    first hundreds of steps?), and the first window with a non-finite error (-1: none)."""
    rows = []
    for key, g in windows.groupby(list(keys), sort=False):
        g = g.sort_values("step")
        centers = (g["window_start"].to_numpy() + g["step"].to_numpy()) / 2.0
        first = first_write_step(parse_variant(g["variant"].iloc[0]))
        late = max(first, int(g["step"].max()) // 2)
        row = dict(zip(keys, key))
        for q in QUANTITIES:
            err = g[f"{q}_rel_err"].to_numpy()
            fit, fit_late = fit_power_law(centers, err, first), fit_power_law(centers, err, late)
            row[f"b_{q}"], row[f"r2_{q}"], row[f"b_{q}_late"] = fit.b, fit.r2, fit_late.b
        bad = g[~np.isfinite(g["out_rel_err"])]
        row["first_nonfinite_step"] = int(bad["window_start"].min()) if len(bad) else -1
        rows.append(row)
    return pd.DataFrame(rows)


__all__ = [
    "HORIZON_FRACTION",
    "RunResult",
    "RunSpec",
    "SUM_COLUMNS",
    "analyze_variants",
    "growth_fits",
    "head_decays",
    "horizon_windows",
    "run",
    "sequence_sums",
    "variant_name",
    "window_frame",
]
