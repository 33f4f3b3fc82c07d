"""Build the study pages (studies/<study>/README.md, tables as markdown + CSV, plots) from the raw study data.

    python studies/make_pages.py                        # reads studies/data/, writes studies/<study>/
    python studies/make_pages.py --data DIR --out DIR   # e.g. the CPU-sized variant of studies/cpu_run.sh

The raw data are `ssmquant analyze` / `eval` / `calibrate` output directories written by
`bash studies/gpu_run.sh` (GPU parts) and `bash studies/cpu_run.sh` (CPU parts). Every number in a page is
computed here from those files; the prose states only what the tables show, with its numbers filled in
from the same data.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ssmquant.calibrate.choose import choose_global, choose_layer, uniform_table  # noqa: E402
from ssmquant.calibrate.recipe import load_recipe  # noqa: E402
from ssmquant.calibrate.settings import Setting  # noqa: E402
from ssmquant.evaluate import load_eval  # noqa: E402
from ssmquant.export.engines import takeable_by_any  # noqa: E402
from ssmquant.formats import parse as parse_format  # noqa: E402
from ssmquant.models.presets import get_preset  # noqa: E402
from ssmquant.replay import parse_scheme  # noqa: E402
from ssmquant.replay.variants import parse_variant  # noqa: E402
from ssmquant.report.files import load_analysis  # noqa: E402

HORIZON_FRACTION = 0.1  # "error at the horizon": mean over the recorded steps in the last 10% of the horizon
BOUNDED_B, DRIFT_B = 0.1, 0.3  # growth-exponent thresholds of the verdicts (err ~ a t^b)
ENC_ORDER = ["fp8_e4m3", "int8", "nvfp4", "bf16", "fp16"]
_CB = sns.color_palette("colorblind", 10)
PALETTE = {"fp8_e4m3": _CB[0], "int8": _CB[1], "nvfp4": _CB[2], "bf16": _CB[4], "fp16": _CB[7], "fp32": _CB[9]}
Y_CLIP = 10.0  # drift plots: errors above this (10x the signal) are cut off and annotated
GPU_CMD = "bash studies/gpu_run.sh            # one H200, about 8 minutes: writes studies/data/ (GPU parts)"
CPU_CMD = "bash studies/cpu_run.sh            # 2 CPU cores, about 13 minutes: the CPU parts"
PAGES_CMD = "python studies/make_pages.py       # this page, its tables (.md + .csv) and plots, and the others"
SMALL_CMD = (
    "SCALE=small DATA=/tmp/ssmquant_small bash studies/cpu_run.sh all   # every study at CPU size, no GPU\n"
    "python studies/make_pages.py --data /tmp/ssmquant_small --out /tmp/ssmquant_small/pages"
)


# -- small helpers ------------------------------------------------------------------------------------------
def num(x, digits: int = 3) -> str:
    """A number for a markdown table: 3 significant digits, 'inf' / 'n/a' for non-finite."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return f"{int(x):,}"
    x = float(x)
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < 1e7:
        return f"{int(x):,}"
    if abs(x) >= 1e7:
        return f"{x:.{digits - 1}e}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) < 1e-4:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def times(x) -> str:
    return "n/a" if not np.isfinite(x) else f"{x:.3g}x" if x < 10 else f"{x:.0f}x"


def span(values, unit: str = "x") -> str:
    """'a-b' (or 'a' when equal; 'a to b' when a < 0) of the finite values, with a unit suffix."""
    v = [float(x) for x in values if np.isfinite(x)]
    if not v:
        return "n/a"
    lo, hi = min(v), max(v)

    def f(z):
        return f"{z:.3g}" if abs(z) < 10 else f"{z:.0f}"

    if f(lo) == f(hi):
        return f"{f(lo)}{unit}"
    return f"{f(lo)} to {f(hi)}{unit}" if lo < 0 else f"{f(lo)}-{f(hi)}{unit}"


def markdown(df: pd.DataFrame) -> str:
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(v if isinstance(v, str) else num(v) for v in row.tolist()) + " |")
    return "\n".join(lines)


def save_table(df: pd.DataFrame, folder: pathlib.Path, stem: str, shown: pd.DataFrame | None = None) -> str:
    """Write the table as CSV (full precision) and markdown (rounded); return the markdown."""
    df.to_csv(folder / f"{stem}.csv", index=False)
    text = markdown(df if shown is None else shown)
    (folder / f"{stem}.md").write_text(text + "\n")
    return text


def env_text(report: dict) -> str:
    e = report.get("environment", {})
    dev = e.get("gpu") or ("CPU" if e.get("device") == "cpu" else e.get("device", "?"))
    parts = [dev, f"torch {e.get('torch')}"]
    if e.get("triton"):
        parts.append(f"triton {e['triton']}")
    parts.append(f"transformers {e.get('transformers')}")
    if e.get("backend"):
        parts.append(f"backend {e['backend']}")
    return ", ".join(parts)


def source_text(report: dict) -> str:
    src = report.get("data_source", {})
    if src.get("kind") == "synthetic":
        return "synthetic inputs (preset shapes, the family's initialisation distributions, no weights)"
    text = src.get("text", {})
    return f"shipped trained model, real text ({text.get('origin')}, {text.get('split')} split)"


def settings_text(report: dict) -> str:
    s = report["settings"]
    layers = report["data_source"].get("layers")
    return f"layers {layers}, batch {s['batch']}, {s['steps']} steps, seed {s['seed']}"


def analyze_cmd(report: dict, out: str) -> str:
    """The `ssmquant analyze` command that produced a run (rebuilt from its report.json)."""
    s = report["settings"]
    parts = ["ssmquant analyze", f"--model {s['model']}"]
    if s.get("synthetic"):
        parts.append("--synthetic")
    if s.get("layers"):
        parts.append("--layers " + ",".join(str(x) for x in s["layers"]))
    parts += [
        "--formats " + ",".join(s["formats"]),
        "--rounding " + ",".join(s["rounding"]),
        "--schemes '" + ",".join(s["schemes"]) + "'",
        f"--steps {s['steps']} --batch {s['batch']} --seed {s['seed']}",
        f"--device {report['environment'].get('device')}",
        f"--out {out}",
    ]
    return " ".join(parts)


def split_variants(df: pd.DataFrame) -> pd.DataFrame:
    """Add encoding / granularity / rounding / scheme / fmt columns parsed from 'variant'."""
    rows = {}
    for v in df["variant"].unique():
        var = parse_variant(v)
        f, s = var.format, var.scheme
        rows[v] = {
            "encoding": f.encoding.value,
            "granularity": f.granularity.name,
            "rounding": f.rounding.value,
            "scheme": s.name,
            "fmt": f.name,
        }
    extra = pd.DataFrame([rows[v] for v in df["variant"]], index=df.index)
    return pd.concat([df.drop(columns=[c for c in extra.columns if c in df.columns]), extra], axis=1)


def horizon_errors(traces: pd.DataFrame, frac: float = HORIZON_FRACTION) -> pd.DataFrame:
    """Per (layer, variant): mean output / state error over the recorded steps in the last `frac` of the horizon."""
    t_max = traces["step"].max()
    w = traces[traces["step"] > (1 - frac) * t_max]
    out = w.groupby(["layer", "variant"], sort=False)[["out_rel_err", "state_rel_err"]].mean().reset_index()
    return split_variants(out)


def over_layers(he: pd.DataFrame, keys: list[str], col: str = "out_rel_err") -> pd.DataFrame:
    """Median and max over layers of a per-layer error."""
    g = he.groupby(keys, sort=False)[col]
    return g.agg(median="median", max="max").reset_index()


def log_bins(df: pd.DataFrame, keys: list[str], col: str, bins: int = 48) -> pd.DataFrame:
    """Median over layers per step, then the mean within log-spaced step bins (for readable drift lines)."""
    med = df.groupby(keys + ["step"], sort=False)[col].median().reset_index()
    edges = np.unique(np.geomspace(med["step"].min(), med["step"].max() + 1, bins).astype(int))
    med["bin"] = np.digitize(med["step"], edges)
    finite = med[col].where(np.isfinite(med[col]))
    med = med.assign(**{col: finite})
    out = med.groupby(keys + ["bin"], sort=False).agg(step=("step", "mean"), err=(col, "mean")).reset_index()
    return out.drop(columns="bin")


