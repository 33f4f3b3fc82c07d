"""Study 4: which layers and heads are fragile, and what a per-layer recipe saves (page only).

Its data are other studies' runs: the per-head sums and decays of study 1 (`conv_vs_replay/data`) and the
calibration runs of study 3 (`granularity_calibration/data`); `collect` has nothing of its own to run.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pandas as pd
from scipy.stats import rankdata

from ssmquant.calibrate.choose import choose_global, choose_layer, uniform_table
from ssmquant.calibrate.settings import Setting
from ssmquant.engines.deployments import takeable_by_any
from studies.common.context import Context, load, load_runs
from studies.common.errors import Cube
from studies.common.models import heads_text
from studies.common.page import NONE_USED, method_note, reproduce, scale_note
from studies.common.plots import PALETTE, Y_CLIP, save_fig, sns, subplots
from studies.common.stats import bootstrap, pooled_rel_err, rank_correlation_test, spearman
from studies.common.tables import diverged, num, read_data, run_line, save_table, span

STUDY = "fragile_heads"
SOURCES = ("conv_vs_replay", "granularity_calibration")
BUDGET = 0.01
QUANT = ("fp8_e4m3", "int8", "nvfp4")


def collect(ctx: Context) -> None:
    """Nothing to run: the page reads studies 1 and 3 (module docstring)."""
    ctx.log(f"[{STUDY}] uses the data of {', '.join(SOURCES)}")


def head_units(heads: pd.DataFrame, decays: pd.DataFrame):
    """Per (model, variant): head instances (seed, layer, head) with their half-life, and the per-sequence
    horizon sums err2 / ref2 [heads, units] (NaN where a unit belongs to another seed)."""
    out = {}
    dec = decays.set_index(["model", "seed", "layer", "head"])
    for (model, variant), g in heads.groupby(["model", "variant"], sort=False):
        inst = sorted({(int(a), int(b), int(c)) for a, b, c in zip(g["seed"], g["layer"], g["head"])})
        units = sorted({(int(a), int(b)) for a, b in zip(g["seed"], g["sequence"])})
        ii, ui = {h: i for i, h in enumerate(inst)}, {u: i for i, u in enumerate(units)}
        err2 = np.full((len(inst), len(units)), np.nan)
        ref2 = np.full_like(err2, np.nan)
        for r in g.itertuples(index=False):
            k = (ii[(r.seed, r.layer, r.head)], ui[(r.seed, r.sequence)])
            err2[k], ref2[k] = r.out_err2_horizon, r.out_ref2_horizon
        half = np.array([dec.loc[(model, s, la, h), "half_life_tokens"] for s, la, h in inst])
        out[(model, variant)] = {
            "inst": inst,
            "units": units,
            "err2": err2,
            "ref2": ref2,
            "half_life": half,
            "group": np.array([s * 10_000 + la for s, la, _ in inst]),
        }
    return out


def head_errors(u: dict, idx: np.ndarray | None = None) -> np.ndarray:
    e, r = u["err2"], u["ref2"]
    if idx is not None:
        e, r = e[:, idx], r[:, idx]
    return pooled_rel_err(np.nan_to_num(e), np.nan_to_num(r), axis=1)


def within_rho(u: dict, ok: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Mean within-layer Spearman rho(half-life, head error) for each row of unit weights [R, U] -> [R]."""
    e, r = np.nan_to_num(u["err2"]) @ weights.T, np.nan_to_num(u["ref2"]) @ weights.T  # [heads, R]
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.sqrt(e / r)
    rhos = []
    for g in np.unique(u["group"]):
        m = (u["group"] == g) & ok
        if m.sum() < 3:
            continue
        rx = rankdata(u["half_life"][m])
        rx = rx - rx.mean()
        ry = rankdata(err[m], axis=0)
        ry = ry - ry.mean(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            rhos.append((rx @ ry) / np.sqrt((rx @ rx) * (ry * ry).sum(axis=0)))
    return np.nanmean(np.array(rhos), axis=0) if rhos else np.full(weights.shape[0], np.nan)


def correlation_table(units: dict, folder: pathlib.Path):
    rows, shown, dead = [], [], []
    for (model, variant), u in units.items():
        err = head_errors(u)
        if diverged(float(pooled_rel_err(np.nan_to_num(u["err2"]), np.nan_to_num(u["ref2"])))):
            dead.append(f"{model} {variant}")  # the variant diverged (study 1): its head ranking means nothing
            continue
        ok = np.isfinite(err)
        if ok.sum() < 4:
            continue
        test = rank_correlation_test(u["half_life"][ok], err[ok], u["group"][ok], permutations=4999)
        strata = np.array([s for s, _ in u["units"]])
        iv = bootstrap(lambda w, u=u, ok=ok: within_rho(u, ok, w), len(u["units"]), strata=strata, vectorized=True)
        longest = int(np.nanargmax(np.where(ok, u["half_life"], -np.inf)))
        row = {
            "model": model,
            "variant": variant,
            "heads": int(ok.sum()),
            "layers x seeds": len(np.unique(u["group"])),
            "within-layer rho(half-life, err)": test.statistic,
            "rho lo": iv.low,
            "rho hi": iv.high,
            "permutation p": test.p_value,
            "pooled rho": spearman(u["half_life"][ok], err[ok]),
            "longest-memory head / median head": float(err[longest] / np.median(err[ok])),
        }
        rows.append(row)
        shown.append(
            {
                "model": model,
                "variant": variant,
                "heads (layer x seed groups)": f"{row['heads']} ({row['layers x seeds']})",
                "within-layer rho [95% CI]": f"{test.statistic:.2f} [{iv.low:.2f}, {iv.high:.2f}]",
                "permutation p": f"{test.p_value:.2g} ({test.method}{', floor' if test.p_value <= test.p_floor * (1 + 1e-9) else ''})",
                "pooled rho": f"{row['pooled rho']:.2f}",
                "longest-memory / median head": f"{row['longest-memory head / median head']:.3g}x",
            }
        )
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "rank_correlation", pd.DataFrame(shown))
    if dead:
        md += "\n\nLeft out, diverged (error above 1 over all its heads): " + ", ".join(dead) + "."
    return tab, md


