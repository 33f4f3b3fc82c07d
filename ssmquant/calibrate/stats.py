"""Statistics of the FP32 reference state over the calibration text, per layer, head and row.

The state is never materialised over time: the reference recurrence runs step by step and each step's
per-row amax is folded into running statistics.

Samples: one per (sequence, step), n = B * T per row. For each row (head, value channel):
- the max of the per-step row amax (nvidia-modelopt's MaxCalibrator with axis=(H, rows));
- its mean;
- exact upper-tail percentiles (nearest rank) of the per-step row amax, from a streaming top-k of the
  n samples (k = the largest rank any requested percentile needs);
and for each head the full distribution of the per-step head amax (max over the head's rows), kept as
[B, T, H] (small), from which any quantile and the amax-over-time profile follow.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from .. import kinds
from ..kinds import LayerInputs
from .settings import CalibrateError

DEFAULT_PERCENTILES = (99.0, 99.9, 99.99)
HEAD_QUANTILES = (50.0, 90.0, 99.0, 99.9, 99.99, 100.0)
MAX_TAIL_BYTES = 2 * 2**30  # refuse a top-k buffer larger than this (lower the percentile or the data)


def iter_reference_states(inputs: LayerInputs, *, every: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (step, state) of the FP32 reference decode, state [B, H, rows, state_dim], at steps every, 2 every, ...

    The kind's ``reference_states``: the arithmetic of `replay.reference_decode`, with group expansion one step
    at a time so that memory stays at the size of the inputs. The yielded tensor is the live state: copy it to
    keep it. Inputs are validated by the caller.
    """
    return kinds.of(inputs).reference_states(inputs, every)


def tail_rank(p: float, n: int) -> int:
    """1-based rank from the top of the nearest-rank p-th percentile of n samples (1 = the max)."""
    return n - math.ceil(Fraction(str(p)) * n / 100) + 1


def nearest_rank(sorted_desc: torch.Tensor, p: float, n: int) -> torch.Tensor:
    """p-th percentile (nearest rank) of n samples along dim 0, from the first ranks sorted descending."""
    return sorted_desc[tail_rank(p, n) - 1]


