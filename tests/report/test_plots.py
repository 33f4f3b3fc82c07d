"""The analyze plots (drift.png, heatmap.png, heads.png) and the eval plot drawn from constructed tables: readable step
ticks, a first-flush marker off the frame, one line width, the legend clear of the title, the budget marked, one
fixed colour scale for every heatmap, head indices, and eval's variants styled as analyze's (issue 27)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

mpl = pytest.importorskip("matplotlib")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from ssmquant.report import plots  # noqa: E402

FORMATS = ("fp8_e4m3", "int8", "nvfp4")
SCHEMES = ("conventional", "replay16")
ORDER = [f"{f}@{s}" for f in FORMATS for s in SCHEMES]
LEVEL = {"fp8_e4m3": 4e-3, "int8": 1e-3, "nvfp4": 3e-2}


def report(steps: int, budget: float | None = 0.02) -> dict:
    rep = {
        "model": "tiny-nemotron",
        "data_source": {"kind": "shipped"},
        "settings": {"batch": 1, "steps": steps, "buffer_len": 16, "seed": 0},
        "first_write_steps": {"conventional": 1, "replay16": 16},
    }
    if budget is not None:
        rep["budget"] = {"value": budget}
        rep["settings"]["budget"] = budget
    return rep


def tables(steps: int, layers=(0, 2), heads: int = 8, scale: float = 1.0):
    """(traces, heads, summary) of a run of ``steps`` steps in windows of 16 (of steps / 64 in a long run): errors
    growing as t^0.3 from a level per format, 4x lower under replay16, layer 2 at twice layer 0's; the worst step
    of a window 1.5x its mean."""
    window = max(16, steps // 64)
    ends = np.arange(window, steps + 1, window)
    rows, head_rows, summary = [], [], []
    for layer in layers:
        for v in ORDER:
            f, s = v.split("@")
            level = scale * LEVEL[f] * (0.25 if s == "replay16" else 1) * (2 if layer == 2 else 1)
            err = level * (ends / 16) ** 0.3
            for e, x in zip(ends, err):
                rows.append({"layer": layer, "variant": v, "step": e, "window_start": e - window + 1, "out_rel_err": x,
                             "out_rel_err_max": 1.5 * x, "state_rel_err": 5 * x})  # fmt: skip
            for h in range(heads):
                head_rows.append({"layer": layer, "variant": v, "step": ends[-1], "window_start": ends[-1] - window + 1,
                                  "head": h, "out_rel_err": err[-1] * (1 + h / 4),
                                  "out_rel_err_max": 1.5 * err[-1] * (1 + h / 4)})  # fmt: skip
            summary.append({"layer": layer, "variant": v, "horizon": ends[-1], "out_rel_err": err[-1],
                            "out_rel_err_peak": 1.5 * err[-1]})  # fmt: skip
    return pd.DataFrame(rows), pd.DataFrame(head_rows), pd.DataFrame(summary)


def panels(fig):
    return [a for a in fig.axes if a.get_title()]


def tick_labels(ax) -> list[str]:
    """The x tick labels shown: non-empty, at ticks inside the axis' view."""
    lo, hi = ax.get_xlim()
    return [t.get_text() for x, t in zip(ax.get_xticks(), ax.get_xticklabels()) if t.get_text() and lo <= x <= hi]


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


@pytest.mark.parametrize("steps,least,most", [(48, 4, 7), (512, 4, 7), (4096, 4, 7), (131072, 4, 7)])
def test_the_step_axis_has_readable_tick_labels(steps, least, most):
    traces, _, summary = tables(steps)
    fig = plots.drift_figure(traces, summary, report(steps))
    fig.canvas.draw()
    bottom = [ax for ax in panels(fig) if ax.get_xlabel() == "decode step"]  # the top row shares their axis
    assert len(bottom) == 2
    for ax in bottom:
        labels = tick_labels(ax)
        assert least <= len(labels) <= most, labels
        assert all(lab.rstrip("K").isdigit() for lab in labels), labels  # plain steps: 16, 512, 4K, 128K
        assert labels[-1] == {48: "48", 512: "512", 4096: "4K", 131072: "128K"}[steps]


def test_step_ticks_are_powers_of_two_with_the_ends_of_a_short_run():
    assert plots.step_ticks(16, 48) == ([16, 32, 48], [])
    assert plots.step_ticks(16, 24)[0] == [16, 24]
    major, minor = plots.step_ticks(1, 4096)
    assert major == [1, 4, 16, 64, 256, 1024, 4096] and minor == [2, 8, 32, 128, 512, 2048]


