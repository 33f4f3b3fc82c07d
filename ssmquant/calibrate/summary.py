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


def summary_text(result) -> str:
    """Per layer: decision, bytes, calibration and held-out error vs the budget; then the global setting."""
    cfg = result.config
    metric = cfg.metric
    ver = {r["layer"]: r for r in (result.verification or {}).get("per_layer", [])}
    rows = []
    for layer in sorted(result.decisions):
        row = result.decision_rows[layer]
        v = ver.get(layer)
        rows.append(
            {
                "layer": layer,
                "engine": cfg.engine,
                "setting": result.decisions[layer].name,
                "bytes/seq": int(row["bytes"]),
                f"{metric} (calib)": _f(row[metric]),
                f"{metric} (held-out)": _f(v[metric]) if v else "n/a",
                "ok": "yes" if v is None or v["meets_budget"] else "NO",
            }
        )
    lines = [
        profile_text(result),
        f"budget: {metric} <= {cfg.budget:g} at step {cfg.horizon} "
        f"({'one setting for all layers (--global)' if cfg.force_global else 'per-layer choice'})",
        pd.DataFrame(rows).to_string(index=False),
    ]
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
    if result.verification is not None and not result.verification["passed"]:
        bad = [r["layer"] for r in result.verification["per_layer"] if not r["meets_budget"]]
        lines.append(
            f"WARNING: on held-out data the decisions of layer(s) {bad} exceed the budget; the recipe records it "
            "(verification.passed = false). Calibrate on more data (--batch, --horizon) or lower the budget."
        )
    return "\n".join(lines)
