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

import dataclasses
import gc
import math
import threading
import time
from dataclasses import dataclass, field

import pandas as pd
import torch

from ..analysis.devices import assign_layers, emulation_threads, run_on_devices
from ..analysis.sources import (
    LayerSource,
    SourceError,
    check_layers_before_loading,
    check_text,
    load_source_model,
    open_source,
    plan_layers,
    resolve_run_devices,
)
from ..engines.deployments import TARGETS, Target, deployments, describe_deployments, takeable_by_any, violations
from ..engines.facts import ENGINE_NAMES, SERVED_KINDS, EngineVersionError
from ..engines.profiles import EngineError, check_engine
from ..formats import FormatError
from ..kinds import InputError, after_prompt
from ..models import get_preset
from ..models.text import TextError
from ..provenance import DEFAULT_PACKAGES, environment
from ..replay.variants import PROMPT_STORE_LIVE_FORMATS
from ..simulate import BACKENDS
from ..sizing import format_seconds
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
    CHOICES,
    CalibrateError,
    LayerDims,
    Setting,
    build_settings,
    metric_quantity,
    with_prompt_stores,
)
from .stats import DEFAULT_PERCENTILES, StateStats, collect_stats
from .timing import (
    VERIFY_SETTINGS_GUESS,
    Costs,
    LayerCost,
    RunClock,
    TimedItems,
    TimeLeft,
    mse_samples_at,
    probe_layer,
)
from .verify import check_uniform, summarize_verification, synthetic_heldout_source, verify_layer


@dataclass
class CalibrateConfig:
    """Settings of one calibration run (the `ssmquant calibrate` options; README.md)."""

    model: str = "tiny-nemotron"
    synthetic: bool = False
    text: str | None = None
    budget: float = 0.02
    metric: str = "out_rel_err"
    horizon: int = 4096  # decode steps (after the prompt)
    prompt: int = 0  # tokens prefilled before decoding (analysis.AnalyzeConfig.prompt)
    batch: int = 4
    heldout_batch: int | None = None  # None: batch
    candidates: list[str] = field(default_factory=lambda: ["fp8_e4m3", "int8", "nvfp4"])
    schemes: list[str] = field(default_factory=lambda: ["replay", "conventional"])
    buffer_lens: list[int] = field(default_factory=lambda: [4, 8, 16])
    rounding: list[str] = field(default_factory=lambda: ["rne"])
    calibration: list[str] = field(default_factory=lambda: ["max", "percentile", "mse"])
    calibration_granularity: list[str] = field(default_factory=lambda: ["row"])
    # fp32: what vLLM and TensorRT-LLM keep for Kimi-Linear's KDA state (the one setting engines run there)
    engine_fallbacks: list[str] = field(default_factory=lambda: ["fp16", "bf16", "fp32"])
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
    # CHOICES: "engines" (default) chooses among what the engines checked run; "research" among every candidate
    choose_among: str = "engines"
    # prompt stores (formats.prompt_store, e.g. "int8col": SGLang's int8 prefix cache): every float setting (fp32,
    # bf16, fp16; candidates and fallbacks) is measured again with the prompt's state kept in each (needs prompt)
    prompt_stores: list[str] = field(default_factory=list)

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
        if isinstance(self.prompt, bool) or not isinstance(self.prompt, int) or self.prompt < 0:
            raise CalibrateError(f"--prompt must be a whole number of tokens >= 0 (0: no prompt), got {self.prompt!r}")
        if self.heldout_batch is not None and (not isinstance(self.heldout_batch, int) or self.heldout_batch < 1):
            raise CalibrateError(f"--heldout-batch must be an integer >= 1, got {self.heldout_batch!r}")
        if self.backend not in BACKENDS:
            raise CalibrateError(f"unknown backend {self.backend!r}; accepted: {', '.join(BACKENDS)}")
        try:
            check_engine(self.engine)
        except EngineError as err:
            raise CalibrateError(f"--engine: {err}") from None
        if self.choose_among not in CHOICES:
            raise CalibrateError(f"--choose-among must be one of {', '.join(CHOICES)}, got {self.choose_among!r}")
        if self.prompt_stores and self.prompt < 1:
            raise CalibrateError(
                "--prompt-store keeps the prompt's state in a prefix cache: give the prompt's length with --prompt N "
                "(N >= 1)"
            )
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
    alternative: dict | None = None  # the cheapest within the budget in the other pool (``CalibrationResult``)
    cost: LayerCost | None = None