def test_the_first_flush_marker_is_off_the_frame():
    """replay16's first flush is the first window's end (step 16): its marker lies well inside the panel, not at
    matplotlib's default margin (4.5% of the axis), where it was hard to tell from the frame."""
    traces, _, summary = tables(48)
    fig = plots.drift_figure(traces, summary, report(48))
    for ax in panels(fig):
        (line,) = [ln for ln in ax.get_lines() if tuple(ln.get_xdata()) == (16, 16)]
        lo, hi = ax.get_xlim()
        where = (np.log(16) - np.log(lo)) / (np.log(hi) - np.log(lo))
        assert 0.1 <= where <= 0.9, where


def test_every_format_is_drawn_with_one_line_width():
    traces, _, summary = tables(512)
    fig = plots.drift_figure(traces, summary, report(512))
    for ax in panels(fig):
        curves = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2]
        means = {ln.get_linewidth() for ln in curves if ln.get_alpha() is None}
        assert means == {plots.LINE_WIDTH}
        faint = {ln.get_linewidth() for ln in curves if ln.get_alpha() is not None}
        assert faint <= {plots.PEAK_LINE_WIDTH}  # the output panels' window maxima: thin, whatever the format


@pytest.mark.parametrize("layers", [(0,), (0, 2)])
def test_the_legend_is_clear_of_the_title_and_the_panels(layers):
    """On a small run (one layer: a narrow figure) the legend sat over the title; it is below the panels now, and
    neither it nor the title is cut off by the figure's edge."""
    traces, _, summary = tables(48, layers=layers)
    fig = plots.drift_figure(traces, summary, report(48))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box, title, frame = legend.get_window_extent(renderer), fig._suptitle.get_window_extent(renderer), fig.bbox
    assert not box.overlaps(title)
    for ax in panels(fig):
        assert not box.overlaps(ax.get_tightbbox(renderer))
    for b in (box, title):
        assert frame.x0 - 1 <= b.x0 and b.x1 <= frame.x1 + 1 and frame.y0 - 1 <= b.y0 and b.y1 <= frame.y1 + 1


def test_the_budget_is_marked_on_every_plot():
    traces, heads, summary = tables(512)
    fig = plots.drift_figure(traces, summary, report(512, budget=0.02))
    for ax in panels(fig):
        flat = [ln for ln in ax.get_lines() if tuple(ln.get_ydata()) == (0.02, 0.02)]
        assert len(flat) == (1 if "output" in ax.get_title() else 0)  # the budget is on the output error
    assert any(t.get_text().startswith("budget 0.02") for t in fig.legends[0].get_texts())
    fig = plots.heads_figure(heads, summary, report(512, budget=0.02))
    assert any(tuple(ln.get_ydata()) == (0.02, 0.02) for ln in fig.axes[0].get_lines())
    fig = plots.heatmap_figure(summary, report(512, budget=0.02))
    ax, cbar = fig.axes[0], fig.axes[1]
    assert any(tuple(ln.get_ydata()) == (0.02, 0.02) for ln in cbar.get_lines())
    outlined = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert len(outlined) == int((summary.out_rel_err_peak > 0.02).sum()) > 0
    # an output written before the verdict (no budget in report.json): no line, nothing outlined
    fig = plots.drift_figure(traces, summary, report(512, budget=None))
    assert not any(tuple(ln.get_ydata()) == (0.02, 0.02) for ax in panels(fig) for ln in ax.get_lines())


def test_the_heatmap_colour_scale_is_the_same_in_every_run():
    """Two runs 1000x apart get the same colour for the same error: one fixed log scale, whose top is the error at
    which analysis.fit calls a run diverged."""
    norms = []
    for scale in (1.0, 1e-3):
        _, _, summary = tables(64, scale=scale)
        fig = plots.heatmap_figure(summary, report(64))
        norms.append(fig.axes[0].collections[0].norm)
    assert [(n.vmin, n.vmax) for n in norms] == [(plots.HEATMAP_VMIN, plots.HEATMAP_VMAX)] * 2
    from ssmquant.analysis.fit import DIVERGED

    assert plots.HEATMAP_VMAX == plots.DIVERGED == DIVERGED


