"""Which measured setting an engine runs for a recipe, and what of the recipe it cannot take.

Engines take one setting for the whole model, so the export picks one uniform setting (measured on every
calibrated layer, README.md) that the target (engine, version, GPU, draft tokens, layer sizes) can run
(`engines.violations` is empty) and that meets the budget: the recipe's global setting when the target
takes it, else the cheapest such setting (ties: lower worst-layer error). Every difference between the
recipe's per-layer decisions and that setting is a dropped setting, reported with its reason (the
engine's own constraint) and its measured cost (bytes per sequence and error, per layer, on calibration
data, and on held-out data where the recipe verified it). No runnable setting within the budget:
ExportError quoting the engine's constraints and naming the nearest runnable setting with its measured
cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..calibrate.recipe import Recipe
from ..calibrate.settings import Setting
from ..engines.deployments import (
    EIGHT_BIT_ENCODINGS,
    TARGET_NAMES,
    Runtime,
    Target,
    UnknownTargetError,
    check_target,
    engine_bytes,
    runtime,
    violations,
)
from ..engines.facts import FACTS, VLLM_PR_BUILD, EngineVersionError, resolve_gpu
from ..errors import SsmquantError

_DTYPE_RULES = ("nvfp4", "dtype", "unreleased", "8bit_replay", "layer_kind", "shape")
_SCHEME_RULES = ("buffer_len", "spec_buffer", "layer_kind", "8bit_replay", "scheme", "gpu", "unreleased")
_SR_RULES = ("sr", "gpu")
PER_LAYER_REASON = "engines take one setting for all layers; this layer's own choice differs from the exported one"
# vLLM speculative methods (vllm/config/speculative.py `SpeculativeMethod`, in every release read) the export
# writes; those in SPEC_NEEDS_MODEL also need the drafter's checkpoint. TensorRT-LLM's decoding_type for each
# (fact trtllm.spec_config; a method without one is refused for TensorRT-LLM).
SPEC_METHODS = ("mtp", "ngram", "eagle", "eagle3", "draft_model")
SPEC_NEEDS_MODEL = ("eagle", "eagle3", "draft_model")
TRTLLM_DECODING_TYPE = {"mtp": "MTP", "ngram": "NGram", "eagle3": "Eagle3", "draft_model": "Draft_Target"}
# SGLang's --speculative-algorithm for each method (fact sglang.spec_algorithm)
SGLANG_ALGORITHM = {"mtp": "NEXTN", "ngram": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3", "draft_model": "STANDALONE"}


@dataclass(frozen=True)
class Speculation:
    """The drafter of a deployment with draft tokens: method (SPEC_METHODS) and, where it needs one, the
    drafter's checkpoint (model)."""

    method: str
    model: str | None = None


def check_speculation(target: str, method: str | None, model: str | None) -> Speculation | None:
    """Validated drafter for `target` (None when no method is given); ExportError naming the accepted values."""
    if method is None:
        if model is not None:
            raise ExportError(
                "--speculative-model needs --speculative-method (one of " + ", ".join(SPEC_NEEDS_MODEL) + ")"
            )
        return None
    m = str(method).strip().lower()
    accepted = {"vllm": SPEC_METHODS, "sglang": tuple(SGLANG_ALGORITHM)}.get(target, tuple(TRTLLM_DECODING_TYPE))
    if target == "flashinfer":
        raise ExportError(
            "--speculative-method applies to the vllm, trtllm and sglang targets; FlashInfer takes no drafter"
        )
    if m not in accepted:
        raise ExportError(
            f"unknown --speculative-method {method!r} for {TARGET_NAMES[target]}; accepted: {', '.join(accepted)}"
        )
    if m in SPEC_NEEDS_MODEL and not model:
        raise ExportError(f"--speculative-method {m} needs the drafter's checkpoint: pass --speculative-model PATH")
    if m not in SPEC_NEEDS_MODEL and model:
        raise ExportError(
            f"--speculative-method {m} takes no --speculative-model (it drafts without a separate checkpoint)"
        )
    return Speculation(m, model or None)


