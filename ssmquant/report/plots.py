"""Error-drift plots (seaborn) from an analysis' saved tables.

- drift.png: relative output and state error vs decode step (log-log), one line per variant (colour =
  format, dashes = scheme), for the worst and the median layer;
- heatmap.png: layers x variants, output error at the horizon (log colour scale);
- heads.png: per-head output error at the horizon for the worst layer, per variant.

Every title names the model, the data source and the settings; every plot lists the variants in the
run's order (``variant_order``).
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
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from .files import PLOT_FILES  # noqa: E402


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


def variant_order(summary: pd.DataFrame) -> list[str]:
    """The run's variant order (formats x roundings x schemes, as the user listed them): one order for
    the terminal table, summary.csv and every plot."""
    return list(dict.fromkeys(summary["variant"]))


def _levels(order: list[str]) -> tuple[list[str], list[str]]:
    """(formats, schemes) in the order the variants list them."""
    parts = [v.split("@", 1) for v in order]
    return list(dict.fromkeys(p[0] for p in parts)), list(dict.fromkeys(p[1] if len(p) > 1 else "" for p in parts))


def first_write(scheme: str, report: dict | None = None) -> int:
    """The 1-based step of a scheme's first state write (1 conventional, L replay(L)); 1 when unknown.
    Read from report.json's ``first_write_steps`` when it has the scheme, else computed from the scheme."""
    known = (report or {}).get("first_write_steps") or {}
    if scheme in known:
        return int(known[scheme])
    # torch (which the schemes' write masks need) is imported only for a report written without the steps: plotting
    # an output needs no torch otherwise
    from ..replay.schemes import SchemeError, parse_scheme
    try:
        sch = parse_scheme(scheme)
    except SchemeError:
        return 1
    mask = sch.write_mask(1, 4 * sch.buffer_len)[0]
    return int(mask.nonzero()[0, 0]) + 1 if bool(mask.any()) else 1


def pick_layers(summary: pd.DataFrame) -> tuple[int, int]:
    """(worst, median) layer by the largest output error at the horizon over variants."""
    per_layer = summary.groupby("layer")["out_rel_err"].max().sort_values()
    worst = int(per_layer.index[-1])
    median = int(per_layer.index[(len(per_layer) - 1) // 2])
    return worst, median


_DASHES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3))]


