"""Verification: the chosen settings re-simulated on held-out data (sequences the calibration never saw).

For text sources the held-out sequences come from the held-out split of the text (a disjoint token range,
`ssmquant.models.text`). Synthetic sources have no text, and their seed also draws the layer's parameters
(A, dt_bias, conv weights), so another seed would be another model: the held-out sequences are instead
sequences B .. B + B_heldout - 1 of the same seed's draw with batch B + B_heldout (the parameters are drawn
first and sequences one after another, so the layer is the same and the sequences are new). Static
settings keep the scales calibrated on the calibration data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..analysis.sources import LayerSource
from ..kinds import LayerInputs
from ..models import get_preset, synthetic_inputs
from ..simulate import simulate
from .settings import Setting, horizon_errors, horizon_window


def synthetic_heldout_source(
    preset: str, *, calibration_batch: int, batch: int, steps: int, seed: int, device: torch.device
) -> LayerSource:
    """Held-out LayerSource of a synthetic preset: new sequences of the same layers (module docstring)."""
    p = get_preset(preset)
    total = calibration_batch + batch

    def iterate(layers):
        for layer in layers:
            inputs = synthetic_inputs(p, layer, batch=total, steps=steps, seed=seed, device=device)
            yield layer, inputs.slice_batch(calibration_batch, total)

    describe = {
        "kind": "synthetic",
        "model": p.name,
        "hf_repo": p.hf_repo,
        "note": f"synthetic held-out: sequences {calibration_batch}..{total - 1} of the seed-{seed} draw with batch "
        f"{total} (same layer parameters as calibration, new sequences)",
    }
    return LayerSource("synthetic", p.name, list(p.ssm_layers), p.layer_kind, p.state_shape, describe, iterate)


@dataclass
class LayerVerification:
    """One layer's held-out check: ``row`` (layer, setting, every metric, meets_budget) for its decision and, per
    uniform setting, {metric: error} (``uniform_errors``)."""

    row: dict
    uniform_errors: dict[str, dict[str, float]]
    timing: tuple[float, float] | None = None  # (wall, thread CPU) seconds, set by calibrate


def verify_layer(
    layer: int,
    inputs: LayerInputs,
    decision: Setting,
    scale,
    uniform: list[Setting],
    *,
    metric: str,
    budget: float,
    backend: str = "auto",
    seed: int = 0,
    engine: str = "ideal",
) -> LayerVerification:
    """Simulate one layer's decision and the uniform (dynamic-scale) settings on its held-out inputs under the
    engine profile `engine` (the calibration's; every setting passed was runnable by it on calibration data).

    scale: FP32 [H, rows] for a static decision, else None."""
    by_name = {u.name: u for u in uniform}
    names = list(by_name)
    static = None if scale is None else scale.to(inputs.device)
    variants = [decision.variant(seed=seed, static_scale=static, engine=engine)]
    variants += [by_name[name].variant(seed=seed, engine=engine) for name in names if name != decision.name]
    trace = simulate(inputs, variants, backend=backend, record_every=horizon_window(variants, inputs.steps))
    errs = horizon_errors(trace)
    row = {
        "layer": int(layer),
        "setting": decision.name,
        **{k: float(v[0]) for k, v in errs.items()},
        "meets_budget": bool(errs[metric][0] <= budget),
    }
    order = [v.name for v in variants]
    uni = {name: {k: float(v[0 if name == decision.name else order.index(name)]) for k, v in errs.items()}
           for name in names}  # fmt: skip
    return LayerVerification(row, uni)


def summarize_verification(
    per_layer: list[dict], uniform_errors: dict[str, dict[int, dict]], *, metric: str, budget: float,
    global_setting: Setting | None = None,
) -> dict:  # fmt: skip
    """The verification document from each layer's row and {uniform name: {layer: errors}} (``verify_layer``)."""
    per_layer = sorted(per_layer, key=lambda r: r["layer"])
    result = {"per_layer": per_layer, "passed": all(r["meets_budget"] for r in per_layer), "uniform": {}}
    for name, errs in uniform_errors.items():
        vals = [e[metric] for e in errs.values()]
        worst = max(vals) if vals and all(math.isfinite(x) for x in vals) else math.inf
        result["uniform"][name] = {
            "errors": {str(k): v for k, v in sorted(errs.items())},
            "max_error": worst,
            "meets_budget": bool(worst <= budget),
        }
    g = result["uniform"].get(global_setting.name) if global_setting is not None else None
    result["global"] = None if g is None else {"setting": global_setting.name, **g}
    result["global_passed"] = None if g is None else g["meets_budget"]
    return result


def check_uniform(uniform: list[Setting]) -> list[Setting]:
    """The distinct uniform settings; refuses a static one (its scales are per layer)."""
    for u in uniform:
        if u.is_static:
            raise ValueError(f"uniform setting {u.name} is static: verify it through per-layer decisions")
    return list({u.name: u for u in uniform}.values())


def verify_layers(
    layer_inputs,
    decisions: dict[int, Setting],
    scales: dict[int, object],
    uniform: list[Setting],
    *,
    metric: str,
    budget: float,
    global_setting: Setting | None = None,
    backend: str = "auto",
    seed: int = 0,
    device=None,
    progress=None,
) -> dict:
    """Simulate each layer's decision, and each uniform (dynamic-scale) setting, on held-out inputs, one layer
    after the other (``calibrate`` spreads ``verify_layer`` over its emulation devices instead).

    layer_inputs: iterator of (layer, inputs) (e.g. LayerSource.iter_layers); scales: {layer: FP32 [H, rows]}
    for static decisions; uniform: settings applied to every layer (the global setting and the settings the
    export would pick per engine). Returns {"per_layer": [...], "passed", "uniform": {name: {"errors",
    "max_error", "meets_budget"}}, "global": that entry of global_setting with its "setting", "global_passed"}.
    """
    uniform = check_uniform(uniform)
    per_layer = []
    uni: dict[str, dict[int, dict]] = {u.name: {} for u in uniform}
    total = len(decisions)
    for n, (layer, inputs) in enumerate(layer_inputs, start=1):
        if device is not None:
            inputs = inputs.to(device)
        checked = verify_layer(layer, inputs, decisions[layer], scales.get(layer), uniform, metric=metric,
                               budget=budget, backend=backend, seed=seed)  # fmt: skip
        per_layer.append(checked.row)
        for name, e in checked.uniform_errors.items():
            uni[name][int(layer)] = e
        if progress:
            progress(n, total, layer)
    return summarize_verification(per_layer, uni, metric=metric, budget=budget, global_setting=global_setting)