def pareto(points: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """The points not dominated in (x lower, y lower), sorted by x."""
    p = points[np.isfinite(points[y])].sort_values([x, y])
    keep, best = [], math.inf
    for i, r in p.iterrows():
        if r[y] < best:
            keep.append(i)
            best = r[y]
    return p.loc[keep]


def save_fig(fig, folder: pathlib.Path, name: str) -> str:
    fig.savefig(folder / name, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return name


def load_run(data: pathlib.Path, rel: str):
    d = data / rel
    if not (d / "report.json").is_file():
        return None
    traces, heads, summary, report = load_analysis(d)
    return {"traces": traces, "heads": heads, "summary": summary, "report": report, "rel": rel}


def layer_dims(model: str) -> dict:
    """heads H, rows d, state_dim n, groups G (Mamba-2 B/C groups; GDN / KDA key heads) of a preset or shipped model."""
    cfg_path = ROOT / "ssmquant" / "assets" / model / "config.json"
    if cfg_path.is_file():
        c = json.loads(cfg_path.read_text())
        if "mamba_num_heads" in c:
            return {
                "kind": "mamba2",
                "H": c["mamba_num_heads"],
                "d": c["mamba_head_dim"],
                "n": c["ssm_state_size"],
                "G": c["n_groups"],
            }
        if "linear_num_heads" in c:  # KDA (kimi_linear): one head count, key dim = value dim
            h, d = c["linear_num_heads"], c["linear_head_dim"]
            return {"kind": "kda", "H": h, "d": d, "n": d, "G": h}
        return {
            "kind": "gdn",
            "H": c["linear_num_value_heads"],
            "d": c["linear_value_head_dim"],
            "n": c["linear_key_head_dim"],
            "G": c["linear_num_key_heads"],
        }
    sh = get_preset(model).shape
    if hasattr(sh, "state_size"):
        return {"kind": "mamba2", "H": sh.num_heads, "d": sh.head_dim, "n": sh.state_size, "G": sh.n_groups}
    if sh.kind == "kda":
        return {"kind": "kda", "H": sh.num_heads, "d": sh.head_dim, "n": sh.head_dim, "G": sh.num_heads}
    return {"kind": "gdn", "H": sh.num_value_heads, "d": sh.value_head_dim, "n": sh.key_head_dim, "G": sh.num_key_heads}


def commands_block(lines: list[str]) -> str:
    return "```bash\n" + "\n".join(lines) + "\n```"


def common_commands(specific: list[str]) -> str:
    return (
        "Everything on this page (raw data, then the page):\n\n"
        + commands_block([GPU_CMD, CPU_CMD, PAGES_CMD])
        + "\n\nThe commands behind this page's data (each rebuilt from its run's `report.json`):\n\n"
        + commands_block(specific)
        + "\n\nSmaller CPU variant of every study (fewer steps, one layer per preset; the page then states "
        "those settings):\n\n" + commands_block([SMALL_CMD])
    )


# -- study 1: conventional vs replay ------------------------------------------------------------------------
SATURATED = 0.5  # a window error this large (worst layer) is reported as saturated, whatever its growth


def verdict(b_max: float, finite: bool, err_max: float = 0.0) -> str:
    if not finite:
        return "diverges"
    if not np.isfinite(b_max):
        return "n/a"
    if err_max >= SATURATED:
        return "saturated"
    return "bounded" if b_max < BOUNDED_B else "slow growth" if b_max < DRIFT_B else "drifts"


def study_conv_vs_replay(data: pathlib.Path, out: pathlib.Path) -> dict:
    folder = out / "conv_vs_replay"
    folder.mkdir(parents=True, exist_ok=True)
    runs = {
        "nemotron-3-nano": "conv_vs_replay/nemotron-3-nano",
        "qwen3.5-9b": "conv_vs_replay/qwen3.5-9b",
        "tiny-nemotron": "conv_vs_replay/tiny-nemotron",
        "tiny-qwen": "conv_vs_replay/tiny-qwen-cpu",
    }
    loaded = {m: load_run(data, rel) for m, rel in runs.items()}
    loaded = {m: r for m, r in loaded.items() if r is not None}
    tables, plots, per_model, cmds, data_lines, noise = [], [], [], [], [], []
    for model, run in loaded.items():
        rep, summ = run["report"], run["summary"]
        he = horizon_errors(run["traces"])
        one = summ.set_index(["layer", "variant"])["out_rel_err"] / he.set_index(["layer", "variant"])["out_rel_err"]
        noise.append(one[np.isfinite(one)])
        summ = split_variants(summ)
        fits = summ.groupby("variant", sort=False).agg(
            b_med=("growth_b_out", "median"), b_max=("growth_b_out", "max"), r2=("fit_r2_out", "median")
        )
        agg = over_layers(he, ["variant", "encoding", "rounding", "scheme"]).set_index("variant").join(fits)
        agg["finite"] = he.groupby("variant", sort=False)["out_rel_err"].apply(lambda s: bool(np.isfinite(s).all()))
        agg["verdict"] = [verdict(b, f, e) for b, f, e in zip(agg["b_max"], agg["finite"], agg["max"])]
        agg = agg.reset_index()
        agg.insert(0, "model", model)
        per_model.append(agg)
        # the per-model table: one row per encoding x rounding, conventional next to replay16
        rows = []
        for enc in [e for e in ENC_ORDER if e in set(agg["encoding"])]:
            for rnd in ["rne", "sr"]:
                c = agg[(agg.encoding == enc) & (agg.rounding == rnd) & (agg.scheme == "conventional")]
                r = agg[(agg.encoding == enc) & (agg.rounding == rnd) & (agg.scheme != "conventional")]
                if c.empty or r.empty:
                    continue
                c, r = c.iloc[0], r.iloc[0]
                rows.append(
                    {
                        "format": enc,
                        "rounding": rnd,
                        "conventional err (median layer)": c["median"],
                        "conventional err (worst layer)": c["max"],
                        f"{r['scheme']} err (median layer)": r["median"],
                        f"{r['scheme']} err (worst layer)": r["max"],
                        "conventional / replay": c["median"] / r["median"] if np.isfinite(c["median"]) else math.inf,
                        "b conventional (worst layer)": c["b_max"],
                        "b replay (worst layer)": r["b_max"],
                        "verdict conventional": c["verdict"],
                        "verdict replay": r["verdict"],
                    }
                )
        tab = pd.DataFrame(rows)
        stem = f"table_{model}"
        tables.append((model, rep, save_table(tab, folder, stem)))
        # variants whose median-layer error exceeds 1 (the error is larger than the output): first such step,
        # and the first step with a non-finite error on any layer
        tr = run["traces"]
        med = tr.groupby(["variant", "step"])["out_rel_err"].median().reset_index()
        big = med[~(med["out_rel_err"] <= 1)].groupby("variant")["step"].min()
        nonfin = tr[~np.isfinite(tr["out_rel_err"])].groupby("variant")["step"].min()
        first_bad = {v: (int(a), int(nonfin[v]) if v in nonfin.index else None) for v, a in big.items()}
        plots.append((model, plot_drift(run, model, folder, first_bad)))
        cmds.append(analyze_cmd(rep, f"studies/data/{run['rel']}"))
        data_lines.append(
            f"- **{model}**: {source_text(rep)}; {settings_text(rep)}; {env_text(rep)}; `studies/data/{run['rel']}`"
        )
    allm = pd.concat(per_model, ignore_index=True) if per_model else pd.DataFrame()
    allm.to_csv(folder / "all_variants.csv", index=False)
    noise = pd.concat(noise) if noise else pd.Series(dtype=float)
    noise_txt = (
        f"the last step alone lies between {noise.quantile(0.1):.2f}x and {noise.quantile(0.9):.2f}x that mean "
        f"for 80% of the (layer, variant) pairs here"
        if len(noise)
        else "n/a"
    )
    r2_txt = span(allm.groupby("model")["r2"].median(), "") if len(allm) else "n/a"
    bufdtype_md, bufdtype_claims, bufdtype_cmd = buffer_dtype_section(data, folder)
    if bufdtype_cmd:
        cmds.append(bufdtype_cmd)

    # end to end (CPU)
    e2e_md, e2e_claims, e2e_plot, e2e_cmds = e2e_section(data, folder)
    cmds += e2e_cmds

    # claims, from the tables
    claims = []
    for enc in [e for e in ENC_ORDER if e in set(allm.get("encoding", []))]:
        for rnd in ["rne", "sr"]:
            ratios = {}
            for model in loaded:
                a = allm[(allm.model == model) & (allm.encoding == enc) & (allm.rounding == rnd)]
                c = a[a.scheme == "conventional"]["median"]
                r = a[a.scheme != "conventional"]["median"]
                if len(c) and len(r):
                    ratios[model] = float(c.iloc[0] / r.iloc[0]) if np.isfinite(c.iloc[0]) else math.inf
            if not ratios:
                continue
            finite = {m: v for m, v in ratios.items() if np.isfinite(v)}
            worse = [m for m, v in ratios.items() if v < 1]
            inf_models = [m for m, v in ratios.items() if not np.isfinite(v)]
            txt = f"**{enc} ({rnd.upper()})**: conventional / replay16 error ratio {span(finite.values())} over {', '.join(finite)}"
            if inf_models:
                txt += f"; conventional diverges on {', '.join(inf_models)}"
            if worse:
                txt += f"; below 1 (replay16 worse) on {', '.join(worse)}"
            claims.append(txt)
    verd = allm.groupby("verdict").size().to_dict() if len(allm) else {}
    non_bounded = allm[allm.verdict != "bounded"] if len(allm) else allm
    nb_lines = [f"{r.model} {r.variant} ({r.verdict}, b = {num(r.b_max)})" for r in non_bounded.itertuples()]
    # SR vs RNE
    sr_lines = []
    for sch in ["conventional", "replay16"]:
        for enc in ["fp8_e4m3", "int8", "nvfp4", "bf16", "fp16"]:
            a = allm[(allm.encoding == enc) & (allm.scheme == sch)]
            if a.empty:
                continue
            p = a.pivot_table(index="model", columns="rounding", values="median")
            if not {"rne", "sr"} <= set(p.columns):
                continue
            ok = np.isfinite(p["sr"]) & np.isfinite(p["rne"])
            ratio = (p["sr"] / p["rne"])[ok]
            lower = int((ratio < 1).sum())
            sr_lines.append(f"{enc} {sch}: SR/RNE {span(ratio.values)} (SR lower on {lower} of {len(ratio)} models)")
    headline = ""
    fp8 = allm[(allm.encoding == "fp8_e4m3") & (allm.rounding == "rne")] if len(allm) else allm
    if len(fp8):
        p = fp8.pivot_table(index="model", columns="scheme", values="median")
        if "conventional" in p and "replay16" in p:
            headline = f"replay16 lowers the fp8 (RNE) horizon output error {span((p['conventional'] / p['replay16']).values)} vs conventional"
    n_div = verd.get("diverges", 0)
    answer = (
        f"{headline}; of {len(allm)} (model, variant) pairs {verd.get('bounded', 0)} stay bounded "
        f"(growth exponent b < {BOUNDED_B} on every layer), {verd.get('slow growth', 0)} grow slowly, "
        f"{verd.get('drifts', 0)} drift, {verd.get('saturated', 0)} saturate (error >= {SATURATED}), {n_div} diverge"
    )
    if n_div:
        answer += (
            " (" + "; ".join(f"{r.model} {r.variant}" for r in allm[allm.verdict == "diverges"].itertuples()) + ")"
        )

    horizon_note = ", ".join(
        f"{m}: {r['report']['settings']['steps']} steps x {r['report']['settings']['batch']}" for m, r in loaded.items()
    )
    page = [
        "# Study 1: conventional vs replay decoding, per format",
        "",
        "**Question.** Stored in FP8 / INT8 / NVFP4 (BF16 and FP16 as references), with round-to-nearest-even "
        "or stochastic rounding, does the error of an SSM layer's state and output stay bounded over a long "
        "decode, or drift, under conventional decoding (state rounded every token) and under "
        "checkpoint-plus-replay with a 16-token buffer (rounded once per 16 tokens)? And what does it do "
        "to the model's predictions end to end?",
        "",
        "## Data",
        "",
        *data_lines,
        "",
        "tiny-qwen's GPU run of `studies/gpu_run.sh` did not finish within its time limit; this page uses the "
        "CPU run of `studies/cpu_run.sh` instead, at a shorter horizon (see the settings above). Horizons: "
        + horizon_note
        + ".",
        "",
        "## Method",
        "",
        "`ssmquant analyze` emulates each layer over the decode horizon, with FP32 inputs from the other "
        "layers (it isolates each layer's own accumulated error), against the FP32 decode of the same inputs. "
        "Error = relative Frobenius error of the layer output (`out_rel_err`) pooled over sequences and heads. "
        f"**Error at the horizon** on this page = the mean of the recorded per-step errors in the last "
        f"{HORIZON_FRACTION:.0%} of the horizon, per layer (a single step is noisy: {noise_txt}); "
        "tables give the median and the worst layer. The growth exponent b is `analyze`'s fit of "
        "err(t) ~ a t^b past the first write (`summary.csv`: `growth_b_out`); b ~ 0.5 is a random walk of "
        "independent rounding errors, b ~ 0 a bounded error. Verdict per (model, variant), on the worst layer: "
        f"**bounded** b < {BOUNDED_B} (less than 2x growth over 1000x more steps), **slow growth** "
        f"{BOUNDED_B} <= b < {DRIFT_B}, **drifts** b >= {DRIFT_B}, **diverges** when the error becomes "
        f"non-finite. The fits' r^2 is low (median per model {r2_txt}; `all_variants.csv`, column `r2`): the "
        "error is mostly step-to-step noise around a nearly flat level, which is also what a small b says.",
        "",
        "## Results per model",
        "",
    ]
    for (model, rep, md), (_, png) in zip(tables, plots):
        page += [f"### {model}", "", f"{source_text(rep)}; {settings_text(rep)}.", "", md, "", f"![{model}]({png})", ""]
    page += [
        "Every variant of every model, with the fit's r^2 and the state error: [`all_variants.csv`](all_variants.csv).",
        "",
        "## What the tables show",
        "",
        *[f"- {c}" for c in claims],
        f"- Verdicts over all {len(allm)} (model, variant) pairs: "
        + ", ".join(f"{k} {v}" for k, v in sorted(verd.items())),
        "- Not bounded: " + ("; ".join(nb_lines) if nb_lines else "none"),
        "- Stochastic vs round-to-nearest (median-layer error, per model): " + "; ".join(sr_lines),
        "",
        "## Why replay16 loses to conventional for an fp16 GDN state (CPU, tiny-qwen)",
        "",
        bufdtype_md,
        "",
        *[f"- {c}" for c in bufdtype_claims],
        "",
        "## End to end (tiny models, CPU)",
        "",
        e2e_md,
        "",
        *[f"- {c}" for c in e2e_claims],
        "",
        f"![end-to-end KL]({e2e_plot})" if e2e_plot else "",
        "",
        "## Synthetic vs real",
        "",
        "nemotron-3-nano and qwen3.5-9b are **synthetic**: the presets' exact layer shapes with inputs drawn "
        "from the model family's initialisation distributions (decays, dt, B/C/k/q statistics at init), not "
        "trained weights and not text. Trained checkpoints have trained decays (more long-memory heads, or "
        "fewer), structured, correlated inputs and outlier channels: the state's dynamic range per row, and so "
        "the 8-bit and 4-bit rounding error, can be larger or smaller, and errors that are independent noise "
        "here can correlate over time there (which raises b). The tiny models are real trained weights on "
        f"real text, but tiny ({tiny_heads_text()}) and trained for minutes (`studies/tiny_models/`): "
        "their decays and state statistics are not those of a 30B model. The end-to-end numbers do not "
        "emulate the bf16 rounding of replay's buffered inputs (the per-layer analysis does).",
        "",
        "## Reproduce",
        "",
        common_commands(cmds),
        "",
    ]
    (folder / "README.md").write_text("\n".join(page))
    return {"folder": "conv_vs_replay", "title": "Conventional vs replay, per format", "answer": answer}


def buffer_dtype_section(data: pathlib.Path, folder: pathlib.Path):
    """replay16 with the default bf16 input buffer vs an FP32 buffer (tiny-qwen, CPU)."""
    run = load_run(data, "conv_vs_replay/tiny-qwen-cpu-bufdtype")
    if run is None:
        return "(no data: run `bash studies/cpu_run.sh`)", [], None
    rep = run["report"]
    he = horizon_errors(run["traces"])
    agg = over_layers(he, ["encoding", "scheme"])
    main = load_run(data, "conv_vs_replay/tiny-qwen-cpu")
    rows = []
    for enc in [e for e in ENC_ORDER if e in set(agg.encoding)]:
        t = agg[agg.encoding == enc].set_index("scheme")
        row = {"format": enc}
        if main is not None:
            hm = horizon_errors(main["traces"])
            c = hm[(hm.encoding == enc) & (hm.rounding == "rne") & (hm.scheme == "conventional")]["out_rel_err"]
            row["conventional (study run)"] = float(c.median()) if len(c) else float("nan")
        for sch in ["replay16", "replay16:fp32"]:
            row[f"{sch} ({'bf16' if sch == 'replay16' else 'fp32'} buffer)"] = (
                t.loc[sch, "median"] if sch in t.index else float("nan")
            )
        rows.append(row)
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "buffer_dtype_tiny-qwen")
    claims = []
    bf, f32 = "replay16 (bf16 buffer)", "replay16:fp32 (fp32 buffer)"
    for r in tab.itertuples(index=False):
        d = dict(zip(tab.columns, r))
        r_buf = d[bf] / d[f32]
        txt = (
            f"{d['format']}: an FP32 buffer {'lowers' if r_buf >= 1 else 'raises'} the replay16 error "
            f"{times(r_buf if r_buf >= 1 else 1 / r_buf)} ({num(d[bf])} -> {num(d[f32])})"
        )
        conv = d.get("conventional (study run)", float("nan"))
        if np.isfinite(conv):
            txt += (
                f"; conventional / replay16 is {times(conv / d[bf])} with the bf16 buffer and "
                f"{times(conv / d[f32])} with the FP32 buffer"
            )
        claims.append(txt)
    claims.append(
        "So on tiny-qwen the bf16 rounding of the buffered inputs, not the checkpoint, sets the replay16 error "
        "of the float states wherever an FP32 buffer lowers it several-fold; qwen3.5-9b's fp16 case was not "
        "re-run with an FP32 buffer (GPU budget)."
    )
    intro = (
        f"tiny-qwen, {source_text(rep)}; {settings_text(rep)}; {env_text(rep)}. Median-layer output error at "
        "the horizon of replay16 with the engines' default bf16 buffer of inputs (GDN: u_t and k_t) and with "
        "an FP32 buffer (`replay16:fp32`), next to conventional decoding from the run above (same inputs)."
    )
    return intro + "\n\n" + md, claims, analyze_cmd(rep, f"studies/data/{run['rel']}")


def plot_drift(run, model: str, folder: pathlib.Path, first_bad: dict) -> str:
    rep = run["report"]
    tr = split_variants(run["traces"])
    tr["scheme"] = tr["scheme"].where(tr["scheme"] == "conventional", tr["scheme"])
    binned = log_bins(tr, ["variant", "encoding", "rounding", "scheme"], "out_rel_err")
    rounds = [r for r in ["rne", "sr"] if r in set(binned["rounding"])]
    fig, axes = plt.subplots(
        1, len(rounds), figsize=(6.2 * len(rounds), 4.8), sharey=True, squeeze=False, layout="constrained"
    )
    hue_order = [e for e in ENC_ORDER if e in set(binned["encoding"])]
    style_order = sorted(set(binned["scheme"]), key=lambda s: (s != "conventional", s))
    for ax, rnd in zip(axes[0], rounds):
        d = binned[binned["rounding"] == rnd]
        sns.lineplot(
            data=d,
            x="step",
            y="err",
            hue="encoding",
            style="scheme",
            hue_order=hue_order,
            style_order=style_order,
            palette=PALETTE,
            estimator=None,
            errorbar=None,
            ax=ax,
            legend=(ax is axes[0][-1]),
        )
        ax.set(xscale="log", yscale="log", xlabel="decode step", ylabel="output relative error (median over layers)")
        lo = np.nanmin(binned["err"].where(binned["err"] > 0))
        ax.set_ylim(lo / 2, min(Y_CLIP, np.nanmax(binned["err"]) * 2))
        ax.set_title(f"{'round to nearest even' if rnd == 'rne' else 'stochastic rounding'}")
        notes = [
            f"{v}: error > 1 from step {a}" + (f", non-finite from step {b}" if b else "") + " (cut off)"
            for v, (a, b) in first_bad.items()
            if parse_variant(v).format.rounding.value == rnd
        ]
        if notes:
            ax.text(0.02, 0.98, "\n".join(notes), transform=ax.transAxes, va="top", fontsize=8, color="crimson")
    if len(rounds):
        axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.suptitle(
        f"{model}: output error vs decode step ({source_text(rep).split(' (')[0]})\n"
        f"{settings_text(rep)}; log-spaced bin means; {env_text(rep)}",
        fontsize=9.5,
    )
    return save_fig(fig, folder, f"drift_{model}.png")


def e2e_section(data: pathlib.Path, folder: pathlib.Path):
    rows, claims, cmds, pos_frames, reps = [], [], [], [], {}
    for model in ["tiny-nemotron", "tiny-qwen"]:
        d = data / "e2e" / model
        if not (d / "eval.json").is_file():
            continue
        positions, summ, rep = load_eval(d)
        reps[model] = rep
        s = rep["settings"]
        cmds.append(
            f"ssmquant eval --model {model} --variants {','.join(s['variants'])} --steps {s['steps']} "
            f"--batch {s['batch']} --seed {s['seed']} --device {s['device']} --out studies/data/e2e/{model}"
        )
        for r in summ.itertuples():
            rows.append(
                {
                    "model": model,
                    "variant": r.variant,
                    "writes per sequence": r.writes_per_seq,
                    "KL at horizon (nats)": r.kl_horizon,
                    "top-1 agreement at horizon": r.top1_agree_horizon,
                    "delta bits/byte at horizon": r.delta_loss_horizon,
                    "KL mean, all positions": r.kl_mean,
                }
            )
        pos_frames.append(positions.assign(model=model))
    if not rows:
        return "(no end-to-end data: run `bash studies/cpu_run.sh`)", [], None, []
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "e2e")
    first = next(iter(reps.values()))
    s = first["settings"]
    ref = {m: r["reference"] for m, r in reps.items()}
    intro = (
        f"`ssmquant eval`: every SSM layer of the model stores its state in the format under the scheme; "
        f"teacher-forced decoding of {s['batch']} held-out sequences x {s['steps']} tokens of the shipped corpus "
        f"(held-out split), CPU, FP32 weights; against the same model with FP32 state. KL(p_fp32 || p_variant) "
        f"of the next-token distribution, top-1 agreement with the FP32-state model, and the change of the "
        f"loss in bits per byte; **at horizon** = mean over the last {rep_window(first)} positions "
        f"({s.get('horizon_fraction', 0.1):.0%}) and both sequences, so top-1 agreement moves in steps of "
        f"{1 / (rep_window(first) * s['batch']):.2%}. FP32-state loss at the horizon: "
        + ", ".join(f"{m} {ref[m]['loss_horizon']:.3f} {ref[m]['loss_unit']}" for m in ref)
        + f". {env_text(first)}."
    )
    for enc in ["fp8_e4m3", "int8", "nvfp4", "bf16"]:
        r = []
        for model in reps:
            t = tab[tab.model == model].set_index("variant")
            c, p = f"{enc}@conventional", f"{enc}@replay16"
            if c in t.index and p in t.index and t.loc[p, "KL at horizon (nats)"] > 0:
                r.append(t.loc[c, "KL at horizon (nats)"] / t.loc[p, "KL at horizon (nats)"])
        if r:
            claims.append(
                f"{enc}: replay16 lowers the KL at the horizon {span(r)} vs conventional (over {', '.join(reps)})"
            )
    worst = tab.sort_values("KL at horizon (nats)").iloc[-1]
    claims.append(
        f"Largest KL at the horizon: {worst['model']} {worst['variant']}, {num(worst['KL at horizon (nats)'])} nats, "
        f"top-1 agreement {worst['top-1 agreement at horizon']:.1%}, delta {num(worst['delta bits/byte at horizon'])} bits/byte."
    )
    eight = tab[tab.variant.str.match(r"^(fp8_e4m3|int8)@")]
    claims.append(
        f"8-bit formats (fp8_e4m3, int8; both schemes): KL at the horizon {num(eight['KL at horizon (nats)'].min())} to "
        f"{num(eight['KL at horizon (nats)'].max())} nats, top-1 agreement >= {eight['top-1 agreement at horizon'].min():.1%}, "
        f"|delta| <= {num(eight['delta bits/byte at horizon'].abs().max())} bits/byte."
    )
    # plot: KL vs position
    pos = pd.concat(pos_frames, ignore_index=True)
    pos = split_variants(pos)
    fig, axes = plt.subplots(
        1, len(reps), figsize=(6.2 * len(reps), 4.6), sharey=True, squeeze=False, layout="constrained"
    )
    win = max(1, s["steps"] // 32)
    for ax, model in zip(axes[0], reps):
        p = pos[pos.model == model].sort_values("position").copy()
        p["kl_smooth"] = p.groupby("variant")["kl"].transform(lambda x: x.rolling(win, min_periods=1).mean())
        p["kl_smooth"] = p["kl_smooth"].where(p["kl_smooth"] > 0)  # replay: exactly 0 before the first flush
        sns.lineplot(
            data=p,
            x="position",
            y="kl_smooth",
            hue="encoding",
            style="scheme",
            palette=PALETTE,
            hue_order=[e for e in ENC_ORDER if e in set(p.encoding)],
            style_order=["conventional", "replay16"],
            estimator=None,
            errorbar=None,
            ax=ax,
            legend=(ax is axes[0][-1]),
        )
        ax.set(
            yscale="log", xlabel="position (decoded token)", ylabel=f"KL(fp32 || variant), nats, rolling mean of {win}"
        )
        ax.text(
            0.99,
            0.02,
            "replay: KL = 0 until the first flush (not drawn)",
            transform=ax.transAxes,
            ha="right",
            fontsize=7,
        )
        ax.set_title(f"{model} (shipped, real text)")
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.suptitle(
        f"End to end: KL of the next-token distribution vs position, all SSM layers stored in the format\n"
        f"held-out text, batch {s['batch']}, {s['steps']} tokens, seed {s['seed']}; {env_text(first)}",
        fontsize=9.5,
    )
    png = save_fig(fig, folder, "e2e_kl.png")
    return intro + "\n\n" + md, claims, png, cmds


def rep_window(rep: dict) -> int:
    return int(rep["reference"]["horizon_window"])


# -- study 2: buffer length ---------------------------------------------------------------------------------
def bytes_per_step(fmt_spec: str, scheme_spec: str, dims: dict) -> dict:
    """Bytes moved per head per decode step (state traffic model of the page; buffer terms included)."""
    H, d, n, G = dims["H"], dims["d"], dims["n"], dims["G"]
    s_head = parse_format(fmt_spec).bytes_per_state((H, d, n)) / H  # one head's stored state, scales included
    entry = 2 * d + 2 * n * G / H + 4  # bf16 x/u (d) + bf16 B/k (n, shared by H/G heads) + fp32 dt/g
    sch = parse_scheme(scheme_spec)
    if sch.kind.value == "conventional":
        return {"state": 2 * s_head, "buffer": 0.0, "total": 2 * s_head, "S": s_head, "entry": entry}
    L = sch.buffer_len
    state = s_head * (1 + 1 / L)
    buf = entry * (1 + (L + 1) / 2)
    return {"state": state, "buffer": buf, "total": state + buf, "S": s_head, "entry": entry}


def study_buffer_length(data: pathlib.Path, out: pathlib.Path) -> dict:
    folder = out / "buffer_length"
    folder.mkdir(parents=True, exist_ok=True)
    models = ["nemotron-3-nano", "tiny-nemotron"]
    rows, cmds, data_lines, loaded = [], [], [], {}
    for model in models:
        run = load_run(data, f"buffer_length/{model}")
        if run is None:
            continue
        loaded[model] = run
        rep = run["report"]
        dims = layer_dims(model)
        he = horizon_errors(run["traces"])
        agg = over_layers(he, ["encoding", "scheme"])
        st = over_layers(he, ["encoding", "scheme"], "state_rel_err")
        agg["state_median"] = st["median"].values
        fp32_conv = 8 * dims["d"] * dims["n"]
        for r in agg.itertuples():
            b = bytes_per_step(r.encoding, r.scheme, dims)
            conv = bytes_per_step(r.encoding, "conventional", dims)
            rows.append(
                {
                    "model": model,
                    "format": r.encoding,
                    "L": parse_scheme(r.scheme).buffer_len,
                    "out err (median layer)": r.median,
                    "out err (worst layer)": r.max,
                    "state err (median layer)": r.state_median,
                    "bytes/step/head": b["total"],
                    "  of which buffer": b["buffer"],
                    "vs conventional, same format": b["total"] / conv["total"],
                    "vs conventional FP32 (8dn)": b["total"] / fp32_conv,
                }
            )
        # conventional reference points from study 1 (same model, its run's window around this horizon)
        c1 = load_run(data, f"conv_vs_replay/{model}")
        T = rep["settings"]["steps"]
        if c1 is not None and c1["traces"]["step"].max() >= T:
            tr = c1["traces"][c1["traces"]["step"] <= T]
            he1 = horizon_errors(tr)
            he1 = he1[(he1.rounding == "rne") & (he1.scheme == "conventional") & (he1.granularity == "row")]
            for r in over_layers(he1, ["encoding"]).itertuples():
                if r.encoding not in set(agg["encoding"]):
                    continue
                b = bytes_per_step(r.encoding, "conventional", dims)
                rows.append(
                    {
                        "model": model,
                        "format": r.encoding,
                        "L": 0,
                        "out err (median layer)": r.median,
                        "out err (worst layer)": r.max,
                        "state err (median layer)": float("nan"),
                        "bytes/step/head": b["total"],
                        "  of which buffer": 0.0,
                        "vs conventional, same format": 1.0,
                        "vs conventional FP32 (8dn)": b["total"] / fp32_conv,
                    }
                )
        cmds.append(analyze_cmd(rep, f"studies/data/{run['rel']}"))
        data_lines.append(f"- **{model}**: {source_text(rep)}; {settings_text(rep)}; {env_text(rep)}")
    tab = pd.DataFrame(rows).sort_values(["model", "format", "L"]).reset_index(drop=True)
    shown = tab.copy()
    shown["L"] = [("conventional*" if L == 0 else f"replay{L}") for L in tab["L"]]
    shown = shown.rename(columns={"L": "scheme"})
    md = save_table(tab, folder, "buffer_length", shown)

    # formula table
    ftab = []
    for model in loaded:
        dims = layer_dims(model)
        for enc in ["fp32", "bf16", "fp8_e4m3", "int8", "nvfp4"]:
            b16 = bytes_per_step(enc, "replay16", dims)
            ftab.append(
                {
                    "model": model,
                    "d x n (G/H)": f"{dims['d']} x {dims['n']} ({dims['G']}/{dims['H']})",
                    "format": enc,
                    "S = bytes_per_state / H": b16["S"],
                    "buffer entry e": b16["entry"],
                    "conventional 2S": 2 * b16["S"],
                    "replay16": b16["total"],
                    "L* = sqrt(2S/e)": math.sqrt(2 * b16["S"] / b16["entry"]),
                }
            )
    fmd = save_table(pd.DataFrame(ftab), folder, "bytes_formula")

    # claims
    claims = []
    for model in loaded:
        for enc in sorted(set(tab[tab.model == model]["format"])):
            t = tab[(tab.model == model) & (tab.format == enc) & (tab.L > 0)].sort_values("L")
            e = t["out err (median layer)"].values
            mono = bool(np.all(np.diff(e) < 0))
            best_err = t.loc[t["out err (median layer)"].idxmin()]
            best_b = t.loc[t["bytes/step/head"].idxmin()]
            r16 = t[t.L == 16]
            conv = tab[(tab.model == model) & (tab.format == enc) & (tab.L == 0)]
            txt = (
                f"**{model}, {enc}**: error {'falls monotonically' if mono else 'does not fall monotonically'} with L "
                f"(replay1 {num(e[0])} -> replay{int(t.L.iloc[-1])} {num(e[-1])}, {times(e[0] / e[-1])} lower); "
                f"lowest error at L={int(best_err.L)}, fewest bytes at L={int(best_b.L)} "
                f"({num(best_b['bytes/step/head'])} B/step/head)"
            )
            if len(r16) and len(conv):
                txt += (
                    f"; replay16 moves {r16['vs conventional, same format'].iloc[0]:.0%} of conventional's bytes "
                    f"at {times(conv['out err (median layer)'].iloc[0] / r16['out err (median layer)'].iloc[0])} "
                    "lower error than conventional*"
                )
            claims.append(txt)
    n_mono = sum("falls monotonically" in c for c in claims)
    fdf = pd.DataFrame(ftab)
    lstar = fdf[fdf["format"].isin(set(tab["format"]))]["L* = sqrt(2S/e)"]
    rp = tab[tab.L > 0]
    fewest = sorted({int(g.loc[g["bytes/step/head"].idxmin(), "L"]) for _, g in rp.groupby(["model", "format"])})
    e1, e32, b32 = [], [], []
    for _, g in rp.groupby(["model", "format"]):
        g = g.set_index("L")
        if {1, 16, 32} <= set(g.index):
            e1.append(g.loc[1, ERR] / g.loc[32, ERR])
            e32.append(g.loc[16, ERR] / g.loc[32, ERR])
            b32.append(g.loc[32, BYTES] / g.loc[16, BYTES])
    answer = (
        f"the error falls with L in {n_mono} of {len(claims)} (model, format) series "
        f"(replay1 -> replay32: {span(e1)} lower); bytes moved per step are fewest at "
        f"L = {', '.join(str(x) for x in fewest)} (L* = sqrt(2S/e) = {span(lstar, '')}), and going from replay16 to "
        f"replay32 lowers the error {span(e32)} for {span(b32)} the bytes per step"
    )
    plot = plot_buffer(tab, loaded, folder)
    page = [
        "# Study 2: replay buffer length",
        "",
        "**Question.** With checkpoint-plus-replay decoding, the checkpoint is rounded once per L tokens. "
        "How does the error at the horizon change with L in {1, 2, 4, 8, 16, 32} for each format, and what "
        "does each L cost in state bytes moved per decode step (the speed side of the ReplaySSM trade-off)?",
        "",
        "## Data",
        "",
        *data_lines,
        "",
        "conventional* rows: the conventional (RNE, per-row) error of the same model from study 1's run "
        "(`conv_vs_replay/<model>`, a longer run with the same seed), averaged over the same window "
        f"(the last {HORIZON_FRACTION:.0%} of steps up to this study's horizon); a reference point, not the "
        "same decode as the replay rows.",
        "",
        "## Method",
        "",
        f"Error at the horizon: mean of the recorded output errors in the last {HORIZON_FRACTION:.0%} of the "
        "horizon, per layer; median and worst layer. Bytes moved per head per decode step, for a head whose "
        "state is d x n (Mamba-2: head_dim x state; GDN: value dim x key dim):",
        "",
        "- **S** = one head's stored state in the format = `StateFormat.bytes_per_state((H, d, n)) / H` "
        "(elements + scales: fp32 4dn, bf16 2dn, fp8_e4m3 / int8 dn + 4d (one FP32 scale per row), nvfp4 "
        "dn/2 + dn/16 + 4d);",
        "- **e** = one buffer entry per head = 2d (x_t or u_t, bf16) + 2n G/H (B_t or k_t, bf16, shared by "
        "the H/G heads of a group / key head) + 4 (dt_t or g_t, FP32);",
        "- **conventional**: read + write the state every step: **2S** (8dn for FP32);",
        "- **replay(L)**: read the checkpoint every step, write it once per L steps, append one buffer entry "
        "and read the h entries held (h = 1..L, (L+1)/2 on average) to form the output: "
        "**S (1 + 1/L) + e (1 + (L+1)/2)** (4dn + buffer terms for FP32).",
        "",
        "The bytes are minimised at L* = sqrt(2S/e). The model counts the state and the buffer only (not "
        "x_t, C_t, q_t of the current token, which both schemes read), and assumes the flush reads the buffer "
        "in the same pass as the last output.",
        "",
        fmd,
        "",
        "## Results",
        "",
        md,
        "",
        f"![buffer length]({plot})",
        "",
        "## What the table shows",
        "",
        *[f"- {c}" for c in claims],
        "",
        "## Synthetic vs real",
        "",
        "nemotron-3-nano is synthetic (preset shapes, initialisation-distribution inputs, no weights); "
        "tiny-nemotron is a real trained model on real text, but tiny. With a real checkpoint the error "
        "levels move (trained decays and outlier channels set the per-row dynamic range), and so may the "
        "gain per doubling of L. The byte model above depends on the model only through d, n and G/H, "
        "so it carries over to a real checkpoint of the same shapes; a kernel's real traffic also depends on "
        "caching and on how it reads the buffer.",
        "",
        "## Reproduce",
        "",
        common_commands(cmds),
        "",
    ]
    (folder / "README.md").write_text("\n".join(page))
    return {"folder": "buffer_length", "title": "Buffer length", "answer": answer}


ERR, BYTES = "out err (median layer)", "bytes/step/head"


def plot_buffer(tab: pd.DataFrame, loaded: dict, folder: pathlib.Path) -> str:
    models = list(loaded)
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.6 * len(models)), squeeze=False, layout="constrained")
    for i, model in enumerate(models):
        rep = loaded[model]["report"]
        t = tab[tab.model == model]
        rep_t = t[t.L > 0]
        conv = t[t.L == 0]
        ax = axes[i][0]
        sns.lineplot(data=rep_t, x="L", y=ERR, hue="format", palette=PALETTE, marker="o", ax=ax)
        for _, r in conv.iterrows():
            ax.axhline(r[ERR], color=PALETTE[r["format"]], ls=":", lw=1.2)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="replay buffer length L (tokens per checkpoint write)",
            ylabel="output relative error at horizon (median layer)",
        )
        ax.set_xticks([1, 2, 4, 8, 16, 32], labels=["1", "2", "4", "8", "16", "32"])
        ax.set_title(
            f"{model} ({source_text(rep).split(' (')[0]}): error vs L\n(dotted: conventional, study 1 run)",
            fontsize=9.5,
        )
        ax.legend(title="format", fontsize=8)
        ax = axes[i][1]
        sns.lineplot(
            data=rep_t, x=BYTES, y=ERR, hue="format", palette=PALETTE, marker="o", sort=False, ax=ax, legend=False
        )
        for _, r in rep_t.iterrows():
            ax.annotate(f"L={r['L']}", (r[BYTES], r[ERR]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for _, r in conv.iterrows():
            ax.scatter(
                [r[BYTES]],
                [r[ERR]],
                marker="X",
                s=70,
                color=PALETTE[r["format"]],
                edgecolor="k",
                zorder=5,
                label=f"{r['format']} conventional",
            )
        ax.margins(x=0.08)
        ax.set(
            yscale="log",
            xlabel="state + buffer bytes moved per head per decode step",
            ylabel="output relative error at horizon (median layer)",
        )
        ax.set_title(f"{model}: error vs bytes moved (X: conventional)\n{settings_text(rep)}", fontsize=9.5)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Replay buffer length: accuracy vs state traffic; {env_text(loaded[models[0]]['report'])}", fontsize=10
    )
    return save_fig(fig, folder, "buffer_length.png")


# -- study 3: scale granularity and calibration ---------------------------------------------------------------
def study_granularity(data: pathlib.Path, out: pathlib.Path) -> dict:
    folder = out / "granularity_calibration"
    folder.mkdir(parents=True, exist_ok=True)
    cmds, claims, page_parts = [], [], []
    answer_bits = []
    run = load_run(data, "granularity/nemotron-3-nano")
    gmd, gpng = "(no data: run `bash studies/gpu_run.sh`)", None
    if run is not None:
        rep = run["report"]
        shape = tuple(rep["data_source"]["state_shape"])
        he = horizon_errors(run["traces"])
        agg = over_layers(he, ["fmt", "encoding", "granularity", "scheme"])
        agg["bits/element"] = [parse_format(f).bits_per_element(shape) for f in agg["fmt"]]
        tab = agg.rename(columns={"median": "out err (median layer)", "max": "out err (worst layer)"})
        tab = tab[
            ["encoding", "granularity", "scheme", "bits/element", "out err (median layer)", "out err (worst layer)"]
        ]
        gmd = save_table(tab, folder, "granularity")
        cmds.append(analyze_cmd(rep, f"studies/data/{run['rel']}"))
        for enc in ["fp8_e4m3", "int8", "nvfp4"]:
            for sch in sorted(set(tab.scheme)):
                t = tab[(tab.encoding == enc) & (tab.scheme == sch)].set_index("granularity")
                if "row" not in t.index:
                    continue
                row = t.loc["row", "out err (median layer)"]
                parts = [
                    f"{g} {times(t.loc[g, 'out err (median layer)'] / row)} the row error at "
                    f"{t.loc[g, 'bits/element']:.3g} vs {t.loc['row', 'bits/element']:.3g} bits"
                    for g in ["rows8", "head"]
                    if g in t.index
                ]
                claims.append(f"{enc} {sch}: " + "; ".join(parts))
        ratios_head = []
        for enc in ["fp8_e4m3", "int8"]:
            for sch in set(tab.scheme):
                t = tab[(tab.encoding == enc) & (tab.scheme == sch)].set_index("granularity")
                if {"row", "head"} <= set(t.index):
                    ratios_head.append(t.loc["head", "out err (median layer)"] / t.loc["row", "out err (median layer)"])
        saved = [
            t.loc["row", "bits/element"] - t.loc["head", "bits/element"]
            for enc in ["fp8_e4m3", "int8"]
            for t in [tab[tab.encoding == enc].drop_duplicates("granularity").set_index("granularity")]
            if {"row", "head"} <= set(t.index)
        ]
        answer_bits.append(
            f"per-head scales cost {span(ratios_head)} the per-row error for the 8-bit formats, to save "
            f"{span(saved, '')} bit per element"
        )
        gpng = plot_pareto(
            tab,
            "bits/element",
            "out err (median layer)",
            "encoding",
            "granularity",
            "scheme",
            folder,
            "granularity.png",
            f"nemotron-3-nano (synthetic): scale granularity, dynamic scales, error vs storage\n"
            f"{settings_text(rep)}; {env_text(rep)}; line = Pareto front",
        )
        page_parts.append(("Scale granularity (GPU, nemotron-3-nano synthetic)", rep))
        for sch in sorted(set(tab.scheme)):
            front = pareto(tab[tab.scheme == sch], "bits/element", "out err (median layer)")
            claims.append(
                f"Pareto front ({sch}): "
                + ", ".join(
                    f"{r['encoding']}/{r['granularity']} ({r['bits/element']:.3g} bits, {num(r['out err (median layer)'])})"
                    for _, r in front.iterrows()
                )
            )

    # calibration (CPU)
    cal_dir = data / "calibrate" / "tiny-nemotron"
    cmd_cal = None
    cmd_md, cpng, cal_claims = "(no calibration data: run `bash studies/cpu_run.sh`)", None, []
    cand_path = cal_dir / "candidates.csv"
    if cand_path.is_file():
        cand = pd.read_csv(cand_path)
        doc = json.loads((cal_dir / "ssm_quant_config.json").read_text())
        cfg = doc["search"]
        cal = doc["data"]["calibration"]
        dims = doc["model"]["dims"]
        shape = (dims["heads"], dims["rows"], dims["state_dim"])
        elements = math.prod(shape)
        c = cand[cand.role == "candidate"].copy()
        c["bits/element"] = c["state_bytes"] * 8 / elements
        c["scale"] = c["calibration"].fillna("dynamic").astype(str)
        c["scale granularity"] = [
            ("head" if ":head" in s else "row") if s != "dynamic" else parse_format(f).granularity.name
            for s, f in zip(c["scale"], c["format"])
        ]
        c["method"] = [s.split(":")[0] if s != "dynamic" else "dynamic" for s in c["scale"]]
        agg = (
            c.groupby(["encoding", "method", "scale granularity", "scheme"], sort=False)
            .agg(
                **{
                    "bits/element": ("bits/element", "first"),
                    "out err (median layer)": ("out_rel_err", "median"),
                    "out err (worst layer)": ("out_rel_err", "max"),
                    "state err (median layer)": ("state_rel_err", "median"),
                }
            )
            .reset_index()
        )
        cmd_md = save_table(agg, folder, "calibration")
        for enc in ["fp8_e4m3", "int8", "nvfp4"]:
            for sch in sorted(set(agg.scheme)):
                t = agg[(agg.encoding == enc) & (agg.scheme == sch)]
                dyn = t[(t.method == "dynamic") & (t["scale granularity"] == "row")]
                st = t[t.method != "dynamic"]
                if dyn.empty or st.empty:
                    continue
                best = st.loc[st["out err (median layer)"].idxmin()]
                d0 = dyn["out err (median layer)"].iloc[0]
                cal_claims.append(
                    f"{enc} {sch}: best static = {best.method} per {best['scale granularity']}, "
                    f"{times(best['out err (median layer)'] / d0)} the dynamic per-row error "
                    f"({num(best['out err (median layer)'])} vs {num(d0)})"
                )
        n_beat = 0
        n_all = 0
        best_ratio = []
        for _, t in agg.groupby(["encoding", "scheme"]):
            dyn = t[(t.method == "dynamic") & (t["scale granularity"] == "row")]
            st = t[t.method != "dynamic"]
            if len(dyn) and len(st):
                n_all += 1
                best_ratio.append(st["out err (median layer)"].min() / dyn["out err (median layer)"].iloc[0])
                n_beat += int(st["out err (median layer)"].min() < dyn["out err (median layer)"].iloc[0])
        # nvfp4 second-level scale: row vs head, dynamic and static
        nv = agg[agg.encoding == "nvfp4"]
        nv_lines = []
        for sch in sorted(set(nv.scheme)):
            for m in ["dynamic", "max", "mse"] + sorted({x for x in nv.method if x.startswith("percentile")}):
                t = nv[(nv.scheme == sch) & (nv.method == m)].set_index("scale granularity")
                if {"row", "head"} <= set(t.index):
                    nv_lines.append(
                        f"{sch} {m}: per-head {times(t.loc['head', 'out err (median layer)'] / t.loc['row', 'out err (median layer)'])} "
                        f"the per-row error"
                    )
        same_pm = []
        for (enc, sch, g), t in agg.groupby(["encoding", "scheme", "scale granularity"]):
            t = t.set_index("method")
            pct = [m for m in t.index if m.startswith("percentile")]
            if (
                "max" in t.index
                and pct
                and t.loc["max", "out err (median layer)"] == t.loc[pct[0], "out err (median layer)"]
            ):
                same_pm.append(f"{enc} {sch} {g}")
        cal_claims.append(
            f"A static scale beats the dynamic per-row scale (median layer) in {n_beat} of {n_all} (format, scheme) cases."
        )
        if nv_lines:
            cal_claims.append("NVFP4 second-level (FP32) scale per head vs per row: " + "; ".join(nv_lines) + ".")
        if same_pm:
            cal_claims.append(
                "The percentile method gives exactly the max method's error in: "
                + ", ".join(same_pm)
                + " (with few samples per row the percentile's nearest rank is the maximum, or clips too little to matter)."
            )
        answer_bits.append(
            f"calibrated static scales beat dynamic per-row scales in {n_beat} of {n_all} (format, scheme) cases on "
            f"tiny-nemotron (best static / dynamic error {span(best_ratio)})"
        )
        samples = cal["batch"] * cal["horizon"]
        cmd_cal = calibrate_cmd(doc)
        cmds.append(cmd_cal)
        env = doc["producer"]["environment"]
        cpng = plot_pareto(
            agg.assign(setting=agg["method"] + " / " + agg["scale granularity"]),
            "bits/element",
            "out err (median layer)",
            "encoding",
            "setting",
            "scheme",
            folder,
            "calibration.png",
            f"tiny-nemotron (shipped, real text): dynamic vs calibrated static scales, error vs storage\n"
            f"calibration split, batch {cal['batch']}, horizon {cal['horizon']}, seed {cfg['seed']}; "
            f"CPU, torch {env['torch']}, modelopt {env['modelopt']}; line = Pareto front",
        )
        calib_intro = (
            f"`ssmquant calibrate` on tiny-nemotron (all {len(doc['model']['calibrated_layers'])} SSM layers), "
            f"calibration split of the shipped corpus, batch {cal['batch']} x horizon {cal['horizon']} "
            f"({samples} per-step row-amax samples per row), CPU. Candidates: {', '.join(cfg['candidates'])} x "
            f"schemes {', '.join(cfg['schemes'])} (L = {', '.join(str(x) for x in cfg['buffer_lens'])}) x scales "
            f"dynamic + static {', '.join(cfg['calibration'])} x static granularity "
            f"{', '.join(cfg['calibration_granularity'])} (`ssmquant/calibrate/README.md` defines the methods). "
            "The error is each setting simulated to the horizon on the calibration data (`candidates.csv`), "
            "median and worst over layers. Static scales count the same bytes as dynamic ones (FP32 per row)."
        )
    page = [
        "# Study 3: scale granularity and calibrated scales",
        "",
        "**Question.** How much accuracy does a coarser FP32 scale (one per 8 rows, one per head) cost "
        "against one per row, for the bits it saves? Do calibrated static scales (max, percentile, MSE) "
        "beat the engines' dynamic per-row amax? For NVFP4, should the second-level FP32 scale be per row "
        "or per head? Error vs bytes per element, with the Pareto front.",
        "",
        "## Scale granularity (GPU)",
        "",
    ]
    if run is not None:
        page += [
            f"{source_text(rep)}; {settings_text(rep)}; {env_text(rep)}. Dynamic scales (amax at every write). "
            f"Error at the horizon = mean of the recorded output errors in the last {HORIZON_FRACTION:.0%} "
            "of the horizon, per layer; median and worst layer. Bits per element include the FP32 scales "
            "(`StateFormat.bits_per_element`).",
            "",
        ]
    page += [gmd, ""]
    if gpng:
        page += [f"![granularity]({gpng})", ""]
    page += [*[f"- {c}" for c in claims], "", "## Dynamic vs calibrated static scales (CPU, tiny-nemotron)", ""]
    if cand_path.is_file():
        page += [calib_intro, ""]
    page += [cmd_md, ""]
    if cpng:
        page += [f"![calibration]({cpng})", ""]
    page += [*[f"- {c}" for c in cal_claims], ""]
    page += [
        "## Synthetic vs real",
        "",
        "The granularity data are synthetic (nemotron-3-nano shapes, initialisation-distribution inputs, "
        "no trained outlier channels). A coarser scale costs most when the rows it shares have unequal "
        "magnitudes: trained checkpoints with outlier channels, where one loud row sets the step of all rows "
        "of its head, should widen the per-head vs per-row gap measured here, not narrow it; only a real "
        "checkpoint's run can say by how much. The calibration data are real (trained tiny model, real text) "
        "but short (see the settings above), and the static scales are scored on the very data they were "
        "calibrated on: their loss against dynamic scales is not a generalisation gap. A static scale is one "
        "number per row for the whole decode (it must cover the row's largest amax), while the dynamic "
        "scale is refit to each write's amax. Longer calibration text gives the percentile and MSE methods "
        "more samples; it cannot make a fixed scale follow a state whose magnitude changes over the decode.",
        "",
        "## Reproduce",
        "",
        common_commands(cmds),
        "",
    ]
    (folder / "README.md").write_text("\n".join(page))
    return {
        "folder": "granularity_calibration",
        "title": "Scale granularity and calibration",
        "answer": "; ".join(answer_bits),
    }


def plot_pareto(tab, x, y, hue, style, panel, folder, name, title) -> str:
    panels = sorted(set(tab[panel]), key=lambda s: (s != "conventional", s))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.4 * len(panels), 4.8), sharey=True, squeeze=False, layout="constrained"
    )
    styles = list(dict.fromkeys(tab[style]))
    width = 0.04 * (tab[x].max() - tab[x].min() or 1)
    for ax, p in zip(axes[0], panels):
        t = tab[tab[panel] == p].copy()
        # points that share a bits value are spread sideways (by style) so that none hides another
        t["_x"] = t[x] + [width * (styles.index(v) - (len(styles) - 1) / 2) / max(len(styles) - 1, 1) for v in t[style]]
        sns.scatterplot(
            data=t,
            x="_x",
            y=y,
            hue=hue,
            style=style,
            style_order=styles,
            palette={k: v for k, v in PALETTE.items() if k in set(t[hue])},
            s=70,
            ax=ax,
            legend=(ax is axes[0][-1]),
        )
        front = pareto(t, x, y)
        ax.plot(front["_x"], front[y], color="k", lw=1, ls="--", zorder=0, label="Pareto front")
        ax.scatter(front["_x"], front[y], facecolors="none", edgecolors="k", s=160, lw=1.2, zorder=4)
        ax.set(
            yscale="log",
            xlabel="stored bits per state element (scales included)",
            ylabel="output relative error at horizon (median layer)",
        )
        ax.set_title(f"scheme: {p}")
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.suptitle(title + "\n(points at the same bits per element are spread sideways for legibility)", fontsize=9.5)
    return save_fig(fig, folder, name)