@dataclass
class StateStats:
    """Per-row and per-head statistics of one layer's FP32 reference state amax over (sequence, step).

    - row_amax [H, rows]: max over all samples; row_mean_amax [H, rows]: mean;
    - row_tail {p: [H, rows]}: exact nearest-rank percentiles of the per-step row amax, p >= min tracked;
    - head_amax_steps [B, T, H]: per-step max over each head's rows (the head distribution and profile).
    """

    layer: int | None
    kind: str
    batch: int
    steps: int
    state_shape: tuple[int, int, int]
    row_amax: torch.Tensor
    row_mean_amax: torch.Tensor
    row_tail: dict[float, torch.Tensor]
    head_amax_steps: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def samples(self) -> int:
        """Samples per row: B * T."""
        return self.batch * self.steps

    def row_percentile(self, p: float) -> torch.Tensor:
        """[H, rows] nearest-rank p-th percentile of the per-step row amax (p must have been tracked)."""
        if float(p) == 100.0:
            return self.row_amax
        if float(p) not in self.row_tail:
            raise CalibrateError(
                f"percentile {p:g} was not tracked; tracked: {', '.join(f'{q:g}' for q in sorted(self.row_tail))}"
            )
        return self.row_tail[float(p)]

    def head_percentile(self, p: float) -> torch.Tensor:
        """[H] nearest-rank p-th percentile of the per-step head amax."""
        flat = self.head_amax_steps.reshape(-1, self.head_amax_steps.shape[-1])  # [B*T, H]
        desc = flat.sort(dim=0, descending=True).values
        return nearest_rank(desc, p, flat.shape[0])

    @property
    def head_amax(self) -> torch.Tensor:
        """[H] max over rows and samples."""
        return self.row_amax.amax(-1)

    def head_quantiles(self, levels=HEAD_QUANTILES) -> dict[float, torch.Tensor]:
        return {float(p): self.head_percentile(p) for p in levels}

    def amax_profile(self) -> torch.Tensor:
        """[T, H] head amax at each step, max over sequences: how the state grows over the horizon."""
        return self.head_amax_steps.amax(0)

    def summary(self) -> dict:
        """A compact JSON-able summary (numbers over rows/heads of this layer)."""
        amax = self.row_amax.flatten()
        pos = amax > 0
        out = {
            "samples_per_row": self.samples,
            "amax_max": float(amax.max()),
            "amax_median_row": float(amax.median()),
            "amax_min_row": float(amax.min()),
            "peak_step_per_head_median": int(self.amax_profile().argmax(0).float().median()) + 1,
        }
        for p in sorted(self.row_tail):
            ratio = self.row_tail[p].flatten()[pos] / amax[pos]
            out[f"p{p:g}_over_max_median_row"] = float(ratio.median()) if ratio.numel() else None
        return out

    def head_table(self) -> dict:
        """{"p50": [H values], ..., "max": [...]} of the per-step head amax (JSON-able)."""
        q = self.head_quantiles()
        return {("max" if p == 100.0 else f"p{p:g}"): [float(v) for v in t] for p, t in q.items()}

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Named FP32 tensors for a safetensors file: row amax, mean, tail percentiles, the [T, H] profile."""
        out = {
            f"{prefix}.row_amax": self.row_amax,
            f"{prefix}.row_mean_amax": self.row_mean_amax,
            f"{prefix}.amax_profile": self.amax_profile(),
        }
        for p, t in sorted(self.row_tail.items()):
            out[f"{prefix}.row_p{p:g}"] = t
        return {k: v.detach().float().cpu().clone() for k, v in out.items()}


def collect_stats(
    inputs: LayerInputs,
    *,
    percentiles=DEFAULT_PERCENTILES,
    layer: int | None = None,
    chunk: int = 64,
) -> StateStats:
    """Stream the FP32 reference decode of one layer and collect its StateStats.

    inputs: Mamba2Inputs or GDNInputs (validated here); percentiles: upper-tail percentiles of the per-step
    row amax to keep exactly (each in [50, 100]); chunk: steps folded into the top-k at once.
    """
    from modelopt.torch.quantization.calib import MaxCalibrator

    inputs.validate()
    pcts = sorted({float(p) for p in percentiles})
    for p in pcts:
        if not 50.0 <= p <= 100.0:
            raise CalibrateError(f"tracked percentiles must lie in [50, 100], got {p:g}")
    bsz, steps, heads, rows = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows
    n = bsz * steps
    k = max([tail_rank(p, n) for p in pcts] + [1])
    if k * heads * rows * 4 > MAX_TAIL_BYTES:
        raise CalibrateError(
            f"percentile {pcts[0]:g} over {n} samples needs a top-{k} buffer of "
            f"{k * heads * rows * 4 / 2**30:.1f} GiB per layer; use a higher percentile or fewer samples"
        )
    dev = inputs.device
    maxcal = MaxCalibrator(axis=(1, 2))  # keep (H, rows), reduce over sequences
    total = torch.zeros(heads, rows, device=dev, dtype=torch.float64)
    head_steps = torch.empty(bsz, steps, heads, device=dev)
    tail = torch.empty(0, heads, rows, device=dev)
    pending: list[torch.Tensor] = []

    def fold():
        nonlocal tail
        if pending:
            allv = torch.cat([tail, *pending], 0)
            tail = allv.topk(min(k, allv.shape[0]), dim=0).values  # sorted descending
            pending.clear()

    for t, state in iter_reference_states(inputs):
        row_amax = state.abs().amax(-1)  # [B, H, rows]
        maxcal.collect(row_amax)
        total += row_amax.sum(0, dtype=torch.float64)
        head_steps[:, t - 1] = row_amax.amax(-1)
        pending.append(row_amax)
        if len(pending) >= chunk:
            fold()
    fold()
    row_tail = {p: nearest_rank(tail, p, n).clone() for p in pcts if p < 100.0}
    return StateStats(
        layer=layer,
        kind=inputs.kind,
        batch=bsz,
        steps=steps,
        state_shape=(heads, rows, inputs.state_dim),
        row_amax=maxcal.compute_amax().reshape(heads, rows).float(),
        row_mean_amax=(total / n).float(),
        row_tail=row_tail,
        head_amax_steps=head_steps,
    )
