"""Text every page shares: the scale of its data and what it supersedes, the method of its statistics,
and how to reproduce it."""

from __future__ import annotations

from .measure import HORIZON_FRACTION
from .stats import DEFAULT_LEVEL, DEFAULT_RESAMPLES

SUPERSEDED = (
    "**Superseded figures.** The earlier version of the studies (2026-11-29) recorded one decode step in every "
    "`steps // 1024`: 8 or 32 steps in its H200 runs (8192- and 32768-step horizons), a multiple of replay16's "
    "flush period, so every recorded replay step was a flush step, the minimum of the replay error cycle (4 in "
    "its CPU tiny-qwen run); its calibration scored a single step, also a flush step. Those figures "
    "under-reported replay's error and are superseded"
)
NONE_USED = "; no number from them is used here"


# Where each scale's runs are made (`studies.run`: the CPU scales on the torch reference, the GPU scale with
# --device cuda, where the fused kernels run every kind that has them)
SCALE_MACHINES = {
    "smoke": "CPU, the torch reference backend",
    "cpu": "2 CPU cores, the torch reference backend",
    "gpu": "one CUDA GPU, the fused Triton kernels",
}


def scale_note(scales: set, extra: str = NONE_USED) -> str:
    """The page's scale and what it supersedes; `extra` ends the superseded sentence (default: none used)."""
    named = sorted(x for x in scales if x)
    s = ", ".join(named) or "n/a"
    where = "; ".join(dict.fromkeys(SCALE_MACHINES.get(x, "see each run's environment") for x in named)) or "n/a"
    text = (
        f"**Scale of this page: `{s}`** (`python -m studies.run --scale {s}`; {where}). Every decode step is "
        "measured; errors are pooled over windows of whole flush cycles, never sampled."
    )
    return text + " " + SUPERSEDED + extra + "."


def method_note() -> str:
    return (
        "**Statistics.** An error is the relative Frobenius error sqrt(sum err^2 / sum ref^2) of the layer "
        "output (or state) against the FP32 decode of the same inputs, pooled over heads, sequences and the "
        f"steps of a window: **all steps** (every decode step of the run) or **horizon** (the last "
        f"{HORIZON_FRACTION:.0%} of the steps, whole windows of whole flush cycles). A model's figure is the "
        f"median over its analysed layers. Intervals are bootstrap {DEFAULT_LEVEL:.0%} percentile intervals "
        f"({DEFAULT_RESAMPLES} resamples of the (seed, sequence) pairs, drawn with replacement; every variant "
        "and layer uses the same resample, so ratios are paired). A variant whose error is non-finite or above 1 "
        "(larger than the signal) is reported as **diverged**, never as a ratio."
    )


def reproduce(study: str) -> str:
    return "\n".join(
        [
            "```bash",
            f"python -m studies.run --scale cpu --only {study}   # the simulations -> studies/{study}/data/ (committed)",
            "python studies/make_pages.py                          # this page and every other, from the committed tables",
            f"SCALE=smoke python -m studies.run --data /tmp/smoke --only {study} && "
            f"python studies/make_pages.py --data /tmp/smoke --out /tmp/smoke --only {study}   # seconds",
            f"python -m studies.run --scale gpu --device cuda --only {study}   # long horizons on a GPU (not run here)",
            "```",
        ]
    )