# -- study 4: fragile layers and heads ------------------------------------------------------------------------
def study_fragile(data: pathlib.Path, out: pathlib.Path) -> dict:
    folder = out / "fragile_heads"
    folder.mkdir(parents=True, exist_ok=True)
    dec_path = data / "fragile_heads" / "decays.csv"
    decays = pd.read_csv(dec_path) if dec_path.is_file() else pd.DataFrame()
    cpu_dec = data / "fragile_heads" / "decays_tiny-qwen-cpu.csv"
    if cpu_dec.is_file():
        decays = pd.concat([decays[decays.get("model", pd.Series(dtype=str)) != "tiny-qwen"], pd.read_csv(cpu_dec)])
    runs = {
        "nemotron-3-nano": "conv_vs_replay/nemotron-3-nano",
        "qwen3.5-9b": "conv_vs_replay/qwen3.5-9b",
        "tiny-nemotron": "conv_vs_replay/tiny-nemotron",
        "tiny-qwen": "conv_vs_replay/tiny-qwen-cpu",
    }
    frames, reps, cmds = [], {}, []
    for model, rel in runs.items():
        run = load_run(data, rel)
        if run is None or decays.empty:
            continue
        reps[model] = run["report"]
        h = run["heads"]
        h = h[h["step"] == h["step"].max()]
        h = split_variants(h)
        h = h.merge(decays[decays.model == model], on=["layer", "head"], how="inner")
        frames.append(h.assign(model=model))
        cmds.append(analyze_cmd(run["report"], f"studies/data/{rel}"))
    heads = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    rows = []
    for (model, variant), g in heads.groupby(["model", "variant"], sort=False):
        g = g[np.isfinite(g["out_rel_err"])]
        if len(g) < 4:
            continue
        rho, p = spearmanr(g["half_life_tokens"], g["out_rel_err"])
        rho99, _ = spearmanr(g["frac_above_0.99"], g["out_rel_err"])
        within = [spearmanr(x["half_life_tokens"], x["out_rel_err"])[0] for _, x in g.groupby("layer") if len(x) >= 4]
        rows.append(
            {
                "model": model,
                "variant": variant,
                "heads": len(g),
                "rho(half-life, err)": rho,
                "p-value": p,
                "rho(share a>0.99, err)": rho99,
                "mean within-layer rho": float(np.nanmean(within)) if within else float("nan"),
                "err of longest-memory head / median head": float(
                    g.loc[g["half_life_tokens"].idxmax(), "out_rel_err"] / g["out_rel_err"].median()
                ),
            }
        )
    corr = pd.DataFrame(rows)
    rne = corr[~corr.variant.str.contains(":sr")] if len(corr) else corr
    cmd_md = save_table(rne, folder, "rank_correlation")
    if len(corr):
        corr.to_csv(folder / "rank_correlation_all.csv", index=False)
    claims = []
    for model in reps:
        t = rne[rne.model == model]
        if t.empty:
            continue
        pos = int(((t["rho(half-life, err)"] > 0) & (t["p-value"] < 0.05)).sum())
        neg = int(((t["rho(half-life, err)"] < 0) & (t["p-value"] < 0.05)).sum())
        q = t[t.variant.str.match(r"^(fp8_e4m3|int8|nvfp4)@")]
        claims.append(
            f"**{model}** ({t['heads'].iloc[0]} heads): rho(half-life, error) {span(t['rho(half-life, err)'], '')} over the "
            f"{len(t)} RNE variants ({span(q['rho(half-life, err)'], '')} for fp8/int8/nvfp4); significantly positive "
            f"(p < 0.05) in {pos}, significantly negative in {neg}; within layers, mean rho "
            f"{span(t['mean within-layer rho'], '')}"
        )
    for model in reps:
        t = rne[rne.model == model]
        if t.empty:
            continue
        conv = t[t.variant.str.endswith("@conventional")]["rho(half-life, err)"]
        rep16 = t[t.variant.str.endswith("@replay16")]["rho(half-life, err)"]
        ratio = t[t.variant.str.endswith("@replay16")]["err of longest-memory head / median head"]
        claims.append(
            f"{model}: median rho conventional {conv.median():.2f}, replay16 {rep16.median():.2f}; under replay16 the "
            f"longest-memory head's error is {span(ratio)} the median head's"
        )
    neg = rne[(rne["rho(half-life, err)"] < 0) & (rne["p-value"] < 0.05)]
    if len(neg):
        claims.append(
            "Significantly negative: "
            + ", ".join(f"{r.model} {r.variant}" for r in neg.itertuples())
            + " (float states under replay16 on GDN, where the bf16 input buffer, not the state, sets the error: "
            "study 1, 'Why replay16 loses to conventional for an fp16 GDN state')."
        )
    png = plot_fragile(heads, reps, folder) if len(heads) else None

    # per-layer spread (which layers are fragile)
    spread_rows = []
    for model, rel in runs.items():
        run = load_run(data, rel)
        if run is None:
            continue
        he = horizon_errors(run["traces"])
        he = he[(he.rounding == "rne") & he.encoding.isin(["fp8_e4m3", "int8", "nvfp4"])]
        for v, g in he.groupby("variant", sort=False):
            g = g.assign(out_rel_err=g["out_rel_err"].fillna(np.inf))
            spread_rows.append(
                {
                    "model": model,
                    "variant": v,
                    "worst layer": int(g.loc[g["out_rel_err"].idxmax(), "layer"]),
                    "best layer": int(g.loc[g["out_rel_err"].idxmin(), "layer"]),
                    "worst / best layer error": float(g["out_rel_err"].max() / g["out_rel_err"].min())
                    if np.isfinite(g["out_rel_err"].min())
                    else float("nan"),
                    "layers with non-finite error": int((~np.isfinite(g["out_rel_err"])).sum()),
                }
            )
    spread = pd.DataFrame(spread_rows)
    spread_md = save_table(spread, folder, "layer_spread")
    spread_claims = []
    for model, g in spread.groupby("model", sort=False):
        top = g["worst layer"].value_counts()
        spread_claims.append(
            f"**{model}**: worst / best layer error {span(g['worst / best layer error'])}; layer {top.index[0]} is the "
            f"worst in {top.iloc[0]} of {len(g)} variants"
        )

    # per-layer recipe vs one global setting
    rec_md, rec_claims, sweep_md, rec_cmd, rec_fails, rec_n = recipe_section(data, folder)
    if rec_cmd:
        cmds.append(rec_cmd)
    n_pos = int(((rne["rho(half-life, err)"] > 0) & (rne["p-value"] < 0.05)).sum()) if len(rne) else 0
    n_neg = int(((rne["rho(half-life, err)"] < 0) & (rne["p-value"] < 0.05)).sum()) if len(rne) else 0
    answer = (
        f"long-memory heads drift more in {n_pos} of {len(rne)} (model, RNE variant) cases and less in {n_neg} "
        f"(Spearman p < 0.05, per-head error at the horizon vs half-life)"
    )
    if rec_claims:
        answer += "; " + rec_claims[0][0].lower() + rec_claims[0][1:].rstrip(".")
        if rec_fails:
            answer += f" - but {rec_fails} of {rec_n} per-layer decisions exceed the budget on held-out text"
        elif rec_n:
            answer += " and every per-layer decision meets the budget on held-out text"
    page = [
        "# Study 4: which layers and heads are fragile",
        "",
        "**Question.** Is the error at the horizon concentrated in the long-memory heads (decay a_t close to "
        "1, long half-life), on the synthetic presets and the trained tiny models? Which layers are the "
        "fragile ones, and what does a per-layer recipe from `ssmquant calibrate` save over one global setting?",
        "",
        "## Data and method",
        "",
        "Per-head output error at the last recorded step of study 1's runs (`heads.parquet`, step = horizon; "
        "one step, so noisier than the window means of the other pages), joined on (model, layer, head) with "
        "the head's decay statistics from `studies/head_decays.py` over the same inputs: mean a_t (Mamba-2 "
        "exp(dt A), GDN exp(g)), mean log a_t, half-life ln 2 / -mean(ln a_t) in tokens, and the share of "
        "steps with a_t > 0.99. tiny-qwen's decays are recomputed for its CPU run's inputs "
        "(`decays_tiny-qwen-cpu.csv`). Spearman rank correlation per (model, variant) over all heads of the "
        "analysed layers (pooled: between-layer differences count too), its p-value (heads are not "
        "independent samples: read it as a guide), and the mean of the per-layer correlations (within-layer).",
        "",
        *[f"- **{m}**: {source_text(r)}; {settings_text(r)}; {env_text(r)}" for m, r in reps.items()],
        "",
        "## Long-memory heads vs error (RNE variants; SR in `rank_correlation_all.csv`)",
        "",
        cmd_md,
        "",
        f"![error vs half-life]({png})" if png else "",
        "",
        *[f"- {c}" for c in claims],
        "",
        "## Which layers (RNE, 8- and 4-bit formats; window error at the horizon)",
        "",
        spread_md,
        "",
        *[f"- {c}" for c in spread_claims],
        "",
        "## Per-layer recipe vs one global setting (CPU, tiny-nemotron)",
        "",
        rec_md,
        "",
        *[f"- {c}" for c in rec_claims],
        "",
        sweep_md,
        "",
        "## Synthetic vs real",
        "",
        f"The presets' decays are drawn from the families' initialisation ({init_text()}): a wide, regular "
        "spread of half-lives that training reshapes. The tiny models' decays are trained, but their heads "
        f"are few ({tiny_heads_text()}) so their correlations rest on "
        f"{span(rne[rne.model.str.startswith('tiny')]['heads'], '') if len(rne) else 'n/a'} heads. In a real checkpoint, outlier "
        "channels and input statistics per head can matter as much as the decay; the per-layer recipe's "
        "savings depend on how unequal the layers are, which only a real checkpoint's calibration shows.",
        "",
        "## Reproduce",
        "",
        common_commands(cmds),
        "",
    ]
    (folder / "README.md").write_text("\n".join(page))
    return {"folder": "fragile_heads", "title": "Fragile layers and heads", "answer": answer}


