"""The evaluation's plot (seaborn): KL(p_fp32 || p_variant) vs position, one line per variant.

kl.png: per-position KL (mean over the sequences) as thin faint lines, a centred rolling mean over a few
positions as the bold line (a run too short to smooth shows the per-position lines alone, and says so), log y;
colour = format, dashes = scheme, as analyze's plots draw variants (``report.plots.variant_styles``); the
horizon window shaded.
Variants whose KL is 0 at every position (fp32) cannot sit on a log axis: a note names them. The title
names the model, the data source and the settings.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from ..report.plots import LINE_WIDTH, variant_styles  # noqa: E402

PLOT_FILES = ("kl.png",)
RAW_WIDTH = 0.6  # the per-position lines under a rolling mean
BOLD_WIDTH = 2.2  # the rolling mean


def subtitle(report: dict) -> str:
    """'model · data source · settings' for the plot title."""
    src = report.get("data_source", {})
    s = report.get("settings", {})
    env = report.get("environment", {})
    kind = src.get("kind", "?")
    data = {"shipped": "shipped trained model", "checkpoint": "checkpoint"}.get(kind, kind)
    text = src.get("text", {}).get("origin")
    if text:
        data += f", held-out text {pathlib.Path(str(text).removeprefix('shipped:')).name}"
    return (
        f"{report.get('model')} · {data} · batch {s.get('batch')}, {s.get('steps')} steps, seed {s.get('seed')}, "
        f"{env.get('device', '?')}, {env.get('weights_dtype', '?')} weights, fp32 state"
    )


def smoothing_window(steps: int) -> int:
    """Positions per rolling mean: about 1/50 of the horizon, at least 1."""
    return max(1, steps // 50)


def kl_figure(positions: pd.DataFrame, summary: pd.DataFrame, report: dict):
    """The KL-vs-position figure (``kl_plot`` writes it). Variants are styled as in analyze's plots
    (``report.plots.variant_styles``: colour = format, dashes = scheme). With a smoothing window of at least 2
    positions each variant is a thin faint per-position line and a bold rolling mean; with a window of 1 (a run
    under 100 positions) there is nothing to smooth and each variant is its per-position line alone, as the axis
    label then says."""
    steps = int(positions["position"].max())
    window = smoothing_window(steps)
    ref = report.get("reference", {})
    batch = report.get("settings", {}).get("batch")
    names = list(summary["variant"])
    positive = [n for n in names if (positions.loc[positions.variant == n, "kl"] > 0).any()]
    zero = [n for n in names if n not in positive]
    styles, _, _ = variant_styles(names)
    horizon_of = dict(zip(summary["variant"], summary["kl_horizon"]))

    fig, ax = plt.subplots(figsize=(10.5, 6.8), layout="constrained")
    for name in positive:
        d = positions[positions.variant == name].sort_values("position")
        kl = d["kl"].to_numpy()
        kl = np.where(kl > 0, kl, np.nan)
        label = f"{name}  (horizon KL {horizon_of[name]:.2e})"
        if window > 1:
            smooth = pd.Series(kl).rolling(window, center=True, min_periods=1).mean().to_numpy()
            ax.plot(d["position"], kl, color=styles[name]["color"], alpha=0.25, linewidth=RAW_WIDTH)
            ax.plot(d["position"], smooth, linewidth=BOLD_WIDTH, label=label, **styles[name])
        else:
            ax.plot(d["position"], kl, linewidth=LINE_WIDTH, label=label, **styles[name])
    if positive:
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "KL = 0 at every position for every variant", ha="center", transform=ax.transAxes)
    if ref.get("horizon_from"):
        ax.axvspan(ref["horizon_from"] - 0.5, steps + 0.5, color="0.85", alpha=0.5, zorder=0, label="horizon window")
    notes = []
    if zero:
        notes.append("KL = 0 at every position (not on a log axis): " + ", ".join(zero))
    leading: dict[int, list[str]] = {}  # positions before a variant's first stored state: KL exactly 0, off the axis
    for name in positive:
        kl = positions[positions.variant == name].sort_values("position")["kl"].to_numpy()
        n = int(np.argmax(kl > 0))
        if n:
            leading.setdefault(n, []).append(name)
    for n, group in sorted(leading.items()):
        notes.append(f"KL = 0 at positions 1-{n} (nothing stored yet; not on a log axis): " + ", ".join(group))
    if notes:
        ax.text(0.01, 0.01, "\n".join(notes), transform=ax.transAxes, fontsize=8, va="bottom")
    ax.set_xlabel("position (tokens read; the next one is predicted)")
    lines = (f"thin: per position; bold: centred rolling mean of {window} positions" if window > 1
             else "per position (too few positions to smooth)")  # fmt: skip
    ax.set_ylabel(f"KL(p_fp32 || p_variant), nats, mean over {batch} sequences\n{lines}")
    ax.set_xlim(1, steps)
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8, title_fontsize=8,
                   title="variant (format@scheme): colour = format, dashes = scheme, as in `ssmquant analyze`")  # fmt: skip
    ax.set_title(f"Next-token KL vs FP32-state model, end to end\n{subtitle(report)}", fontsize=10)
    return fig


def kl_plot(positions: pd.DataFrame, summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    fig = kl_figure(positions, summary, report)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_all(positions: pd.DataFrame, summary: pd.DataFrame, report: dict, out_dir) -> list[str]:
    """Write the plots into out_dir; returns their file names."""
    out_dir = pathlib.Path(out_dir)
    sns.set_theme(style="whitegrid", context="notebook")
    kl_plot(positions, summary, report, out_dir / PLOT_FILES[0])
    return list(PLOT_FILES)