@dataclass
class CalibrationResult:
    """Everything a recipe is made of (see recipe.py for the files).

    evaluations: one row per (layer, setting) on calibration data; decisions: {layer: Setting};
    scales: {layer: FP32 [H, rows]} for static decisions; stats: {layer: StateStats}; uniform: one row
    per setting over all layers; global_row / global_status: the engine setting (choose.choose_global);
    verification: held-out numbers (verify.py) or None. choose_among: what the decisions and the global setting
    were chosen among (CHOICES); runs_on: {setting name: [engines of the checked deployments that run it as
    measured on these layers' sizes]} (a setting the profile refused: []); alternatives: {layer: the evaluation row
    of the cheapest setting within the budget in the other pool (engines: among what no checked engine runs, the
    research settings; research: among what they run), or None}.
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
    choose_among: str = "engines"
    runs_on: dict = field(default_factory=dict)
    alternatives: dict = field(default_factory=dict)
    engine_choices: dict = field(default_factory=dict)  # {engine: the uniform setting its export takes, or None}


def _open(cfg: CalibrateConfig, device, split: str, batch: int, seed: int, loaded=None) -> LayerSource:
    try:
        return open_source(
            cfg.model,
            synthetic=cfg.synthetic,
            batch=batch,
            steps=cfg.prompt + cfg.horizon,  # the prompt's tokens, then the decoded ones
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
    try:  # the config alone says which layers are SSM layers: refused before minutes of loading
        check_layers_before_loading(cfg.model, cfg.layers)
    except SourceError as err:
        raise CalibrateError(f"--layers: {err}") from None
    splits = [("calibration", cfg.batch)] + ([("heldout", cfg.heldout_batch or cfg.batch)] if cfg.verify else [])
    for split, batch in splits:
        try:
            check_text(cfg.text, batch=batch, length=cfg.prompt + cfg.horizon, split=split)
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
    time_left=None,
) -> CalibrationResult:
    """Run a calibration. progress: optional callable(stage, done, total, layer), stage "calibrate" | "verify",
    done in layers (fractional while a layer is under way: its statistics, scales and each simulate call move it),
    total the layers; notify: optional callable(line) that receives the time estimate before the first layer
    (measured only when given: a short trial of the pipeline on this machine, torch backend) and, after the first
    layer, the time it took and what it implies for the rest, verification included; time_left: optional
    callable(TimeLeft) called with every progress update once an estimate exists (the calibration left and the
    verification, a range where the machine is busy; ``timing.TimeLeft``).

    model: a LoadedModel already in memory (``load_model``, ``models.build.build_random_model``) to capture
    both splits from; else a checkpoint named by ``cfg.model`` is loaded once (over the emulation GPUs when
    ``cfg.devices`` names several) and serves both splits. Layers stream one at a time from capture (memory:
    the model plus one layer's inputs per emulation device). source / heldout_source: LayerSources to use
    instead (tests, custom data); the held-out source must yield different sequences of the same layers.
    Raises CalibrateError (bad settings), BudgetError (no setting within the budget: `.table` holds the
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
    if cfg.prompt_stores and not any(s.encoding in PROMPT_STORE_LIVE_FORMATS for s in settings + fallbacks):
        raise CalibrateError(
            "--prompt-store restores the prompt's state into a float state: add fp32, bf16 or fp16 to the candidates "
            "or keep the engine fallbacks"
        )
    names = {s.name for s in settings}
    fallbacks = [s for s in fallbacks if s.name not in names]
    for s in fallbacks:
        if s.format.encoding.scaled:
            raise CalibrateError(
                f"engine fallback {s.format.name!r} is not a float dtype; fallbacks are fp32, bf16 or fp16"
            )
    settings, fallbacks = (with_prompt_stores(group, cfg.prompt_stores) for group in (settings, fallbacks))
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
    targets, gpu_note = cfg.deployments()
    sized = sized_targets(targets, source.dims, _architecture(cfg, source))
    runs_on = {s.name: [] if s.name in refused else engines_running(s, source.layer_kind, sized) for s in all_settings}
    engine_pool = {name for name, e in runs_on.items() if e}
    research_pool = {s.name for s in settings}
    if cfg.choose_among == "engines":
        if not any(source.layer_kind in SERVED_KINDS[t.engine] for t in targets):
            served = "; ".join(f"{ENGINE_NAMES[e]} serves {', '.join(kinds)}" for e, kinds in SERVED_KINDS.items())
            raise CalibrateError(
                f"--choose-among engines: no engine serves {source.layer_kind} layers ({served}); choose among "
                "research settings (--choose-among research)"
            )
        if not engine_pool:
            raise CalibrateError(
                f"--choose-among engines: none of the {len(all_settings)} settings runs on "
                f"{_engines_text(describe_deployments(targets, gpu_note))} for these {source.layer_kind} layers "
                f"{tuple(source.state_shape)} as measured; add settings they run (e.g. --engine-fallbacks fp16,bf16,fp32, "
                "--candidates int8 --schemes replay on Mamba-2) or choose among research settings "
                "(--choose-among research)"
            )
        pool, other = engine_pool, research_pool - engine_pool
    else:
        pool, other = research_pool, engine_pool
    simulated = [s for s in all_settings if s.name not in refused]
    cpu = all(torch.device(d).type == "cpu" for d in emu_devices)
    hb = cfg.heldout_batch or cfg.batch
    with emulation_threads(emu_devices):
        probe, costs = _plan(cfg, source, layers, simulated, keys, emu_devices, chosen_backend, notify is not None)
        clock = RunClock(len(layers), parallel=len(emu_devices), verify=cfg.verify, heldout_ratio=hb / cfg.batch,
                         cpu=cpu, costs=costs)  # fmt: skip
        estimate = clock.left()  # from the probe alone: nothing is measured yet
        if estimate is not None:
            notify(_estimate_line(cfg, estimate, len(layers), len(simulated), probe))
        percentiles = sorted(set(DEFAULT_PERCENTILES) | set(required_percentiles(keys)))
        by_name = {s.name: s for s in all_settings}
        in_use = _cuda_devices([device, *emu_devices, *(source.layer_devices or {}).values()])
        for d in in_use:
            torch.cuda.reset_peak_memory_stats(d)
        report = _Reporter(progress, time_left, clock, len(layers))

        def calibrate_layer(layer, inputs, dev):
            w0, c0 = time.perf_counter(), time.thread_time()
            inputs = inputs.to(dev)
            try:
                inputs = after_prompt(inputs.validate(), cfg.prompt)
            except InputError as err:
                raise InputError(f"layer {layer}: {err}") from None
            if inputs.steps != cfg.horizon:
                raise CalibrateError(
                    f"layer {layer}: the source gave {inputs.steps} decode steps, --horizon is {cfg.horizon}"
                )
            w_stats, w_scales, w_eval = clock.weights()
            dims = LayerDims.of(inputs)
            t1 = time.perf_counter()
            st = collect_stats(inputs, percentiles=percentiles, layer=layer)
            t2 = time.perf_counter()
            report.advance("calibrate", layer, w_stats)
            scales = calibrate_scales(inputs, st, keys)
            t3 = time.perf_counter()
            report.advance("calibrate", layer, w_stats + w_scales)

            def chunk_done(done, total):
                report.advance("calibrate", layer, w_stats + w_scales + w_eval * done / max(1, total))

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
                on_chunk=chunk_done,
                count_cached_prompt=bool(cfg.prompt_stores),
            )
            t4 = time.perf_counter()
            chosen = choose_layer(df, cfg.budget, cfg.metric, among=pool)
            alternative = choose_layer(df, cfg.budget, cfg.metric, among=other) if other else None
            decision = None if chosen is None else by_name[chosen["setting"]]
            scale = scales[decision.scale_key].cpu() if decision is not None and decision.is_static else None
            del inputs, scales
            _free()
            row = None if chosen is None else chosen.to_dict()
            cost = LayerCost(
                wall_s=time.perf_counter() - w0, cpu_s=time.thread_time() - c0, stats_s=t2 - t1, scales_s=t3 - t2,
                eval_s=t4 - t3, simulated=len(simulated), calls=math.ceil(len(simulated) / MAX_VARIANTS_PER_CALL),
                steps=cfg.horizon, batch=cfg.batch,
            )  # fmt: skip
            alt = None if alternative is None else alternative.to_dict()
            return LayerCalibration(df, _to_cpu(st), dims, decision, row, scale, alt, cost)

        items = TimedItems(source.iter_layers(layers))

        def calibrated(layer, result, seconds):
            cost = result.cost
            cost.wall_s = max(cost.wall_s, seconds) + items.take_wait()  # the capture waited for counts too
            clock.calibrated(layer, cost)
            if len(clock.done) == 1 and notify is not None and len(layers) > 1:
                left = clock.left()
                notify(
                    f"the first layer took {format_seconds(seconds)}: {left.text(more=True)}: "
                    f"{format_seconds(left.calibrate_s)} for the other {len(layers) - 1} layers"
                    + (f", {format_seconds(left.verify_s)} for the verification" if cfg.verify else "")
                )
            report.done("calibrate", layer)

        report.start("calibrate")
        assignment = assign_layers(layers, emu_devices, source.layer_devices)
        results, run = run_on_devices(items, assignment, calibrate_layer, on_result=calibrated)
    evals = [results[layer].evaluations for layer in layers]
    stats = {layer: results[layer].stats for layer in layers}
    dims = results[layers[0]].dims if layers else None
    decisions = {layer: results[layer].decision for layer in layers if results[layer].decision is not None}
    decision_rows = {layer: results[layer].decision_row for layer in decisions}
    alternatives = {layer: results[layer].alternative for layer in layers}
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
        "prompt": cfg.prompt,
        "seed": cfg.seed,
    }
    ssm_layers, layer_kind = list(source.layers), source.layer_kind

    missing = [layer for layer in layers if layer not in decisions]
    if missing:
        table = best_table(evaluations, cfg.metric, cfg.budget, among=pool)
        if cfg.choose_among == "engines":
            within = sorted({alternatives[la]["setting"] for la in missing if alternatives.get(la)})
            what = f"no setting that {_engines_text(describe_deployments(targets, gpu_note))} run meets"
            hint = (
                "Widen the settings (e.g. --engine-fallbacks fp16,bf16,fp32, replay schemes), raise --budget or shorten "
                "--horizon"
                + (
                    f"; research settings that no checked engine runs meet it ({', '.join(within[:4])}): "
                    "--choose-among research chooses among them."
                    if within
                    else "."
                )
            )
        else:
            what = "no candidate meets"
            hint = (
                "Widen the candidates (e.g. add fp16, replay schemes, stochastic rounding), raise --budget or "
                "shorten --horizon."
            )
        raise BudgetError(
            f"{what} the budget {cfg.metric} <= {cfg.budget:g} at step {cfg.horizon} on layer(s) "
            f"{missing}; no recipe written. Best achievable per layer:\n{table.to_string(index=False)}\n{hint}",
            table,
        )

    uniform = uniform_table(evaluations, cfg.budget, cfg.metric)
    # takeable: an engine can run it and the profile measured it on every layer (a refused setting has no numbers)
    runnable = evaluations.groupby("setting")["runnable"].all()
    if cfg.choose_among == "engines":  # checked as the export checks: with the layer sizes and the architecture
        takeable = {name: bool(runnable[name]) and name in engine_pool for name in uniform["setting"]}
    else:
        takeable = {
            name: bool(runnable[name]) and takeable_by_any(by_name[name], layer_kind, targets)
            for name in uniform["setting"]
        }
    among = pool if cfg.choose_among == "engines" else None
    global_row, status = choose_global(uniform, takeable, among=among)
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
        + [by_name[name] for name in engine_picks(uniform, by_name, layer_kind, sized)]
    )
    engine_choices = export_choices(uniform, by_name, layer_kind, sized, global_setting)
    stages["choose_s"] = round(time.perf_counter() - t_choose, 3)
    verification, heldout_desc = None, None
    if cfg.verify:
        t_verify = time.time()
        verified_names = {d.name for d in decisions.values()} | {u.name for u in verify_uniform}
        clock.start_verification(max(len({u.name for u in verify_uniform} | {d.name}) for d in decisions.values()))
        report.start("verify")
        if heldout_source is None:
            if cfg.synthetic:
                heldout_source = synthetic_heldout_source(
                    cfg.model, calibration_batch=cfg.batch, batch=hb, steps=cfg.prompt + cfg.horizon, seed=cfg.seed,
                    device=device,
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
            w0, c0 = time.perf_counter(), time.thread_time()
            inputs = inputs.to(dev)
            inputs = after_prompt(inputs, cfg.prompt)
            out = verify_layer(layer, inputs, decisions[layer], chosen_scales.get(layer), verify_uniform,
                               metric=cfg.metric, budget=cfg.budget, backend=cfg.backend, seed=cfg.seed,
                               engine=cfg.engine)  # fmt: skip
            out.timing = (time.perf_counter() - w0, time.thread_time() - c0)
            return out

        held_items = TimedItems(heldout_source.iter_layers(layers))

        def verified(layer, result, seconds):
            wall, cpu_s = result.timing
            clock.verified(layer, max(wall, seconds) + held_items.take_wait(), cpu_s)
            report.done("verify", layer)

        with emulation_threads(emu_devices):
            checked, vrun = run_on_devices(held_items, assignment, verify_one, on_result=verified)
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
            "verify_settings": len(verified_names),
        }
    if estimate is not None:
        stages["estimate_s"] = round(estimate.seconds, 3)
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
        choose_among=cfg.choose_among,
        runs_on=runs_on,
        alternatives=alternatives,
        engine_choices=engine_choices,
    )


