"""Study 2: replay buffer length L, error against state traffic (collect + page)."""

from __future__ import annotations

import math
import pathlib

import pandas as pd

from ssmquant.formats import parse as parse_format
from ssmquant.replay import parse_scheme, parse_variant
from studies.common.context import Context, load, load_runs
from studies.common.errors import Cube
from studies.common.measure import RunSpec
from studies.common.models import layer_dims
from studies.common.page import method_note, reproduce, scale_note
from studies.common.plots import PALETTE, save_fig, sns, subplots
from studies.common.tables import ci, num, ratio_ci, run_line, save_table, settings_text, short_source, span

STUDY = "buffer_length"
LENGTHS = [1, 2, 4, 8, 16, 32]
SCHEMES = ["conventional"] + [f"replay{L}" for L in LENGTHS]
SCALES = {
    "smoke": {"tiny-nemotron": (False, [0], ["fp8_e4m3", "int8"], 64, 2, [0])},
    "cpu": {
        "tiny-nemotron": (False, None, ["fp8_e4m3", "int8", "nvfp4"], 1024, 3, [0]),
        "nemotron-3-nano": (True, [0], ["fp8_e4m3"], 1024, 2, [0]),
    },
    "gpu": {
        "tiny-nemotron": (False, None, ["fp8_e4m3", "int8", "nvfp4"], 8192, 8, [0]),
        "nemotron-3-nano": (True, [0, 14, 30, 50], ["fp8_e4m3", "int8", "nvfp4"], 8192, 4, [0, 1]),
    },
}


def collect(ctx: Context) -> None:
    for model, (synthetic, layers, formats, steps, batch, seeds) in SCALES[ctx.scale].items():
        variants = [f"{f}@{s}" for f in formats for s in SCHEMES]
        ctx.run_and_store(
            STUDY,
            RunSpec(model, model, variants, steps, batch, seeds, layers, synthetic, keep_windows=False),
        )


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


def page(data: pathlib.Path, out: pathlib.Path) -> dict:
    src = data / STUDY / "data"
    folder = out / STUDY
    folder.mkdir(parents=True, exist_ok=True)
    seqs, runs = load(src, "sequences"), load_runs(src)
    models = [m for m in ("tiny-nemotron", "nemotron-3-nano") if not seqs.empty and m in set(seqs.model)]
    rows, shown, claims, plots = [], [], [], []
    gains = {"1->32": [], "16->32": [], "conv->16": []}
    for model in models:
        dims = layer_dims(model)
        sq = seqs[seqs.model == model]
        c_all, c_hz, c_st = (Cube.from_frame(sq, q, w) for q, w in (("out", "all"), ("out", "horizon"), ("state", "all")))
        encs = list(dict.fromkeys(parse_variant(v).format.name for v in c_all.variants))
        for enc in encs:
            conv_b = bytes_per_step(enc, "conventional", dims)["total"]
            series = []
            for sch in SCHEMES:
                v = f"{enc}@{sch}"
                if v not in c_all.variants:
                    continue
                med, hz = c_all.median_layer(v), c_hz.median_layer(v)
                b = bytes_per_step(enc, sch, dims)
                L = 0 if sch == "conventional" else parse_scheme(sch).buffer_len
                vs16 = c_all.ratio(v, f"{enc}@replay16") if f"{enc}@replay16" in c_all.variants else None
                rows.append(
                    {
                        "model": model,
                        "format": enc,
                        "L": L,
                        "out err all steps": med.estimate,
                        "out err lo": med.low,
                        "out err hi": med.high,
                        "out err horizon": hz.estimate,
                        "state err all steps": c_st.median_layer(v).estimate,
                        "error / replay16's": vs16.estimate if vs16 else math.nan,
                        "bytes/step/head": b["total"],
                        "of which buffer": b["buffer"],
                        "vs conventional bytes": b["total"] / conv_b,
                    }
                )
                shown.append(
                    {
                        "model": model,
                        "format": enc,
                        "scheme": sch,
                        "out err, all steps (median layer)": ci(med),
                        "out err, horizon": ci(hz),
                        "state err, all steps": num(c_st.median_layer(v).estimate),
                        "error / replay16's": ratio_ci(vs16) if vs16 else "n/a",
                        "bytes/step/head": num(b["total"]),
                        "of which buffer": num(b["buffer"]),
                        "vs conventional bytes": f"{b['total'] / conv_b:.2f}",
                    }
                )
                series.append((L, med.estimate))
            reps = [(L, e) for L, e in series if L > 0]
            mono = all(b < a for (_, a), (_, b) in zip(reps, reps[1:]))
            r1_32 = c_all.ratio(f"{enc}@replay1", f"{enc}@replay32")
            r16_32 = c_all.ratio(f"{enc}@replay16", f"{enc}@replay32")
            conv16 = c_all.ratio(f"{enc}@conventional", f"{enc}@replay16")
            gains["1->32"].append(r1_32.estimate)
            gains["16->32"].append(r16_32.estimate)
            gains["conv->16"].append(conv16.estimate)
            claims.append(
                f"**{model}, {enc}**: the error {'falls monotonically' if mono else 'does not fall monotonically'} with L; "
                f"replay1 / replay32 {ratio_ci(r1_32)}, replay16 / replay32 {ratio_ci(r16_32)}, conventional / replay16 "
                f"{ratio_ci(conv16)}"
            )
        plots.append(model)
    tab = pd.DataFrame(rows)
    md = save_table(tab, folder, "buffer_length", pd.DataFrame(shown))
    ftab = []
    for model in models:
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
    fewest = sorted(
        {int(g.loc[g["bytes/step/head"].idxmin(), "L"]) for _, g in tab[tab.L > 0].groupby(["model", "format"])}
    ) if len(tab) else []
    n_mono = sum("falls monotonically" in c for c in claims)
    answer = (
        f"the error falls with L in {n_mono} of {len(claims)} (model, format) series (replay1 -> replay32: "
        f"{span(gains['1->32'])} lower; replay16 -> replay32: {span(gains['16->32'])}; conventional -> replay16: "
        f"{span(gains['conv->16'])}); bytes moved per step are fewest at L = {', '.join(str(x) for x in fewest)}"
    )
    png = plot_buffer(tab, models, runs, folder) if len(tab) else None
    scales = {r.get("scale") for r in runs.values()}
    text = [
        "# Study 2: replay buffer length",
        "",
        scale_note(scales),
        "",
        "**Question.** With checkpoint-plus-replay decoding the checkpoint is rounded once per L tokens. How does "
        "the error change with L in {1, 2, 4, 8, 16, 32} for each format (conventional decoding as the reference, "
        "same inputs), and what does each L cost in state bytes moved per decode step?",
        "",
        "## Data",
        "",
        *[run_line(runs[m]) for m in models],
        "",
        "## Method",
        "",
        method_note(),
        "",
        "Bytes moved per head per decode step, for a head whose state is d x n (Mamba-2: head_dim x state):",
        "",
        "- **S** = one head's stored state = `StateFormat.bytes_per_state((H, d, n)) / H` (elements + scales);",
        "- **e** = one buffer entry per head = 2d (x_t, bf16) + 2n G/H (B_t, bf16, shared by the H/G heads of a "
        "group) + 4 (dt_t, FP32);",
        "- **conventional**: read + write the state every step: **2S**;",
        "- **replay(L)**: read the checkpoint every step, write it once per L steps, append one buffer entry and "
        "read the h entries held ((L+1)/2 on average): **S (1 + 1/L) + e (1 + (L+1)/2)**, fewest at L* = sqrt(2S/e).",
        "",
        "The model counts the state and the buffer only (not the current token's x_t, C_t, which both schemes "
        "read). A kernel's real traffic also depends on caching.",
        "",
        fmd,
        "",
        "## Results",
        "",
        md,
        "",
        f"![buffer length]({png})" if png else "",
        "",
        "## What the table shows",
        "",
        *[f"- {c}" for c in claims],
        "",
        "## Synthetic vs real",
        "",
        "nemotron-3-nano is synthetic (`init` profile); tiny-nemotron is a real trained model on real text, but "
        "tiny. The byte model depends on the model only through d, n and G/H, so it carries over to a real "
        "checkpoint of the same shapes; the error levels do not.",
        "",
        "## Reproduce",
        "",
        reproduce(STUDY),
        "",
    ]
    (folder / "README.md").write_text("\n".join(text))
    return {"folder": STUDY, "title": "Buffer length", "answer": answer}


