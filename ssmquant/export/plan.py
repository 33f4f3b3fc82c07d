"""Which measured setting an engine runs for a recipe, and what of the recipe it cannot take.

Engines take one setting for the whole model, so the export picks one uniform setting (measured on every
calibrated layer, README.md) that the target can run (`engines.violations` is empty) and that meets the
budget: the recipe's global setting when the target takes it, else the cheapest such setting (ties: lower
worst-layer error). Every difference between the recipe's per-layer decisions and that setting is a
dropped setting, reported with its reason and its measured cost (bytes per sequence and error, per layer,
on calibration data, and on held-out data where the recipe verified it). No takeable setting within the
budget: ExportError naming why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..calibrate.recipe import Recipe
from ..calibrate.settings import Setting
from .engines import TARGET_NAMES, check_target, violations

_DTYPE_RULES = ("nvfp4", "dtype", "8bit_replay", "layer_kind")
_SCHEME_RULES = ("buffer_len", "spec_buffer", "layer_kind", "8bit_replay")
PER_LAYER_REASON = "engines take one setting for all layers; this layer's own choice differs from the exported one"


class ExportError(ValueError):
    """The recipe cannot be exported to the target (unsatisfiable, unknown target, bad recipe)."""


@dataclass
class Dropped:
    """One setting of the recipe that the target does not take, with the layers and the measured cost.

    cost: {"bytes_per_sequence": [recipe, exported] summed over `layers`, "errors": [{"layer", "recipe",
    "exported", "recipe_heldout", "exported_heldout"}]} in the recipe's metric (None where not measured).
    """

    what: str
    reason: str
    layers: list[int]
    cost: dict = field(default_factory=dict)

    def lines(self, metric: str) -> list[str]:
        b0, b1 = self.cost.get("bytes_per_sequence", (None, None))
        head = f"dropped {self.what} (layers {_span(self.layers)}): {self.reason}"
        out = [head]
        if b0 is not None:
            out.append(
                f"    measured cost of the export at these layers: bytes/sequence {b0:,} -> {b1:,} ({_pct(b0, b1)})"
            )
        for e in self.cost.get("errors", []):
            s = f"    layer {e['layer']}: {metric} {_f(e['recipe'])} -> {_f(e['exported'])} (calibration)"
            if e.get("recipe_heldout") is not None or e.get("exported_heldout") is not None:
                s += f", {_f(e.get('recipe_heldout'))} -> {_f(e.get('exported_heldout'))} (held-out)"
            out.append(s)
        return out

    def to_dict(self) -> dict:
        return {"what": self.what, "reason": self.reason, "layers": self.layers, "cost": self.cost}


@dataclass
class ExportPlan:
    """target; setting: what the engine runs; entry: its uniform_settings entry; dropped; notes."""

    target: str
    setting: Setting
    entry: dict
    from_global: bool
    draft_tokens: int
    dropped: list[Dropped]
    notes: list[str]
    heldout: dict | None  # held-out numbers of the exported setting, when the recipe verified it


def _f(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.4g}"


def _pct(a, b) -> str:
    return "n/a" if not a else f"{(b - a) / a:+.1%}"


def _span(layers: list[int]) -> str:
    return ", ".join(str(i) for i in layers)


def _messages(msgs: list[tuple[str, str]], rules) -> list[str]:
    return [m for r, m in msgs if r in rules]


def plan_export(recipe: Recipe, target: str, *, num_speculative_tokens: int | None = None) -> ExportPlan:
    """Choose the setting `target` runs for `recipe` and list what is dropped (module docstring)."""
    t = check_target(target)
    name = TARGET_NAMES[t]
    if num_speculative_tokens is not None and (
        isinstance(num_speculative_tokens, bool)
        or not isinstance(num_speculative_tokens, int)
        or num_speculative_tokens < 0
    ):
        raise ExportError(f"--num-speculative-tokens must be an integer >= 0, got {num_speculative_tokens!r}")
    kind, metric, budget = recipe.layer_kind, recipe.metric, recipe.budget
    T = num_speculative_tokens
    uniform = recipe.uniform
    takeable = [u for u in uniform if not violations(t, u.setting, kind, T)]
    feasible = [u for u in takeable if u.entry["meets_budget"]]
    glob = recipe.global_setting
    pick = next((u for u in feasible if glob is not None and u.setting.name == glob.name), None)
    from_global = pick is not None
    if pick is None and feasible:
        pick = min(feasible, key=lambda u: (u.entry["bytes_per_sequence"], u.entry["max_error"], u.setting.name))
    if pick is None:
        raise ExportError(_unsatisfiable(recipe, t, T, takeable))
    chosen = pick.setting
    draft = chosen.draft_tokens if T is None else T
    per_layer = recipe.layers
    n_layers = len(per_layer)
    exported_bytes_layer = pick.entry["bytes_per_sequence"] // max(1, n_layers)
    verification = recipe.config.get("verification") or {}
    vsel = (verification.get("uniform") or {}).get(chosen.name)  # held-out numbers of the exported setting

    # -- dropped settings, grouped by (what, reason) ----------------------------------------------------
    groups: dict[tuple[str, str], list] = {}
    for d in per_layer:
        s = d.setting
        if s.name == chosen.name:
            continue
        msgs = violations(t, s, kind, T)

        def add(what, rules, d=d, msgs=msgs):
            reasons = _messages(msgs, rules) or [PER_LAYER_REASON]
            groups.setdefault((what, "; ".join(dict.fromkeys(reasons))), []).append(d)

        if s.encoding != chosen.encoding:
            add(f"{s.encoding} state (-> {chosen.encoding})", _DTYPE_RULES)
        if s.is_static:
            add(f"static scales [{s.calibration_label}] (-> dynamic per-row scales)", ("static",))
        if s.granularity != chosen.granularity and not s.is_static:
            add(f"{s.granularity} scale granularity (-> {chosen.granularity})", ("granularity",))
        if s.scheme.name != chosen.scheme.name:
            add(f"{s.scheme.name} decoding (-> {chosen.scheme.name})", _SCHEME_RULES)
        if s.rounding != chosen.rounding:
            add(f"{s.rounding} rounding (-> {chosen.rounding})", ("sr",))
    dropped = []
    for (what, reason), decs in groups.items():
        errors = []
        for d in decs:
            held = d.entry.get("heldout_error") or {}
            errors.append(
                {
                    "layer": d.layer,
                    "recipe": d.entry["calibration_error"].get(metric),
                    "exported": pick.errors.get(d.layer),
                    "recipe_heldout": held.get(metric),
                    "exported_heldout": (vsel or {}).get("errors", {}).get(str(d.layer), {}).get(metric),
                }
            )
        dropped.append(
            Dropped(
                what,
                reason,
                [d.layer for d in decs],
                {
                    "bytes_per_sequence": [
                        sum(d.entry["bytes_per_sequence"]["total"] for d in decs),
                        exported_bytes_layer * len(decs),
                    ],
                    "errors": errors,
                },
            )
        )
    if glob is not None and glob.name != chosen.name:
        reasons = [m for _, m in violations(t, glob, kind, T)] or [
            f"it does not meet the budget on every layer (worst {metric} {_f(recipe.config['global'].get('max_error'))})"
        ]
        g = recipe.config["global"]
        dropped.append(
            Dropped(
                f"the recipe's global setting {glob.name} (-> {chosen.name})",
                "; ".join(dict.fromkeys(reasons)),
                [d.layer for d in per_layer],
                {
                    "bytes_per_sequence": [g.get("bytes_per_sequence"), pick.entry["bytes_per_sequence"]],
                    "errors": [
                        {
                            "layer": d.layer,
                            "recipe": g.get("errors", {}).get(str(d.layer)),
                            "exported": pick.errors.get(d.layer),
                        }
                        for d in per_layer
                    ],
                },
            )
        )

    # -- notes ---------------------------------------------------------------------------------------
    notes = []
    model = recipe.config["model"]
    missing = [x for x in model["ssm_layers"] if x not in model["calibrated_layers"]]
    if missing:
        notes.append(
            f"the recipe calibrated SSM layers {model['calibrated_layers']} only; {name} applies the setting to every "
            f"SSM layer, including the unmeasured layers {missing}"
        )
    if vsel is not None:
        verdict = "meets" if vsel.get("meets_budget") else "DOES NOT meet"
        notes.append(
            f"held-out verification of {chosen.name}: worst-layer {metric} {_f(vsel.get('max_error'))} {verdict} the "
            f"budget {budget:g}"
        )
    else:
        notes.append(
            f"{chosen.name} was measured on calibration data only (worst-layer {metric} "
            f"{_f(pick.entry['max_error'])} <= budget {budget:g}); it was not verified on held-out data"
        )
    if verification and not verification.get("passed", True):
        notes.append("the recipe's per-layer decisions did not all meet the budget on held-out data (see the recipe)")
    if pick.entry.get("role") == "fallback":
        notes.append(f"{chosen.name} is an engine fallback measured by calibrate, not one of its --candidates")
    if chosen.encoding in ("int8", "fp8_e4m3") and t == "vllm":
        notes.append(
            f"vLLM takes {chosen.encoding} SSM state only through FlashInfer ReplaySSM (--mamba-backend flashinfer "
            "--use-replayssm), pending upstream: use a vLLM build that has it"
        )
    if chosen.rounding == "sr":
        notes.append(
            "stochastic rounding: ssmquant emulates it with its own counter-based random bits; the engine uses "
            "Philox with the rounds given here. Both are unbiased; the random bits differ"
        )
    heldout = None
    if vsel is not None:
        heldout = {"max_error": vsel.get("max_error"), "meets_budget": vsel.get("meets_budget")}
    return ExportPlan(t, chosen, pick.entry, from_global, draft, dropped, notes, heldout)


def _unsatisfiable(recipe: Recipe, t: str, T: int | None, takeable) -> str:
    name = TARGET_NAMES[t]
    kind, metric, budget = recipe.layer_kind, recipe.metric, recipe.budget
    lines = [f"{name} cannot run this recipe within the budget {metric} <= {budget:g}:"]
    seen = set()
    glob = recipe.global_setting
    for s in ([glob] if glob is not None else []) + [d.setting for d in recipe.layers]:
        if s.name in seen:
            continue
        seen.add(s.name)
        msgs = violations(t, s, kind, T)
        if msgs:
            lines.append(f"  - {s.name}: " + "; ".join(dict.fromkeys(m for _, m in msgs)))
    if takeable:
        best = min(takeable, key=lambda u: u.entry["max_error"] if u.entry["max_error"] is not None else math.inf)
        lines.append(
            f"  - of the measured settings {name} can take, none meets the budget; the closest is {best.setting.name} "
            f"(worst-layer {metric} {_f(best.entry['max_error'])})"
        )
    else:
        lines.append(f"  - the recipe measured no setting that {name} can take")
    hint = {
        "trtllm": "float state (--candidates or --engine-fallbacks fp16,bf16) under conventional or replay16",
        "vllm": "float state, or int8/fp8_e4m3 under replay with --buffer-lens <= 16 (Mamba-2)",
        "flashinfer": "float state, or int8/fp8_e4m3 under replay with --buffer-lens <= 16 (Mamba-2 only)",
    }[t]
    lines.append(f"Re-run `ssmquant calibrate` with settings {name} takes: {hint}.")
    return "\n".join(lines)