def test_a_diverged_cell_is_labelled_not_coloured_as_over():
    _, _, summary = tables(64)
    summary.loc[0, "out_rel_err_peak"] = float("nan")
    summary.loc[1, "out_rel_err_peak"] = 7.0
    fig = plots.heatmap_figure(summary, report(64))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("diverged") == 2


def test_heads_plot_names_the_head_indices():
    _, heads, summary = tables(64, heads=8)
    fig = plots.heads_figure(heads, summary, report(64))
    ax = fig.axes[0]
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(h) for h in range(8)]
    assert "head" in ax.get_xlabel()
    curves = [ln for ln in ax.get_lines() if len(ln.get_xdata()) == 8]
    assert len(curves) == len(ORDER) and all(list(ln.get_xdata()) == list(range(8)) for ln in curves)
    # many heads: integer ticks, not one per head
    _, heads, summary = tables(64, heads=64)
    fig = plots.heads_figure(heads, summary, report(64))
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert 4 <= len(labels) <= 20 and all(lab.lstrip("−-").isdigit() for lab in labels)


# -- the eval plot follows analyze's styles ----------------------------------------------------------------------


def eval_tables(steps: int):
    rng = np.random.default_rng(0)
    rows = [{"variant": v, "position": p, "kl": float(rng.lognormal(-10, 1))} for v in ORDER for p in range(1, steps + 1)]
    summary = pd.DataFrame({"variant": ORDER, "scheme": [v.split("@")[1] for v in ORDER], "kl_horizon": 1e-5})
    rep = {"model": "tiny-nemotron", "data_source": {"kind": "shipped"}, "settings": {"batch": 2, "steps": steps,
           "seed": 0}, "reference": {"horizon_from": steps - 15}}  # fmt: skip
    return pd.DataFrame(rows), summary, rep


