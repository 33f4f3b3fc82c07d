"""`analyze`: every selected SSM layer of a model, every variant, over the decode horizon.

Data flows one way: a LayerSource yields each layer's decode inputs (captured or synthetic), `simulate`
turns them into a Trace per layer, and this module reduces the traces to tables (long traces, per-head
values at selected steps, a per-layer summary with fitted growth and forecasts) and the memory table.
Writing files and plots is `ssmquant.report`'s job.

Each layer is emulated with the inputs of an FP32 run of the other layers (captured from one prefill):
the analysis isolates the error that each layer's own stored state accumulates. What the errors of all
layers do together to the model's predictions is the end-to-end evaluation's question.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from .. import __version__, kinds
from ..engines.deployments import TARGETS, Target, engine_bytes, engines_running, runtime, violations
from ..engines.profiles import EngineError, check_variant
from ..errors import SsmquantError
from ..formats import Encoding, FormatError, parse
from ..formats.prompt_store import parse_prompt_store
from ..kinds import after_prompt
from ..provenance import environment
from ..replay import Trace, cycle_window, parse_scheme
from ..replay.schemes import SchemeError
from ..replay.variants import PROMPT_STORE_LIVE_FORMATS, Variant, VariantError
from ..simulate import start_simulation
from ..sizing import LayerEstimate, format_seconds
from .devices import assign_layers, emulation_threads, run_on_devices
from .fit import (
    DEFAULT_BUDGET,
    DIVERGED,
    MIN_FORECAST_R2,
    fit_power_law,
    forecast,
    forecast_columns,
    forecast_verdict,
    peak_verdict,
)
from .sources import LayerSource, SourceError, open_source, plan_layers, resolve_run_devices

FORECAST_STEPS = (32768, 131072)
ROUNDINGS = ("rne", "sr")
MAX_RECORDED_STEPS = 1024
HEAD_TABLE_POINTS = 8
# Layers each GPU emulates at once, one CUDA stream each (analysis.devices.run_on_devices): while one
# layer's kernels run, another's host work (its tables, the host syncs of its launches) proceeds and the next
# layer's inputs are made, so the GPU does not wait for the host between layers.
# 1 (off): two lanes are not faster than one lane that pipelines a layer's host work behind the next layer's
# kernels (run_on_devices' complete=; lab/DESIGN_NOTES.md).
GPU_LANES = 1


class AnalyzeError(SsmquantError, ValueError):
    """Bad analyze settings; the message names the problem and the accepted values."""


@dataclass
class AnalyzeConfig:
    """Settings of one analysis run (the `ssmquant analyze` options)."""

    DEFAULT_FORMATS: ClassVar[tuple[str, ...]] = ("fp8_e4m3", "int8", "nvfp4")

    model: str = "tiny-nemotron"
    synthetic: bool = False
    synthetic_profile: str = "init"  # dynamics profile of synthetic inputs (ssmquant.models.synthetic.PROFILES)
    text: str | None = None
    formats: list[str] = field(default_factory=lambda: list(AnalyzeConfig.DEFAULT_FORMATS))
    schemes: list[str] = field(default_factory=lambda: ["conventional", "replay"])
    buffer_len: int = 16
    rounding: list[str] = field(default_factory=lambda: ["rne"])
    steps: int = 4096  # decode steps (after the prompt)
    # tokens prefilled before decoding (kinds.after_prompt): the first `prompt` captured tokens of each sequence run in
    # FP32 and each variant stores the state they leave once, as an engine writes its prefill's final state; 0: every
    # captured token is a decode step from an empty state
    prompt: int = 0
    batch: int = 8
    layers: list[int] | None = None
    device: str = "auto"
    backend: str = "auto"
    seed: int = 0
    record_every: int | None = None  # window length; None: whole flush cycles, at most 1024 windows
    engines: list[str] = field(default_factory=lambda: ["ideal"])  # engine profiles (ssmquant.engines.profiles)
    # emulation devices: "cuda:0,cuda:1", a list, or "all" (analysis.devices); None: `device` alone
    devices: str | list[str] | None = None
    # the verdict's budget on the worst-step output error (analysis.fit, DEFAULT_BUDGET: why this number)
    budget: float = DEFAULT_BUDGET
    # also measure the layer kind's baselines (LayerKind.analyze_baselines; KDA: bf16@conventional, what its engines
    # keep below float32) with each engine profile, rounded to nearest; None: when `formats` are the defaults (the
    # CLI: when --formats is not given)
    kind_baselines: bool | None = None
    # leave out the variants an engine profile (``engines``) cannot run, instead of refusing the run; None: when
    # `formats` are the defaults (the CLI: when --formats is not given), which nobody chose for that engine
    skip_unrunnable: bool | None = None
    # prompt stores (formats.prompt_store, e.g. "int8col": SGLang's int8 prefix cache): each float-format variant is
    # measured again with the prompt's state kept in the store before its live format takes it over; needs `prompt`
    prompt_stores: list[str] = field(default_factory=list)


# The float states the engines keep (vLLM's and TensorRT-LLM's cache dtypes below float32): measured beside the
# default formats when an engine profile runs on them (``AnalyzeConfig.skip_unrunnable``).
ENGINE_FLOAT_FORMATS = ("bf16", "fp16")


def build_variants(cfg: AnalyzeConfig) -> list[Variant]:
    """formats x roundings x schemes, as Variants (errors name the bad value and the accepted ones)."""
    if cfg.buffer_len < 1:
        raise AnalyzeError(f"--buffer-len must be >= 1, got {cfg.buffer_len}")
    for r in cfg.rounding:
        if r not in ROUNDINGS:
            raise AnalyzeError(f"unknown rounding {r!r}; accepted: {', '.join(ROUNDINGS)}")
    variants, seen = [], set()
    try:
        schemes = [parse_scheme(s, default_buffer_len=cfg.buffer_len) for s in cfg.schemes]
        for spec, r, scheme, engine in itertools.product(cfg.formats, cfg.rounding, schemes, cfg.engines):
            fmt = parse(spec)
            if fmt.scale_mode.value == "static":
                raise AnalyzeError(
                    f"{spec!r}: static scales come from `ssmquant calibrate`; analyze uses dynamic scales"
                )
            if r == "sr":
                if fmt.encoding is Encoding.FP32:
                    continue
                fmt = parse(f"{fmt.name}:sr") if fmt.rounding.value == "rne" else fmt
            v = Variant(fmt, scheme, seed=cfg.seed, engine=engine)
            if v.name not in seen:
                seen.add(v.name)
                variants.append(v)
    except (FormatError, SchemeError, VariantError) as err:
        raise AnalyzeError(str(err)) from None
    if not variants:
        raise AnalyzeError("no variants: give at least one format and one scheme")
    return variants + _prompt_store_variants(cfg, variants)


def _prompt_store_variants(cfg: AnalyzeConfig, variants: list[Variant]) -> list[Variant]:
    """Each float-format variant again with each of cfg.prompt_stores (AnalyzeError naming what is missing)."""
    if not cfg.prompt_stores:
        return []
    if cfg.prompt < 1:
        raise AnalyzeError(
            "--prompt-store keeps the prompt's state in a prefix cache: give the prompt's length with --prompt N (N >= 1)"
        )
    floats = [v for v in variants if v.format.encoding.value in PROMPT_STORE_LIVE_FORMATS]
    if not floats:
        raise AnalyzeError(
            f"--prompt-store restores the prompt's state into a float state: add one of "
            f"{', '.join(PROMPT_STORE_LIVE_FORMATS)} to --formats"
        )
    try:
        return [replace(v, prompt_store=store) for store in cfg.prompt_stores for v in floats]
    except VariantError as err:
        raise AnalyzeError(str(err)) from None


def baseline_variants(cfg: AnalyzeConfig, kind: str, variants: list[Variant]) -> list[Variant]:
    """The layer kind's baselines (LayerKind.analyze_baselines) not among `variants`, one per engine profile of
    `cfg`, when cfg.kind_baselines (None: when cfg.formats are the defaults); [] otherwise."""
    on = cfg.kind_baselines
    if not (list(cfg.formats) == list(cfg.DEFAULT_FORMATS) if on is None else on):
        return []
    have = {v.name for v in variants}
    out = []
    for name, engine in itertools.product(kinds.get(kind).analyze_baselines, cfg.engines):
        spec, scheme = name.split("@", 1)
        v = Variant(parse(spec), parse_scheme(scheme, default_buffer_len=cfg.buffer_len), seed=cfg.seed, engine=engine)
        if v.name not in have:
            have.add(v.name)
            out.append(v)
    return out


@dataclass
class AnalysisResult:
    """Tables of a run. traces: one row per (layer, variant, recorded step); heads: per-head errors at
    selected steps; summary: one row per (layer, variant); memory: bytes per sequence per format."""

    config: AnalyzeConfig
    source: dict
    traces: pd.DataFrame
    heads: pd.DataFrame
    summary: pd.DataFrame
    memory: pd.DataFrame
    environment: dict
    elapsed_s: float
    stages: dict = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)  # variants an engine profile cannot run, left out

    def report(self) -> dict:
        """The report.json document."""
        return {
            "ssmquant_version": __version__,
            "model": self.source.get("model"),
            "data_source": self.source,
            "settings": {k: v for k, v in asdict(self.config).items()},
            "environment": self.environment,
            "elapsed_s": round(self.elapsed_s, 3),
            "stages": self.stages,
            "summary": _records(self.summary),
            "memory": _records(self.memory),
            "memory_note": MEMORY_ENGINE_NOTE,
            "budget": {"value": self.config.budget, "note": verdict_note(self.config.budget)},
            "prompt": {"tokens": self.config.prompt, "note": prompt_note(self.config.prompt)},
            "verdict": verdicts(self.summary),
            "skipped_variants": self.skipped,
            # per scheme, the step of the first rounded state: the plots mark it without parsing schemes (which
            # imports torch: seconds in a plotting process that needs nothing else of it)
            "first_write_steps": {v.scheme.name: first_write_step(v) for v in build_variants(self.config)},
            "forecast_note": "forecast_* columns extrapolate the power-law fit err(t) ~ a t^b beyond the "
            "measured horizon; they are forecasts, not measurements. A forecast is null where its *_status is "
            f"'diverged' (the measured relative error reached {DIVERGED}), 'no fit', 'unreliable' (fit r^2 below "
            f"{MIN_FORECAST_R2}) or '>=1' (the forecast reaches {DIVERGED})",
        }


def _records(df: pd.DataFrame) -> list[dict]:
    out = []
    for rec in df.to_dict(orient="records"):
        out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()})
    return out


def check_engine_profiles(
    variants: list[Variant], kind: str, state_shape: tuple[int, ...], *, skip_unrunnable: bool = False
) -> tuple[list[Variant], list[dict]]:
    """Refuse, before any layer runs, a variant whose engine profile cannot run it on these layers (the engine's
    own words), instead of after the first layer's capture. ``skip_unrunnable`` (the default formats, which nobody
    chose for this engine): such variants are left out instead, and returned as {"variant", "engine", "reason"};
    an engine left with no variant is still refused. Returns (the variants kept, those left out)."""
    kept, skipped = [], []
    for v in variants:
        if v.engine != "ideal":
            try:
                check_variant(v.engine, v.format, v.scheme, kind, state_shape)
            except EngineError as err:
                msg = str(err)  # the profiles' messages mostly start with the variant already
                msg = msg if msg.startswith(f"{v.format.name}@") else f"{v.name}: {msg}"
                if not skip_unrunnable:
                    raise AnalyzeError(msg) from None
                skipped.append({"variant": v.name, "engine": v.engine, "reason": msg})
                continue
        kept.append(v)
    for engine in dict.fromkeys(v.engine for v in variants):
        if not any(v.engine == engine for v in kept):
            mine = [x for x in skipped if x["engine"] == engine]
            raise AnalyzeError(
                f"the {engine} profile runs none of the {len(mine)} default variants on these {kind} layers, e.g. "
                f"{mine[0]['reason']}; name formats and schemes it runs with --formats / --schemes"
            )
    return kept, skipped


def skipped_lines(skipped: list[dict]) -> list[str]:
    """One line per engine profile for the variants ``check_engine_profiles`` left out."""
    lines = []
    for engine in dict.fromkeys(x["engine"] for x in skipped):
        mine = [x for x in skipped if x["engine"] == engine]
        names = ", ".join(x["variant"].split("~")[0] for x in mine)
        lines.append(
            f"{engine}: left out {len(mine)} default variant{'s' if len(mine) > 1 else ''} it cannot run ({names}), "
            f"e.g. {mine[0]['reason']} (report.json: skipped_variants)"
        )
    return lines


def first_write_step(variant: Variant) -> int:
    """The 1-based step whose state is the first rounded one (1 conventional, L replay)."""
    return _first_write_step(variant.scheme)


@functools.lru_cache(maxsize=256)
def _first_write_step(scheme) -> int:
    # once per scheme (a Python loop for spec schemes); every scheme stores its state by step L at the latest (the
    # flush of a full buffer), so L steps of the mask hold the first write
    mask = scheme.write_mask(1, max(scheme.buffer_len, 1))[0]
    written = mask.nonzero()
    return int(written[0, 0]) + 1 if len(written) else scheme.buffer_len


def flush_cycle(variant: Variant) -> int:
    """Steps between the stored state's rewrites: 1 conventional, L replay(L) and spec(L) (on average
    shorter for spec, whose flushes are irregular; a window of whole L-cycles still averages them)."""
    return variant.scheme.buffer_len


def worst_step(maxima: np.ndarray, ends: np.ndarray) -> tuple[float, int]:
    """(value, window end) of the largest of the windows' worst steps; the first non-finite one (NaN / inf: the
    run broke down) wins over any number. (NaN, 0) when there is no window."""
    if len(maxima) == 0:
        return float("nan"), 0
    bad = np.flatnonzero(~np.isfinite(maxima))
    i = int(bad[0]) if len(bad) else int(np.argmax(maxima))
    return float(maxima[i]), int(ends[i])


def budget_columns(maxima: np.ndarray, starts: np.ndarray, ends: np.ndarray, first_write: int, budget: float) -> dict:
    """Summary columns of the budget verdict (analysis.fit) from one variant's window maxima of the output error:
    the worst step of the run and its window end, the power-law fit of the window maxima (abscissa: the window
    ends) with its forecasts at FORECAST_STEPS (status 'measured' where the run reached the step: then the worst
    step up to it), the budget and the verdicts over the horizon and up to each forecast step."""
    peak, peak_step = worst_step(maxima, ends)
    fit = fit_power_law(ends, maxima, first_write)
    measured = peak_verdict(peak, budget)
    cols = {
        "out_rel_err_peak": peak,
        "out_rel_err_peak_step": peak_step,
        "growth_b_out_max": fit.b,
        "fit_r2_out_max": fit.r2,
        "budget": budget,
        "verdict_horizon": measured,
    }
    for step in FORECAST_STEPS:
        k = f"{step // 1024}k"
        if step <= ends[-1]:
            value, status = worst_step(maxima[starts <= step], ends[starts <= step])[0], "measured"
        else:
            value, status = forecast(fit, step, peak)
        cols[f"forecast_out_max_{k}"] = value
        cols[f"forecast_out_max_{k}_status"] = status
        cols[f"verdict_{k}"] = forecast_verdict(measured, value, status, budget)
    return cols


def summarize_layer(
    layer: int, kind: str, trace: Trace, variants: list[Variant], budget: float = DEFAULT_BUDGET
) -> list[dict]:
    """Per variant: the error over the horizon window (mean and max over its steps), the worst head, the
    fitted growth of the window means and its forecasts, and the budget verdict (``budget_columns``)."""
    h = trace.horizon_index
    state = trace.rel_err("state")  # [V, R] window means
    out = trace.rel_err("out")
    out_max = trace.rel_err("out", stat="max")
    state_max = trace.rel_err("state", stat="max")
    out_heads = trace.rel_err("out", per_head=True)[:, h]  # [V, H]
    centers = trace.window_centers
    rows = []
    for i, v in enumerate(variants):
        fit_out = fit_power_law(centers, out[i], first_write_step(v))
        fit_state = fit_power_law(centers, state[i], first_write_step(v))
        worst = int(np.nanargmax(out_heads[i])) if np.isfinite(out_heads[i]).any() else -1
        rows.append(
            {
                "layer": layer,
                "kind": kind,
                "variant": v.name,
                "format": v.format.name,
                "scheme": v.scheme.name,
                "engine": v.engine,
                "horizon": int(trace.steps[h]),
                "horizon_window_start": int(trace.window_starts[h]),
                "state_rel_err": float(state[i, h]),
                "state_rel_err_max": float(state_max[i, h]),
                "out_rel_err": float(out[i, h]),
                "out_rel_err_max": float(out_max[i, h]),
                "out_snr_db": float(-20 * np.log10(out[i, h])) if out[i, h] > 0 else float("inf"),
                "worst_head": worst,
                "worst_head_out_rel_err": float(out_heads[i, worst]) if worst >= 0 else float("nan"),
                "growth_b_out": fit_out.b,
                "growth_a_out": fit_out.a,
                "fit_r2_out": fit_out.r2,
                "growth_b_state": fit_state.b,
                "fit_r2_state": fit_state.r2,
                **forecast_columns("out", fit_out, FORECAST_STEPS, float(out[i, -1])),
                **forecast_columns("state", fit_state, FORECAST_STEPS, float(state[i, -1])),
                **budget_columns(out_max[i], trace.window_starts, trace.steps, first_write_step(v), budget),
            }
        )
    return rows


def engines_note(variant: Variant, kind: str, dims=None, arch=None) -> str:
    """Which engines serve ``variant`` as measured (engine facts, each engine's newest release read): "engines:
    FlashInfer 0.7.4", or "engines: none (vLLM 0.33.0, ...)" naming those checked. A variant measured with an engine
    profile (``~vllm``) names that engine alone."""
    if variant.engine != "ideal":
        target = Target.make(variant.engine, dims=dims, arch=arch)
        label = f"{target.name} {target.version}"
        return f"engine: {label}" if not violations(target, variant, kind) else f"engine: {label} does not serve it"
    runs, not_runs = engines_running(variant, kind, dims, arch)
    return f"engines: {', '.join(runs)}" if runs else f"engines: none ({', '.join(not_runs)} checked)"


def _with_engines(summary: pd.DataFrame, variants: list[Variant], source) -> pd.DataFrame:
    """The summary with an ``engines`` column: ``engines_note`` of each row's variant."""
    if summary.empty:
        return summary
    arch = (source.describe or {}).get("architecture")
    notes = {v.name: engines_note(v, source.layer_kind, source.dims, arch) for v in variants}
    return summary.assign(engines=summary["variant"].map(notes))


def _layer_list(layers) -> str:
    return f"layer{'s' if len(layers) > 1 else ''} {', '.join(str(int(x)) for x in layers)}"


def verdicts(summary: pd.DataFrame) -> list[dict]:
    """The budget verdict per variant (format x rounding x scheme x engine), in the run's order, from the summary's
    per-layer verdict columns: for the horizon and each forecast step, 'yes' (every layer under the budget), 'no'
    (a layer over or diverged) or 'unknown' (none over, a forecast withheld), the layers in each state, and a line
    of text such as "fp8_e4m3@replay16: every layer under 0.02 to 4096 steps; 32K: yes; 128K: layers 6, 12 over"."""
    if summary.empty or "verdict_horizon" not in summary.columns:
        return []
    out = []
    for variant, g in summary.groupby("variant", sort=False):
        budget, horizon = float(g["budget"].iloc[0]), int(g["horizon"].max())
        rec = {"variant": variant, "budget": budget, "steps": horizon}
        parts = []
        for key, label in (("horizon", None), *((f"{s // 1024}k", f"{s // 1024}K") for s in FORECAST_STEPS)):
            col = g[f"verdict_{key}"]
            layers = {
                state: sorted(int(x) for x in g.loc[col == state, "layer"]) for state in ("over", "diverged", "unknown")
            }
            answer = "no" if layers["over"] or layers["diverged"] else "unknown" if layers["unknown"] else "yes"
            rec[key] = {"answer": answer, **{f"layers_{k}": v for k, v in layers.items()}}
            if key == "horizon":
                if answer == "yes":
                    parts.append(f"every layer under {budget:g} to {horizon} steps")
                else:
                    bits = []
                    if layers["over"]:
                        worst = g[col == "over"].sort_values("out_rel_err_peak").iloc[-1]
                        bits.append(f"{_layer_list(layers['over'])} over {budget:g} within {horizon} steps (worst "
                                    f"{worst.out_rel_err_peak:.2e}, layer {int(worst.layer)})")  # fmt: skip
                    if layers["diverged"]:
                        bits.append(f"{_layer_list(layers['diverged'])} diverged within {horizon} steps (error >= "
                                    f"{DIVERGED:g} or not finite)")  # fmt: skip
                    parts.append(", ".join(bits))
                continue
            if answer == "yes":
                parts.append(f"{label}: yes")
                continue
            bits = []
            if layers["over"]:
                bits.append(f"{_layer_list(layers['over'])} over")
            if layers["diverged"]:
                bits.append(f"{_layer_list(layers['diverged'])} diverged")
            if layers["unknown"]:
                unfit = g["fit_r2_out_max"].isna() & (col == "unknown")
                for rows, why in ((col == "unknown") & ~unfit, f"fit r2 < {MIN_FORECAST_R2}"), (unfit, "no fit"):
                    if rows.any():
                        bits.append(f"{_layer_list(sorted(int(x) for x in g.loc[rows, 'layer']))} unknown ({why})")
            parts.append(f"{label}: {', '.join(bits)}")
        if "engines" in g.columns and isinstance(g["engines"].iloc[0], str):
            rec["engines"] = g["engines"].iloc[0]
            parts.append(rec["engines"])
        rec["text"] = f"{variant}: " + "; ".join(parts)
        out.append(rec)
    return out


def prompt_note(prompt: int) -> str:
    """What the step numbers of a run with this prompt length count."""
    if not prompt:
        return "no prompt: every captured token is a decode step, from an empty state"
    return (
        f"the first {prompt} tokens of each sequence are a prompt, prefilled in FP32; each variant stores the state "
        "they leave once in its format (conventional: its stored state; replay: its first checkpoint) and the steps "
        "count the decode steps after it"
    )


def verdict_note(budget: float) -> str:
    """What the verdict compares, for report.json and the terminal."""
    return (
        f"budget {budget:g} on the worst step of the relative output error (the largest per-step error of every "
        "window, pooled over sequences and heads: every decode step counts, replay is judged at its peaks before "
        f"each flush); 32K / 128K: the worst step measured so far and the power-law forecast of the window maxima, "
        f"forecasts, not measurements. Labels, first that applies: 'diverged' (the measured error reached {DIVERGED:g} "
        f"or is not finite), 'over' (measured, then forecast: a forecast reaching {DIVERGED:g} is over too), "
        f"'unknown' (forecast withheld: no fit, or its r2 < {MIN_FORECAST_R2}), 'under'"
    )


def head_steps(steps: np.ndarray, points: int = HEAD_TABLE_POINTS) -> np.ndarray:
    """Indices of ~log-spaced recorded steps (always the last) for the per-head table."""
    targets = np.unique(np.geomspace(steps[0], steps[-1], points).round())
    idx = np.unique(np.searchsorted(steps, targets).clip(0, len(steps) - 1))
    return np.unique(np.append(idx, len(steps) - 1))


def head_table(layer: int, trace: Trace) -> pd.DataFrame:
    """Per-head state/out relative errors (window mean and max) at ~log-spaced windows, long format."""
    idx = head_steps(trace.steps[: trace.horizon_index + 1])
    s = trace.rel_err("state", per_head=True)[:, idx]  # [V, K, H]
    o = trace.rel_err("out", per_head=True)[:, idx]
    o_max = trace.rel_err("out", stat="max", per_head=True)[:, idx]
    nv, nk, nh = s.shape
    return pd.DataFrame(
        {
            "layer": layer,
            "variant": np.repeat(np.array(trace.variants, dtype=object), nk * nh),
            "step": np.tile(np.repeat(trace.steps[idx], nh), nv),
            "window_start": np.tile(np.repeat(trace.window_starts[idx], nh), nv),
            "head": np.tile(np.arange(nh), nv * nk),
            "state_rel_err": s.reshape(-1),
            "out_rel_err": o.reshape(-1),
            "out_rel_err_max": o_max.reshape(-1),
        }
    )


# What the engine columns of the memory table assume: each engine's newest release read, on sm90, decoding
# conventionally without drafts at its defaults (vLLM: prefix caching on, as for every hybrid model)
MEMORY_ENGINE_GPU = 90
MEMORY_ENGINE_NOTE = (
    "<engine>_bytes_per_sequence: what the engine reserves for the format at its newest release read on sm90, "
    "decoding conventionally without drafts at its defaults (vLLM: prefix caching on, its default for hybrid models; "
    "state copies per sequence in <engine>_state_copies); empty where the engine stores no such state"
)


def _engine_memory(source: LayerSource, fmt, num_layers: int) -> dict:
    """{<engine>_bytes_per_sequence, <engine>_state_copies} of one format (None where the engine takes none)."""
    out = {}
    variant = Variant(fmt, parse_scheme("conventional"))
    dims = source.dims
    for engine in TARGETS:
        t = Target.make(engine, None, MEMORY_ENGINE_GPU, 0, dims)
        if fmt.scale_mode.value != "dynamic" or violations(t, variant, source.layer_kind):
            out[f"{engine}_bytes_per_sequence"], out[f"{engine}_state_copies"] = None, None
            continue
        rt = runtime(t, variant, source.layer_kind)
        out[f"{engine}_bytes_per_sequence"] = (
            engine_bytes(t, variant, source.layer_kind, dims, rt)["total"] * num_layers
        )
        out[f"{engine}_state_copies"] = rt.state_copies
    return out


def memory_table(source: LayerSource, variants: list[Variant], num_layers: int) -> pd.DataFrame:
    """Bytes per sequence for all SSM layers of the model, per format, and the capacity vs FP32; then what each
    engine reserves for the format per sequence (MEMORY_ENGINE_NOTE)."""
    shape = source.state_shape
    fp32 = parse("fp32").bytes_per_state(shape) * num_layers
    rows, seen = [], set()

    def row(name: str, nbytes: int, bits: float, **more) -> dict:
        return {"format": name, "bytes_per_sequence": nbytes, "MiB_per_sequence": nbytes / 2**20,
                "bits_per_element": bits, "capacity_vs_fp32": fp32 / nbytes, **more}  # fmt: skip

    for fmt in [parse("fp32"), parse("bf16")] + [v.format for v in variants]:
        if fmt.name in seen:
            continue
        seen.add(fmt.name)
        b = fmt.bytes_per_state(shape) * num_layers
        rows.append(row(fmt.name, b, fmt.bits_per_element(shape), **_engine_memory(source, fmt, num_layers)))
    heads, rows_per_head, state_dim = shape
    elements = heads * rows_per_head * state_dim
    for v in variants:  # a prompt store's cached copy of the prompt's state (scales in the live dtype)
        name = f"{v.prompt_store} (prompt cache, {v.format.encoding.value} scales)"
        if v.prompt_store is None or name in seen:
            continue
        seen.add(name)
        scale_bytes = v.format.encoding.spec.storage.itemsize
        per_head = parse_prompt_store(v.prompt_store).bytes_per_head(rows_per_head, state_dim, scale_bytes)
        b = heads * per_head * num_layers
        rows.append(row(name, b, 8 * b / (elements * num_layers)))
    return pd.DataFrame(rows)


def _stages(load_s: float, after_load_s: float, run, emulated_s: float, device, emu_devices, in_use) -> dict:
    """report.json's stage times (seconds) and peak GPU memory (GiB) of one analysis; per device with several."""
    stages = {
        "load_s": round(load_s, 3),
        # capture runs in a worker thread beside the emulation: this is the time spent waiting for it
        "capture_wait_s": round(run.wait_s, 3),
        "emulate_s": round(emulated_s, 3),  # summed over devices: above the wall time when they overlap
        "layers_wall_s": round(run.wall_s, 3),  # from the first layer requested to the last one done
        "tables_s": round(after_load_s - run.wall_s, 3),
        "peak_gpu_memory_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        if device.type == "cuda"
        else None,
    }
    if len(emu_devices) > 1 or len(in_use) > 1:
        stages["emulation_devices"] = {str(d): sorted(run.layers.get(str(d), [])) for d in emu_devices}
        stages["busy_s_per_device"] = {d: round(v, 3) for d, v in run.busy_s.items()}
        stages["peak_gpu_memory_GiB_per_device"] = {
            str(d): round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in in_use
        }
    return stages


def _checked(cfg: AnalyzeConfig) -> tuple[AnalyzeConfig, list, bool]:
    """(the config with its formats and recording window settled, its variants, whether unrunnable variants are
    skipped); AnalyzeError naming the first setting that cannot run."""
    if cfg.steps < 1 or cfg.batch < 1:
        raise AnalyzeError(f"--steps and --batch must be >= 1, got steps={cfg.steps}, batch={cfg.batch}")
    if not (math.isfinite(cfg.budget) and 0 < cfg.budget < DIVERGED):
        raise AnalyzeError(
            f"--budget must lie in (0, {DIVERGED:g}): a relative output error, where {DIVERGED:g} is an error as large "
            f"as the signal; got {cfg.budget}"
        )
    if isinstance(cfg.prompt, bool) or not isinstance(cfg.prompt, int) or cfg.prompt < 0:
        raise AnalyzeError(f"--prompt must be a whole number of tokens >= 0 (0: no prompt), got {cfg.prompt!r}")
    if cfg.record_every is not None and cfg.record_every < 1:
        raise AnalyzeError(f"--record-every must be >= 1 (keep every k-th step), got {cfg.record_every}")
    skip = cfg.skip_unrunnable if cfg.skip_unrunnable is not None else tuple(cfg.formats) == cfg.DEFAULT_FORMATS
    if skip and any(e != "ideal" for e in cfg.engines):
        # the engines' own 16-bit states beside the default formats, which released engines mostly do not store
        cfg = replace(cfg, formats=[*cfg.formats, *(f for f in ENGINE_FLOAT_FORMATS if f not in cfg.formats)])
    variants = build_variants(cfg)
    never = sorted({v.scheme.name for v in variants if first_write_step(v) > cfg.steps})
    if never:
        raise AnalyzeError(
            f"{', '.join(never)} never rewrites its checkpoint within --steps {cfg.steps} (the first write would be "
            f"after step {max(first_write_step(v) for v in variants)}), so its error would read 0: raise --steps or "
            "lower --buffer-len"
        )
    record_every = cfg.record_every or cycle_window([flush_cycle(v) for v in variants], cfg.steps, MAX_RECORDED_STEPS)
    if not 1 <= record_every <= cfg.steps:
        raise AnalyzeError(f"--record-every must lie in [1, --steps={cfg.steps}], got {record_every}")
    cfg = replace(cfg, record_every=record_every)  # report.json names the window actually used
    return cfg, variants, skip


def analyze(cfg: AnalyzeConfig, *, model=None, progress=None, notify=None) -> AnalysisResult:
    """Run the analysis. progress: optional callable(done_layers, total_layers, layer_index) for a bar;
    notify: optional callable(line) that receives the time estimate before the emulation starts (the
    estimate is measured only when notify is given) and, after the first layer, what it implies for the rest.
    model: a LoadedModel already in memory (``load_model``, ``models.build.build_random_model``, possibly
    spread over several GPUs) to capture from instead of loading ``cfg.model``. With several emulation
    devices (``cfg.devices``) each layer is emulated on the GPU holding it, or round-robin
    (``analysis.devices``); each GPU emulates GPU_LANES layers at once, one worker thread and CUDA stream each.

    Raises AnalyzeError / SourceError with a message naming the problem, SizingError (before any layer
    runs) when the run's memory estimate exceeds the free memory; NaN/Inf in captured inputs raise
    InputError naming the layer and step.
    """
    t0 = time.time()
    cfg, variants, skip = _checked(cfg)
    device, emu_devices, chosen_backend = resolve_run_devices(cfg.device, cfg.devices, cfg.backend, model=model)
    record_every = cfg.record_every
    source = open_source(
        cfg.model,
        synthetic=cfg.synthetic,
        batch=cfg.batch,
        steps=cfg.prompt + cfg.steps,  # the prompt's tokens, then the decoded ones
        seed=cfg.seed,
        device=device,
        text_path=cfg.text,
        synthetic_profile=cfg.synthetic_profile,
        loaded=model,
        devices=emu_devices,
        layers=cfg.layers,
    )
    t_loaded = time.time()
    layers = source.select(cfg.layers)
    # conventional baselines write every step: they change neither the first-write check nor the window above
    variants = variants + baseline_variants(cfg, source.layer_kind, variants)
    source.check_formats([v.format for v in variants])
    variants, skipped = check_engine_profiles(
        variants, source.layer_kind, (cfg.batch, *source.state_shape), skip_unrunnable=skip
    )
    if notify is not None:
        for line in skipped_lines(skipped):
            notify(line)
    lanes = GPU_LANES if all(d.type == "cuda" for d in emu_devices) else 1
    # one GPU, one lane: synthetic inputs are drawn one layer ahead on their own stream while the kernels run
    ahead = source.can_make_ahead and cfg.devices is None and lanes == 1
    sizes = dict(steps=cfg.steps, batch=cfg.batch, backend=chosen_backend, recorded=cfg.steps // record_every,
                 workers=len(emu_devices), lanes=lanes, ahead=ahead, prompt=cfg.prompt)  # fmt: skip
    # the probe measures the emulation as it will run: the same threads
    with emulation_threads(emu_devices):
        per_step = plan_layers(
            source, layers, variants, device=emu_devices[0], measure_time=notify is not None, **sizes
        )
        for dev in emu_devices[1:]:  # every emulation device holds one layer's emulation at a time
            plan_layers(source, layers, variants, device=dev, **sizes)
        if per_step is not None:
            notify(
                f"estimate: about {format_seconds(per_step * cfg.steps * len(layers))} to emulate {len(layers)} layers x "
                f"{len(variants)} variants x {cfg.steps} steps x batch {cfg.batch} (torch backend, "
                f"{1e3 * per_step:.3g} ms per layer-step measured on this machine; loading and capture not included)"
            )
        if progress:
            progress(0, len(layers), None)
        assignment = assign_layers(layers, emu_devices, source.layer_devices)
        in_use = {d for d in [device, *emu_devices, *(source.layer_devices or {}).values()] if d.type == "cuda"}
        in_use = sorted({torch.device("cuda", d.index or 0) for d in in_use}, key=str)
        for d in in_use:
            torch.cuda.reset_peak_memory_stats(d)
        done = []

        def emulate(layer, inputs, dev):
            """Queue the layer's emulation (validation errors raise here); ``reduce`` waits for it."""
            t_sim = time.perf_counter()
            inputs = inputs.to(dev)
            inputs.meta.setdefault("layer", layer)
            try:
                inputs = after_prompt(inputs, cfg.prompt)  # validates the prompt's steps too
                pending = start_simulation(inputs, variants, backend=cfg.backend, record_every=record_every)
            except ValueError as err:
                raise AnalyzeError(f"layer {layer}: {err}") from err
            return pending, time.perf_counter() - t_sim

        kernels: dict[
            str, str
        ] = {}  # variant -> the fused kernel that ran it ("cuda", "triton", "engine"), GPU backends

        def reduce(layer, started):
            pending, sim_s = started
            t_wait = time.perf_counter()
            trace = pending.result()
            kernels.update(trace.meta.get("kernels", {}))
            sim_s += time.perf_counter() - t_wait  # the wait for the device: emulation, as before
            frame = trace.to_frame()
            frame.insert(0, "layer", layer)
            summary_rows = summarize_layer(layer, source.layer_kind, trace, variants, cfg.budget)
            return frame, head_table(layer, trace), summary_rows, sim_s

        estimate = LayerEstimate(len(layers), len(emu_devices) * lanes, notify)

        def finished(layer, _result, seconds):
            done.append(layer)
            estimate.done(seconds)
            if progress:
                progress(len(done), len(layers), layer)

        results, run = run_on_devices(
            source.iter_layers(layers, ahead=ahead),
            assignment,
            emulate,
            on_result=finished,
            lanes=lanes,
            complete=reduce,
        )
    traces = [results[i][0] for i in layers]
    heads = [results[i][1] for i in layers]
    summary = [row for i in layers for row in results[i][2]]
    emulated = sum(results[i][3] for i in layers)
    stages = _stages(t_loaded - t0, time.time() - t_loaded, run, emulated, device, emu_devices, in_use)
    return AnalysisResult(
        config=cfg,
        source={
            **source.describe,
            "layers": layers,
            "layer_kind": source.layer_kind,
            "state_shape": list(source.state_shape),
        },
        traces=pd.concat(traces, ignore_index=True),
        heads=pd.concat(heads, ignore_index=True),
        summary=_with_engines(pd.DataFrame(summary), variants, source),
        memory=memory_table(source, variants, len(source.layers)),
        environment=environment(device, backend=chosen_backend, **({"fused_kernels": kernels} if kernels else {})),
        elapsed_s=time.time() - t0,
        stages=stages,
        skipped=skipped,
    )


__all__ = [
    "AnalysisResult",
    "AnalyzeConfig",
    "AnalyzeError",
    "SourceError",
    "analyze",
    "baseline_variants",
    "build_variants",
    "verdicts",
]