def plot_heads(units: dict, runs: dict, folder: pathlib.Path) -> str | None:
    frames = []
    for (model, variant), u in units.items():
        fmt, _, sch = variant.partition("@")
        frames.append(pd.DataFrame({"model": model, "encoding": fmt, "scheme": sch, "half_life": u["half_life"], "err": head_errors(u)}))
    if not frames:
        return None
    h = pd.concat(frames, ignore_index=True)
    h = h[np.isfinite(h.err) & (h.err > 0)]
    models = list(dict.fromkeys(h.model))
    ncol = 2
    nrow = math.ceil(len(models) / ncol)
    fig, axes = subplots(nrow, ncol, 6.0, 4.4)
    for ax, model in zip(axes.flat, models):
        t = h[h.model == model]
        sns.scatterplot(
            data=t, x="half_life", y="err", hue="encoding", style="scheme", hue_order=list(QUANT),
            palette={k: PALETTE[k] for k in QUANT}, style_order=["conventional", "replay16"], s=24, alpha=0.8,
            ax=ax, legend=(ax is axes.flat[0]),
        )  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="head half-life ln2 / -mean(ln a_t), tokens", ylabel="per-head output error, horizon window")
        if (t.err > Y_CLIP).any():
            ax.set_ylim(top=Y_CLIP)
        ax.set_title(f"{model}", fontsize=9)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    fig.suptitle("Per-head error at the horizon (whole flush cycles) vs the head's memory (RNE)", fontsize=10)
    return save_fig(fig, folder, "error_vs_half_life.png")


def layer_spread(seqs: pd.DataFrame, folder: pathlib.Path):
    rows, shown = [], []
    for model, sq in seqs.groupby("model", sort=False):
        c = Cube.from_frame(sq, "out", "all")
        if len(c.layers) < 2:
            continue
        errs = c.layer_errors()
        for v in c.variants:
            fmt, _, sch = v.partition("@")
            if fmt not in QUANT or sch not in ("conventional", "replay16"):
                continue
            i = c.index(v)
            e = errs[i]
            if not np.isfinite(e).all():
                continue
            iv = c.interval(lambda x, i=i: np.max(x[i], axis=0) / np.min(x[i], axis=0))
            rows.append(
                {
                    "model": model,
                    "variant": v,
                    "worst layer": c.layers[int(np.argmax(e))],
                    "best layer": c.layers[int(np.argmin(e))],
                    "worst / best": iv.estimate,
                    "lo": iv.low,
                    "hi": iv.high,
                }
            )
            shown.append({**{k: rows[-1][k] for k in ("model", "variant", "worst layer", "best layer")}, "worst / best layer error [95% CI]": f"{iv.estimate:.3g}x [{iv.low:.3g}, {iv.high:.3g}]"})
    tab = pd.DataFrame(rows)
    if tab.empty:
        return "(every model here has one analysed layer)", []
    md = save_table(tab, folder, "layer_spread", pd.DataFrame(shown))
    claims = []
    for model, g in tab.groupby("model", sort=False):
        top = g["worst layer"].value_counts()
        claims.append(
            f"**{model}**: worst / best layer error {span(g['worst / best'])}; layer {top.index[0]} is the worst in "
            f"{top.iloc[0]} of {len(g)} variants"
        )
    return md, claims


