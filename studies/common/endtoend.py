"""End-to-end runs for the pages: `ssmquant.evaluate` one held-out sequence at a time, so that every
number has a per-sequence value to bootstrap over.

`evaluate` reports means over its batch; with batch = 1 each run is one sequence. Its `seed` picks the
held-out passage, and passages of different seeds may overlap: `disjoint_seeds` keeps the first seeds
whose passages share no token position, so the sequences are distinct text.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch

from ssmquant.evaluate import EvalConfig, evaluate
from ssmquant.models import load_model
from ssmquant.models.text import calibration_batch, load_text, split_bounds, tokenize
from ssmquant.provenance import environment

POSITION_BIN = 16


def passage_start(tokens: np.ndarray, window: np.ndarray) -> int:
    """First position of `window` in `tokens` (-1 when absent)."""
    if len(window) > len(tokens):
        return -1
    view = np.lib.stride_tricks.sliding_window_view(tokens, len(window))
    hits = np.flatnonzero((view == window).all(axis=1))
    return int(hits[0]) if len(hits) else -1


def disjoint_seeds(tokenizer, length: int, count: int, max_seed: int = 1000) -> list[int]:
    """The first `count` seeds whose held-out passages of `length` tokens do not overlap."""
    tokens = tokenize(load_text(None), tokenizer).numpy()
    start, stop = split_bounds(len(tokens), "heldout")
    held = tokens[start:stop]
    taken: list[tuple[int, int]] = []
    seeds = []
    for seed in range(max_seed):
        ids = calibration_batch(1, length, tokenizer=tokenizer, seed=seed, split="heldout")[0].numpy()
        a = passage_start(held, ids)
        if a < 0 or any(a < b + length and b < a + length for b, _ in taken):
            continue
        taken.append((a, seed))
        seeds.append(seed)
        if len(seeds) == count:
            return seeds
    raise RuntimeError(f"found only {len(seeds)} disjoint held-out passages of {length} tokens")


def run_e2e(model: str, variants: list[str], steps: int, sequences: int, log=print):
    """(per-sequence summary, binned KL per position, provenance) for `sequences` held-out passages."""
    t0 = time.time()
    loaded = load_model(model, device=torch.device("cpu"))
    seeds = disjoint_seeds(loaded.tokenizer, steps + 1, sequences)
    rows, bins, reference = [], [], []
    for seed in seeds:
        t1 = time.time()
        res = evaluate(EvalConfig(loaded, variants, steps=steps, batch=1, seed=seed))
        for r in res.summary.to_dict(orient="records"):
            rows.append({"model": model, "seed": seed, "sequence": 0, **r})
        pos = res.positions.assign(bin=lambda d: (d["position"] - 1) // POSITION_BIN)
        b = pos.groupby(["variant", "bin"], sort=False).agg(position=("position", "max"), kl=("kl", "mean"))
        bins.append(b.reset_index().drop(columns="bin").assign(model=model, seed=seed))
        reference.append({"seed": seed, **res.reference})
        log(f"  e2e {model} seed {seed}: {time.time() - t1:.1f} s")
    provenance = {
        "run": f"e2e-{model}",
        "model": model,
        "data_source": {**res.source, "location": f"ssmquant/assets/{model}"},
        "settings": {
            "variants": list(variants),
            "steps": steps,
            "batch": 1,
            "seeds": seeds,
            "horizon_window": res.reference["horizon_window"],
        },
        "reference": reference,
        "environment": environment(torch.device("cpu"), cpu_threads=torch.get_num_threads()),
        "elapsed_s": round(time.time() - t0, 1),
    }
    return pd.DataFrame(rows), pd.concat(bins, ignore_index=True), provenance