def test_eval_colours_by_format_and_dashes_by_scheme_as_analyze_does():
    from matplotlib.colors import to_rgb

    from ssmquant.evaluate.plots import kl_figure

    positions, summary, rep = eval_tables(64)
    fig = kl_figure(positions, summary, rep)
    ax = fig.axes[0]
    labelled = {ln.get_label().split()[0]: ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    styles, _, _ = plots.variant_styles(ORDER)
    assert set(labelled) == set(ORDER)
    for v, ln in labelled.items():
        assert to_rgb(ln.get_color()) == pytest.approx(to_rgb(styles[v]["color"]))
    assert to_rgb(labelled["int8@conventional"].get_color()) == to_rgb(labelled["int8@replay16"].get_color())
    assert labelled["int8@conventional"].get_linestyle() == labelled["nvfp4@conventional"].get_linestyle() == "-"
    assert labelled["int8@replay16"].get_linestyle() != "-"


@pytest.mark.parametrize("steps", [64, 400])
def test_eval_draws_the_bold_rolling_mean_its_label_promises(steps):
    from ssmquant.evaluate.plots import BOLD_WIDTH, kl_figure, smoothing_window

    positions, summary, rep = eval_tables(steps)
    fig = kl_figure(positions, summary, rep)
    ax = fig.axes[0]
    window = smoothing_window(steps)
    bold = [ln for ln in ax.get_lines() if ln.get_linewidth() == BOLD_WIDTH]
    if window > 1:
        assert "bold: centred rolling mean" in ax.get_ylabel() and len(bold) == len(ORDER)
        kl = positions[positions.variant == ORDER[0]].sort_values("position").kl
        mean = kl.rolling(window, center=True, min_periods=1).mean().to_numpy()
        assert np.allclose(bold[0].get_ydata(), mean)
    else:
        assert "bold" not in ax.get_ylabel() and "per position" in ax.get_ylabel() and not bold


def _inside(fig, artist) -> bool:
    box, frame = artist.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    return box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0 - 1 and box.y1 <= frame.y1 + 1


def test_a_one_cell_heatmap_shows_its_whole_title_and_colour_bar_label():
    """At 1 layer x 1 variant the title and the colour bar's label ran off the figure (issue 42)."""
    _, _, summary = tables(64, layers=(0,))
    fig = plots.heatmap_figure(summary[summary.variant == ORDER[0]], report(64))
    fig.canvas.draw()
    ax = fig.axes[0]
    assert _inside(fig, ax.title)
    assert _inside(fig, ax.collections[0].colorbar.ax.yaxis.label)


def test_a_heatmap_of_many_variants_stays_readable():
    """40 variants drew a 6408 x 436 px strip: past a dozen, variants go down the figure, one row each."""
    _, _, summary = tables(64, layers=(0,))
    many = pd.concat([summary.assign(variant=summary.variant + f"~{i}") for i in range(7)], ignore_index=True)
    fig = plots.heatmap_figure(many, report(64))
    width, height = fig.get_size_inches()
    assert width <= 10 and height >= 0.25 * many.variant.nunique()
    fig.canvas.draw()
    assert _inside(fig, fig.axes[0].title)


def test_the_subtitle_names_the_buffer_only_for_a_bare_replay():
    rep = report(64)
    rep["settings"]["schemes"] = ["conventional"]
    assert "L=" not in plots.subtitle(rep)
    rep["settings"]["schemes"] = ["conventional", "replay"]
    assert "L=16" in plots.subtitle(rep)


def test_the_heads_plot_labels_more_than_the_powers_of_ten_it_spans():
    """heads.png labelled two decades of the three its values spanned: 2 and 5 x 10^k are labelled too."""
    _, heads, summary = tables(64)
    fig = plots.heads_figure(heads, summary, report(64))
    fig.canvas.draw()
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    shown = [t.get_text() for t in [*ax.get_yticklabels(), *ax.get_yticklabels(minor=True)]
             if t.get_text() and lo <= t.get_position()[1] <= hi]  # fmt: skip
    assert np.log10(hi / lo) > 2 and len(shown) >= 5, shown


def test_kl_plot_says_where_a_variant_has_kl_zero_before_its_first_stored_state():
    """kl.png dropped replay curves at positions 1-16 (KL exactly 0 on a log axis) without a word."""
    from ssmquant.evaluate.plots import kl_figure

    positions, summary, rep = eval_tables(64)
    replay = positions.variant.str.endswith("replay16") & (positions.position <= 16)
    positions.loc[replay, "kl"] = 0.0
    fig = kl_figure(positions, summary, rep)
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "KL = 0 at positions 1-16" in texts and all(v in texts for v in ORDER if v.endswith("replay16"))


def _curve_starts(fig) -> set[float]:
    return {float(np.min(ln.get_xdata())) for ax in panels(fig) for ln in ax.get_lines() if len(ln.get_xdata()) > 2}


def test_drift_curves_start_at_the_first_step_of_their_first_window():
    """With replay4 beside replay16 the windows are 16 steps long: every curve started at step 16 (the first
    window's end) and replay4's first-flush marker stood left of all data (issue 42). Each window is now drawn over
    the steps it covers."""
    traces, _, summary = tables(256)
    traces = traces.assign(variant=traces.variant.str.replace("replay16", "replay4"))
    summary = summary.assign(variant=summary.variant.str.replace("replay16", "replay4"))
    rep = report(256)
    rep["first_write_steps"] = {"conventional": 1, "replay4": 4}
    fig = plots.drift_figure(traces, summary, rep)
    assert _curve_starts(fig) == {1.0}
    for ax in panels(fig):
        (flush,) = [ln for ln in ax.get_lines() if tuple(ln.get_xdata()) == (4, 4)]
        lo, _ = ax.get_xlim()
        assert lo < 1  # the marker lies within the curves' span, not left of it


def test_drift_zero_error_markers_neither_stack_nor_leave_the_frame():
    """Zero errors of several variants at one step were drawn on top of each other on the bottom edge, half
    outside the frame: each variant now has its own row inside the panel, below every curve."""
    traces, _, summary = tables(64)
    early = traces.step <= 16
    traces.loc[early, "state_rel_err"] = 0.0
    fig = plots.drift_figure(traces, summary, report(64))
    ax = [a for a in panels(fig) if a.get_title().endswith("state error")][0]
    rows = [c.get_offsets()[:, 1] for c in ax.collections]
    assert len(rows) == len(ORDER)
    heights = {float(r[0]) for r in rows}
    assert len(heights) == len(ORDER) and all(0 < h < 0.5 for h in heights)  # axes fractions: inside the frame
    band_top = plots.ZERO_ROW * (len(ORDER) + 0.5)
    lo, hi = np.log10(ax.get_ylim())
    lowest = min(np.log10(ln.get_ydata()).min() for ln in ax.get_lines() if len(ln.get_xdata()) > 2)
    assert (lowest - lo) / (hi - lo) >= band_top - 1e-9  # no curve runs through the band