def recipe_section(cs: pd.DataFrame, meta: pd.DataFrame, prov: dict, folder: pathlib.Path):
    """Per-layer choice vs one global setting with the library's choice functions, on the calibration split;
    each decision then checked on held-out text (with its interval)."""
    m = meta.set_index("setting")
    names = list(m.index)
    errs = {}
    for split in ("calibration", "heldout"):
        c = Cube.from_frame(cs[cs.split == split], "out", "horizon", variants=names)
        errs[split] = (c, c.layer_errors())
    c_cal, e_cal = errs["calibration"]
    c_held, e_held = errs["heldout"]
    cand = pd.DataFrame(
        [
            {
                "layer": layer,
                "setting": n,
                "role": "candidate",
                "bytes": int(m.loc[n, "bytes"]),
                "state_bytes": int(m.loc[n, "state_bytes"]),
                "buffer_bytes": int(m.loc[n, "buffer_bytes"]),
                "out_rel_err": float(e_cal[i, j]),
                "state_rel_err": math.nan,
            }
            for i, n in enumerate(names)
            for j, layer in enumerate(c_cal.layers)
        ]
    )
    kind = "mamba2"
    takeable = {n: takeable_by_any(Setting.parse(n), kind) for n in names}
    rows, fails = [], []
    picks = {layer: choose_layer(cand[cand.layer == layer], BUDGET, "out_rel_err") for layer in c_cal.layers}
    for j, layer in enumerate(c_cal.layers):
        p = picks[layer]
        if p is None:
            rows.append({"layer": layer, "per-layer choice": "(none within budget)"})
            continue
        i = names.index(p["setting"])
        iv = c_held.interval(lambda e, i=i, j=j: e[i, j])
        exceeds = iv.low > BUDGET
        if iv.estimate > BUDGET:
            fails.append((layer, p["setting"], iv))
        rows.append(
            {
                "layer": layer,
                "per-layer choice": p["setting"],
                "bytes/sequence (state + ring)": int(p["bytes"]),
                "error, calibration": float(p["out_rel_err"]),
                "error, held-out [95% CI]": f"{num(iv.estimate)} [{num(iv.low)}, {num(iv.high)}]"
                + (" (above budget)" if exceeds else " (over budget)" if iv.estimate > BUDGET else ""),
            }
        )
    uni = uniform_table(cand, BUDGET, "out_rel_err")
    grow, status = choose_global(uni, takeable)
    per_bytes = sum(int(p["bytes"]) for p in picks.values() if p is not None)
    claims = []
    if grow is not None:
        gi = names.index(grow["setting"])
        held_worst = float(np.max(e_held[gi]))
        rows.append(
            {
                "layer": "all (per-layer total)",
                "per-layer choice": "",
                "bytes/sequence (state + ring)": per_bytes,
                "error, calibration": float(max(p["out_rel_err"] for p in picks.values() if p is not None)),
                "error, held-out [95% CI]": "",
            }
        )
        rows.append(
            {
                "layer": "all (global setting)",
                "per-layer choice": f"{grow['setting']} ({status})",
                "bytes/sequence (state + ring)": int(grow["bytes"]),
                "error, calibration": float(grow["max_error"]),
                "error, held-out [95% CI]": f"{num(held_worst)} (worst layer)",
            }
        )
        ratio = grow["bytes"] / per_bytes
        claims.append(
            f"At budget {BUDGET} (output error over the horizon window), the per-layer recipe stores {per_bytes:,} "
            f"bytes per sequence against {int(grow['bytes']):,} for the global {grow['setting']} ({status}): the "
            f"global setting costs {ratio:.2f}x the bytes; on held-out text its worst layer is {num(held_worst)}"
        )
    claims.append(
        f"Held-out check: {len(fails)} of {len(picks)} per-layer decisions exceed the budget on held-out text"
        + (" (" + "; ".join(f"layer {la} {s} {num(iv.estimate)} [{num(iv.low)}, {num(iv.high)}]" for la, s, iv in fails) + ")" if fails else "")
        + ". A recipe chosen right at the budget on little calibration text needs a margin below it."
    )
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "recipe")
    sweep_md, sweep_claim = budget_sweep(cand, takeable, names, c_cal.layers, e_held, folder)
    claims.append(sweep_claim)
    s = prov["settings"]
    intro = (
        f"`ssmquant.calibrate.choose` (`choose_layer`, `uniform_table`, `choose_global`) on the calibration-split "
        f"errors of study 3's run ({s['batch']} sequences x {s['steps']} steps; error = output error over the horizon "
        f"window, per layer), budget {BUDGET}; objective: bytes per sequence of the "
        "stored state plus the replay ring; the global setting is the cheapest one an engine can take "
        f"(`ssmquant.engines.deployments.takeable_by_any`). Each decision is then scored on {s['heldout_batch']} held-out "
        "sequences, with a bootstrap interval over them: *over budget* when the estimate exceeds the budget, "
        "*above budget* when the whole interval does."
    )
    return intro + "\n\n" + md + "\n\n" + sweep_md, claims, len(fails), len(picks)