def synthetic_note(recipe: Recipe) -> str | None:
    """A warning for a recipe calibrated on synthetic inputs (``--synthetic``: a preset's shapes, no model's weights
    or text), None for one measured on a real or shipped model."""
    data = (recipe.config.get("data") or {}).get("calibration") or {}
    if data.get("kind") != "synthetic":
        return None
    return (
        f"SYNTHETIC recipe: its errors were measured on synthetic inputs with {data.get('model', 'a preset')}'s shapes, "
        "not on a model's weights and text; re-calibrate on the checkpoint before relying on them"
    )


def recipe_architecture(recipe: Recipe) -> str | None:
    """The model's architecture (HF `architectures[0]`): as the recipe's calibration source recorded it (a
    checkpoint or shipped model), else the preset's of that name (synthetic inputs), else None."""
    src = (recipe.config.get("data") or {}).get("calibration") or {}
    if isinstance(src, dict) and src.get("architecture"):
        return str(src["architecture"])
    from ..models.presets import get_preset  # only for a recipe made from a preset; keeps export's import light

    try:
        return get_preset(str(recipe.config["model"].get("name"))).architecture
    except ValueError:
        return None


class ExportError(SsmquantError, ValueError):
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

    def short_line(self, metric: str) -> str:
        """One line: what, the layers, bytes per sequence and the worst error before -> after (calibration)."""
        b0, b1 = self.cost.get("bytes_per_sequence", (None, None))
        errs = self.cost.get("errors", [])
        worst = [max((e[k] for e in errs if e.get(k) is not None), default=None) for k in ("recipe", "exported")]
        cost = f"bytes/sequence {b0:,} -> {b1:,} ({_pct(b0, b1)})" if b0 is not None and b1 is not None else ""
        if any(w is not None for w in worst):
            cost += f"{'; ' if cost else ''}worst {metric} {_f(worst[0])} -> {_f(worst[1])}"
        return f"dropped {self.what} (layers {_span(self.layers)})" + (f": {cost}" if cost else "")

    def to_dict(self) -> dict:
        return {"what": self.what, "reason": self.reason, "layers": self.layers, "cost": self.cost}


@dataclass
class ExportPlan:
    """target: engine name; deployment: engine, version, GPU, drafts, sizes; setting: what the engine runs;
    entry: its uniform_settings entry; runtime: how the engine runs it; engine_bytes: per layer and sequence
    in the engine's buffers (engines.engine_bytes); dropped; notes."""

    target: str
    setting: Setting
    entry: dict
    from_global: bool
    draft_tokens: int
    dropped: list[Dropped]
    notes: list[str]
    heldout: dict | None  # held-out numbers of the exported setting, when the recipe verified it
    deployment: Target | None = None
    runtime: Runtime | None = None
    engine_bytes: dict | None = None
    num_ssm_layers: int = 0
    speculation: Speculation | None = None
    architecture: str | None = None

    @property
    def other_notes(self) -> list[str]:
        """The notes after the 'checked for' line and the unreleased-build label (files print those first)."""
        skip = 1 + (self.deployment is not None and self.deployment.build is not None)
        return self.notes[skip:]


def _f(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.4g}"


def _pct(a, b) -> str:
    return "n/a" if not a else f"{(b - a) / a:+.1%}"


def _span(layers: list[int]) -> str:
    return ", ".join(str(i) for i in layers)


def _messages(msgs: list[tuple[str, str]], rules) -> list[str]:
    return [m for r, m in msgs if r in rules]


