"""The recipe: `ssm_quant_config.json` (versioned schema, README.md "Schema") plus the tensors beside it.

Files of a recipe directory:

- ssm_quant_config.json        the decisions, the global setting, the uniform settings, the verification
- ssm_state_scales.safetensors static decode scales, `layers.{i}.state_scale`, FP32 (nheads, head_dim)
                               (FlashInfer's state_scale layout without the cache dim), one per layer whose
                               decision is static (the file exists, possibly empty, in every recipe)
- ssm_state_stats.safetensors  the per-layer statistics (`layers.{i}.row_amax`, `.row_p99.99`, ...)
- candidates.csv               every (layer, setting) evaluated on calibration data

`load_recipe` validates the schema and refuses a recipe of another schema version, naming both.
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
from dataclasses import dataclass, field

import torch

from .. import __version__, kinds
from ..engines.deployments import TARGETS
from ..engines.profiles import ENGINES, arithmetic
from ..errors import SsmquantError
from ..report.outdir import write_atomically
from .settings import CHOICES, METRICS, CalibrateError, LayerDims, Setting, other_metric, setting_bytes

SCHEMA_VERSION = 1
RECIPE_KIND = "ssmquant.ssm_state_recipe"
CONFIG_NAME = "ssm_quant_config.json"
SCALES_NAME = "ssm_state_scales.safetensors"
STATS_NAME = "ssm_state_stats.safetensors"
CANDIDATES_NAME = "candidates.csv"
BUDGET_DEFINITION = (
    "pooled relative error (Frobenius ratio over all sequences and heads) of the metric over the horizon window "
    "(the last ~1/64 of the decode horizon, in whole flush cycles of every candidate): the RMS over the window's "
    "steps for out_rel_err / state_rel_err, its worst step for the *_max metrics; against the FP32 reference "
    "decode of the same inputs"
)
SCALE_LAYOUT = (
    "FP32 decode scales (nheads, head_dim): value = code * scale; FlashInfer state_scale without the cache dim"
)


# what `search.choose_among` means (calibrate --choose-among)
CHOICE_POOLS = {
    "engines": "the settings (candidates and float fallbacks) that one of global.engines_checked runs as measured on "
    "these layers' sizes",
    "research": "every candidate, including settings that no engine runs yet",
}


class RecipeError(SsmquantError, ValueError):
    """A recipe directory or document is missing, malformed, or of another schema version."""


def scale_name(layer: int) -> str:
    return f"layers.{int(layer)}.state_scale"


def _num(x):
    """JSON-safe float (None for NaN / inf)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


# -- building the document ---------------------------------------------------------------------------
def engine_profile_doc(result) -> dict:
    """The recipe's `engine_profile`: the profile every candidate was emulated with (`calibrate --engine`), the
    arithmetic it ran on this layer kind, and the settings it refused with the engine's reason."""
    name = result.config.engine
    ev = result.evaluations
    refused = ev[~ev["runnable"]].drop_duplicates("setting") if "runnable" in ev else ev.iloc[:0]
    return {
        "name": name,
        "arithmetic": arithmetic(name, result.layer_kind),
        "refused": {str(r["setting"]): str(r["refusal"]) for _, r in refused.iterrows()},
    }