def init_text() -> str:
    n = get_preset("nemotron-3-nano").shape
    q = get_preset("qwen3.5-9b").shape
    return (
        f"nemotron-3-nano: A_log = {n.a_log_init}, dt_bias = {n.dt_bias_init} with time_step_min "
        f"{n.time_step_min}, time_step_max {n.time_step_max}; qwen3.5-9b: A_log = {q.a_log_init}, dt_bias = "
        f"{q.dt_bias_init}"
    )


def tiny_heads_text() -> str:
    parts = []
    for m in ("tiny-nemotron", "tiny-qwen"):
        d = layer_dims(m)
        parts.append(f"{m}: {d['H']} {'Mamba-2' if d['kind'] == 'mamba2' else 'GDN value'} heads per layer")
    return ", ".join(parts)


def plot_fragile(heads: pd.DataFrame, reps: dict, folder: pathlib.Path) -> str:
    h = heads[(heads.rounding == "rne") & heads.encoding.isin(["fp8_e4m3", "int8", "nvfp4"])].copy()
    h = h[np.isfinite(h["out_rel_err"]) & (h["out_rel_err"] > 0)]
    models = [m for m in reps if m in set(h.model)]
    ncol = 2
    nrow = math.ceil(len(models) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(12, 4.8 * nrow), squeeze=False, layout="constrained")
    for ax, model in zip(axes.flat, models):
        t = h[h.model == model]
        sns.scatterplot(
            data=t,
            x="half_life_tokens",
            y="out_rel_err",
            hue="encoding",
            style="scheme",
            palette={k: PALETTE[k] for k in set(t.encoding)},
            hue_order=["fp8_e4m3", "int8", "nvfp4"],
            style_order=["conventional", "replay16"],
            s=28,
            alpha=0.8,
            ax=ax,
            legend=(ax is axes.flat[0]),
        )
        r = reps[model]
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="head half-life ln2 / -mean(ln a_t), tokens",
            ylabel="per-head output relative error at horizon",
        )
        over = t[t["out_rel_err"] > Y_CLIP]
        if len(over):
            ax.set_ylim(top=Y_CLIP)
            names = ", ".join(sorted(set(over["variant"])))
            ax.text(
                0.02,
                0.98,
                f"{len(over)} heads with error > {Y_CLIP:g} not shown ({names})",
                transform=ax.transAxes,
                va="top",
                fontsize=8,
                color="crimson",
            )
        ax.set_title(f"{model} ({source_text(r).split(' (')[0]})\n{settings_text(r)}", fontsize=9)
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    if models:
        axes.flat[0].legend(fontsize=8, loc="best")
    fig.suptitle(
        "Per-head error at the horizon vs the head's memory (RNE; colour = format, marker = scheme)", fontsize=10
    )
    return save_fig(fig, folder, "error_vs_half_life.png")