def plan_export(
    recipe: Recipe,
    target: str,
    *,
    num_speculative_tokens: int | None = None,
    engine_version: str | None = None,
    gpu: str | int | None = None,
    speculative_method: str | None = None,
    speculative_model: str | None = None,
) -> ExportPlan:
    """Choose the setting `target` runs for `recipe` and list what is dropped (module docstring).

    engine_version: a release whose source was read or a build with open PRs (facts.VERSIONS; None: the
    newest release); gpu: "sm90" etc. (None: the local GPU, else sm90 with a note); speculative_method /
    speculative_model: the drafter (SPEC_METHODS), which vLLM and TensorRT-LLM need whenever the exported
    setting drafts tokens.
    """
    try:
        t = check_target(target)
    except UnknownTargetError as err:
        raise ExportError(str(err)) from None
    name = TARGET_NAMES[t]
    if num_speculative_tokens is not None and (
        isinstance(num_speculative_tokens, bool)
        or not isinstance(num_speculative_tokens, int)
        or num_speculative_tokens < 0
    ):
        raise ExportError(f"--num-speculative-tokens must be an integer >= 0, got {num_speculative_tokens!r}")
    spec = check_speculation(t, speculative_method, speculative_model)
    arch = recipe_architecture(recipe)
    try:
        cc, gpu_note = resolve_gpu(gpu)
        dep = Target.make(t, engine_version, cc, num_speculative_tokens, recipe.dims, arch)
    except EngineVersionError as err:
        raise ExportError(str(err)) from None
    kind, metric, budget = recipe.layer_kind, recipe.metric, recipe.budget
    T = num_speculative_tokens
    uniform = recipe.uniform
    takeable = [u for u in uniform if not violations(dep, u.setting, kind)]
    feasible = [u for u in takeable if u.entry["meets_budget"]]
    glob = recipe.global_setting
    in_global = next((u for u in feasible if glob is not None and u.setting.name == glob.name), None)

    def rank(u):  # among equal bytes, a setting that keeps the engine's fused kernel before a lower error
        return (
            u.entry["bytes_per_sequence"],
            _off_fused_kernel(dep, u.setting, kind),
            u.entry["max_error"],
            u.setting.name,
        )

    best = min(feasible, key=rank) if feasible else None
    # the recipe's global setting, unless this engine runs an equally small one on its fused kernel instead
    pick = in_global if in_global is not None and rank(in_global)[:2] <= rank(best)[:2] else best
    from_global = pick is not None and pick is in_global
    if pick is None:
        raise ExportError(_unsatisfiable(recipe, dep, takeable))
    chosen = pick.setting
    draft = chosen.draft_tokens if T is None else T
    if draft and spec is None and t != "flashinfer":
        raise ExportError(_needs_method(dep, chosen, draft))
    if not draft and spec is not None:
        raise ExportError(
            f"--speculative-method {spec.method} given, but the export drafts no tokens ({chosen.name}); pass "
            "--num-speculative-tokens T, or leave the method out"
        )
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
        msgs = [(v.rule, v.message) for v in violations(dep, s, kind)]

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
            add(f"{s.rounding} rounding (-> {chosen.rounding})", _SR_RULES)
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
        reasons = [v.message for v in violations(dep, glob, kind)]
        if not reasons and in_global is not None:  # feasible here, as small as the pick, off the fused kernel
            reasons = [
                f"{dep.name} runs it off its fused kernel (on a fallback) where {chosen.name} is as small and stays "
                f"on it (worst {metric} {_f(pick.entry['max_error'])}, within the budget)"
            ]
        elif not reasons:
            reasons = [
                f"it does not meet the budget on every layer (worst {metric} "
                f"{_f(recipe.config['global'].get('max_error'))})"
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
    notes = [f"checked for {dep.label}" + (f" ({gpu_note})" if gpu_note else "")]
    if dep.build is not None:
        notes.append(dep.build.label(t))
    model = recipe.config["model"]
    missing = [x for x in model["ssm_layers"] if x not in model["calibrated_layers"]]
    if missing:
        notes.append(
            f"the recipe calibrated SSM layers {model['calibrated_layers']} only; {name} applies the setting to every "
            f"SSM layer, including the unmeasured layers {missing}"
        )
    synthetic = synthetic_note(recipe)
    if synthetic:
        notes.append(synthetic)
    if vsel is not None:
        verdict = "meets" if vsel.get("meets_budget") else "DOES NOT meet"
        notes.append(
            f"held-out verification of {chosen.name}: worst-layer {metric} {_f(vsel.get('max_error'))} {verdict} the "
            f"budget {budget:g}" + (" on synthetic inputs" if synthetic else "")
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
    if chosen.draft_tokens != draft and chosen.scheme_kind != "conventional":
        notes.append(
            f"{chosen.name} was measured with {chosen.draft_tokens} draft tokens per step; the deployment drafts "
            f"{draft}, so the engine's flushes fall at other steps than measured"
        )
    if (
        t == "vllm"
        and dep.version != VLLM_PR_BUILD
        and any(v.rule == "unreleased" for u in uniform for v in violations(dep, u.setting, kind))
    ):
        notes.append(
            f"settings with {'/'.join(EIGHT_BIT_ENCODINGS)} state run only on unreleased vLLM code: "
            f"--engine-version {VLLM_PR_BUILD} (PR #52962, open)"
        )
    notes += _kind_notes(recipe, dep, chosen, uniform)
    if chosen.rounding == "sr":
        notes.append(
            "stochastic rounding: ssmquant emulates it with its own counter-based random bits; the engine uses "
            "Philox with the rounds given here. Both are unbiased; the random bits differ"
        )
    heldout = None
    if vsel is not None:
        heldout = {"max_error": vsel.get("max_error"), "meets_budget": vsel.get("meets_budget")}
    rt = runtime(dep, chosen, kind)
    per_layer_bytes = engine_bytes(dep, chosen, kind, recipe.dims, rt)
    return ExportPlan(
        t, chosen, pick.entry, from_global, draft, dropped, notes, heldout, dep, rt, per_layer_bytes,
        len(model["ssm_layers"]), spec, arch,
    )  # fmt: skip


def _needs_method(dep: Target, chosen, draft: int) -> str:
    f = FACTS[{"vllm": "vllm.spec_method", "sglang": "sglang.spec_algorithm"}.get(dep.engine, "trtllm.spec_config")]
    accepted = {"vllm": SPEC_METHODS, "sglang": tuple(SGLANG_ALGORITHM)}.get(dep.engine, tuple(TRTLLM_DECODING_TYPE))
    words = f'"{f.quote}" ' if f.quote else ""
    return (
        f"{dep.name} drafts {draft} tokens per step for {chosen.name}, and its speculative config needs the "
        f"drafter's method: {words}{f.cite()}; pass --speculative-method ({', '.join(accepted)}), plus "
        "--speculative-model for " + ", ".join(m for m in SPEC_NEEDS_MODEL if m in accepted)
    )


def _off_fused_kernel(dep: Target, setting, kind: str) -> bool:
    """Whether the engine runs ``setting`` off its fused kernel, on a fallback (vLLM's GDN decode: fp16 state)."""
    return dep.engine == "vllm" and kind == "gdn" and setting.encoding == "fp16" and dep.holds("vllm.fused_gdn_dtypes")


def _kind_notes(recipe: Recipe, dep: Target, chosen, uniform) -> list[str]:
    """What the layer kind changes on this engine that the files alone do not say."""
    kind, metric = recipe.layer_kind, recipe.metric
    notes = []
    if _off_fused_kernel(dep, chosen, kind):
        f = FACTS["vllm.fused_gdn_dtypes"]
        bf16 = next((u for u in uniform if u.setting.name == chosen.name.replace("fp16", "bf16", 1)), None)
        cost = (
            f"; bf16 measured worst-layer {metric} {_f(bf16.entry['max_error'])} "
            f"({'meets' if bf16.entry['meets_budget'] else 'misses'} the budget) at the same bytes"
            if bf16 is not None
            else "; bf16 was not measured (calibrate --engine-fallbacks bf16)"
        )
        notes.append(
            f'vLLM\'s fused GDN decode takes a float32 or bfloat16 state only ("{f.quote}" {f.cite()}): this fp16 '
            f"state decodes on the Triton fallback, while bf16 is the same size and stays on the fused kernel{cost}"
        )
    if kind == "kda" and dep.engine == "vllm":
        fam = dep.kda_family
        who = {"glm5next": "GLM-5.3-Flash", "kimi_k3": "Kimi-K3", "kimi_linear": "Kimi-Linear"}.get(fam)
        notes.append(
            f"KDA layers of {dep.arch or 'an unnamed architecture'}"
            + (f" ({who})" if who else "")
            + f": vLLM {dep.version} keeps their state in "
            + (f"the --mamba-ssm-cache-dtype given ({chosen.encoding})" if chosen.encoding != "fp32" else "float32")
            + "; vLLM reads no HF config key for it"
        )
        if fam == "kimi_k3" and dep.holds("vllm.kda_decode_backend"):
            notes.append(
                "--kda-decode-backend is left at auto: " + FACTS["vllm.kda_decode_backend"].says.split(": ", 1)[1]
            )
    return notes


# The settings a refusal checks the target against to say what to measure instead (each against the layers' sizes).
_ADVICE_GRID = tuple(
    Setting.parse(f"{enc}@{scheme}")
    for enc in ("fp32", "bf16", "fp16", "int8", "fp8_e4m3")
    for scheme in ("conventional", "replay16")
)


def _unsatisfiable(recipe: Recipe, dep: Target, takeable) -> str:
    """The refusal: each measured setting with the engine's constraints, then the nearest runnable setting."""
    kind, metric, budget = recipe.layer_kind, recipe.metric, recipe.budget
    lines = [f"{dep.label} cannot run this recipe within the budget {metric} <= {budget:g}:"]
    seen, rules = set(), set()
    glob = recipe.global_setting
    settings = [glob] if glob is not None else []
    settings += [d.setting for d in recipe.layers] + [u.setting for u in recipe.uniform]
    for s in settings:
        if s.name in seen:
            continue
        seen.add(s.name)
        msgs = violations(dep, s, kind)
        rules.update(v.rule for v in msgs)
        if msgs:
            lines.append(f"  - {s.name}: " + "; ".join(dict.fromkeys(v.message for v in msgs)))
    if takeable:
        best = min(takeable, key=lambda u: u.entry["max_error"] if u.entry["max_error"] is not None else math.inf)
        e = best.entry
        rt_bytes = engine_bytes(dep, best.setting, kind, recipe.dims)["total"] * len(
            recipe.config["model"]["ssm_layers"]
        )
        lines.append(
            f"Nearest runnable setting: {best.setting.name}, measured worst-layer {metric} {_f(e['max_error'])} "
            f"(budget {budget:g}, not met), {e['bytes_per_sequence']:,} bytes per sequence over the calibrated "
            f"layers ({rt_bytes:,} in {dep.name}'s buffers over all SSM layers)."
        )
    else:
        lines.append(f"The recipe measured no setting that {dep.label} can run.")
    runnable = [x.name for x in _ADVICE_GRID if not violations(dep, x, kind)]
    if not runnable:
        why = sorted(
            {v.message for x in _ADVICE_GRID for v in violations(dep, x, kind) if v.rule in ("shape", "layer_kind")}
        )
        lines.append(
            f"{dep.label} runs none of {', '.join(x.name for x in _ADVICE_GRID)} on these layers"
            + (f" ({'; '.join(why)})" if why else "")
            + ": export for another target."
        )
        return "\n".join(lines)
    formats = ",".join(dict.fromkeys(n.split("@")[0] for n in runnable))
    schemes = ",".join(dict.fromkeys(n.split("@")[1] for n in runnable))
    lines.append(
        f"Settings {dep.label} runs on these layers: {', '.join(runnable)}; re-run `ssmquant calibrate` with "
        f"--candidates {formats} --schemes {schemes}."
    )
    if "unreleased" in rules:
        lines.append(f"Or export for the unreleased build: --engine-version {VLLM_PR_BUILD}.")
    return "\n".join(lines)