def build_document(result) -> dict:
    """The ssm_quant_config.json document of a CalibrationResult (schema README.md)."""
    import modelopt
    import transformers

    cfg = result.config
    metric, budget = cfg.metric, cfg.budget
    other = other_metric(metric)
    layers = sorted(result.decisions)
    dims: LayerDims = result.dims
    fp32_bytes = 4 * dims.heads * dims.rows * dims.state_dim
    ver = {r["layer"]: r for r in (result.verification or {}).get("per_layer", [])}
    by_name = {s.name: s for s in result.settings}

    runs_on = getattr(result, "runs_on", {}) or {}
    mode = getattr(result, "choose_among", "research")
    alternatives = getattr(result, "alternatives", {}) or {}
    layer_docs = []
    for layer in layers:
        d, row = result.decisions[layer], result.decision_rows[layer]
        v = ver.get(layer)
        alt = None if cfg.force_global else alternatives.get(layer)
        layer_docs.append(
            {
                "layer": int(layer),
                "setting": d.to_dict(),
                "bytes_per_sequence": {
                    "state": int(row["state_bytes"]),
                    "buffer": int(row["buffer_bytes"]),
                    **({"cached_prompt": int(row["cached_prompt_bytes"])} if cfg.prompt_stores else {}),
                    "total": int(row["bytes"]),
                },
                "calibration_error": {
                    **{m: _num(row[m]) for m in METRICS},
                    "worst_head": int(row[f"worst_head_{metric.split('_')[0]}"]),
                    "worst_head_error": _num(row[f"worst_head_{metric.split('_')[0]}_rel_err"]),
                },
                "heldout_error": None
                if v is None
                else {m: _num(v[m]) for m in METRICS},
                "meets_budget": bool(row[metric] <= budget),
                "state_scale": scale_name(layer) if d.is_static else None,
                "stats": result.stats[layer].summary() if layer in result.stats else None,
                "runs_on": list(runs_on.get(d.name, [])),
                "alternative": None
                if alt is None
                else {
                    "pool": "research" if mode == "engines" else "engines",
                    "setting": str(alt["setting"]),
                    "runs_on": list(runs_on.get(alt["setting"], [])),
                    "bytes_per_sequence": int(alt["bytes"]),
                    "calibration_error": {m: _num(alt[m]) for m in METRICS},
                },
            }
        )
    per_layer_bytes = sum(doc["bytes_per_sequence"]["total"] for doc in layer_docs)
    per_layer_max = max(float(result.decision_rows[layer][metric]) for layer in layers)

    uniform_docs = []
    for rec in result.uniform.to_dict(orient="records"):
        s = by_name[rec["setting"]]
        uniform_docs.append(
            {
                "setting": s.to_dict(),
                "role": rec["role"],
                "engine_takeable": bool(result.takeable.get(rec["setting"], False)),
                "bytes_per_sequence": int(rec["bytes"]),
                "max_error": _num(rec["max_error"]),
                "meets_budget": bool(rec["meets_budget"]),
                "errors": {str(k): _num(e) for k, e in rec["errors"].items()},
                f"errors_{other}": {str(k): _num(e) for k, e in rec["errors_other_metric"].items()},
            }
        )

    glob = None
    if result.global_setting is not None:
        g = next(u for u in uniform_docs if u["setting"]["name"] == result.global_setting.name)
        notes = {
            "meets_budget": "the cheapest single setting an engine can take that meets the budget on every layer",
            "closest": "no single engine-takeable setting meets the budget on every layer: this one comes "
            "closest (lowest worst-layer error); the per-layer decisions meet it",
        }
        glob = {
            "setting": g["setting"],
            "status": result.global_status,
            "meets_budget": result.global_status == "meets_budget",
            "note": notes[result.global_status],
            "bytes_per_sequence": g["bytes_per_sequence"],
            "max_error": g["max_error"],
            "errors": g["errors"],
            "cost_vs_per_layer": {
                "bytes_per_sequence_per_layer_choice": per_layer_bytes,
                "bytes_per_sequence_global": g["bytes_per_sequence"],
                "bytes_ratio": g["bytes_per_sequence"] / per_layer_bytes if per_layer_bytes else None,
                "max_error_per_layer_choice": _num(per_layer_max),
                "max_error_global": g["max_error"],
            },
        }
    else:
        glob = {
            "setting": None,
            "status": "none",
            "meets_budget": False,
            "note": "no candidate is takeable by any engine (engines take fp32/bf16/fp16, and int8/fp8_e4m3 with "
            "dynamic per-row scales under FlashInfer ReplaySSM on Mamba-2 layers); add such candidates",
        }

    glob["engines_checked"] = result.takeability  # what "engine-takeable" means in this recipe
    verification = None
    if result.verification is not None:
        vr = result.verification
        verification = {
            "data": vr.get("data"),
            "metric": metric,
            "budget": budget,
            "per_layer": [
                {
                    "layer": r["layer"],
                    "setting": r["setting"],
                    **{m: _num(r[m]) for m in METRICS},
                    "meets_budget": r["meets_budget"],
                }
                for r in vr["per_layer"]
            ],
            "passed": vr["passed"],
            "uniform": {
                name: {
                    "errors": {k: {q: _num(x) for q, x in e.items()} for k, e in u["errors"].items()},
                    "max_error": _num(u["max_error"]),
                    "meets_budget": u["meets_budget"],
                }
                for name, u in vr.get("uniform", {}).items()
            },
            "global": None
            if vr.get("global") is None
            else {
                "setting": vr["global"]["setting"],
                "errors": {k: {q: _num(x) for q, x in e.items()} for k, e in vr["global"]["errors"].items()},
                "max_error": _num(vr["global"]["max_error"]),
                "meets_budget": vr["global"]["meets_budget"],
            },
            "global_passed": vr.get("global_passed"),
        }

    return {
        "schema_version": SCHEMA_VERSION,
        "kind": RECIPE_KIND,
        "producer": {
            "name": "ssmquant",
            "version": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "modelopt": modelopt.__version__,
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "environment": result.environment,
            "elapsed_s": round(result.elapsed_s, 3),
            "stages": dict(getattr(result, "stages", {}) or {}),
        },
        "model": {
            "name": result.source.get("model"),
            "layer_kind": result.layer_kind,
            "dims": dims.to_dict(),
            "ssm_layers": [int(x) for x in result.ssm_layers],
            "calibrated_layers": [int(x) for x in layers],
            "fp32_state_bytes_per_sequence_per_layer": fp32_bytes,
        },
        "data": {"calibration": result.source, "heldout": result.heldout_source},
        # prompt: tokens prefilled (FP32) before the horizon's decode steps, the state stored once per setting
        "budget": {"metric": metric, "value": budget, "horizon": cfg.horizon, "prompt": cfg.prompt,
                   "definition": BUDGET_DEFINITION},  # fmt: skip
        "engine_profile": engine_profile_doc(result),
        "search": {
            "candidates": list(cfg.candidates),
            "schemes": list(cfg.schemes),
            "buffer_lens": list(cfg.buffer_lens),
            "roundings": list(cfg.rounding),
            "calibration": list(cfg.calibration),
            "calibration_granularity": list(cfg.calibration_granularity),
            "engine_fallbacks": list(cfg.engine_fallbacks),
            "objective": objective_name(cfg.count_buffer, bool(cfg.prompt_stores)),
            **({"prompt_stores": list(cfg.prompt_stores)} if cfg.prompt_stores else {}),
            "force_global": cfg.force_global,
            "choose_among": mode,
            "choice_pool": CHOICE_POOLS[mode],
            "seed": cfg.seed,
            "settings_evaluated": len(result.settings),
        },
        "layers": layer_docs,
        "per_layer_total": {
            "bytes_per_sequence": per_layer_bytes,
            "fp32_bytes_per_sequence": fp32_bytes * len(layers),
            "capacity_vs_fp32": (fp32_bytes * len(layers)) / per_layer_bytes if per_layer_bytes else None,
            "max_error": _num(per_layer_max),
        },
        "global": glob,
        "uniform_settings": uniform_docs,
        "verification": verification,
        "files": {
            "config": CONFIG_NAME,
            "scales": SCALES_NAME,
            "scale_layout": SCALE_LAYOUT,
            "stats": STATS_NAME,
            "candidates": CANDIDATES_NAME,
        },
    }