def calibrate_cmd(doc: dict) -> str:
    """The `ssmquant calibrate` command that produced a recipe (rebuilt from its config)."""
    cfg, cal = doc["search"], doc["data"]["calibration"]
    return (
        f"ssmquant calibrate --model {doc['model']['name']} --budget {doc['budget']['value']} "
        f"--metric {doc['budget']['metric']} --horizon {cal['horizon']} --batch {cal['batch']} "
        f"--candidates {','.join(cfg['candidates'])} --schemes {','.join(cfg['schemes'])} "
        f"--buffer-lens {','.join(str(x) for x in cfg['buffer_lens'])} --calibration {','.join(cfg['calibration'])} "
        f"--calibration-granularity {','.join(cfg['calibration_granularity'])} --seed {cfg['seed']} "
        f"--device {doc['producer']['environment']['device']} --out studies/data/calibrate/{doc['model']['name']}"
    )


def held_text(d) -> str:
    if not isinstance(d, dict):
        return "n/a"
    t = d.get("text") or {}
    return f"the {d.get('split')} split of {t.get('origin', '?')}, batch {d.get('batch')} x {d.get('horizon')} steps"


def recipe_section(data: pathlib.Path, folder: pathlib.Path):
    cal_dir = data / "calibrate" / "tiny-nemotron"
    if not (cal_dir / "ssm_quant_config.json").is_file():
        return "(no recipe: run `bash studies/cpu_run.sh`)", [], "", None, 0, 0
    doc = load_recipe(cal_dir).config  # validated
    cal = doc["data"]["calibration"]
    budget = doc["budget"]
    rows = [
        {
            "layer": lay["layer"],
            "per-layer choice": lay["setting"]["name"],
            "bytes/sequence (state + ring)": lay["bytes_per_sequence"]["total"],
            f"{budget['metric']} (calibration)": lay["calibration_error"][budget["metric"]],
            f"{budget['metric']} (held-out)": (lay.get("heldout_error") or {}).get(budget["metric"], float("nan")),
        }
        for lay in doc["layers"]
    ]
    g = doc["global"]
    cost = g.get("cost_vs_per_layer") or {}
    rows.append(
        {
            "layer": "all (per-layer total)",
            "per-layer choice": "",
            "bytes/sequence (state + ring)": doc["per_layer_total"]["bytes_per_sequence"],
            f"{budget['metric']} (calibration)": doc["per_layer_total"]["max_error"],
            f"{budget['metric']} (held-out)": float("nan"),
        }
    )
    ver = doc.get("verification") or {}
    vglob = ver.get("global") or {}
    if g.get("setting"):
        rows.append(
            {
                "layer": "all (global setting)",
                "per-layer choice": g["setting"]["name"] + f" ({g['status']})",
                "bytes/sequence (state + ring)": g["bytes_per_sequence"],
                f"{budget['metric']} (calibration)": g["max_error"],
                f"{budget['metric']} (held-out)": vglob.get("max_error", float("nan")),
            }
        )
    held = [r[f"{budget['metric']} (held-out)"] for r in rows if isinstance(r["layer"], int)]
    rows[len(held)][f"{budget['metric']} (held-out)"] = max(held) if held else float("nan")
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "recipe")
    intro = (
        f"`ssmquant calibrate --budget {budget['value']}` ({budget['metric']} at step {budget['horizon']}), "
        f"calibration split batch {cal['batch']}, held-out verification; objective: bytes per sequence of "
        "the stored state plus the replay ring. The global setting is the cheapest one any engine can "
        "take today that meets the budget on every layer (`ssmquant/calibrate/README.md`). Held-out "
        f"data: {held_text(ver.get('data'))}. "
        "Rows 'all': bytes summed over layers, errors = worst layer."
    )
    claims = []
    if cost:
        claims.append(
            f"At budget {budget['value']}, the per-layer recipe stores {num(cost['bytes_per_sequence_per_layer_choice'])} "
            f"bytes per sequence against {num(cost['bytes_per_sequence_global'])} for the global {g['setting']['name']}: "
            f"the global setting costs {cost['bytes_ratio']:.2f}x the bytes (the per-layer recipe saves {1 - 1 / cost['bytes_ratio']:.0%})."
        )
        claims.append(
            f"Worst-layer error on the calibration data: per-layer {num(cost['max_error_per_layer_choice'])}, global "
            f"{num(cost['max_error_global'])}: the per-layer recipe spends the budget, the global setting stays below it."
        )
    if ver.get("per_layer"):
        fails = [r for r in ver["per_layer"] if not r["meets_budget"]]
        claims.append(
            f"Held-out check: {len(fails)} of {len(ver['per_layer'])} per-layer decisions exceed the budget on held-out "
            "text"
            + (
                " (" + ", ".join(f"layer {r['layer']} {r['setting']} {num(r[budget['metric']])}" for r in fails) + ")"
                if fails
                else ""
            )
            + f"; the global setting {'meets' if ver.get('global_passed') else 'misses'} it on every layer "
            f"(worst {num(vglob.get('max_error', float('nan')))}). "
            + (
                "With this little calibration data the per-layer saving is not safe at this budget: a recipe "
                "for serving needs a margin below the budget or more calibration text."
                if fails
                else ""
            )
        )
    # budget sweep from the same candidate table (the library's own choice functions)
    cand = pd.read_csv(cal_dir / "candidates.csv")
    metric = budget["metric"]
    kind = doc["model"]["layer_kind"]
    takeable = {n: takeable_by_any(Setting.parse(n), kind) for n in cand["setting"].unique()}
    layers = sorted(cand["layer"].unique())
    srows = []
    finite = cand.loc[cand.role == "candidate", metric]
    finite = finite[np.isfinite(finite)]
    lo = max(float(finite.min()), 1e-5)
    for b in sorted(
        {float(f"{x:.1g}") for x in np.geomspace(lo * 2, min(float(finite.max()), 0.2), 9)} | {budget["value"]}
    ):
        picks = [choose_layer(cand[cand.layer == la], b, metric) for la in layers]
        if any(p is None for p in picks):
            srows.append(
                {
                    "budget": b,
                    "per-layer bytes": float("nan"),
                    "global setting": "(a layer has no candidate within budget)",
                    "global bytes": float("nan"),
                    "global / per-layer": float("nan"),
                    "per-layer choices": "",
                }
            )
            continue
        per_bytes = int(sum(int(p["bytes"]) for p in picks))
        uni = uniform_table(cand, b, metric)
        row, status = choose_global(uni, takeable)
        gb = int(row["bytes"]) if row is not None and status == "meets_budget" else float("nan")
        choices = pd.Series([p["setting"] for p in picks]).value_counts()
        srows.append(
            {
                "budget": b,
                "per-layer bytes": per_bytes,
                "global setting": (row["setting"] if row is not None else "none")
                + ("" if status == "meets_budget" else f" ({status})"),
                "global bytes": gb,
                "global / per-layer": gb / per_bytes if np.isfinite(gb) else float("nan"),
                "per-layer choices": "; ".join(f"{k} x{v}" for k, v in choices.items()),
            }
        )
    sweep = pd.DataFrame(srows)
    smd = save_table(sweep, folder, "recipe_budget_sweep")
    ok = sweep["global / per-layer"].dropna()
    if len(ok):
        claims.append(
            f"Over {len(sweep)} budgets from {num(sweep['budget'].min())} to {num(sweep['budget'].max())} (same candidate table, "
            f"the library's own choice functions), one global engine setting costs {span(ok)} the per-layer bytes "
            f"where one meets the budget ({len(ok)} of {len(sweep)} budgets)."
        )
    sweep_text = (
        "Budget sweep: the same calibration table (`candidates.csv`), each budget re-decided with "
        "`ssmquant.calibrate.choose` (per layer: `choose_layer`; global: `uniform_table` + `choose_global` over "
        "engine-takeable settings); calibration data only, no held-out check.\n\n" + smd
    )
    n_fail = sum(not r["meets_budget"] for r in ver.get("per_layer", []))
    return intro + "\n\n" + md, claims, sweep_text, calibrate_cmd(doc), n_fail, len(ver.get("per_layer", []))


