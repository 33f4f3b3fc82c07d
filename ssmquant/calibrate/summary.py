"""Plain-text summary of a calibration for the terminal (the recipe JSON holds the same numbers)."""

from __future__ import annotations

import pandas as pd

from ..engines.facts import ENGINE_NAMES
from ..engines.profiles import arithmetic


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def engines_checked_text(takeability: dict) -> str:
    """'vLLM 0.33.0, TensorRT-LLM main@2829508, FlashInfer 0.7.4 on sm90 (note)' from a recipe's record."""
    names = ", ".join(f"{ENGINE_NAMES[e]} {v}" for e, v in takeability["engines"].items())
    extra = [*takeability.get("unreleased", []), *([takeability["note"]] if takeability.get("note") else [])]
    return f"{names} on {takeability['gpu']}" + (f" ({'; '.join(extra)})" if extra else "")


SHOW_REFUSED = 8


def _reason(refusal: str) -> str:
    """The profile's message without its leading 'format@scheme: ' (the line names the setting already)."""
    where, sep, rest = refusal.partition(": ")
    return rest if sep and "@" in where and " " not in where else refusal


def profile_text(result) -> str:
    """'engine profile: flashinfer (...)' and one line per setting the profile refused, with the engine's reason."""
    name = result.config.engine
    ev = result.evaluations
    refused = ev[~ev["runnable"]].drop_duplicates("setting")
    head = f"engine profile: {name} (candidates emulated with the {arithmetic(name, result.layer_kind)} arithmetic"
    head += f"; {len(refused)} setting(s) not runnable by this engine, not measured)" if len(refused) else ")"
    lines = [head] + [f"  not runnable: {r['setting']}: {_reason(r['refusal'])}" for _, r in refused.head(SHOW_REFUSED).iterrows()]
    if len(refused) > SHOW_REFUSED:
        lines.append(f"  ... {len(refused) - SHOW_REFUSED} more (candidates.csv: runnable, refusal)")
    return "\n".join(lines)


ENGINE_SHORT = {"vllm": "vLLM", "trtllm": "TRT-LLM", "flashinfer": "FlashInfer", "sglang": "SGLang"}


def runs_on_text(engines) -> str:
    """'vLLM,FlashInfer' or '-' (no engine checked runs it)."""
    return ",".join(ENGINE_SHORT.get(e, e) for e in engines) or "-"


def choice_text(result) -> str:
    """What the decisions were chosen among (``--choose-among``), with the engines checked."""
    engines = engines_checked_text(result.takeability)
    if getattr(result, "choose_among", "research") == "engines":
        return (
            f"choosing among: what {engines} run as measured on these layers (--choose-among engines; the research "
            "settings no checked engine runs yet are listed below, --choose-among research chooses among them too)"
        )
    return (
        f"choosing among: every candidate, research settings included (--choose-among research); what {engines} "
        "run is listed below"
    )


def _pct(a: float, b: float) -> str:
    return f"{(b - a) / a:+.1%}" if a else "n/a"


def alternatives_text(result) -> str | None:
    """Per layer, the cheapest setting within the budget in the pool not chosen from: the research settings beside
    an engines choice, or what the engines run beside a research choice; None when nothing was recorded."""
    alts = getattr(result, "alternatives", None) or {}
    if not alts or not result.decisions:
        return None
    metric = result.config.metric
    engines_mode = getattr(result, "choose_among", "research") == "engines"
    rows = []
    for layer in sorted(result.decisions):
        alt = alts.get(layer)
        chosen = int(result.decision_rows[layer]["bytes"])
        if alt is None:
            rows.append({"layer": layer, "setting": "none within the budget", "runs on": "", "bytes/seq": "",
                         "vs chosen": "", f"{metric} (calib)": ""})  # fmt: skip
            continue
        rows.append(
            {
                "layer": layer,
                "setting": alt["setting"],
                "runs on": runs_on_text(result.runs_on.get(alt["setting"], [])),
                "bytes/seq": int(alt["bytes"]),
                "vs chosen": _pct(chosen, int(alt["bytes"])),
                f"{metric} (calib)": _f(alt[metric]),
            }
        )
    head = (
        "research settings (no checked engine runs them yet), the cheapest within the budget per layer:"
        if engines_mode
        else "what the checked engines run, the cheapest within the budget per layer:"
    )
    return head + "\n" + pd.DataFrame(rows).to_string(index=False)