class _Reporter:
    """Progress of the layers (fractional while one is under way) and the time left, to the caller's callbacks;
    called from the emulation workers (one lock)."""

    def __init__(self, progress, time_left, clock: RunClock, total: int):
        self.progress, self.time_left, self.clock, self.total = progress, time_left, clock, total
        self.finished: dict[str, int] = {}
        self.lock = threading.Lock()

    def _send(self, stage: str, done: float, layer) -> None:
        if self.time_left is not None:
            left = self.clock.left()
            if left is not None:
                self.time_left(left)
        if self.progress is not None:
            self.progress(stage, done, self.total, layer)

    def start(self, stage: str) -> None:
        with self.lock:
            self.finished[stage] = 0
            self._send(stage, 0, None)

    def advance(self, stage: str, layer: int, fraction: float) -> None:
        self.clock.advance(layer, fraction)
        with self.lock:
            self._send(stage, min(self.finished.get(stage, 0) + self.clock.in_flight_total(), self.total), layer)

    def done(self, stage: str, layer: int) -> None:
        with self.lock:
            self.finished[stage] = self.finished.get(stage, 0) + 1
            self._send(stage, min(self.finished[stage] + self.clock.in_flight_total(), self.total), layer)


def _cuda_devices(devices) -> list[torch.device]:
    """The distinct CUDA devices among ``devices`` (index None read as 0), in a stable order."""
    found = {torch.device("cuda", d.index or 0) for d in map(torch.device, devices) if d.type == "cuda"}
    return sorted(found, key=str)