# -- study 5: speculative decoding -------------------------------------------------------------------------------
def flush_stats(scheme: str, batch: int, steps: int) -> dict:
    mask = parse_scheme(scheme).write_mask(batch, steps)
    per_seq = mask.sum(1).double()
    gaps = []
    for b in range(batch):
        idx = torch_nonzero(mask[b])
        gaps += np.diff(np.concatenate([[-1], idx])).tolist()
    gaps = np.asarray(gaps)
    return {
        "flushes per 1000 tokens": float(per_seq.mean()) * 1000 / steps,
        "mean interval": float(gaps.mean()),
        "min interval": int(gaps.min()),
        "max interval": int(gaps.max()),
    }


def torch_nonzero(row) -> np.ndarray:
    return row.nonzero().flatten().numpy()


def study_speculative(data: pathlib.Path, out: pathlib.Path) -> dict:
    folder = out / "speculative"
    folder.mkdir(parents=True, exist_ok=True)
    rows, cmds, data_lines, reps = [], [], [], {}
    for model in ["nemotron-3-nano", "tiny-nemotron"]:
        run = load_run(data, f"speculative/{model}")
        if run is None:
            continue
        rep = run["report"]
        reps[model] = rep
        B, T = rep["settings"]["batch"], rep["settings"]["steps"]
        he = horizon_errors(run["traces"])
        agg = over_layers(he, ["encoding", "scheme"])
        fl = {s: flush_stats(s, B, T) for s in agg["scheme"].unique()}
        base = agg[agg.scheme.str.startswith("replay")].set_index("encoding")["median"]
        for r in agg.itertuples():
            s = parse_scheme(r.scheme)
            rows.append(
                {
                    "model": model,
                    "format": r.encoding,
                    "scheme": r.scheme,
                    "draft tokens T": s.draft_tokens,
                    "acceptance p": s.accept_rate if s.accept_rate is not None else float("nan"),
                    **fl[r.scheme],
                    "out err (median layer)": r.median,
                    "out err (worst layer)": r.max,
                    "vs replay16": r.median / base.get(r.encoding, float("nan")),
                }
            )
        cmds.append(analyze_cmd(rep, f"studies/data/{run['rel']}"))
        data_lines.append(f"- **{model}**: {source_text(rep)}; {settings_text(rep)}; {env_text(rep)}")
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "speculative")
    claims = []
    for model in reps:
        for enc in sorted(set(tab[tab.model == model]["format"])):
            t = tab[(tab.model == model) & (tab.format == enc)]
            sp = t[t["draft tokens T"] > 0]
            rho, p = spearmanr(t["flushes per 1000 tokens"], t["out err (median layer)"])
            worst = sp.loc[sp["vs replay16"].idxmax()]
            claims.append(
                f"**{model}, {enc}**: speculative schedules flush {span(sp['flushes per 1000 tokens'], '')} times per 1000 tokens "
                f"(replay16: {num(t[t['draft tokens T'] == 0]['flushes per 1000 tokens'].iloc[0])}); their error is "
                f"{span(sp['vs replay16'])} replay16's, largest for {worst.scheme} ({times(worst['vs replay16'])}); "
                f"Spearman rho(flushes, error) = {rho:.2f} (p = {p:.2g}, {len(t)} schedules)"
            )
    rho_all = []
    for _, t in tab.groupby(["model", "format"]):
        rho_all.append(spearmanr(t["flushes per 1000 tokens"], t["out err (median layer)"])[0])
    sp = tab[tab["draft tokens T"] > 0]
    answer = (
        f"irregular speculative flushes raise the flush rate up to {sp['flushes per 1000 tokens'].max():.0f} per 1000 tokens "
        f"(replay16: {num(tab[tab['draft tokens T'] == 0]['flushes per 1000 tokens'].iloc[0])}) and the error to "
        f"{span(sp['vs replay16'])} replay16's; the error rank-correlates with "
        f"the flush rate (rho {span(rho_all, '')})"
        if len(sp)
        else "no data"
    )
    png = plot_spec(tab, reps, folder) if len(tab) else None
    page = [
        "# Study 5: speculative decoding with replay",
        "",
        "**Question.** With speculative decoding, draft tokens share the replay buffer, and the checkpoint "
        "is flushed early when h + 2T > L (h committed tokens held, T drafts), so flush intervals become "
        "irregular and, for large T, shorter. How does the error at the horizon of spec16x{2,4,6} with "
        "per-draft acceptance {1.0, 0.8, 0.5} compare with plain replay16?",
        "",
        "## Data",
        "",
        *data_lines,
        "",
        "## Method",
        "",
        f"Error at the horizon: mean of the recorded output errors in the last {HORIZON_FRACTION:.0%} of the "
        "horizon, per layer; median and worst layer. Flushes per 1000 tokens and flush intervals (tokens "
        "between checkpoint writes) are computed from the exact schedule the runs used, "
        "`ssmquant.replay.parse_scheme(scheme).write_mask(batch, steps)` (acceptance draws seeded per "
        "sequence, seed 0), averaged over the batch. Acceptance p: each draft accepted with probability p "
        "until the first rejection; a round commits accepted + 1 tokens.",
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
        "nemotron-3-nano is synthetic; tiny-nemotron is a real trained model on real text. The acceptance "
        "process is synthetic in both (independent per-draft Bernoulli acceptance); a real draft model's "
        "acceptance is correlated with the text (long accepted runs in easy passages), which changes the "
        "flush schedule and so the flush rate. The emulation rounds the checkpoint at the schedule's flushes "
        "and the buffered inputs in bf16; rejected drafts never reach the checkpoint.",
        "",
        "## Reproduce",
        "",
        common_commands(cmds),
        "",
    ]
    (folder / "README.md").write_text("\n".join(page))
    return {"folder": "speculative", "title": "Speculative decoding", "answer": answer}