def write_recipe(result, out_dir, *, force: bool = False) -> pathlib.Path:
    """Write a CalibrationResult as a recipe directory (atomically); returns the directory."""
    from safetensors.torch import save_file

    doc = build_document(result)
    validate_document(doc)

    def fill(tmp: pathlib.Path):
        scales = {scale_name(layer): s.float().cpu().contiguous() for layer, s in sorted(result.scales.items())}
        meta = {"schema_version": str(SCHEMA_VERSION), "layout": SCALE_LAYOUT}
        for layer in sorted(result.scales):
            meta[scale_name(layer)] = result.decisions[layer].name
        save_file(scales, str(tmp / SCALES_NAME), metadata=meta)
        stats = {}
        for layer, st in sorted(result.stats.items()):
            stats.update(st.tensors(f"layers.{layer}"))
        save_file(stats, str(tmp / STATS_NAME), metadata={"schema_version": str(SCHEMA_VERSION)})
        result.evaluations.to_csv(tmp / CANDIDATES_NAME, index=False)
        (tmp / CONFIG_NAME).write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")

    return write_atomically(out_dir, force, fill, "calibrate")


# -- validation and loading --------------------------------------------------------------------------
def _need(d: dict, key: str, types, where: str):
    if not isinstance(d, dict) or key not in d:
        raise RecipeError(f"{CONFIG_NAME}: {where} is missing {key!r}")
    v = d[key]
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        want = " or ".join(t.__name__ for t in types)
        raise RecipeError(f"{CONFIG_NAME}: {where}.{key} must be {want}, got {type(v).__name__}")
    return v


