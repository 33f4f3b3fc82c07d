"""Error-drift plots (seaborn) from an analysis' saved tables.

- drift.png: relative output and state error vs decode step (log-log), one line per variant (colour =
  format, dashes = scheme, one line width), for the worst and the median layer; the output panels add each
  window's worst step (thin) and the verdict's budget (a horizontal line);
- heatmap.png: layers x variants, the worst-step output error of the run (the verdict's statistic) on one fixed
  log colour scale (HEATMAP_VMIN..HEATMAP_VMAX in every run, so two runs compare by eye), the budget marked on the
  colour bar and the cells over it outlined;
- heads.png: per-head output error (worst step of the last window) of the worst layer against the head index,
  one line per variant, with the budget.

Every title names the model, the data source and the settings; every plot lists the variants in the run's order
(``variant_order``) and styles them alike (``variant_styles``; the eval plot follows it too). Nothing here imports
torch (a plotting process needs nothing else of it), so the constants of ``analysis.fit`` it needs are repeated
here and a test holds them equal.
"""

from __future__ import annotations

import pathlib
import textwrap

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FixedFormatter,
    FixedLocator,
    LogFormatterSciNotation,
    MaxNLocator,
    NullFormatter,
)

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
        f"{report.get('model')} · {data} · batch {s.get('batch')}, "
        + (f"{s['prompt']}-token prompt, then " if s.get("prompt") else "")
        + f"{s.get('steps')} decode steps, "
        # the buffer length of a bare "replay" (replay<L> and spec<L>x<T> name theirs; conventional has none)
        + (f"L={s.get('buffer_len')}, " if "replay" in [str(x) for x in s.get("schemes") or []] else "")
        + f"seed {s.get('seed')}"
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
FORMAT_PALETTE = "deep"
LINE_WIDTH = 1.8  # every variant's line: a wider line would read as a more important format
PEAK_LINE_WIDTH = 0.8  # the windows' worst steps, thin and faint beside their means
BUDGET_COLOUR = "#b2182b"
BUDGET_STYLE = {"color": BUDGET_COLOUR, "linestyle": (0, (6, 3)), "linewidth": 1.4}
# The heatmap's colour scale, the same in every run so that two heatmaps compare by eye: from 1e-5, below the
# smallest non-zero error the studies record (fp16 and the fp32-buffered replays: about 1e-4), to 1, the relative
# error at which analysis.fit.DIVERGED calls a run diverged (the error as large as the signal). Values outside are
# drawn in the end colours (the colour bar's triangles); zero errors (fp32) are left blank.
HEATMAP_VMIN = 1e-5
HEATMAP_VMAX = 1.0
DIVERGED = 1.0  # analysis.fit.DIVERGED (not imported: analysis imports torch)
MAX_STEP_TICKS = 7
HEATMAP_MAX_COLUMNS = 12  # variants across; more go down the figure, one row each
HEATMAP_MIN_SIZE = (7.5, 4.8)  # inches: the wrapped title and the colour bar's three-line label fit
MIN_WIDTH = 10.5  # inches: the title's settings line and a legend row fit in a one-layer figure


def variant_styles(order: list[str]) -> tuple[dict[str, dict], dict[str, tuple], dict[str, object]]:
    """({variant: {"color", "linestyle"}}, {format: colour}, {scheme: dashes}) for the variants in ``order``:
    colour = the format (with its rounding, the part before '@'), dashes = the scheme (the part after it), in the
    order the run lists them. Every plot of analyze and eval draws variants this way."""
    formats, schemes = _levels(order)
    colours = dict(zip(formats, sns.color_palette(FORMAT_PALETTE, len(formats))))
    dashes = {sch: _DASHES[i % len(_DASHES)] for i, sch in enumerate(schemes)}
    styles = {}
    for v in order:
        f, sch = v.split("@", 1) if "@" in v else (v, "")
        styles[v] = {"color": colours[f], "linestyle": dashes[sch]}
    return styles, colours, dashes