def plot_spec(tab: pd.DataFrame, reps: dict, folder: pathlib.Path) -> str:
    models = list(reps)
    encs = sorted(set(tab["format"]))
    fig, axes = plt.subplots(
        len(models), len(encs), figsize=(6 * len(encs), 4.6 * len(models)), squeeze=False, layout="constrained"
    )
    t = tab.copy()
    t["draft tokens"] = [("replay16 (no drafts)" if T == 0 else f"T = {T}") for T in t["draft tokens T"]]
    t["acceptance"] = [("-" if not np.isfinite(p) else f"p = {p:g}") for p in t["acceptance p"]]
    hue_order = ["replay16 (no drafts)", "T = 2", "T = 4", "T = 6"]
    pal = dict(zip(hue_order, ["black"] + sns.color_palette("viridis", 3)))
    for i, model in enumerate(models):
        for j, enc in enumerate(encs):
            ax = axes[i][j]
            d = t[(t.model == model) & (t.format == enc)]
            sns.scatterplot(
                data=d,
                x="flushes per 1000 tokens",
                y="out err (median layer)",
                hue="draft tokens",
                style="acceptance",
                hue_order=[h for h in hue_order if h in set(d["draft tokens"])],
                palette=pal,
                s=90,
                ax=ax,
                legend=(i == 0 and j == len(encs) - 1),
            )
            base = d[d["draft tokens T"] == 0]["out err (median layer)"]
            if len(base):
                ax.axhline(base.iloc[0], color="k", ls=":", lw=1)
            ax.set(
                xlabel="checkpoint flushes per 1000 tokens", ylabel="output relative error at horizon (median layer)"
            )
            ax.set_title(
                f"{model} ({source_text(reps[model]).split(' (')[0]}), {enc}\n{settings_text(reps[model])}", fontsize=9
            )
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.suptitle(f"Speculative replay (spec16xT, acceptance p) vs replay16; {env_text(reps[models[0]])}", fontsize=10)
    return save_fig(fig, folder, "speculative.png")


