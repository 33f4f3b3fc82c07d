"""Error traces of a simulation: window statistics per variant and per (batch, head).

Every backend measures every decode step; nothing is sampled. The steps are cut into consecutive windows
of `record_every` steps (the last one shorter when the run is not a multiple of it) and each window keeps,
per (batch, head):

- mean: the mean over the window's steps of each per-step metric (METRIC_NAMES: squared error and squared
  reference norm of the state and of the output), so that any pooled relative error is exact:
  sqrt(sum err^2 / sum ref^2) over the window's steps and the pooled (batch, head) set (an RMS ratio);
- last: the metrics at the window's last step;
- max: the largest per-step relative error inside the window, for each pooling (all sequences and heads,
  per head, per sequence, per (sequence, head)), since a maximum cannot be pooled after the fact.

Why windows and not samples: under replay(L) the error is lowest at a flush step and highest just after
it; a sample taken every k steps with k sharing a factor with L sees one phase of that cycle only
(ARCHITECTURE.md, "Windows"). A window mean or max over every step is unaliased whatever the window and the period;
a window of whole flush cycles (`cycle_window`) also makes each window a like-for-like sample of the
cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

METRIC_NAMES = ("state_err2", "state_ref2", "out_err2", "out_ref2")
QUANTITIES = ("state", "out")
STATS = ("mean", "max", "last")
# The Triton backend's per-step metrics of one launch are [NV, T, b, H, row blocks, 4] fp32; the batch is cut
# into slices so that this buffer stays under the budget whatever T x batch (Nemotron-3-Nano's six variants at
# 4096 steps: 384 MiB per sequence, two sequences per launch; several small launches take the time of one large
# one: lab/DESIGN_NOTES.md). A constant, not a share of the free memory: the order of the float64
# sums over the batch (the pooled maxima) follows the slices and must not depend on the machine's state.
METRIC_BUFFER_BYTES = 1 << 30
# pooling name -> (per_batch, per_head)
POOLINGS = {"all": (False, False), "head": (False, True), "batch": (True, False), "batch_head": (True, True)}


def _ratio(err2: np.ndarray, ref2: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(np.where(ref2 > 0, err2 / ref2, np.where(err2 > 0, np.inf, 0.0)))


def _ratio_t(err2: torch.Tensor, ref2: torch.Tensor) -> torch.Tensor:
    """Relative error sqrt(err2 / ref2) elementwise; 0 where both are 0, inf where only ref2 is; NaN stays NaN."""
    zero = torch.zeros((), dtype=err2.dtype, device=err2.device)
    inf = torch.full((), math.inf, dtype=err2.dtype, device=err2.device)
    return torch.where(ref2 > 0, err2 / ref2, torch.where(err2 > 0, inf, torch.where(err2 == 0, zero, err2))).sqrt()


def snr_db(rel_err: np.ndarray) -> np.ndarray:
    """Signal-to-noise ratio in dB of a relative error (inf where the error is 0)."""
    with np.errstate(divide="ignore"):
        return -20.0 * np.log10(rel_err)


def window_ends(steps: int, record_every: int) -> np.ndarray:
    """1-based last step of each window of `record_every` steps covering steps 1..steps: int64 [R]."""
    if record_every < 1:
        raise ValueError(f"record_every must be >= 1, got {record_every}")
    ends = np.arange(record_every, steps + 1, record_every, dtype=np.int64)
    if len(ends) == 0 or ends[-1] != steps:
        ends = np.append(ends, np.int64(steps))
    return ends


def cycle_window(cycles: list[int], steps: int, max_windows: int = 1024) -> int:
    """The window length for a run: a multiple of every flush period in `cycles` (so that each window
    holds whole cycles of every variant), as short as possible while keeping at most `max_windows`.

    cycles: flush periods of the variants (1 for conventional, L for replay(L) and spec(L)). Returns a
    length in [1, steps]; when no whole cycle fits (steps < lcm), the whole run is one window.
    """
    base = math.lcm(*[max(1, int(c)) for c in cycles]) if cycles else 1
    if base > steps:
        return steps
    need = max(1, math.ceil(steps / max_windows))
    return min(steps, base * math.ceil(need / base))


class WindowAccumulator:
    """Reduces per-step metrics into window statistics, one batch slice at a time.

    steps T, record_every W, batch B and heads H fix the output shapes; `add(per_step [T, b, H, 4], b0)`
    takes the per-step metrics of sequences b0..b0+b (any float dtype, on any device) and `finish()`
    returns {"mean", "last": float64 [R, B, H, 4], "max": {pooling: float64 [R, (B), (H), 2]}} as numpy.
    The pooled maxima (all, per head) need every sequence of a step together, so the accumulator keeps
    the per-step sums over the batch ([T, H, 4], float64) until `finish`.
    """

    def __init__(self, steps: int, record_every: int, batch: int, heads: int, device: torch.device | str = "cpu"):
        self.ends = window_ends(steps, record_every)
        self.steps, self.batch, self.heads = steps, batch, heads
        dev = torch.device(device)
        r = len(self.ends)
        # window_ends on the device, made there: a copy from the host would wait for the device's queue
        ends = (torch.arange(1, r + 1, dtype=torch.int64, device=dev) * record_every).clamp_(max=steps)
        self.window_of_step = torch.arange(steps, dtype=torch.int64, device=dev) // record_every
        lengths = torch.diff(ends, prepend=torch.zeros(1, dtype=ends.dtype, device=dev))
        self.lengths = lengths.double()
        self.last_index = ends - 1
        self.mean = torch.full((r, batch, heads, 4), math.nan, dtype=torch.float64, device=dev)
        self.last = torch.full_like(self.mean, math.nan)
        self.peak_bh = torch.full((r, batch, heads, 2), math.nan, dtype=torch.float64, device=dev)
        self.peak_b = torch.full((r, batch, 2), math.nan, dtype=torch.float64, device=dev)
        self.batch_sums = torch.zeros(steps, heads, 4, dtype=torch.float64, device=dev)
        self.filled = torch.zeros(batch, dtype=torch.bool)
        self.record_every = record_every
        self.full_windows = steps // record_every  # windows of record_every steps; a shorter last one if any

    def _window_sums(self, m: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [R, ...]: the sum over each window's steps, added in step order (((0 + m_1) + m_2) + ...).

        The same order and so the same bits as a sequential ``index_add_`` on the CPU, on every device: CUDA's
        ``index_add_`` adds with atomics in an order that changes from run to run (and so did the last digits
        of the window means, which made two runs on one GPU differ). One strided add per offset in the window.
        """
        w, full = self.record_every, self.full_windows
        sums = torch.zeros((len(self.ends), *m.shape[1:]), dtype=m.dtype, device=m.device)
        if full:
            blocks = m[: full * w].reshape(full, w, *m.shape[1:])
            for j in range(w):
                sums[:full] += blocks[:, j]
        for t in range(full * w, m.shape[0]):  # the shorter last window
            sums[-1] += m[t]
        return sums

    def _window_max(self, per_step: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [R, ...]: max over each window's steps (NaN propagates)."""
        out = torch.full((len(self.ends), *per_step.shape[1:]), -math.inf, dtype=per_step.dtype, device=per_step.device)
        index = self.window_of_step.view(-1, *([1] * (per_step.dim() - 1))).expand_as(per_step)
        return out.scatter_reduce_(0, index, per_step, "amax", include_self=True)

    def add(self, per_step: torch.Tensor, b0: int = 0) -> None:
        m = per_step.to(device=self.mean.device, dtype=torch.float64)
        nb = m.shape[1]
        self.mean[:, b0 : b0 + nb] = self._window_sums(m) / self.lengths[:, None, None, None]
        self.last[:, b0 : b0 + nb] = m[self.last_index]
        self.peak_bh[:, b0 : b0 + nb] = self._window_max(_ratio_t(m[..., 0::2], m[..., 1::2]))
        per_seq = m.sum(2)  # [T, b, 4]
        self.peak_b[:, b0 : b0 + nb] = self._window_max(_ratio_t(per_seq[..., 0::2], per_seq[..., 1::2]))
        self.batch_sums += m.sum(1)
        self.filled[b0 : b0 + nb] = True

    def finish_tensors(self) -> dict:
        """The statistics of ``finish`` as float64 tensors on the accumulator's device (nothing waits for
        the device: ``finish`` or a non-blocking copy to the host follows)."""
        if not bool(self.filled.all()):
            missing = (~self.filled).nonzero().flatten().tolist()
            raise RuntimeError(f"window statistics are missing sequences {missing}")
        bs = self.batch_sums
        peak_h = self._window_max(_ratio_t(bs[..., 0::2], bs[..., 1::2]))  # [R, H, 2]
        pooled = bs.sum(1)
        peak_all = self._window_max(_ratio_t(pooled[..., 0::2], pooled[..., 1::2]))  # [R, 2]
        return {
            "mean": self.mean,
            "last": self.last,
            "max": {"all": peak_all, "head": peak_h, "batch": self.peak_b, "batch_head": self.peak_bh},
        }

    def finish(self) -> dict:
        return stats_to_numpy(self.finish_tensors())


def stats_to_numpy(stats: dict) -> dict:
    """``WindowAccumulator.finish_tensors`` (or host copies of it) as numpy arrays, the layout of ``finish``."""
    np_ = lambda t: t.cpu().numpy()  # noqa: E731
    return {"mean": np_(stats["mean"]), "last": np_(stats["last"]), "max": {p: np_(t) for p, t in stats["max"].items()}}


def window_statistics(per_step: torch.Tensor, record_every: int) -> dict:
    """Window statistics of per-step metrics [T, B, H, 4] in one go (see `WindowAccumulator.finish`)."""
    steps, batch, heads, _ = per_step.shape
    acc = WindowAccumulator(steps, record_every, batch, heads, per_step.device)
    acc.add(per_step, 0)
    return acc.finish()


@dataclass
class Trace:
    """Window statistics of one simulated layer.

    variants: names, in order; steps: int64 [R] the 1-based last step of each window (windows cover steps
    1..T; each is `record_every` long except possibly the last); mean, last: float64 [V, R, B, H, 4]
    (METRIC_NAMES along the last dim); peak: {pooling: float64 [V, R, (B), (H), 2]} the window max of the
    per-step relative error of the state (0) and output (1) for the poolings in POOLINGS; meta: provenance
    (layer kind, shapes, backend, data source, record_every...).
    """

    variants: list[str]
    steps: np.ndarray
    mean: np.ndarray
    last: np.ndarray
    peak: dict[str, np.ndarray]
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_windows(cls, variants, ends: np.ndarray, stats: list[dict], meta: dict) -> Trace:
        """Stack the per-variant results of `WindowAccumulator.finish` (in variant order)."""
        return cls(
            list(variants),
            np.asarray(ends, dtype=np.int64),
            np.stack([s["mean"] for s in stats]),
            np.stack([s["last"] for s in stats]),
            {p: np.stack([s["max"][p] for s in stats]) for p in POOLINGS},
            dict(meta),
        )

    @property
    def window_starts(self) -> np.ndarray:
        """1-based first step of each window: int64 [R]."""
        return np.concatenate([[1], self.steps[:-1] + 1]).astype(np.int64)

    @property
    def window_centers(self) -> np.ndarray:
        """Mid-point of each window (a float step), the abscissa for fits of window means: [R]."""
        return (self.window_starts + self.steps) / 2.0

    @property
    def horizon_index(self) -> int:
        """Index of the last full-length window: the horizon statistic (a shorter last window, when T is
        not a multiple of the window, may hold only part of a flush cycle)."""
        lengths = self.steps - self.window_starts + 1
        return int(np.flatnonzero(lengths == lengths.max())[-1])

    def _index(self, variant: str) -> int:
        try:
            return self.variants.index(variant)
        except ValueError:
            raise KeyError(f"unknown variant {variant!r}; this trace has: {', '.join(self.variants)}") from None

    def rel_err(
        self, quantity: str = "state", *, stat: str = "mean", per_head: bool = False, per_batch: bool = False
    ) -> np.ndarray:
        """Relative error per window, pooled over (batch, head) unless per_head / per_batch.

        stat: "mean" (RMS ratio over the window's steps), "max" (largest per-step value in the window) or
        "last" (the window's last step). Returns [V, R] (pooled), [V, R, H] (per_head), [V, R, B]
        (per_batch) or [V, R, B, H] (both).
        """
        if quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {QUANTITIES}, got {quantity!r}")
        if stat not in STATS:
            raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
        q = QUANTITIES.index(quantity)
        if stat == "max":
            pooling = next(p for p, key in POOLINGS.items() if key == (per_batch, per_head))
            return self.peak[pooling][..., q]
        m = self.mean if stat == "mean" else self.last
        err2, ref2 = m[..., 2 * q], m[..., 2 * q + 1]
        axes = tuple(ax for ax, keep in ((2, per_batch), (3, per_head)) if not keep)
        return _ratio(err2.sum(axis=axes), ref2.sum(axis=axes))

    def final(self, quantity: str = "state", stat: str = "mean") -> dict[str, float]:
        """Pooled relative error over the horizon window (`horizon_index`), per variant."""
        r = self.rel_err(quantity, stat=stat)[:, self.horizon_index]
        return dict(zip(self.variants, r.tolist()))

    def to_frame(self, *, per_head: bool = False) -> pd.DataFrame:
        """Long table: one row per (variant, window[, head]).

        Columns: variant, step (the window's last step), window_start, [head], and for state / out:
        `<q>_rel_err` (window mean, RMS over its steps), `<q>_rel_err_max`, `<q>_rel_err_last`, and
        `<q>_snr_db` of the window mean.
        """
        nv, nr = len(self.variants), len(self.steps)
        nh = self.mean.shape[3] if per_head else 1
        cols = {
            "variant": np.repeat(np.array(self.variants, dtype=object), nr * nh),
            "step": np.tile(np.repeat(self.steps, nh), nv),
            "window_start": np.tile(np.repeat(self.window_starts, nh), nv),
        }
        if per_head:
            cols["head"] = np.tile(np.arange(nh), nv * nr)
        for q in QUANTITIES:
            for stat, suffix in (("mean", ""), ("max", "_max"), ("last", "_last")):
                cols[f"{q}_rel_err{suffix}"] = self.rel_err(q, stat=stat, per_head=per_head).reshape(-1)
        for q in QUANTITIES:
            cols[f"{q}_snr_db"] = snr_db(cols[f"{q}_rel_err"])
        return pd.DataFrame(cols)


__all__ = [
    "METRIC_BUFFER_BYTES",
    "METRIC_NAMES",
    "POOLINGS",
    "QUANTITIES",
    "STATS",
    "Trace",
    "WindowAccumulator",
    "cycle_window",
    "snr_db",
    "window_ends",
    "window_statistics",
]
