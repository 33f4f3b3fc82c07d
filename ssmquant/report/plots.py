"""Error-drift plots (seaborn) from an analysis' saved tables.

- drift.png: relative output and state error vs decode step (log-log), one line per variant (colour =
  format, dashes = scheme), for the worst and the median layer;
- heatmap.png: layers x variants, output error at the horizon (log colour scale);
- heads.png: per-head output error at the horizon for the worst layer, per variant.

Every title names the model, the data source and the settings.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

PLOT_FILES = ("drift.png", "heatmap.png", "heads.png")


def subtitle(report: dict) -> str:
    """'model · data source · settings' for plot titles."""
    src = report.get("data_source", {})
    s = report.get("settings", {})
    kind = src.get("kind", "?")
    data = {"synthetic": "synthetic inputs", "shipped": "shipped trained model", "checkpoint": "checkpoint"}.get(
        kind, kind
    )
    profile = src.get("synthetic_profile")
    if kind == "synthetic" and profile and profile != "init":
        data += f" ({profile} stress profile)"
    text = src.get("text", {}).get("origin")
    if text and kind != "synthetic":
        data += f", text {pathlib.Path(str(text)).name}"
    return (
        f"{report.get('model')} · {data} · batch {s.get('batch')}, {s.get('steps')} steps, "
        f"L={s.get('buffer_len')}, seed {s.get('seed')}"
    )


def _split_variant(df: pd.DataFrame) -> pd.DataFrame:
    parts = df["variant"].str.split("@", n=1, expand=True)
    return df.assign(format=parts[0], scheme=parts[1])


def pick_layers(summary: pd.DataFrame) -> tuple[int, int]:
    """(worst, median) layer by the largest output error at the horizon over variants."""
    per_layer = summary.groupby("layer")["out_rel_err"].max().sort_values()
    worst = int(per_layer.index[-1])
    median = int(per_layer.index[(len(per_layer) - 1) // 2])
    return worst, median


def drift_plot(traces: pd.DataFrame, summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    worst, median = pick_layers(summary)
    layers = [worst] if worst == median else [worst, median]
    fig, axes = plt.subplots(2, len(layers), figsize=(6.5 * len(layers), 9), squeeze=False, sharex=True)
    data = _split_variant(traces[traces.layer.isin(layers)])
    for col, layer in enumerate(layers):
        for row, (metric, label) in enumerate((("out_rel_err", "output"), ("state_rel_err", "state"))):
            ax = axes[row, col]
            d = data[(data.layer == layer) & (data[metric] > 0) & np.isfinite(data[metric])]
            if d.empty:
                ax.text(0.5, 0.5, "zero error (fp32)", ha="center", transform=ax.transAxes)
            else:
                sns.lineplot(data=d, x="step", y=metric, hue="format", style="scheme", ax=ax, linewidth=1.2)
                ax.set_xscale("log")
                ax.set_yscale("log")
            which = "worst" if layer == worst else "median"
            ax.set_title(f"layer {layer} ({which}): {label} error")
            ax.set_xlabel("decode step")
            ax.set_ylabel(f"relative {label} error ||e|| / ||ref||")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend() is not None:
                ax.legend(fontsize=8, title="format / scheme", title_fontsize=8)
    fig.suptitle(f"Error drift over the decode horizon\n{subtitle(report)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heatmap_plot(summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    table = summary.pivot_table(index="layer", columns="variant", values="out_rel_err", aggfunc="first")
    positive = table.where(table > 0)
    fig, ax = plt.subplots(figsize=(1.3 * len(table.columns) + 3, 0.35 * len(table) + 2.5))
    finite = positive.stack()
    if finite.empty:
        sns.heatmap(table, annot=True, fmt=".1e", cmap="viridis", ax=ax, cbar_kws={"label": "relative output error"})
    else:
        norm = LogNorm(vmin=float(finite.min()), vmax=float(finite.max()))
        sns.heatmap(
            positive,
            annot=table.map(lambda v: f"{v:.1e}"),
            fmt="",
            cmap="viridis",
            norm=norm,
            ax=ax,
            annot_kws={"fontsize": 7},
            cbar_kws={"label": "relative output error (log scale)"},
        )
    ax.set_xlabel("variant (format@scheme)")
    ax.set_ylabel("SSM layer (decoder index)")
    horizon = int(summary["horizon"].max())
    ax.set_title(f"Output error at step {horizon}, per layer and variant\n{subtitle(report)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heads_plot(heads: pd.DataFrame, summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    worst, _ = pick_layers(summary)
    d = heads[(heads.layer == worst) & (heads.step == heads.step.max())]
    d = _split_variant(d[d.out_rel_err > 0])
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * d.variant.nunique() + 3), 5))
    if d.empty:
        ax.text(0.5, 0.5, "zero error (fp32)", ha="center", transform=ax.transAxes)
    else:
        sns.boxplot(data=d, x="variant", y="out_rel_err", hue="format", ax=ax, fliersize=0, legend=False)
        sns.stripplot(data=d, x="variant", y="out_rel_err", color="k", size=2.5, alpha=0.6, ax=ax)
        ax.set_yscale("log")
    ax.set_xlabel("variant (format@scheme)")
    ax.set_ylabel("relative output error per head")
    ax.tick_params(axis="x", rotation=30)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.set_title(
        f"Per-head output error at step {int(heads.step.max())}, worst layer {worst}\n{subtitle(report)}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_all(traces: pd.DataFrame, heads: pd.DataFrame, summary: pd.DataFrame, report: dict, out_dir) -> list[str]:
    """Write the three plots into out_dir; returns their file names."""
    out_dir = pathlib.Path(out_dir)
    sns.set_theme(style="whitegrid", context="notebook")
    drift_plot(traces, summary, report, out_dir / PLOT_FILES[0])
    heatmap_plot(summary, report, out_dir / PLOT_FILES[1])
    heads_plot(heads, summary, report, out_dir / PLOT_FILES[2])
    return list(PLOT_FILES)