def _setting(d, where: str) -> Setting:
    try:
        return Setting.from_dict(d)
    except CalibrateError as err:
        raise RecipeError(f"{CONFIG_NAME}: {where}: {err}") from None


def _fail(msg: str):
    raise RecipeError(f"{CONFIG_NAME}: {msg}")


def _int_list(d: dict, key: str, where: str, minimum: int = 0) -> list[int]:
    values = _need(d, key, list, where)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        _fail(f"{where}.{key} must be a list of integers >= {minimum}, got {values}")
    if len(set(values)) != len(values):
        _fail(f"{where}.{key} lists a value twice: {values}")
    return values


def _error_value(d: dict, key: str, where: str) -> float | None:
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
        _fail(f"{where}.{key} must be a relative error >= 0 or null, got {v!r}")
    return v


def validate_document(doc: dict) -> None:
    """Check a recipe document against schema version 1; raise RecipeError naming the first problem.

    Every field is checked for its type and range, and fields that depend on each other must agree: each
    setting's fields with its format and scheme; each layer's bytes with its setting and the model's dims;
    every meets_budget flag with the errors and the budget; the layers with model.calibrated_layers and
    model.ssm_layers; the global setting with its status and the uniform settings; the verification with
    the layers' decisions.
    """
    if not isinstance(doc, dict):
        raise RecipeError(f"{CONFIG_NAME} must hold a JSON object, got {type(doc).__name__}")
    bad = _non_finite(doc)
    if bad is not None:
        where, v = bad
        _fail(
            f"{where} is {json.dumps(v)}: a recipe holds finite numbers only (calibrate writes null for an error that is not "
            "finite); re-run `ssmquant calibrate` or correct the field"
        )
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RecipeError(
            f"{CONFIG_NAME} has schema_version {version!r}; this ssmquant ({__version__}) reads schema_version "
            f"{SCHEMA_VERSION} only. Re-run `ssmquant calibrate` with this version, or use the ssmquant that "
            "wrote the recipe"
        )
    if doc.get("kind") != RECIPE_KIND:
        _fail(f"kind must be {RECIPE_KIND!r}, got {doc.get('kind')!r}")
    _need(doc, "producer", dict, "the document")
    model = _need(doc, "model", dict, "the document")
    kind = _need(model, "layer_kind", str, "model")
    if kind not in kinds.names():
        _fail(f"model.layer_kind must be one of {', '.join(map(repr, kinds.names()))}, got {kind!r}")
    dims = _need(model, "dims", dict, "model")
    for k in ("heads", "rows", "state_dim", "groups"):
        v = _need(dims, k, int, "model.dims")
        if v < 1:
            _fail(f"model.dims.{k} must be >= 1, got {v}")
    if dims.get("kind", kind) != kind:
        _fail(f"model.dims.kind is {dims.get('kind')!r} but model.layer_kind is {kind!r}")
    layer_dims = LayerDims(kind, dims["heads"], dims["rows"], dims["state_dim"], dims["groups"])
    ssm_layers = _int_list(model, "ssm_layers", "model")
    calibrated = _int_list(model, "calibrated_layers", "model")
    if not set(calibrated) <= set(ssm_layers):
        _fail(f"model.calibrated_layers {calibrated} are not all in model.ssm_layers {ssm_layers}")
    budget = _need(doc, "budget", dict, "the document")
    metric = budget.get("metric")
    if metric not in METRICS:
        _fail(f"budget.metric must be one of {', '.join(METRICS)}, got {metric!r}")
    value = _need(budget, "value", (int, float), "budget")
    if not math.isfinite(value) or value <= 0:
        _fail(f"budget.value must be a finite number > 0, got {value}")
    if _need(budget, "horizon", int, "budget") < 1:
        _fail(f"budget.horizon must be >= 1, got {budget['horizon']}")
    prompt = budget.get("prompt", 0)  # recipes written before prompts had none: no prompt
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 0:
        _fail(f"budget.prompt must be a whole number of tokens >= 0, got {prompt!r}")
    count_buffer, count_cached_prompt = _validate_search(doc.get("search"))
    _validate_engine_profile(doc.get("engine_profile"))

    def meets(err, flag, where):
        if not isinstance(flag, bool):
            _fail(f"{where}.meets_budget must be true or false, got {flag!r}")
        if err is not None and flag != (err <= value):
            _fail(f"{where}.meets_budget is {flag} but its {metric} {err} against the budget {value} says {not flag}")

    layers = _need(doc, "layers", list, "the document")
    if not layers:
        _fail("layers is empty")
    seen, decisions = set(), {}
    for i, entry in enumerate(layers):
        where = f"layers[{i}]"
        layer = _need(entry, "layer", int, where)
        if layer in seen:
            _fail(f"layer {layer} appears twice in layers")
        seen.add(layer)
        s = _setting(_need(entry, "setting", dict, where), f"{where}.setting")
        decisions[layer] = s.name
        nbytes = _need(entry, "bytes_per_sequence", dict, where)
        want = setting_bytes(s, layer_dims, count_buffer=count_buffer, count_cached_prompt=count_cached_prompt)
        for part in want:
            got = _need(nbytes, part, int, f"{where}.bytes_per_sequence")
            if got != want[part]:
                _fail(
                    f"{where}.bytes_per_sequence.{part} is {got} but {s.name!r} on a layer of dims "
                    f"{layer_dims.state_shape} (groups {layer_dims.groups}) takes {want[part]}"
                )
        cal = _need(entry, "calibration_error", dict, where)
        for q in METRICS:
            _error_value(cal, q, f"{where}.calibration_error")
        if "meets_budget" in entry:
            meets(cal.get(metric), entry["meets_budget"], where)
        held = entry.get("heldout_error")
        if held is not None:
            for q in METRICS:
                _error_value(_need(entry, "heldout_error", dict, where), q, f"{where}.heldout_error")
        ref = entry.get("state_scale")
        if s.is_static and ref != scale_name(layer):
            _fail(f"{where} is static but state_scale is {ref!r}, not {scale_name(layer)!r}")
        if not s.is_static and ref is not None:
            _fail(f"{where} has dynamic scales but names a state_scale tensor {ref!r}")
    if sorted(seen) != sorted(calibrated):
        _fail(f"layers hold decisions for {sorted(seen)} but model.calibrated_layers is {sorted(calibrated)}")

    uniform = {}
    for i, u in enumerate(_need(doc, "uniform_settings", list, "the document")):
        where = f"uniform_settings[{i}]"
        s = _setting(_need(u, "setting", dict, where), f"{where}.setting")
        uniform[s.name] = u
        errors = _need(u, "errors", dict, where)
        bad = sorted(k for k in errors if not str(k).isdigit() or int(k) not in seen)
        if bad:
            _fail(f"{where}.errors names layers {bad} that the recipe did not calibrate ({sorted(seen)})")
        for k in errors:
            _error_value(errors, k, f"{where}.errors")
        if _need(u, "bytes_per_sequence", int, where) < 0:
            _fail(f"{where}.bytes_per_sequence must be >= 0")
        if u.get("role") not in ("candidate", "fallback"):
            _fail(f"{where}.role must be candidate or fallback")
        if "meets_budget" in u:
            meets(_error_value(u, "max_error", where), u["meets_budget"], where)

    glob = _need(doc, "global", dict, "the document")
    status = glob.get("status")
    if status not in ("meets_budget", "closest", "none"):
        _fail(f"global.status must be meets_budget, closest or none, got {status!r}")
    g = glob.get("setting")
    if (g is None) != (status == "none"):
        _fail(f"global.status is {status!r} but global.setting is {'missing' if g is None else 'set'}")
    if "meets_budget" in glob and glob["meets_budget"] != (status == "meets_budget"):
        _fail(f"global.meets_budget is {glob['meets_budget']} but global.status is {status!r}")
    if g is not None:
        name = _setting(g, "global.setting").name
        if name not in uniform:
            _fail(f"global.setting {name!r} is not one of uniform_settings")
        gmax = _error_value(glob, "max_error", "global")
        if status == "meets_budget" and (gmax is None or gmax > value) and "max_error" in glob:
            _fail(f"global.status is 'meets_budget' but its max_error {gmax} is not within the budget {value}")
    mode = (doc.get("search") or {}).get("choose_among")
    for i, entry in enumerate(layers):
        _validate_runs_on(entry, f"layers[{i}]", mode)

    v = doc.get("verification")
    if v is not None:
        per_layer = _need(v, "per_layer", list, "verification")
        passed = _need(v, "passed", bool, "verification")
        for i, r in enumerate(per_layer):
            where = f"verification.per_layer[{i}]"
            layer = _need(r, "layer", int, where)
            if layer not in decisions:
                _fail(f"{where}.layer {layer} has no decision in layers")
            if r.get("setting") != decisions[layer]:
                _fail(f"{where}.setting is {r.get('setting')!r} but layer {layer} decides {decisions[layer]!r}")
            meets(_error_value(r, metric, where), r.get("meets_budget"), where)
        if passed != all(r["meets_budget"] for r in per_layer):
            _fail(f"verification.passed is {passed} but its per_layer meets_budget flags say otherwise")