def drift_plot(traces: pd.DataFrame, summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    _save(drift_figure(traces, summary, report), path)


def heatmap_plot(summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    _save(heatmap_figure(summary, report), path)


def _save(fig, path: pathlib.Path) -> None:
    fig.savefig(path, dpi=120)
    plt.close(fig)


def drift_figure(traces: pd.DataFrame, summary: pd.DataFrame, report: dict):
    """Output (top) and state (bottom) error vs step, log-log, for the worst and the median layer.

    One legend for the figure. Colour = format, line style = scheme; formats are drawn widest first, so
    curves that coincide (replay before its first flush, where only the input buffer is rounded) stay
    visible as nested stripes, and each replay scheme's first flush is marked. Exactly-zero errors (no
    place on a log axis) are drawn as triangles on the bottom edge.
    """
    worst, median = pick_layers(summary)
    layers = [worst] if worst == median else [worst, median]
    order = variant_order(summary)
    formats, schemes = _levels(order)
    colours = dict(zip(formats, sns.color_palette("deep", len(formats))))
    dashes = {sch: _DASHES[i % len(_DASHES)] for i, sch in enumerate(schemes)}
    widths = dict(zip(formats, np.linspace(2.6, 1.0, len(formats)) if len(formats) > 1 else [1.4]))
    flushes = {sch: step for sch in schemes if (step := first_write(sch, report)) > 1}
    fig, axes = plt.subplots(
        2, len(layers), figsize=(6.2 * len(layers) + 2.4, 9), squeeze=False, sharex=True, layout="constrained"
    )
    data = _split_variant(traces[traces.layer.isin(layers)])
    marker_sizes = dict(zip(formats, np.linspace(70, 22, len(formats)) if len(formats) > 1 else [36]))
    zeros_drawn = False
    for col, layer in enumerate(layers):
        for row, (metric, label) in enumerate((("out_rel_err", "output"), ("state_rel_err", "state"))):
            ax = axes[row, col]
            d = data[data.layer == layer]
            positive = d[(d[metric] > 0) & np.isfinite(d[metric])]
            which = "worst" if layer == worst else "median"
            ax.set_title(f"layer {layer} ({which}): {label} error")
            ax.set_xlabel("decode step" if row == 1 else "")
            ax.set_ylabel(f"relative {label} error ||e|| / ||ref||")
            if positive.empty:
                ax.text(0.5, 0.5, "zero error at every step", ha="center", transform=ax.transAxes)
                continue
            for v in order:
                f, sch = v.split("@", 1) if "@" in v else (v, "")
                dv = positive[positive.variant == v]
                ax.plot(dv.step, dv[metric], color=colours[f], linestyle=dashes[sch], linewidth=widths[f])
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # a run of < 1 decade labels every minor tick: crowded
            ax.grid(True, which="both", alpha=0.3)
            floor = ax.get_ylim()[0]
            for v in order:
                z = d[(d.variant == v) & (d[metric] == 0)]
                if len(z):
                    f = v.split("@", 1)[0]
                    ax.scatter(z.step, np.full(len(z), floor), marker="v", s=marker_sizes[f], color=colours[f],
                               clip_on=False, zorder=5)  # fmt: skip
                    zeros_drawn = True
            ax.set_ylim(bottom=floor)
            for sch, step in flushes.items():
                ax.axvline(step, color="0.45", linestyle=dashes[sch], linewidth=0.9, alpha=0.7)
    handles = [Line2D([], [], color=colours[f], linewidth=2.2, label=f) for f in formats]
    handles += [Line2D([], [], color="0.3", linestyle=dashes[s], linewidth=1.4, label=s or "conventional") for s in schemes]
    if zeros_drawn:
        handles.append(Line2D([], [], color="0.3", marker="v", linestyle="none", label="error exactly 0"))
    for sch, step in flushes.items():
        handles.append(Line2D([], [], color="0.45", linestyle=dashes[sch], linewidth=0.9, label=f"{sch}: 1st flush, step {step}"))
    fig.legend(handles=handles, loc="outside right upper", title="format / scheme", fontsize=9, title_fontsize=9)
    note = ""
    if flushes:
        note = "\nbefore a replay scheme's first flush only its input buffer is rounded: its curves coincide for all formats"
    fig.suptitle(f"Error drift over the decode horizon\n{subtitle(report)}{note}", fontsize=11)
    return fig


def heatmap_figure(summary: pd.DataFrame, report: dict):
    """Layers x variants, output error at the horizon, log colour scale, variants in the run's order."""
    order = variant_order(summary)
    table = summary.pivot_table(index="layer", columns="variant", values="out_rel_err", aggfunc="first")[order]
    table.columns = [v.replace("@", "\n@") for v in order]  # two short lines instead of long rotated labels
    positive = table.where(table > 0)
    fig, ax = plt.subplots(
        figsize=(1.25 * len(table.columns) + 3.2, 0.42 * len(table) + 2.6), layout="constrained"
    )
    finite = positive.stack()
    label = "relative output error"
    if finite.empty:
        sns.heatmap(table, annot=True, fmt=".1e", cmap="viridis", ax=ax, cbar_kws={"label": label})
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
            cbar_kws={"label": f"{label} (log scale)"},
        )
    ax.tick_params(axis="x", rotation=0, labelsize=8)
    ax.tick_params(axis="y", rotation=0)
    ax.set_xlabel("variant (format @ scheme)")
    ax.set_ylabel("SSM layer (decoder index)")
    horizon = int(summary["horizon"].max())
    ax.set_title(f"Output error at step {horizon}, per layer and variant\n{subtitle(report)}", fontsize=10)
    return fig


def heads_plot(heads: pd.DataFrame, summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    worst, _ = pick_layers(summary)
    d = heads[(heads.layer == worst) & (heads.step == heads.step.max())]
    d = _split_variant(d[d.out_rel_err > 0])
    order = [v for v in variant_order(summary) if v in set(d.variant)]
    formats, _ = _levels(variant_order(summary))
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(order) + 3), 5), layout="constrained")
    if d.empty:
        ax.text(0.5, 0.5, "zero error (fp32)", ha="center", transform=ax.transAxes)
    else:
        sns.boxplot(data=d, x="variant", y="out_rel_err", hue="format", order=order, hue_order=formats,
                    palette=dict(zip(formats, sns.color_palette("deep", len(formats)))), ax=ax, fliersize=0,
                    legend=False)  # fmt: skip
        # seaborn's jitter draws from numpy's global generator (seaborn/categorical.py, 0.13): a fixed seed
        # makes the PNG the same in every process and run
        state = np.random.get_state()
        np.random.seed(0)
        try:
            sns.stripplot(data=d, x="variant", y="out_rel_err", order=order, color="k", size=2.5, alpha=0.6, ax=ax)
        finally:
            np.random.set_state(state)
        ax.set_yscale("log")
    ax.set_xlabel("variant (format@scheme)")
    ax.set_ylabel("relative output error per head")
    ax.tick_params(axis="x", rotation=30)
    plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.set_title(
        f"Per-head output error at step {int(heads.step.max())}, worst layer {worst}\n{subtitle(report)}", fontsize=10
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _theme() -> None:
    sns.set_theme(style="whitegrid", context="notebook")


def warm_up() -> None:
    """Set the theme and draw a throwaway figure, which loads the fonts (about 0.5 s of the first plot)."""
    _theme()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.set_title("warm-up")
    ax.set_yscale("log")
    ax.plot([1, 10], [1e-3, 1e-1])
    fig.canvas.draw()
    plt.close(fig)


def render_one(
    name: str, traces: pd.DataFrame, heads: pd.DataFrame, summary: pd.DataFrame, report: dict, out_dir
) -> str:
    """Write the plot ``name`` (one of PLOT_FILES) into out_dir; returns its file name."""
    path = pathlib.Path(out_dir) / name
    _theme()
    if name == "drift.png":
        drift_plot(traces, summary, report, path)
    elif name == "heatmap.png":
        heatmap_plot(summary, report, path)
    elif name == "heads.png":
        heads_plot(heads, summary, report, path)
    else:
        raise ValueError(f"unknown plot {name!r}; plots: {', '.join(PLOT_FILES)}")
    return name


def render_all(traces: pd.DataFrame, heads: pd.DataFrame, summary: pd.DataFrame, report: dict, out_dir) -> list[str]:
    """Write the three plots into out_dir; returns their file names."""
    return [render_one(name, traces, heads, summary, report, out_dir) for name in PLOT_FILES]
