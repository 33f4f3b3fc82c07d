"""The evaluation's plot (seaborn): KL(p_fp32 || p_variant) vs position, one line per variant.

kl.png: per-position KL (mean over the sequences) as thin faint lines, a centred rolling mean over a few
positions as the bold line, log y; colour = variant, dashes = scheme kind; the horizon window shaded.
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

PLOT_FILES = ("kl.png",)
_DASHES = {"conventional": "-", "replay": "--", "spec": ":"}


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


def kl_plot(positions: pd.DataFrame, summary: pd.DataFrame, report: dict, path: pathlib.Path) -> None:
    steps = int(positions["position"].max())
    window = smoothing_window(steps)
    ref = report.get("reference", {})
    batch = report.get("settings", {}).get("batch")
    names = list(summary["variant"])
    positive = [n for n in names if (positions.loc[positions.variant == n, "kl"] > 0).any()]
    zero = [n for n in names if n not in positive]
    palette = dict(zip(positive, sns.color_palette("tab10" if len(positive) <= 10 else "husl", len(positive))))
    scheme_of = dict(zip(summary["variant"], summary["scheme"]))
    horizon_of = dict(zip(summary["variant"], summary["kl_horizon"]))

    fig, ax = plt.subplots(figsize=(10, 6))
    for name in positive:
        d = positions[positions.variant == name].sort_values("position")
        kl = d["kl"].to_numpy()
        smooth = pd.Series(np.where(kl > 0, kl, np.nan)).rolling(window, center=True, min_periods=1).mean()
        kind = next((k for k in _DASHES if str(scheme_of.get(name, "")).startswith(k)), "conventional")
        colour = palette[name]
        ax.plot(d["position"], np.where(kl > 0, kl, np.nan), color=colour, alpha=0.2, linewidth=0.6)
        sns.lineplot(
            x=d["position"].to_numpy(),
            y=smooth.to_numpy(),
            ax=ax,
            color=colour,
            linestyle=_DASHES[kind],
            linewidth=1.8,
            label=f"{name}  (horizon KL {horizon_of[name]:.2e})",
        )
    if positive:
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "KL = 0 at every position for every variant", ha="center", transform=ax.transAxes)
    if ref.get("horizon_from"):
        ax.axvspan(ref["horizon_from"] - 0.5, steps + 0.5, color="0.85", alpha=0.5, zorder=0, label="horizon window")
    if zero:
        ax.text(
            0.01,
            0.01,
            "KL = 0 at every position (not on a log axis): " + ", ".join(zero),
            transform=ax.transAxes,
            fontsize=8,
            va="bottom",
        )
    ax.set_xlabel("position (tokens read; the next one is predicted)")
    ax.set_ylabel(f"KL(p_fp32 || p_variant), nats\nmean over {batch} sequences; bold: rolling mean of {window}")
    ax.set_xlim(1, steps)
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=8, title="variant (format@scheme)", title_fontsize=8, loc="best")
    ax.set_title(f"Next-token KL vs FP32-state model, end to end\n{subtitle(report)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_all(positions: pd.DataFrame, summary: pd.DataFrame, report: dict, out_dir) -> list[str]:
    """Write the plots into out_dir; returns their file names."""
    out_dir = pathlib.Path(out_dir)
    sns.set_theme(style="whitegrid", context="notebook")
    kl_plot(positions, summary, report, out_dir / PLOT_FILES[0])
    return list(PLOT_FILES)