def _non_finite(node, where: str = "the document"):
    """(path, value) of the first NaN or infinity in a JSON document (Python's json reads NaN, Infinity), else None."""
    if isinstance(node, float) and not math.isfinite(node):
        return where, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        path = (f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}") if where != "the document" else str(k)
        found = _non_finite(v, path)
        if found is not None:
            return found
    return None


def _validate_runs_on(entry: dict, where: str, mode) -> None:
    """`runs_on` (optional): engine ids; a recipe chosen among what the engines run has a non-empty one per layer.
    `alternative` (optional): null or the other pool's cheapest setting within the budget."""
    engines = entry.get("runs_on")
    if engines is not None:
        if not isinstance(engines, list) or any(e not in TARGETS for e in engines):
            _fail(f"{where}.runs_on must list engines among {', '.join(TARGETS)}, got {engines!r}")
        if mode == "engines" and not engines:
            _fail(f"{where}.runs_on is empty but search.choose_among is 'engines': the layer's setting runs on no engine")
    alt = entry.get("alternative")
    if alt is not None:
        if not isinstance(alt, dict) or not isinstance(alt.get("setting"), str):
            _fail(f"{where}.alternative must be null or an object with a setting name, got {alt!r}")
        try:
            Setting.parse(alt["setting"])
        except CalibrateError as err:
            _fail(f"{where}.alternative.setting: {err}")
        if alt.get("pool") not in CHOICES:
            _fail(f"{where}.alternative.pool must be one of {', '.join(CHOICES)}, got {alt.get('pool')!r}")


