"""What the end-to-end evaluation measures, per position, and its summaries.

At decode step t (position p = t + 1: the model has read p tokens and predicts token p + 1), for each
sequence b, with p = softmax of the FP32-state model's logits and q = the variant's:

- ``kl``: KL(p || q) = sum_v p_v (log p_v - log q_v), in nats (log-softmax in float64; clamped at 0
  against rounding in the last bits);
- ``top1_agree``: 1 where argmax q = argmax p, else 0;
- ``delta_loss``: cross-entropy of the actual next token under q minus under p, in bits (per byte for
  byte-level models, per token otherwise): positive when the variant predicts the text worse.

The long table holds the mean over the batch's sequences at every position. Summaries: the mean over
all positions and sequences (``*_mean``), and at the horizon: the mean over the last
``horizon_fraction`` of positions (at least one) and all sequences (``*_horizon``); the per-sequence table
holds the same means for each sequence, so that intervals over sequences can be drawn from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

LN2 = math.log(2.0)
METRICS = ("kl", "top1_agree", "delta_loss")


@dataclass
class ReferenceStep:
    """The FP32-state model at one step: log-probs and probs [B, V] float64, argmax [B], next-token loss [B] (nats)."""

    logp: torch.Tensor
    prob: torch.Tensor
    top1: torch.Tensor
    nll: torch.Tensor


def reference_step(logits: torch.Tensor, target: torch.Tensor) -> ReferenceStep:
    """logits [B, V] (FP32), target [B] (the actual next tokens) -> ReferenceStep."""
    logp = logits.double().log_softmax(-1)
    return ReferenceStep(logp, logp.exp(), logits.argmax(-1), -logp.gather(-1, target[:, None])[:, 0])


def compare_step(ref: ReferenceStep, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A variant's logits [B, V] against the reference -> [3, B] float64: kl (nats), top-1 agreement, delta nll (nats)."""
    logq = logits.double().log_softmax(-1)
    kl = (ref.prob * (ref.logp - logq)).sum(-1).clamp_min(0.0)
    agree = (logits.argmax(-1) == ref.top1).double()
    dnll = -logq.gather(-1, target[:, None])[:, 0] - ref.nll
    return torch.stack([kl, agree, dnll])


def horizon_window(steps: int, fraction: float, cycle: int = 1) -> int:
    """Number of last positions that make up the horizon window: at least `fraction` of the run, rounded
    up to whole flush cycles (`cycle`: the lcm of the variants' flush periods) so that every phase of a
    replay cycle weighs the same, capped at `steps`."""
    n = max(1, math.ceil(fraction * steps))
    return min(steps, cycle * math.ceil(n / cycle))


def positions_frame(names: list[str], values: np.ndarray) -> pd.DataFrame:
    """Long table from values [V, 3, B, T] (kl nats, agreement, delta loss in bits): one row per (variant, position).

    Columns: variant, position (1-based), kl, top1_agree, delta_loss (means over the batch).
    """
    nv, _, _, nt = values.shape
    mean = values.mean(axis=2)  # [V, 3, T]
    return pd.DataFrame(
        {
            "variant": np.repeat(np.array(names, dtype=object), nt),
            "position": np.tile(np.arange(1, nt + 1), nv),
            **{m: mean[:, i].reshape(-1) for i, m in enumerate(METRICS)},
        }
    )


def sequences_frame(names: list[str], values: np.ndarray, window: int) -> pd.DataFrame:
    """One row per (variant, sequence) from values [V, 3, B, T]: each metric's mean over all positions
    (``*_mean``) and over the last ``window`` positions (``*_horizon``) of that sequence."""
    nv, _, nb, _ = values.shape
    return pd.DataFrame(
        {
            "variant": np.repeat(np.array(names, dtype=object), nb),
            "sequence": np.tile(np.arange(nb), nv),
            **{f"{m}_mean": values[:, i].mean(axis=-1).reshape(-1) for i, m in enumerate(METRICS)},
            **{f"{m}_horizon": values[:, i, :, -window:].mean(axis=-1).reshape(-1) for i, m in enumerate(METRICS)},
        }
    )


def summary_rows(values: np.ndarray, window: int) -> list[dict]:
    """Per variant: means over everything and over the horizon window, from values [V, 3, B, T]."""
    rows = []
    for v in range(values.shape[0]):
        row = {}
        for i, m in enumerate(METRICS):
            row[f"{m}_mean"] = float(values[v, i].mean())
            row[f"{m}_horizon"] = float(values[v, i, :, -window:].mean())
        row["kl_final"] = float(values[v, 0, :, -1].mean())
        rows.append(row)
    return rows