def _plan(cfg: CalibrateConfig, source: LayerSource, layers, settings, keys, devices, backend,
          measure_time: bool) -> tuple[LayerCost | None, Costs | None]:  # fmt: skip
    """Refuse a run that will not fit in memory on any of the emulation ``devices`` (each holds one layer's
    work at a time); with ``measure_time`` and the torch backend, time a short trial of the per-layer pipeline
    here (``timing.probe_layer``): (the trial, its cost model at the run's sizes), else (None, None)."""
    dynamic = [s.variant(seed=cfg.seed, engine=cfg.engine) for s in settings if not s.is_static]
    hb = cfg.heldout_batch or cfg.batch
    # verification of synthetic data draws calibration + held-out sequences and slices (verify.py)
    held = hb + (cfg.batch if cfg.synthetic else 0) if cfg.verify else 0
    batch = max(cfg.batch, held)
    sizes = dict(steps=cfg.horizon, batch=batch, backend=backend, recorded=1, workers=len(devices),
                 variants_at_once=min(len(settings), MAX_VARIANTS_PER_CALL), steps_option="--horizon",
                 batch_note="" if batch == cfg.batch else ", the calibration and held-out sequences together",
                 prompt=cfg.prompt)  # fmt: skip
    for dev in devices:
        plan_layers(source, layers, dynamic, device=dev, **sizes)
    if not measure_time or backend != "torch" or not layers or not settings:
        return None, None
    percentiles = sorted(set(DEFAULT_PERCENTILES) | set(required_percentiles(keys)))
    probe = probe_layer(source.dims, settings, keys, steps=cfg.horizon, batch=cfg.batch, percentiles=percentiles,
                        seed=cfg.seed, engine=cfg.engine, device=devices[0], count_buffer=cfg.count_buffer)  # fmt: skip
    mse = any(k[1] == "mse" for k in keys)
    costs = Costs.from_probe(
        probe, steps=cfg.horizon, settings=len(settings), calls=math.ceil(len(settings) / MAX_VARIANTS_PER_CALL),
        mse_samples=mse_samples_at(cfg.horizon) if mse else 0, verify_settings=VERIFY_SETTINGS_GUESS,
        heldout_ratio=hb / cfg.batch, cpu=all(torch.device(d).type == "cpu" for d in devices),
    )  # fmt: skip
    return probe, costs