def verification_failure(result) -> str | None:
    """One line when the per-layer decisions exceed the budget on held-out data, else None."""
    v = result.verification
    if v is None or v["passed"]:
        return None
    metric = result.config.metric
    bad = [r for r in v["per_layer"] if not r["meets_budget"]]
    worst = max(bad, key=lambda r: r[metric])
    return (
        f"verification failed: on held-out data the decisions of layer(s) {[r['layer'] for r in bad]} exceed the "
        f"budget {metric} <= {result.config.budget:g} (worst {worst[metric]:.4g}, layer {worst['layer']})"
    )


def summary_text(result) -> str:
    """Per layer: decision, the engines that run it, bytes, calibration and held-out error vs the budget; the
    other pool's cheapest setting per layer; then the global setting."""
    cfg = result.config
    metric = cfg.metric
    ver = {r["layer"]: r for r in (result.verification or {}).get("per_layer", [])}
    rows = []
    for layer in sorted(result.decisions):
        row = result.decision_rows[layer]
        v = ver.get(layer)
        name = result.decisions[layer].name
        rows.append(
            {
                "layer": layer,
                "engine": cfg.engine,
                "setting": name,
                "runs on": runs_on_text(getattr(result, "runs_on", {}).get(name, [])),
                "bytes/seq": int(row["bytes"]),
                f"{metric} (calib)": _f(row[metric]),
                f"{metric} (held-out)": _f(v[metric]) if v else "n/a",
                "ok": "yes" if v is None or v["meets_budget"] else "NO",
            }
        )
    lines = [
        profile_text(result),
        choice_text(result),
        f"budget: {metric} <= {cfg.budget:g} at step {cfg.horizon} "
        f"({'one setting for all layers (--global)' if cfg.force_global else 'per-layer choice'})",
        pd.DataFrame(rows).to_string(index=False),
    ]
    alts = None if cfg.force_global else alternatives_text(result)
    if alts:
        lines.append(alts)
    total = sum(int(result.decision_rows[la]["bytes"]) for la in result.decisions)
    g = result.global_setting
    if g is None:
        lines.append("global setting: none of the candidates is takeable by an engine")
    else:
        u = result.uniform.set_index("setting").loc[g.name]
        status = "meets the budget" if result.global_status == "meets_budget" else "CLOSEST (does not meet the budget)"
        lines.append(
            f"global setting (one for all layers, engine-takeable): {g.name} [{status}]: worst layer {metric} "
            f"{u['max_error']:.4g}, {int(u['bytes']):,} bytes/seq vs {total:,} for the per-layer choice "
            f"({(int(u['bytes']) - total) / total:+.1%})"
        )
        vg = (result.verification or {}).get("global")
        if vg:
            lines.append(
                f"  held-out: worst layer {metric} {vg['max_error']:.4g} "
                f"({'meets' if vg['meets_budget'] else 'DOES NOT meet'} the budget)"
            )
    lines.append(f"engine-takeable: runs as measured on one of {engines_checked_text(result.takeability)}")
    takes = export_text(result, total)
    if takes:
        lines.append(takes)
    return "\n".join(lines)


def export_text(result, per_layer_total: int) -> str | None:
    """'what each engine takes (ssmquant export: ...): vLLM 0.33.0: fp16@replay4 (..., +40.2%); ...'."""
    choices = getattr(result, "engine_choices", None) or {}
    if not choices:
        return None
    u = result.uniform.set_index("setting")
    versions = result.takeability["engines"]
    parts = []
    for engine, name in choices.items():
        label = f"{ENGINE_NAMES[engine]} {versions.get(engine, '')}".strip()
        if name is None:
            parts.append(f"{label}: no setting it runs meets the budget")
            continue
        b = int(u.loc[name, "bytes"])
        pct = f", {(b - per_layer_total) / per_layer_total:+.1%} vs the per-layer choice" if per_layer_total else ""
        parts.append(f"{label}: {name} ({b:,} bytes/seq{pct})")
    return "what each engine takes (`ssmquant export`, one setting for all layers): " + "; ".join(parts)
