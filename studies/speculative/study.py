"""Study 5: speculative decoding with replay: irregular flushes against plain replay16 (collect + page)."""

from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd

from ssmquant.replay import parse_scheme
from studies.common.context import Context, load, load_runs
from studies.common.errors import Cube
from studies.common.measure import RunSpec
from studies.common.page import method_note, reproduce, scale_note
from studies.common.plots import save_fig, sns, subplots
from studies.common.stats import rank_correlation_test
from studies.common.tables import ci, num, p_text, ratio_ci, run_line, save_table, settings_text, short_source, span

STUDY = "speculative"
# canonical scheme names (full acceptance "spec16x2:p1.0" is named "spec16x2"), as the variants carry them
SPEC = [parse_scheme(s).name for s in ["replay16"] + [f"spec16x{t}:p{p}" for t in (2, 4, 6) for p in ("1.0", "0.8", "0.5")]]
SCALES = {
    "smoke": {"tiny-nemotron": (False, [0], ["fp8_e4m3"], 48, 2, [0])},
    "cpu": {
        "tiny-nemotron": (False, None, ["fp8_e4m3", "int8"], 1024, 3, [0]),
        "nemotron-3-nano": (True, [0], ["fp8_e4m3"], 1024, 2, [0]),
    },
    "gpu": {
        "tiny-nemotron": (False, None, ["fp8_e4m3", "int8"], 8192, 8, [0]),
        "nemotron-3-nano": (True, [0, 14, 30, 50], ["fp8_e4m3", "int8"], 8192, 4, [0, 1]),
    },
}


def collect(ctx: Context) -> None:
    for model, (synthetic, layers, formats, steps, batch, seeds) in SCALES[ctx.scale].items():
        variants = [f"{f}@{s}" for f in formats for s in SPEC]
        ctx.run_and_store(
            STUDY,
            RunSpec(model, model, variants, steps, batch, seeds, layers, synthetic, keep_windows=False),
        )


def flush_stats(scheme: str, batch: int, steps: int) -> dict:
    """Flushes per 1000 tokens and the intervals between them, from the exact schedule the runs used."""
    mask = parse_scheme(scheme).write_mask(batch, steps)
    gaps = []
    for b in range(batch):
        idx = mask[b].nonzero().flatten().numpy()
        gaps += np.diff(np.concatenate([[-1], idx])).tolist()
    gaps = np.asarray(gaps)
    return {
        "flushes per 1000 tokens": float(mask.sum(1).double().mean()) * 1000 / steps,
        "mean interval": float(gaps.mean()),
        "min interval": int(gaps.min()),
        "max interval": int(gaps.max()),
    }