def _estimate_line(cfg: CalibrateConfig, left: TimeLeft, layers: int, settings: int, probe: LayerCost) -> str:
    """The estimate said before the first layer (``left``: the run clock's, from the trial ``probe``)."""
    hb = cfg.heldout_batch or cfg.batch
    return (
        f"estimate: {left.text()}: {format_seconds(left.calibrate_s)} to evaluate {layers} layers x {settings} "
        f"settings x {cfg.horizon} steps x batch {cfg.batch}"
        + (f", {format_seconds(left.verify_s)} to verify on {hb} held-out sequences" if cfg.verify else "")
        + f" (from a {format_seconds(probe.wall_s)} trial of the pipeline on {probe.steps} steps of random inputs "
        "here, torch backend; loading and capture not included; refined after the first layer)"
    )


def engine_picks(uniform: pd.DataFrame, by_name: dict[str, Setting], layer_kind: str, targets=None) -> list[str]:
    """Per export target, the cheapest uniform setting it can take that meets the budget (what the export
    picks when the global setting is not takeable); verified on held-out data with the global setting.
    targets: the Targets checked (``sized_targets`` of CalibrateConfig.deployments: with the layer sizes, as the
    export checks them); None: every engine's newest release on sm90, sizes unchecked."""
    ok = uniform[uniform["meets_budget"]].sort_values(["bytes", "max_error", "setting"], kind="mergesort")
    picks = []
    for t in targets if targets is not None else TARGETS:
        for name in ok["setting"]:
            if not by_name[name].is_static and not violations(t, by_name[name], layer_kind):
                picks.append(name)
                break
    return list(dict.fromkeys(picks))


