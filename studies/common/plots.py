"""Plot helpers shared by the pages (matplotlib on the Agg backend, seaborn's colour-blind palette)."""

from __future__ import annotations

import math
import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

ENC_ORDER = ["fp8_e4m3", "int8", "nvfp4", "bf16", "fp16"]
_CB = sns.color_palette("colorblind", 10)
PALETTE = {"fp8_e4m3": _CB[0], "int8": _CB[1], "nvfp4": _CB[2], "bf16": _CB[4], "fp16": _CB[7], "fp32": _CB[9]}
Y_CLIP = 10.0  # errors above this (10x the signal) are cut off and annotated


def theme() -> None:
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.85)


def save_fig(fig, folder: pathlib.Path, name: str) -> str:
    for ax in fig.axes:  # minor tick labels of a log axis spanning less than a decade overlap
        if ax.get_xscale() == "log":
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.savefig(folder / name, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return name


def subplots(nrows: int, ncols: int, w: float, h: float, **kw):
    return plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False, layout="constrained", **kw)


def pareto(points: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """The points not dominated in (x lower, y lower), sorted by x."""
    p = points[np.isfinite(points[y])].sort_values([x, y])
    keep, best = [], math.inf
    for i, r in p.iterrows():
        if r[y] < best:
            keep.append(i)
            best = r[y]
    return p.loc[keep]