def page(data: pathlib.Path, out: pathlib.Path) -> dict:
    src = data / STUDY / "data"
    folder = out / STUDY
    folder.mkdir(parents=True, exist_ok=True)
    seqs, runs = load(src, "sequences"), load_runs(src)
    models = [m for m in ("tiny-nemotron", "nemotron-3-nano") if not seqs.empty and m in set(seqs.model)]
    rows, shown, claims, rhos = [], [], [], []
    for model in models:
        s = runs[model]["settings"]
        c = Cube.from_frame(seqs[seqs.model == model], "out", "all")
        fl = {sch: flush_stats(sch, s["batch"], s["steps"]) for sch in SPEC}
        for enc in dict.fromkeys(v.split("@")[0] for v in c.variants):
            base = f"{enc}@replay16"
            t_rows = []
            for sch in SPEC:
                v = f"{enc}@{sch}"
                if v not in c.variants:
                    continue
                sc = parse_scheme(sch)
                med, vs = c.median_layer(v), c.ratio(v, base)
                row = {
                    "model": model,
                    "format": enc,
                    "scheme": sch,
                    "draft tokens T": sc.draft_tokens,
                    "acceptance p": sc.accept_rate if sc.accept_rate is not None else float("nan"),
                    **fl[sch],
                    "out err all steps": med.estimate,
                    "out err lo": med.low,
                    "out err hi": med.high,
                    "vs replay16": vs.estimate,
                    "vs replay16 lo": vs.low,
                    "vs replay16 hi": vs.high,
                }
                rows.append(row)
                t_rows.append(row)
                shown.append(
                    {
                        "model": model,
                        "format": enc,
                        "scheme": sch,
                        "flushes / 1000 tokens": num(fl[sch]["flushes per 1000 tokens"]),
                        "interval mean (min-max)": f"{fl[sch]['mean interval']:.3g} ({fl[sch]['min interval']}-{fl[sch]['max interval']})",
                        "out err, all steps (median layer)": ci(med),
                        "vs replay16": "1 (reference)" if sch == "replay16" else ratio_ci(vs),
                    }
                )
            t = pd.DataFrame(t_rows)
            test = rank_correlation_test(t["flushes per 1000 tokens"], t["out err all steps"])
            rhos.append(test.statistic)
            sp = t[t["draft tokens T"] > 0]
            higher = sum(r["vs replay16 lo"] > 1 for r in t_rows if r["scheme"] != "replay16")
            claims.append(
                f"**{model}, {enc}**: speculative schedules flush {span(sp['flushes per 1000 tokens'], '')} times per "
                f"1000 tokens (replay16: {num(fl['replay16']['flushes per 1000 tokens'])}); their error is "
                f"{span(sp['vs replay16'])} replay16's (interval above 1 for {higher} of {len(sp)}); Spearman "
                f"rho(flush rate, error) over the {len(t)} schedules = {test.statistic:.2f}, permutation {p_text(test)}"
            )
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "speculative", pd.DataFrame(shown))
    sp = tab[tab["draft tokens T"] > 0] if len(tab) else tab
    answer = (
        f"irregular speculative flushes raise the flush rate up to {sp['flushes per 1000 tokens'].max():.0f} per 1000 "
        f"tokens (replay16: {num(tab[tab['draft tokens T'] == 0]['flushes per 1000 tokens'].iloc[0])}) and the error "
        f"to {span(sp['vs replay16'])} replay16's; the error rank-correlates "
        f"with the flush rate (rho {span(rhos, '')}, permutation tests)"
        if len(sp)
        else "no data"
    )
    png = plot_spec(tab, models, runs, folder) if len(tab) else None
    scales = {r.get("scale") for r in runs.values()}
    text = [
        "# Study 5: speculative decoding with replay",
        "",
        scale_note(scales),
        "",
        "**Question.** With speculative decoding, draft tokens share the replay buffer, and the checkpoint is "
        "flushed before a verify round when h + T + 1 > L (h committed tokens held, T drafts: FlashInfer's "
        "checkpointing_ssu criterion with max_window L and T + 1 tokens per call), so flush intervals become "
        "irregular and, for large T, shorter. How does the error of spec16x{2,4,6} with per-draft acceptance "
        "{1.0, 0.8, 0.5} compare with plain replay16 on the same inputs?",
        "",
        "## Data",
        "",
        *[run_line(runs[m]) for m in models],
        "",
        "## Method",
        "",
        method_note() + " Flush statistics come from the exact schedules the runs used "
        "(`parse_scheme(scheme).write_mask(batch, steps)`, acceptance draws seeded per sequence), averaged over "
        "the sequences; windows hold whole 16-step periods, so irregular flushes are averaged over every phase. "
        "The rank correlation's p-value is a permutation test (the errors relabelled over the schedules), not "
        "the asymptotic formula.",
        "",
        "## Results",
        "",
        md,
        "",
        f"![speculative]({png})" if png else "",
        "",
        "## What the table shows",
        "",
        *[f"- {c}" for c in claims],
        "",
        "## Synthetic vs real",
        "",
        "nemotron-3-nano is synthetic (`init` profile); tiny-nemotron is real. The acceptance process is synthetic "
        "in both (independent per-draft Bernoulli acceptance); a real draft model's acceptance is correlated with "
        "the text, which changes the flush schedule. Rejected drafts never reach the checkpoint.",
        "",
        "## Reproduce",
        "",
        reproduce(STUDY),
        "",
    ]
    (folder / "README.md").write_text("\n".join(text))
    return {"folder": STUDY, "title": "Speculative decoding", "answer": answer}


def plot_spec(tab: pd.DataFrame, models: list[str], runs: dict, folder: pathlib.Path) -> str:
    encs = sorted(set(tab["format"]))
    fig, axes = subplots(len(models), len(encs), 6.0, 4.4)
    t = tab.copy()
    t["draft tokens"] = [("replay16 (no drafts)" if T == 0 else f"T = {T}") for T in t["draft tokens T"]]
    t["acceptance"] = [("-" if not np.isfinite(p) else f"p = {p:g}") for p in t["acceptance p"]]
    hue_order = ["replay16 (no drafts)", "T = 2", "T = 4", "T = 6"]
    pal = dict(zip(hue_order, ["black"] + sns.color_palette("viridis", 3)))
    for i, model in enumerate(models):
        for j, enc in enumerate(encs):
            ax = axes[i][j]
            d = t[(t.model == model) & (t.format == enc)]
            if d.empty:
                ax.axis("off")
                continue
            ax.errorbar(
                d["flushes per 1000 tokens"], d["out err all steps"],
                yerr=[d["out err all steps"] - d["out err lo"], d["out err hi"] - d["out err all steps"]],
                fmt="none", ecolor="grey", capsize=2, zorder=1,
            )  # fmt: skip
            sns.scatterplot(
                data=d, x="flushes per 1000 tokens", y="out err all steps", hue="draft tokens", style="acceptance",
                hue_order=[h for h in hue_order if h in set(d["draft tokens"])], palette=pal, s=80, ax=ax,
                legend=(i == 0 and j == len(encs) - 1), zorder=2,
            )  # fmt: skip
            ax.set(xlabel="checkpoint flushes per 1000 tokens", ylabel="output error, all steps (median layer)")
            ax.set_title(f"{model} ({short_source(runs[model]['data_source'])}), {enc}\n{settings_text(runs[model])}", fontsize=8)
    handles = axes[0][-1].get_legend()
    if handles is not None:
        axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.suptitle("Speculative replay (spec16xT, acceptance p) vs replay16 (bars: 95% bootstrap intervals)", fontsize=10)
    return save_fig(fig, folder, "speculative.png")


__all__ = ["collect", "flush_stats", "page"]