def export_choices(uniform: pd.DataFrame, by_name: dict[str, Setting], layer_kind: str, targets,
                   global_setting: Setting | None) -> dict[str, str | None]:  # fmt: skip
    """{engine: the one setting `ssmquant export` takes for it}: the global setting where the engine runs it and it
    meets the budget, else the cheapest uniform setting the engine runs that meets it, else None (export/plan.py's
    rule; ``targets``: ``sized_targets``)."""
    ok = uniform[uniform["meets_budget"]].sort_values(["bytes", "max_error", "setting"], kind="mergesort")
    out = {}
    for t in targets:
        runs = [n for n in ok["setting"] if not violations(t, by_name[n], layer_kind)]
        g = global_setting.name if global_setting is not None else None
        out[t.engine] = g if g in runs else (runs[0] if runs else None)
    return out


def sized_targets(targets, dims, arch: str | None = None) -> tuple[Target, ...]:
    """The deployments with the layer sizes (and the model's architecture where the engine facts read it), so that
    `violations` checks what the export checks."""
    return tuple(dataclasses.replace(t, dims=dims, arch=arch) for t in targets)


def engines_running(setting: Setting, layer_kind: str, targets) -> list[str]:
    """The engines (ids) among ``targets`` that run ``setting`` as measured."""
    return [t.engine for t in targets if not violations(t, setting, layer_kind)]


def _engines_text(takeability: dict) -> str:
    """'vLLM 0.33.0, TensorRT-LLM main@2829508, FlashInfer 0.7.4 on sm90'."""
    return ", ".join(f"{ENGINE_NAMES[e]} {v}" for e, v in takeability["engines"].items()) + f" on {takeability['gpu']}"


def _architecture(cfg: CalibrateConfig, source: LayerSource) -> str | None:
    """The model's architecture (HF `architectures[0]`): the loaded checkpoint's, else the preset's (synthetic)."""
    arch = (source.describe or {}).get("architecture")
    if arch:
        return str(arch)
    if source.kind == "synthetic":
        try:
            return get_preset(source.name).architecture
        except (ValueError, AttributeError):
            return None
    return None


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


__all__ = ["BudgetError", "CalibrateConfig", "CalibrateError", "CalibrationResult", "SourceError", "calibrate"]