def _validate_engine_profile(prof) -> None:
    """`engine_profile` is optional (recipes before it was recorded were measured with `ideal`)."""
    if prof is None:
        return
    if not isinstance(prof, dict):
        _fail(f"engine_profile must be an object, got {type(prof).__name__}")
    if prof.get("name") not in ENGINES:
        _fail(f"engine_profile.name must be one of {', '.join(ENGINES)}, got {prof.get('name')!r}")
    refused = prof.get("refused", {})
    if not isinstance(refused, dict) or not all(isinstance(v, str) for v in refused.values()):
        _fail(f"engine_profile.refused must map setting names to reasons, got {refused!r}")


def _validate_search(search) -> tuple[bool, bool]:
    """Types of the search block (informational, but a recipe's record of how it was made); returns
    (whether the layers' byte totals count the replay ring, whether they count a cached prompt state): its
    objective."""
    if search is None:
        return True, False
    if not isinstance(search, dict):
        _fail(f"search must be an object, got {type(search).__name__}")
    for key in ("candidates", "schemes", "roundings", "calibration", "calibration_granularity", "engine_fallbacks",
                "prompt_stores"):
        if key in search and (not isinstance(search[key], list) or not all(isinstance(x, str) for x in search[key])):
            _fail(f"search.{key} must be a list of strings, got {search[key]!r}")
    if "buffer_lens" in search:
        _int_list(search, "buffer_lens", "search", minimum=1)
    if "choose_among" in search and search["choose_among"] not in CHOICES:
        _fail(f"search.choose_among must be one of {', '.join(CHOICES)}, got {search['choose_among']!r}")
    objectives = {objective_name(ring, cached): (ring, cached) for ring in (True, False) for cached in (False, True)}
    objective = search.get("objective", objective_name(True, False))
    if objective not in objectives:
        _fail(f"search.objective must be one of {list(objectives)}, got {objective!r}")
    return objectives[objective]