def style_handles(colours: dict, dashes: dict) -> list[Line2D]:
    """Legend entries: one per format (its colour), one per scheme (its dashes)."""
    handles = [Line2D([], [], color=c, linewidth=LINE_WIDTH, label=f) for f, c in colours.items()]
    handles += [Line2D([], [], color="0.3", linestyle=d, linewidth=LINE_WIDTH, label=s or "conventional")
                for s, d in dashes.items()]  # fmt: skip
    return handles


def budget_of(report: dict) -> float | None:
    """The verdict's budget recorded in report.json (None for an output written before it had one)."""
    value = (report.get("budget") or {}).get("value", (report.get("settings") or {}).get("budget"))
    return float(value) if value is not None else None


def step_label(step: int) -> str:
    """A decode step as a tick label: 16, 512, 4K, 128K."""
    return f"{step // 1024}K" if step >= 1024 and step % 1024 == 0 else str(step)


def step_ticks(lo: float, hi: float, max_ticks: int = MAX_STEP_TICKS) -> tuple[list[int], list[int]]:
    """(labelled, unlabelled) ticks of a log step axis over [lo, hi]: powers of two (the flush cycles and window
    lengths are), every k-th one so that at most ``max_ticks`` are labelled, always at least two (the ends of a
    run shorter than one octave); the rest of the powers of two are unlabelled minor ticks."""
    lo, hi = max(1, int(np.ceil(lo))), max(1, int(np.floor(hi)))
    powers = [2**k for k in range(int(np.log2(hi)) + 1) if lo <= 2**k <= hi]
    stride = max(1, -(-len(powers) // max_ticks))
    major = powers[::-1][::stride][::-1]  # counted from the top: the largest power is labelled
    if not major or hi / major[-1] >= 1.5:
        major.append(hi)  # the horizon, where the largest power lies well below it
    if len(major) < 2 and lo < hi:
        major = [lo, *[m for m in major if m != lo]]
    major = sorted(set(major))
    return major, [p for p in powers if p not in major]


STEP_AXIS_PAD = (0.12, 0.03)  # fractions of the step axis left free before the first step and after the last


def set_step_axis(ax, lo: float, hi: float) -> None:
    """A log step axis over [lo, hi] with readable tick labels (``step_ticks``), padded so that what is drawn at lo
    sits well inside the frame: replay's first flush is the first window's end, and its marker, at matplotlib's
    default margin, was hard to tell from the frame's edge."""
    left, right = STEP_AXIS_PAD
    length = max(np.log10(hi / lo) if hi > lo else 0.0, np.log10(2.0)) / (1 - left - right)
    ax.set_xscale("log")
    ax.set_xlim(lo / 10 ** (left * length), hi * 10 ** (right * length))
    major, minor = step_ticks(lo, hi)
    ax.xaxis.set_major_locator(FixedLocator(major))
    ax.xaxis.set_major_formatter(FixedFormatter([step_label(t) for t in major]))
    ax.xaxis.set_minor_locator(FixedLocator(minor))
    ax.xaxis.set_minor_formatter(NullFormatter())


def drift_plot(traces: pd.DataFrame, summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    _save(drift_figure(traces, summary, report), path)


def heatmap_plot(summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    _save(heatmap_figure(summary, report), path)


def heads_plot(heads: pd.DataFrame, summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    _save(heads_figure(heads, summary, report), path)


def _save(fig, path: pathlib.Path) -> None:
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _legend_below(fig, handles: list, title: str) -> None:
    """One legend for the figure, below the panels (beside them it ran into the title of a narrow figure), in as
    many columns as the figure's width holds."""
    ncols = max(1, min(len(handles), int(fig.get_figwidth() // 3.4)))
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, title=title, fontsize=9, title_fontsize=9,
               frameon=True)  # fmt: skip


def drift_figure(traces: pd.DataFrame, summary: pd.DataFrame, report: dict):
    """Output (top) and state (bottom) error vs step, log-log, for the worst and the median layer.

    One legend for the figure, below the panels. Colour = format, line style = scheme, one line width; the thick
    line is each window's mean (RMS over its steps); in the output panels a thin faint line of the same style is
    each window's worst step, the statistic the budget (the horizontal line) is compared with. A window's value is
    drawn over the steps it covers (from its first step to its last), so every curve starts at step 1 whatever the
    window length (a window holds whole flush cycles of every scheme). Each replay scheme's first flush is marked
    (curves before it coincide for all formats: only the input buffer is rounded). Exactly-zero errors (no place
    on a log axis) are drawn as triangles in a band at the bottom of the panel, one row per variant, over the
    windows where they occur. The step axis is labelled at powers of two and padded so that no marker sits on the
    frame.
    """
    worst, median = pick_layers(summary)
    layers = [worst] if worst == median else [worst, median]
    order = variant_order(summary)
    styles, colours, dashes = variant_styles(order)
    budget = budget_of(report)
    flushes = {sch: step for sch in dashes if (step := first_write(sch, report)) > 1}
    fig, axes = plt.subplots(
        2, len(layers), figsize=(max(MIN_WIDTH, 6.2 * len(layers) + 0.6), 10), squeeze=False, sharex=True,
        layout="constrained",
    )
    data = _split_variant(traces[traces.layer.isin(layers)])
    has_max = "out_rel_err_max" in data.columns
    starts = data.window_start if "window_start" in data.columns else data.step
    lo = float(min([*starts[starts > 0], *flushes.values()], default=1))
    hi = float(max(data.step.max() if len(data) else 1, lo))
    flushes = {sch: step for sch, step in flushes.items() if step <= hi}  # a flush after the run marks nothing
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
            set_step_axis(ax, lo, hi)
            if positive.empty:
                ax.text(0.5, 0.5, "zero error at every step", ha="center", transform=ax.transAxes)
                continue
            for v in order:
                dv = positive[positive.variant == v]
                ax.plot(*_over_windows(dv, metric), linewidth=LINE_WIDTH, **styles[v])
                if row == 0 and has_max:
                    dm = d[(d.variant == v) & (d.out_rel_err_max > 0) & np.isfinite(d.out_rel_err_max)]
                    ax.plot(*_over_windows(dm, "out_rel_err_max"), linewidth=PEAK_LINE_WIDTH, alpha=0.5, **styles[v])
            if row == 0 and budget is not None:
                ax.axhline(budget, zorder=1.5, **BUDGET_STYLE)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            zeros = [(v, d[(d.variant == v) & (d[metric] == 0)]) for v in order]
            zeros = [(v, z) for v, z in zeros if len(z)]
            if zeros:
                _zero_band(ax, zeros, styles)
                zeros_drawn = True
            for sch, step in flushes.items():
                ax.axvline(step, color="0.45", linestyle=dashes[sch], linewidth=0.9, alpha=0.7)
    handles = style_handles(colours, dashes)
    if has_max:
        handles.append(Line2D([], [], color="0.3", linewidth=PEAK_LINE_WIDTH, alpha=0.5,
                              label="thin: worst step of each window (output)"))  # fmt: skip
    if budget is not None:
        handles.append(Line2D([], [], label=f"budget {budget:g} (on the worst step)", **BUDGET_STYLE))
    if zeros_drawn:
        handles.append(Line2D([], [], color="0.3", marker="v", linestyle="none", label="error exactly 0"))
    for sch, step in flushes.items():
        handles.append(Line2D([], [], color="0.45", linestyle=dashes[sch], linewidth=0.9, label=f"{sch}: 1st flush, step {step}"))
    window = int((data.step - data.window_start + 1).max()) if "window_start" in data.columns and len(data) else 1
    span = f"{window}-step window" if window > 1 else "step"
    _legend_below(fig, handles, f"colour: format · dashes: scheme · thick: each {span}'s mean (RMS over its steps)")
    note = ""
    if flushes:
        note = "\nbefore a replay scheme's first flush only its input buffer is rounded: its curves coincide for all formats"
    fig.suptitle(f"Error drift over the decode horizon\n{subtitle(report)}{note}", fontsize=11)
    return fig


def _over_windows(d: pd.DataFrame, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a staircase that draws each window's value over the steps it covers, from its ``window_start`` to
    its ``step`` (its last step); plain points at the window ends for tables without window starts."""
    if "window_start" not in d.columns or d.empty:
        return d.step.to_numpy(), d[metric].to_numpy()
    d = d.sort_values("step")
    x = np.stack([d.window_start.to_numpy(), d.step.to_numpy()], axis=1).ravel()
    y = np.repeat(d[metric].to_numpy(), 2)
    return x, y


ZERO_ROW = 0.03  # the height of one variant's row of zero-error markers, as a fraction of the panel


def _zero_band(ax, zeros: list[tuple[str, pd.DataFrame]], styles: dict) -> None:
    """Exactly-zero errors (no place on a log axis) as triangles at the bottom of the panel, one row per variant
    (markers of different variants at one step neither stack nor hide each other), inside the frame: the y axis is
    extended downwards so that the band lies below every curve."""
    band = ZERO_ROW * (len(zeros) + 0.5)
    lo, hi = (np.log10(v) for v in ax.get_ylim())
    ax.set_ylim(bottom=10 ** ((lo - band * hi) / (1 - band)))  # the old bottom now sits at the band's top
    for row, (v, z) in enumerate(zeros):
        y = np.full(len(z), ZERO_ROW * (row + 0.5))
        ax.scatter(z.step, y, marker="v", s=20, color=styles[v]["color"], transform=ax.get_xaxis_transform(),
                   zorder=5)  # fmt: skip


def heatmap_values(summary: pd.DataFrame) -> tuple[str, str]:
    """(column, what it is) the heatmap shows: the run's worst step of the output error (the verdict's statistic),
    or, for an output written before the verdict, the output error of the horizon window."""
    horizon = int(summary["horizon"].max())
    if "out_rel_err_peak" in summary.columns:
        return "out_rel_err_peak", f"worst-step output error, steps 1-{horizon}"
    return "out_rel_err", f"output error at step {horizon}"


def heatmap_figure(summary: pd.DataFrame, report: dict):
    """Layers x variants, the worst-step output error of the run, on the fixed log colour scale HEATMAP_VMIN ..
    HEATMAP_VMAX (the same in every run); cells over the budget outlined, diverged ones (error >= 1 or not finite)
    labelled; the budget marked on the colour bar. Variants in the run's order."""
    order = variant_order(summary)
    column, what = heatmap_values(summary)
    table = summary.pivot_table(index="layer", columns="variant", values=column, aggfunc="first", dropna=False)
    table = table.reindex(columns=order)
    budget = budget_of(report)
    diverged = ~np.isfinite(table) | (table >= DIVERGED)
    shown = table.where((table > 0) & ~diverged)
    labels = table.map(lambda v: f"{v:.1e}")
    table.columns = shown.columns = labels.columns = [v.replace("@", "\n@") for v in order]
    across = len(order) <= HEATMAP_MAX_COLUMNS  # many variants: one row each, layers across
    if not across:
        table, shown, labels, diverged = table.T, shown.T, labels.T, diverged.T
        table.index = shown.index = labels.index = order
    width = max(HEATMAP_MIN_SIZE[0], 1.25 * table.shape[1] + 3.4)
    height = max(HEATMAP_MIN_SIZE[1], (0.42 if across else 0.3) * table.shape[0] + 2.8)
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    norm = LogNorm(vmin=HEATMAP_VMIN, vmax=HEATMAP_VMAX)
    label = f"{what}\n(log scale, fixed in every run:\n{HEATMAP_VMIN:g} to {HEATMAP_VMAX:g})"
    sns.heatmap(shown, annot=labels, fmt="", cmap="viridis", norm=norm, ax=ax, annot_kws={"fontsize": 7},
                cbar_kws={"label": label, "extend": "both"})  # fmt: skip
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            if diverged.iat[i, j]:
                ax.text(j + 0.5, i + 0.5, "diverged", ha="center", va="center", fontsize=7, color="0.15")
            elif budget is not None and column == "out_rel_err_peak" and table.iat[i, j] > budget:
                ax.add_patch(Rectangle((j + 0.04, i + 0.06), 0.92, 0.88, fill=False, edgecolor=BUDGET_COLOUR,
                                       linewidth=2.0))  # fmt: skip
    if budget is not None:
        ax.collections[0].colorbar.ax.axhline(budget, color=BUDGET_COLOUR, linewidth=2.5)
    ax.tick_params(axis="x", rotation=0, labelsize=8)
    ax.tick_params(axis="y", rotation=0)
    ax.set_xlabel("variant (format @ scheme)" if across else "SSM layer (decoder index)")
    ax.set_ylabel("SSM layer (decoder index)" if across else "variant (format @ scheme)")
    mark = ""
    if budget is not None and column == "out_rel_err_peak":
        mark = f"; outlined: over the budget {budget:g} (red line on the colour bar)"
    title = f"{what[0].upper()}{what[1:]}, per layer and variant{mark}\n{subtitle(report)}"
    chars = int(width * 10)  # characters of a 10-pt title line that fit the figure's width
    ax.set_title("\n".join(textwrap.fill(line, chars) for line in title.split("\n")), fontsize=10)
    return fig


def heads_figure(heads: pd.DataFrame, summary: pd.DataFrame, report: dict):
    """Per-head output error of the worst layer in the last recorded window against the head index, one line per
    variant (styled as in drift.png): the worst step of that window per head (its mean for an older output),
    with the budget, which the layer's error (pooled over heads) cannot exceed while every head stays under it."""
    worst, _ = pick_layers(summary)
    d = heads[heads.layer == worst]
    d = d[d.step == d.step.max()]
    column = "out_rel_err_max" if "out_rel_err_max" in d.columns else "out_rel_err"
    order = variant_order(summary)
    styles, colours, dashes = variant_styles(order)
    budget = budget_of(report)
    n_heads = int(heads["head"].max()) + 1 if len(heads) else 1
    fig, ax = plt.subplots(figsize=(max(MIN_WIDTH, 0.22 * n_heads + 4), 6), layout="constrained")
    positive = d[(d[column] > 0) & np.isfinite(d[column])]
    if positive.empty:
        ax.text(0.5, 0.5, "zero error at every head (fp32)", ha="center", transform=ax.transAxes)
    else:
        for v in order:
            dv = d[d.variant == v].sort_values("head")
            y = dv[column].where((dv[column] > 0) & np.isfinite(dv[column]))
            ax.plot(dv["head"], y, marker="o", markersize=4, linewidth=LINE_WIDTH, **styles[v])
        ax.set_yscale("log")
        # a span of two or three decades shows two powers of ten: label 2 and 5 x 10^k between them too
        ax.yaxis.set_minor_formatter(LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(3, 1)))
    if budget is not None:
        ax.axhline(budget, zorder=1.5, **BUDGET_STYLE)
    ax.set_xlim(-0.5, n_heads - 0.5)
    if n_heads <= 32:
        ax.set_xticks(range(n_heads))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.set_xlabel("head (index within the layer)")
    stat = "worst step" if column == "out_rel_err_max" else "mean"
    ax.set_ylabel(f"relative output error per head ({stat} of the window)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    handles = style_handles(colours, dashes)
    if budget is not None:
        handles.append(Line2D([], [], label=f"budget {budget:g} (the layer's worst step)", **BUDGET_STYLE))
    _legend_below(fig, handles, "colour: format · dashes: scheme")
    window = f"steps {int(d.window_start.min())}-{int(d.step.max())}" if "window_start" in d.columns and len(d) else ""
    ax.set_title(f"Per-head output error, worst layer {worst}, last window ({window})\n{subtitle(report)}", fontsize=10)
    return fig


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