def budget_sweep(cand, takeable, names, layers, e_held, folder):
    """The same choice at budgets from twice the smallest error to 0.2, each checked on held-out text."""
    finite = cand["out_rel_err"][np.isfinite(cand["out_rel_err"])]
    lo = max(float(finite.min()), 1e-5)
    budgets = sorted({float(f"{x:.1g}") for x in np.geomspace(lo * 2, min(float(finite.max()), 0.2), 9)} | {BUDGET})
    rows = []
    for b in budgets:
        picks = [choose_layer(cand[cand.layer == la], b, "out_rel_err") for la in layers]
        if any(p is None for p in picks):
            rows.append({"budget": b, "per-layer bytes": math.nan, "global setting": "(a layer has no candidate within budget)"})
            continue
        per = int(sum(int(p["bytes"]) for p in picks))
        grow, status = choose_global(uniform_table(cand, b, "out_rel_err"), takeable)
        gb = int(grow["bytes"]) if grow is not None and status == "meets_budget" else math.nan
        over = sum(float(e_held[names.index(p["setting"]), j]) > b for j, p in enumerate(picks))
        rows.append(
            {
                "budget": b,
                "per-layer bytes": per,
                "global setting": (grow["setting"] if grow is not None else "none") + ("" if status == "meets_budget" else f" ({status})"),
                "global bytes": gb,
                "global / per-layer": gb / per if np.isfinite(gb) else math.nan,
                "per-layer picks over budget on held-out text": f"{over} of {len(picks)}",
                "per-layer choices": "; ".join(f"{k} x{v}" for k, v in pd.Series([p["setting"] for p in picks]).value_counts().items()),
            }
        )
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "recipe_budget_sweep")
    ok = tab["global / per-layer"].dropna() if "global / per-layer" in tab else pd.Series(dtype=float)
    claim = (
        f"Budget sweep ({len(tab)} budgets, same candidate table and choice functions): one global engine setting "
        f"costs {span(ok)} the per-layer bytes where both exist ({len(ok)} budgets); the held-out column counts the "
        "per-layer picks whose held-out error exceeds the budget"
    )
    return "Budget sweep (calibration errors decide; held-out errors check):\n\n" + md, claim


