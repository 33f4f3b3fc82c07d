"""`calibrate`: statistics, static scales, the per-layer choice under an error budget, and its verification.

Per SSM layer of the calibration data (one layer alive at a time):

1. `collect_stats`: per-row / per-head amax of the FP32 reference state over (sequence, step);
2. `calibrate_scales`: static scales for every (encoding, method, granularity) the candidates need;
3. `evaluate_layer`: every candidate (and engine fallback) simulated to the horizon;
4. `choose_layer`: the cheapest candidate within the budget.

Then the uniform settings (one setting for all layers) and the global setting an engine can take, and the
verification of the chosen settings on held-out data. Nothing is written here: `write_recipe` does that.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch

from ..analysis.devices import assign_layers, run_on_devices
from ..analysis.sources import (
    LayerSource,
    SourceError,
    check_text,
    load_source_model,
    open_source,
    plan_layers,
    resolve_run_devices,
)
from ..engines.deployments import TARGETS, deployments, describe_deployments, takeable_by_any, violations
from ..engines.facts import EngineVersionError
from ..engines.profiles import EngineError, check_engine
from ..formats import FormatError
from ..kinds import InputError
from ..models.text import TextError
from ..provenance import DEFAULT_PACKAGES, environment
from ..simulate import BACKENDS
from ..sizing import LayerEstimate, format_seconds
from .choose import (
    MAX_VARIANTS_PER_CALL,
    BudgetError,
    best_table,
    choose_global,
    choose_layer,
    evaluate_layer,
    profile_refusals,
    uniform_table,
)
from .scales import calibrate_scales, required_percentiles, scale_keys
from .settings import (
    CalibrateError,
    LayerDims,
    Setting,
    build_settings,
    metric_quantity,
    parse_method,
)
from .stats import DEFAULT_PERCENTILES, StateStats, collect_stats
from .verify import check_uniform, summarize_verification, synthetic_heldout_source, verify_layer


@dataclass
class CalibrateConfig:
    """Settings of one calibration run (the `ssmquant calibrate` options; README.md)."""

    model: str = "tiny-nemotron"
    synthetic: bool = False
    text: str | None = None
    budget: float = 0.02
    metric: str = "out_rel_err"
    horizon: int = 4096
    batch: int = 4
    heldout_batch: int | None = None  # None: batch
    candidates: list[str] = field(default_factory=lambda: ["fp8_e4m3", "int8", "nvfp4"])
    schemes: list[str] = field(default_factory=lambda: ["replay", "conventional"])
    buffer_lens: list[int] = field(default_factory=lambda: [4, 8, 16])
    rounding: list[str] = field(default_factory=lambda: ["rne"])
    calibration: list[str] = field(default_factory=lambda: ["max", "percentile", "mse"])
    calibration_granularity: list[str] = field(default_factory=lambda: ["row"])
    engine_fallbacks: list[str] = field(default_factory=lambda: ["fp16", "bf16"])
    count_buffer: bool = True
    force_global: bool = False
    layers: list[int] | None = None
    device: str = "auto"
    backend: str = "auto"
    seed: int = 0
    verify: bool = True
    # what "engine-takeable" is checked against: {engine: version} (an engine left out: its newest release the
    # export's facts cover) on gpu ("sm90" ...; None: the local GPU, else sm90); recorded in the recipe
    engine_versions: dict[str, str] = field(default_factory=dict)
    gpu: str | None = None
    # emulation devices: "cuda:0,cuda:1", a list, or "all" (analysis.devices); None: `device` alone. Each
    # layer is calibrated and verified on the GPU holding it, or round-robin, one worker thread per GPU.
    devices: str | list[str] | None = None
    # the engine profile whose arithmetic emulates every candidate (`ssmquant.engines.profiles`); a setting the
    # profile refuses is recorded as not runnable by that engine, with its reason, and never chosen
    engine: str = "ideal"

    def deployments(self):
        """(Targets, GPU note) that takeability is checked for (`engines.deployments.deployments`)."""
        try:
            return deployments(self.engine_versions, self.gpu)
        except EngineVersionError as err:
            raise CalibrateError(str(err)) from None

    def validate(self) -> None:
        if not isinstance(self.budget, (int, float)) or not math.isfinite(self.budget) or self.budget <= 0:
            raise CalibrateError(
                f"--budget must be a finite number > 0 (a relative error, e.g. 0.02), got {self.budget!r}"
            )
        metric_quantity(self.metric)
        for name in ("horizon", "batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CalibrateError(f"--{name} must be an integer >= 1, got {v!r}")
        if self.heldout_batch is not None and (not isinstance(self.heldout_batch, int) or self.heldout_batch < 1):
            raise CalibrateError(f"--heldout-batch must be an integer >= 1, got {self.heldout_batch!r}")
        if self.backend not in BACKENDS:
            raise CalibrateError(f"unknown backend {self.backend!r}; accepted: {', '.join(BACKENDS)}")
        try:
            check_engine(self.engine)
        except EngineError as err:
            raise CalibrateError(f"--engine: {err}") from None
        self.deployments()


@dataclass
class LayerCalibration:
    """What calibrating one layer gives: every candidate's evaluation (a table, one row per setting), the state
    statistics, the layer's sizes, the chosen setting (None when none meets the budget) with its evaluation row,
    and its static decode scales [H, rows // group] (None for dynamic scales)."""

    evaluations: pd.DataFrame
    stats: StateStats
    dims: LayerDims
    decision: Setting | None
    decision_row: dict | None
    scale: torch.Tensor | None


@dataclass
class CalibrationResult:
    """Everything a recipe is made of (see recipe.py for the files).

    evaluations: one row per (layer, setting) on calibration data; decisions: {layer: Setting};
    scales: {layer: FP32 [H, rows]} for static decisions; stats: {layer: StateStats}; uniform: one row
    per setting over all layers; global_row / global_status: the engine setting (choose.choose_global);
    verification: held-out numbers (verify.py) or None.
    """

    config: CalibrateConfig
    source: dict
    heldout_source: dict | None
    ssm_layers: list[int]
    layer_kind: str
    dims: LayerDims
    settings: list[Setting]
    evaluations: pd.DataFrame
    decisions: dict[int, Setting]
    decision_rows: dict[int, dict]
    scales: dict[int, torch.Tensor]
    stats: dict[int, StateStats]
    uniform: pd.DataFrame
    takeable: dict[str, bool]
    takeability: dict  # what takeable was checked for (engines.deployments.describe_deployments)
    global_setting: Setting | None
    global_status: str
    verification: dict | None
    environment: dict
    elapsed_s: float
    stages: dict = field(default_factory=dict)  # seconds per stage and peak GPU memory (recipe: producer.stages)


def _open(cfg: CalibrateConfig, device, split: str, batch: int, seed: int, loaded=None) -> LayerSource:
    try:
        return open_source(
            cfg.model,
            synthetic=cfg.synthetic,
            batch=batch,
            steps=cfg.horizon,
            seed=seed,
            device=device,
            text_path=cfg.text,
            split=split,
            loaded=loaded,
        )
    except TextError as err:
        hint = " (or lower --heldout-batch)" if split == "heldout" else ""
        raise CalibrateError(f"{split} data: {err}{hint}") from None


def _load(cfg: CalibrateConfig, device, devices):
    """The checkpoint, loaded once for both splits, after checking that both splits' text holds the run
    (a text too short is refused before the weights load)."""
    splits = [("calibration", cfg.batch)] + ([("heldout", cfg.heldout_batch or cfg.batch)] if cfg.verify else [])
    for split, batch in splits:
        try:
            check_text(cfg.text, batch=batch, length=cfg.horizon, split=split)
        except SourceError as err:
            hint = " (or lower --heldout-batch)" if split == "heldout" else ""
            raise CalibrateError(f"{split} data: {err}{hint}") from None
    return load_source_model(cfg.model, device, devices)


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def calibrate(
    cfg: CalibrateConfig,
    *,
    model=None,
    progress=None,
    source: LayerSource | None = None,
    heldout_source: LayerSource | None = None,
    notify=None,
) -> CalibrationResult:
    """Run a calibration. progress: optional callable(stage, done, total, layer), stage "calibrate" | "verify";
    notify: optional callable(line) that receives the time estimate before the first layer (measured only
    when given) and, after the first layer, the time that layer took and what it implies for the rest.

    model: a LoadedModel already in memory (``load_model``, ``models.build.build_random_model``) to capture
    both splits from; else a checkpoint named by ``cfg.model`` is loaded once (over the emulation GPUs when
    ``cfg.devices`` names several) and serves both splits. Layers stream one at a time from capture (memory:
    the model plus one layer's inputs per emulation device). source / heldout_source: LayerSources to use
    instead (tests, custom data); the held-out source must yield different sequences of the same layers.
    Raises CalibrateError (bad settings), BudgetError (no candidate within the budget: `.table` holds the
    best achievable error per layer), SourceError / InputError (data), SizingError (the memory estimate
    exceeds the free memory; raised before the first layer).
    """
    t0 = time.time()
    cfg.validate()
    try:
        settings = build_settings(
            cfg.candidates, cfg.schemes, cfg.buffer_lens, cfg.rounding, cfg.calibration, cfg.calibration_granularity
        )
        fallbacks = (
            []
            if not cfg.engine_fallbacks
            else build_settings(cfg.engine_fallbacks, cfg.schemes, cfg.buffer_lens, ["rne"], ["none"], ["row"])
        )
    except FormatError as err:
        raise CalibrateError(str(err)) from None
    names = {s.name for s in settings}
    fallbacks = [s for s in fallbacks if s.name not in names]
    for s in fallbacks:
        if s.format.encoding.scaled:
            raise CalibrateError(
                f"engine fallback {s.format.name!r} is not a float dtype; fallbacks are fp32, bf16 or fp16"
            )
    roles = {s.name: "candidate" for s in settings} | {s.name: "fallback" for s in fallbacks}
    all_settings = settings + fallbacks
    keys = scale_keys(settings)
    device, emu_devices, chosen_backend = resolve_run_devices(cfg.device, cfg.devices, cfg.backend, model=model)
    loaded = model
    if source is None:
        if loaded is None and not cfg.synthetic:
            loaded = _load(cfg, device, emu_devices)
        source = _open(cfg, device, "calibration", cfg.batch, cfg.seed, loaded)
    t_loaded = time.time()
    layers = source.select(cfg.layers)
    source.check_formats([s.format for s in all_settings])
    # the estimate counts what the profile simulates (a refused setting costs nothing)
    refused = profile_refusals(cfg.engine, all_settings, source.layer_kind, source.state_shape)
    if all(s.name in refused for s in settings):
        reasons = sorted(set(refused.values()))
        raise CalibrateError(
            f"--engine {cfg.engine}: the profile runs none of the {len(settings)} candidates on these "
            f"{source.layer_kind} layers ({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''})"
        )
    _plan(cfg, source, layers, [s for s in all_settings if s.name not in refused], emu_devices, chosen_backend, notify)
    percentiles = sorted(set(DEFAULT_PERCENTILES) | set(required_percentiles(keys)))
    by_name = {s.name: s for s in all_settings}
    in_use = _cuda_devices([device, *emu_devices, *(source.layer_devices or {}).values()])
    for d in in_use:
        torch.cuda.reset_peak_memory_stats(d)

    def calibrate_layer(layer, inputs, dev):
        inputs = inputs.to(dev)
        try:
            inputs.validate()
        except InputError as err:
            raise InputError(f"layer {layer}: {err}") from None
        if inputs.steps != cfg.horizon:
            raise CalibrateError(
                f"layer {layer}: the source gave {inputs.steps} decode steps, --horizon is {cfg.horizon}"
            )
        dims = LayerDims.of(inputs)
        st = collect_stats(inputs, percentiles=percentiles, layer=layer)
        scales = calibrate_scales(inputs, st, keys)
        df = evaluate_layer(
            layer,
            inputs,
            all_settings,
            scales,
            roles=roles,
            backend=cfg.backend,
            seed=cfg.seed,
            count_buffer=cfg.count_buffer,
            engine=cfg.engine,
        )
        chosen = choose_layer(df, cfg.budget, cfg.metric)
        decision = None if chosen is None else by_name[chosen["setting"]]
        scale = scales[decision.scale_key].cpu() if decision is not None and decision.is_static else None
        del inputs, scales
        _free()
        row = None if chosen is None else chosen.to_dict()
        return LayerCalibration(df, _to_cpu(st), dims, decision, row, scale)

    done = []

    def finished(stage, total_after):
        suffix = ", then the verification" if total_after else ""
        estimate = LayerEstimate(len(layers), len(emu_devices), notify if stage == "calibrate" else None, suffix)

        def on_result(layer, _result, seconds):
            done.append(layer)
            n = len(done)
            estimate.done(seconds)
            if progress:
                progress(stage, n, len(layers), layer)

        return on_result

    if progress:
        progress("calibrate", 0, len(layers), None)
    assignment = assign_layers(layers, emu_devices, source.layer_devices)
    results, run = run_on_devices(
        source.iter_layers(layers), assignment, calibrate_layer, on_result=finished("calibrate", cfg.verify)
    )
    evals = [results[layer].evaluations for layer in layers]
    stats = {layer: results[layer].stats for layer in layers}
    dims = results[layers[0]].dims if layers else None
    decisions = {layer: results[layer].decision for layer in layers if results[layer].decision is not None}
    decision_rows = {layer: results[layer].decision_row for layer in decisions}
    chosen_scales = {layer: results[layer].scale for layer in decisions if results[layer].scale is not None}
    del results
    stages = {
        "load_s": round(t_loaded - t0, 3),
        # capture runs in a worker thread beside the emulation: the time spent waiting for it
        "capture_wait_s": round(run.wait_s, 3),
        "calibrate_s": round(sum(run.busy_s.values()), 3),  # statistics, scales, candidates; summed over devices
        "calibrate_wall_s": round(run.wall_s, 3),
    }
    t_choose = time.perf_counter()
    evaluations = pd.concat(evals, ignore_index=True)
    source_desc = {
        **source.describe,
        "split": "calibration",
        "batch": cfg.batch,
        "horizon": cfg.horizon,
        "seed": cfg.seed,
    }
    ssm_layers, layer_kind = list(source.layers), source.layer_kind

    missing = [layer for layer in layers if layer not in decisions]
    if missing:
        table = best_table(evaluations, cfg.metric, cfg.budget)
        raise BudgetError(
            f"no candidate meets the budget {cfg.metric} <= {cfg.budget:g} at step {cfg.horizon} on layer(s) "
            f"{missing}; no recipe written. Best achievable per layer:\n{table.to_string(index=False)}\n"
            "Widen the candidates (e.g. add fp16, replay schemes, stochastic rounding), raise --budget or "
            "shorten --horizon.",
            table,
        )

    uniform = uniform_table(evaluations, cfg.budget, cfg.metric)
    targets, gpu_note = cfg.deployments()
    # takeable: an engine can run it and the profile measured it on every layer (a refused setting has no numbers)
    runnable = evaluations.groupby("setting")["runnable"].all()
    takeable = {
        name: bool(runnable[name]) and takeable_by_any(by_name[name], layer_kind, targets) for name in uniform["setting"]
    }
    global_row, status = choose_global(uniform, takeable)
    global_setting = by_name[global_row["setting"]] if global_row is not None else None
    if cfg.force_global:
        if status != "meets_budget":
            table = _uniform_failure_table(uniform, takeable, cfg)
            what = (
                "no candidate is takeable by an engine"
                if status == "none"
                else "no single engine-takeable setting meets the budget on every layer"
            )
            raise BudgetError(
                f"--global: {what}; no recipe written. Uniform settings, closest first:\n"
                f"{table.to_string(index=False)}",
                table,
            )
        rows = evaluations[evaluations["setting"] == global_setting.name].set_index("layer")
        decisions = {layer: global_setting for layer in layers}
        decision_rows = {layer: {**rows.loc[layer].to_dict(), "layer": layer} for layer in layers}
        chosen_scales = {}

    verify_uniform = check_uniform(
        ([global_setting] if global_setting is not None else [])
        + [by_name[name] for name in engine_picks(uniform, by_name, layer_kind, targets)]
    )
    stages["choose_s"] = round(time.perf_counter() - t_choose, 3)
    verification, heldout_desc = None, None
    if cfg.verify:
        t_verify = time.time()
        hb = cfg.heldout_batch or cfg.batch
        if heldout_source is None:
            if cfg.synthetic:
                heldout_source = synthetic_heldout_source(
                    cfg.model, calibration_batch=cfg.batch, batch=hb, steps=cfg.horizon, seed=cfg.seed, device=device
                )
            else:  # the same model, held-out text
                heldout_source = _open(cfg, device, "heldout", hb, cfg.seed, loaded)
        heldout_desc = {
            **heldout_source.describe,
            "split": "heldout",
            "batch": hb,
            "horizon": cfg.horizon,
            "seed": cfg.seed,
        }

        def verify_one(layer, inputs, dev):
            inputs = inputs.to(dev)
            return verify_layer(layer, inputs, decisions[layer], chosen_scales.get(layer), verify_uniform,
                                metric=cfg.metric, budget=cfg.budget, backend=cfg.backend, seed=cfg.seed,
                                engine=cfg.engine)  # fmt: skip

        done.clear()
        if progress:
            progress("verify", 0, len(layers), None)
        checked, vrun = run_on_devices(
            heldout_source.iter_layers(layers), assignment, verify_one, on_result=finished("verify", False)
        )
        per_layer = [checked[layer].row for layer in layers]
        errors = {u.name: {int(layer): checked[layer].uniform_errors[u.name] for layer in layers} for u in verify_uniform}
        verification = summarize_verification(
            per_layer, errors, metric=cfg.metric, budget=cfg.budget, global_setting=global_setting
        )
        verification["data"] = heldout_desc
        stages |= {
            "verify_open_s": round(time.time() - t_verify - vrun.wall_s, 3),
            "verify_capture_wait_s": round(vrun.wait_s, 3),
            "verify_s": round(sum(vrun.busy_s.values()), 3),
            "verify_wall_s": round(vrun.wall_s, 3),
        }
    if in_use:
        stages["peak_gpu_memory_GiB"] = round(max(torch.cuda.max_memory_allocated(d) for d in in_use) / 2**30, 3)
    if len(in_use) > 1 or len(emu_devices) > 1:
        stages["emulation_devices"] = {str(d): sorted(run.layers.get(str(d), [])) for d in emu_devices}
        stages["busy_s_per_device"] = {d: round(v, 3) for d, v in run.busy_s.items()}
        stages["peak_gpu_memory_GiB_per_device"] = {
            str(d): round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in in_use
        }
    return CalibrationResult(
        config=cfg,
        source=source_desc,
        heldout_source=heldout_desc,
        ssm_layers=ssm_layers,
        layer_kind=layer_kind,
        dims=dims,
        settings=all_settings,
        evaluations=evaluations,
        decisions=decisions,
        decision_rows=decision_rows,
        scales=chosen_scales,
        stats=stats,
        uniform=uniform,
        takeable=takeable,
        takeability=describe_deployments(targets, gpu_note),
        global_setting=global_setting,
        global_status=status,
        verification=verification,
        environment=environment(
            device, packages=(*DEFAULT_PACKAGES, "modelopt"), backend=chosen_backend
        ),
        elapsed_s=time.time() - t0,
        stages=stages,
    )


def _cuda_devices(devices) -> list[torch.device]:
    """The distinct CUDA devices among ``devices`` (index None read as 0), in a stable order."""
    found = {torch.device("cuda", d.index or 0) for d in map(torch.device, devices) if d.type == "cuda"}
    return sorted(found, key=str)


# For the time estimate only: settings re-simulated per layer on held-out data (the decision, the global
# and the engines' picks), and what the statistics cost in settings (one FP32 reference decode, with top-k).
VERIFIED_PER_LAYER = 3
STATS_COST = 2


def _plan(cfg: CalibrateConfig, source: LayerSource, layers, settings, devices, backend, notify) -> None:
    """Refuse a run that will not fit in memory on any of the emulation ``devices`` (each holds one layer's
    work at a time); send the time estimate to ``notify`` (torch backend)."""
    dynamic = [s.variant(seed=cfg.seed, engine=cfg.engine) for s in settings if not s.is_static]
    hb = cfg.heldout_batch or cfg.batch
    # verification of synthetic data draws calibration + held-out sequences and slices (verify.py)
    held = hb + (cfg.batch if cfg.synthetic else 0) if cfg.verify else 0
    batch = max(cfg.batch, held)
    sizes = dict(steps=cfg.horizon, batch=batch, backend=backend, recorded=1, workers=len(devices),
                 variants_at_once=min(len(settings), MAX_VARIANTS_PER_CALL), steps_option="--horizon",
                 batch_note="" if batch == cfg.batch else ", the calibration and held-out sequences together")  # fmt: skip
    per_step = plan_layers(
        source, layers, dynamic, device=devices[0], measure_time=notify is not None and bool(dynamic), **sizes
    )
    for dev in devices[1:]:
        plan_layers(source, layers, dynamic, device=dev, **sizes)
    if per_step is None:
        return
    per_step *= cfg.batch / batch
    per_setting = per_step / len(dynamic)  # seconds per layer-step of one setting at the calibration batch
    work = len(settings) + STATS_COST + (VERIFIED_PER_LAYER * hb / cfg.batch if cfg.verify else 0)
    total = per_setting * work * cfg.horizon * len(layers) / len(devices)
    mse = any(parse_method(k[1]).kind == "mse" for k in scale_keys(settings))
    notify(
        f"estimate: about {format_seconds(total)} to evaluate {len(layers)} layers x {len(settings)} settings x "
        f"{cfg.horizon} steps x batch {cfg.batch}" + (f" and verify on {hb} held-out sequences" if cfg.verify else "")
        + f" (torch backend, {1e3 * per_setting:.3g} ms per setting and layer-step measured on this machine; "
        "loading and capture not included"
        + ("; the MSE scale search comes on top: timed on the first layer" if mse else "") + ")"
    )


def engine_picks(uniform: pd.DataFrame, by_name: dict[str, Setting], layer_kind: str, targets=None) -> list[str]:
    """Per export target, the cheapest uniform setting it can take that meets the budget (what the export
    picks when the global setting is not takeable); verified on held-out data with the global setting.
    targets: the Targets checked (CalibrateConfig.deployments); None: every engine's newest release on sm90."""
    ok = uniform[uniform["meets_budget"]].sort_values(["bytes", "max_error", "setting"], kind="mergesort")
    picks = []
    for t in targets if targets is not None else TARGETS:
        for name in ok["setting"]:
            if not by_name[name].is_static and not violations(t, by_name[name], layer_kind):
                picks.append(name)
                break
    return list(dict.fromkeys(picks))


def _to_cpu(st: StateStats) -> StateStats:
    st.row_amax = st.row_amax.cpu()
    st.row_mean_amax = st.row_mean_amax.cpu()
    st.row_tail = {p: t.cpu() for p, t in st.row_tail.items()}
    st.head_amax_steps = st.head_amax_steps.cpu()
    return st


def _uniform_failure_table(uniform: pd.DataFrame, takeable: dict[str, bool], cfg: CalibrateConfig) -> pd.DataFrame:
    pool = uniform[(uniform["role"] == "candidate") & uniform["setting"].map(lambda n: takeable.get(n, False))]
    if pool.empty:
        pool = uniform[uniform["role"] == "candidate"]
    t = pool.sort_values(["max_error", "bytes"]).head(10)
    return pd.DataFrame(
        {
            "setting": t["setting"],
            f"worst_layer_{cfg.metric}": t["max_error"],
            "budget": cfg.budget,
            "bytes_per_sequence": t["bytes"],
        }
    )


def config_dict(cfg: CalibrateConfig) -> dict:
    return asdict(cfg)


__all__ = ["BudgetError", "CalibrateConfig", "CalibrateError", "CalibrationResult", "SourceError", "calibrate"]