# -- index ----------------------------------------------------------------------------------------------------
def write_index(data: pathlib.Path, out: pathlib.Path, answers: list[dict]) -> None:
    envs = []
    stale = data / "conv_vs_replay" / "tiny-qwen"
    for rep_path in sorted(data.glob("*/*/report.json")):
        if rep_path.parent == stale:
            continue
        rep = json.loads(rep_path.read_text())
        envs.append(
            {
                "run": str(rep_path.parent.relative_to(data)),
                "data": rep["data_source"].get("kind"),
                "steps x batch": f"{rep['settings']['steps']} x {rep['settings']['batch']}",
                "hardware / versions": env_text(rep),
                "elapsed s": rep.get("elapsed_s"),
            }
        )
    for ev in sorted(data.glob("e2e/*/eval.json")):
        rep = json.loads(ev.read_text())
        envs.append(
            {
                "run": str(ev.parent.relative_to(data)),
                "data": rep["data_source"].get("kind"),
                "steps x batch": f"{rep['settings']['steps']} x {rep['settings']['batch']}",
                "hardware / versions": env_text(rep),
                "elapsed s": rep.get("elapsed_s"),
            }
        )
    for cal in sorted(data.glob("calibrate/*/ssm_quant_config.json")):
        doc = json.loads(cal.read_text())
        e = doc["producer"]["environment"]
        c = doc["data"]["calibration"]
        envs.append(
            {
                "run": str(cal.parent.relative_to(data)),
                "data": c.get("kind"),
                "steps x batch": f"{c['horizon']} x {c['batch']}",
                "hardware / versions": f"{e.get('gpu') or 'CPU'}, torch {e['torch']}, transformers {e['transformers']}, modelopt {e['modelopt']}",
                "elapsed s": doc["producer"].get("elapsed_s"),
            }
        )
    env_tab = pd.DataFrame(envs)
    bench = ROOT / "benchmarks" / "results" / "emulation.md"
    m = re.search(r"date (\d{4}-\d{2}-\d{2})", bench.read_text()) if bench.is_file() else None
    gpu_date = (
        f"The GPU runs come from one call of `studies/gpu_run.sh`, the same call that wrote "
        f"`benchmarks/results/emulation.md` (date {m.group(1)})."
        if m
        else ""
    )
    page = [
        "# Studies",
        "",
        "Reproducible studies of quantized SSM state (issue 8). Each folder holds a page (question, method, "
        "tables, plots, commands), its tables as markdown and CSV, and its plots; all of it is written by "
        "`python studies/make_pages.py` from the raw data in `studies/data/` (git-ignored).",
        "",
        "| study | answer (computed from the data) |",
        "|---|---|",
        *[f"| [{a['title']}]({a['folder']}/README.md) | {a['answer']} |" for a in answers],
        "",
        "## Raw data: runs, hardware and versions",
        "",
        markdown(env_tab) if len(env_tab) else "(no data)",
        "",
        gpu_date,
        "",
        "Synthetic runs (`data` = synthetic) use the presets' exact shapes with inputs from the model family's "
        "initialisation distributions, not trained weights; `shipped` runs use the tiny models trained for "
        "ssmquant (`studies/tiny_models/`) on the shipped public-domain text.",
    ]
    if stale.is_dir():
        page += [
            "",
            f"`{stale.relative_to(data)}` is not used: the GPU run of tiny-qwen did not finish in its time "
            "limit (the directory holds an earlier smoke run); study 1 uses `conv_vs_replay/tiny-qwen-cpu`.",
        ]
    page += [
        "",
        "## Commands",
        "",
        commands_block(
            [
                GPU_CMD,
                CPU_CMD,
                "python studies/make_pages.py       # every page, table and plot (about a minute)",
                "ruff check studies",
            ]
        ),
        "",
        "Smaller, CPU-only variant of every study (the pages then state those settings):",
        "",
        commands_block([SMALL_CMD]),
        "",
        "`studies/tiny_models/` documents how the shipped tiny models were trained. Speed: "
        "`benchmarks/results/emulation.md`, `benchmarks/results/analyze.md`.",
        "",
    ]
    (out / "README.md").write_text("\n".join(page))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "studies" / "data"), help="raw study data (default studies/data)")
    ap.add_argument("--out", default=str(ROOT / "studies"), help="where the study folders go (default studies/)")
    args = ap.parse_args(argv)
    data, out = pathlib.Path(args.data), pathlib.Path(args.out)
    if not data.is_dir():
        ap.error(f"{data} is not a directory: run `bash studies/gpu_run.sh` and `bash studies/cpu_run.sh` first")
    out.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.85)
    answers = []
    for build in (study_conv_vs_replay, study_buffer_length, study_granularity, study_fragile, study_speculative):
        print(f"{build.__name__} ...", flush=True)
        answers.append(build(data, out))
    write_index(data, out, answers)
    for a in answers:
        print(f"- {a['title']}: {a['answer']}")


if __name__ == "__main__":
    main()