def page(data: pathlib.Path, out: pathlib.Path) -> dict:
    folder = out / STUDY
    folder.mkdir(parents=True, exist_ok=True)
    s1 = data / "conv_vs_replay" / "data"
    heads, decays, seqs = load(s1, "heads"), load(s1, "decays"), load(s1, "sequences")
    runs = load_runs(s1)
    units = head_units(heads[heads.variant.isin([f"{f}@{s}" for f in QUANT for s in ("conventional", "replay16")])], decays) if len(heads) else {}
    corr, cmd = correlation_table(units, folder) if units else (pd.DataFrame(), "(no data)")
    png = plot_heads(units, runs, folder)
    claims = []
    for model, t in corr.groupby("model", sort=False) if len(corr) else []:
        pos = int(((t["within-layer rho(half-life, err)"] > 0) & (t["permutation p"] < 0.05)).sum())
        neg = int(((t["within-layer rho(half-life, err)"] < 0) & (t["permutation p"] < 0.05)).sum())
        claims.append(
            f"**{model}** ({t['heads'].iloc[0]} heads): within-layer rho {span(t['within-layer rho(half-life, err)'], '')} "
            f"over {len(t)} variants; significantly positive (permutation p < 0.05) in {pos}, negative in {neg}; "
            f"under replay16 the longest-memory head's error is "
            f"{span(t[t.variant.str.endswith('replay16')]['longest-memory head / median head'])} the median head's"
        )
    spread_md, spread_claims = layer_spread(seqs, folder) if len(seqs) else ("(no data)", [])
    s3 = data / "granularity_calibration" / "data"
    cs, meta = read_data(s3, "calib_sequences"), read_data(s3, "calib_settings")
    cal_runs = load_runs(s3)
    rec_md, rec_claims, n_fail, n_layers = "(no calibration data)", [], 0, 0
    if cs is not None and meta is not None and "calibration" in cal_runs:
        rec_md, rec_claims, n_fail, n_layers = recipe_section(cs, meta, cal_runs["calibration"], folder)
    n_pos = int(((corr["within-layer rho(half-life, err)"] > 0) & (corr["permutation p"] < 0.05)).sum()) if len(corr) else 0
    n_neg = int(((corr["within-layer rho(half-life, err)"] < 0) & (corr["permutation p"] < 0.05)).sum()) if len(corr) else 0
    answer = (
        f"within layers, long-memory heads have the larger error in {n_pos} of {len(corr)} (model, RNE variant) cases "
        f"and the smaller in {n_neg} (Spearman, permutation p < 0.05); {n_fail} of {n_layers} per-layer recipe "
        f"decisions at budget {BUDGET} exceed it on held-out text"
    )
    scales = {r.get("scale") for r in runs.values()} | {r.get("scale") for r in cal_runs.values()}
    text = [
        "# Study 4: which layers and heads are fragile",
        "",
        scale_note(
            scales,
            NONE_USED + "; the per-head errors of the earlier page were taken at step 32768, a flush step where "
            "short-memory heads sit at their cycle minimum, so its head ratios were inflated",
        ),
        "",
        "**Question.** Is the error concentrated in the long-memory heads (decay a_t close to 1)? Which layers are "
        "the fragile ones, and what does a per-layer recipe save over one global setting, and does it hold on "
        "held-out text?",
        "",
        "## Data and method",
        "",
        *[run_line(r) for k, r in runs.items() if not k.startswith("e2e-")],
        "",
        "Per-head output error over the horizon window (the last 10% of steps, whole flush cycles: every phase of "
        "the replay cycle), from study 1's runs, joined with the head's decay statistics over the same inputs: "
        "half-life ln 2 / -mean(ln a_t) in tokens (Mamba-2 a_t = exp(dt A), GDN exp(g)). A head instance is (seed, "
        "layer, head): a synthetic seed is another draw of the layer's parameters. The statistic is the **mean "
        "within-layer Spearman correlation** of half-life and error; its p-value is a permutation test that "
        "relabels the errors among the heads of each layer (so differences between layers neither create nor hide "
        "an association), and its interval a bootstrap over the sequences (within seeds). " + method_note(),
        "",
        "## Long-memory heads vs error (RNE)",
        "",
        cmd,
        "",
        f"![error vs half-life]({png})" if png else "",
        "",
        *[f"- {c}" for c in claims],
        "",
        "## Which layers (RNE, 8- and 4-bit formats; output error over all steps)",
        "",
        spread_md,
        "",
        *[f"- {c}" for c in spread_claims],
        "",
        "## Per-layer recipe vs one global setting (tiny-nemotron)",
        "",
        rec_md,
        "",
        *[f"- {c}" for c in rec_claims],
        "",
        "## Synthetic vs real",
        "",
        "The presets' decays are the families' initialisation (`init` profile): a wide, regular spread of "
        f"half-lives that training reshapes. The tiny models' decays are trained, but their heads are few "
        f"({heads_text()}). In a real checkpoint, outlier channels and low-rank keys can matter as much as the decay "
        "(see the synthetic-profile study).",
        "",
        "## Reproduce",
        "",
        reproduce("conv_vs_replay") + "\n\n" + reproduce("granularity_calibration"),
        "",
    ]
    (folder / "README.md").write_text("\n".join(text))
    return {"folder": STUDY, "title": "Fragile layers and heads", "answer": answer}