def objective_name(count_buffer: bool, count_cached_prompt: bool) -> str:
    """The recipe's search.objective: what a layer's bytes per sequence count."""
    return "bytes per sequence: state" + (" + replay ring" if count_buffer else "") + (
        " + cached prompt state" if count_cached_prompt else ""
    )


@dataclass
class LayerDecision:
    layer: int
    setting: Setting
    entry: dict


@dataclass
class UniformSetting:
    setting: Setting
    entry: dict

    @property
    def errors(self) -> dict[int, float | None]:
        return {int(k): v for k, v in self.entry["errors"].items()}


@dataclass
class Recipe:
    """A loaded, validated recipe. config: the JSON document; scales: {layer: FP32 (nheads, head_dim)}."""

    path: pathlib.Path
    config: dict
    scales: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def layer_kind(self) -> str:
        return self.config["model"]["layer_kind"]

    @property
    def dims(self) -> LayerDims:
        d = self.config["model"]["dims"]
        return LayerDims(self.layer_kind, d["heads"], d["rows"], d["state_dim"], d["groups"])

    @property
    def metric(self) -> str:
        return self.config["budget"]["metric"]

    @property
    def budget(self) -> float:
        return float(self.config["budget"]["value"])

    @property
    def engine_profile(self) -> str | None:
        """The engine profile the recipe's numbers were measured with; None: not recorded (an older recipe,
        measured with the `ideal` arithmetic: `calibrate --engine` did not exist)."""
        prof = self.config.get("engine_profile")
        return None if prof is None else prof["name"]

    @property
    def layers(self) -> list[LayerDecision]:
        return [LayerDecision(e["layer"], Setting.from_dict(e["setting"]), e) for e in self.config["layers"]]

    @property
    def global_setting(self) -> Setting | None:
        g = self.config["global"].get("setting")
        return None if g is None else Setting.from_dict(g)

    @property
    def uniform(self) -> list[UniformSetting]:
        return [UniformSetting(Setting.from_dict(u["setting"]), u) for u in self.config["uniform_settings"]]

    def static_scale(self, layer: int) -> torch.Tensor | None:
        return self.scales.get(int(layer))


def load_recipe(path) -> Recipe:
    """Load and validate a recipe directory (or its ssm_quant_config.json). Raises RecipeError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = pathlib.Path(path)
    cfg_path = p if p.is_file() else p / CONFIG_NAME
    if not cfg_path.is_file():
        raise RecipeError(f"{p} has no {CONFIG_NAME}; is it an `ssmquant calibrate` recipe directory?")
    try:
        doc = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise RecipeError(f"{cfg_path} is not valid JSON: {err}") from None
    validate_document(doc)
    directory = cfg_path.parent
    scales_path = directory / doc.get("files", {}).get("scales", SCALES_NAME)
    static = [e for e in doc["layers"] if e.get("state_scale")]
    scales: dict[int, torch.Tensor] = {}
    if scales_path.is_file():
        try:
            tensors = load_file(str(scales_path))
        except (SafetensorError, OSError) as err:
            raise RecipeError(f"{scales_path} cannot be read: {err}") from None
    elif static:
        raise RecipeError(f"{directory} has static layers but no {SCALES_NAME}")
    else:
        tensors = {}
    d = doc["model"]["dims"]
    expected = (d["heads"], d["rows"])
    for e in static:
        name = e["state_scale"]
        if name not in tensors:
            raise RecipeError(f"{scales_path.name} has no tensor {name!r} (layer {e['layer']} is static)")
        t = tensors[name]
        if t.dtype != torch.float32 or tuple(t.shape) != expected:
            raise RecipeError(
                f"{scales_path.name}: {name} is {t.dtype} {tuple(t.shape)}; expected float32 {expected} (nheads, head_dim)"
            )
        if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
            raise RecipeError(f"{scales_path.name}: {name} must be finite and > 0")
        scales[int(e["layer"])] = t
    return Recipe(directory, doc, scales)