ERR, BYTES = "out err all steps", "bytes/step/head"


def plot_buffer(tab: pd.DataFrame, models: list[str], runs: dict, folder: pathlib.Path) -> str:
    fig, axes = subplots(len(models), 2, 6.0, 4.4)
    for i, model in enumerate(models):
        t = tab[tab.model == model]
        rep, conv = t[t.L > 0], t[t.L == 0]
        ax = axes[i][0]
        for enc, g in rep.groupby("format", sort=False):
            g = g.sort_values("L")
            ax.errorbar(
                g["L"], g[ERR], yerr=[g[ERR] - g["out err lo"], g["out err hi"] - g[ERR]],
                marker="o", color=PALETTE[enc], label=enc, capsize=3,
            )  # fmt: skip
        for _, r in conv.iterrows():
            ax.axhline(r[ERR], color=PALETTE[r["format"]], ls=":", lw=1.2)
        ax.set(xscale="log", yscale="log", xlabel="replay buffer length L", ylabel="output error, all steps (median layer)")
        ax.set_xticks(LENGTHS, labels=[str(x) for x in LENGTHS])
        ax.set_title(f"{model} ({short_source(runs[model]['data_source'])}): error vs L (dotted: conventional)", fontsize=9)
        ax.legend(title="format", fontsize=8)
        ax = axes[i][1]
        sns.lineplot(data=rep, x=BYTES, y=ERR, hue="format", palette=PALETTE, marker="o", sort=False, ax=ax, legend=False)
        for _, r in rep.iterrows():
            ax.annotate(f"L={int(r['L'])}", (r[BYTES], r[ERR]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for _, r in conv.iterrows():
            ax.scatter([r[BYTES]], [r[ERR]], marker="X", s=70, color=PALETTE[r["format"]], edgecolor="k", zorder=5)
        ax.set(yscale="log", xlabel="state + buffer bytes moved per head per decode step", ylabel="output error, all steps")
        ax.set_title(f"{model}: error vs bytes (X: conventional)\n{settings_text(runs[model])}", fontsize=9)
    fig.suptitle("Replay buffer length: accuracy vs state traffic (bars: 95% bootstrap intervals)", fontsize=10)
    return save_fig(fig, folder, "buffer_length.png")


__all__ = ["bytes_per_step", "collect", "page"]
