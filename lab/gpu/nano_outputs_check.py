"""Do the speed changes of issue 15 (pipelined layers, inputs made ahead, ordered window sums) leave analyze's
outputs alone?

Runs analyze() in this process on a few nemotron-3-nano layers at the full 4096 steps x batch 8, four times:

- ``new`` twice: this tree as it is (each layer's host work overlaps the next layer's kernels; the window sums
  added in step order). The two runs must be identical to the bit: the run is deterministic;
- ``main`` twice: the same code with main's per-layer loop (no overlap, inputs drawn in the loop's thread after
  the previous layer's kernels) and main's window sums (CUDA's
  ``index_add_``, which adds with atomics in an order that changes from run to run). Whether those two
  differ from each other says whether main itself was reproducible on this GPU.

Prints, for traces, heads and summary, whether each pair is identical and the largest relative difference
of new against main (main's atomic sums round differently in the last bits: a difference is expected, and
must stay at float64 rounding, below 1e-12). Exits 1 if the two new runs differ or new and main differ by
more than 1e-12 relative. On the CPU (``--device cpu``), whose index_add_ adds in order, all four must be
identical.

    python lab/gpu/nano_outputs_check.py [--device cuda] [--steps 4096] [--batch 8] [--layers 0,2,4,7]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import numpy as np
import pandas as pd
import torch

from ssmquant.analysis import AnalyzeConfig, analyze
from ssmquant.analysis import devices as devices_mod
from ssmquant.analysis.sources import LayerSource
from ssmquant.replay.trace import WindowAccumulator

TABLES = ("traces", "heads", "summary")
TOLERANCE = 1e-12


def _index_add_sums(self, m):
    """main's window sums (ssmquant/replay/trace.py before issue 15's change): CUDA's atomic index_add_."""
    sums = torch.zeros((len(self.ends), *m.shape[1:]), dtype=torch.float64, device=m.device)
    return sums.index_add_(0, self.window_of_step, m)


@contextlib.contextmanager
def mains_arithmetic():
    """main's loop (each layer waits for its results before the next is read) and main's window sums."""
    sums, pipeline, ahead = WindowAccumulator._window_sums, devices_mod._pipeline, LayerSource.can_make_ahead

    def serial(next_item, assignment, work, complete, record):
        while (item := next_item()) is not devices_mod._DONE:
            key, payload = item
            t0 = time.perf_counter()
            res = complete(key, work(key, payload, assignment[key]))
            record(key, res, assignment[key], time.perf_counter() - t0)

    WindowAccumulator._window_sums, devices_mod._pipeline = _index_add_sums, serial
    LayerSource.can_make_ahead = property(lambda self: False)  # inputs drawn in this thread, after the kernels
    try:
        yield
    finally:
        WindowAccumulator._window_sums, devices_mod._pipeline, LayerSource.can_make_ahead = sums, pipeline, ahead


def max_rel_diff(a: pd.DataFrame, b: pd.DataFrame) -> float:
    worst = 0.0
    for col in a.columns:
        if a[col].dtype.kind != "f":
            if not a[col].equals(b[col]):
                return float("inf")
            continue
        x, y = a[col].to_numpy(), b[col].to_numpy()
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        if same.all():
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.abs(x - y) / np.maximum(np.abs(x), np.abs(y))
        worst = max(worst, float(np.nanmax(np.where(same, 0.0, rel))))
    return worst


def compare(label: str, a, b) -> tuple[bool, float]:
    identical, worst = True, 0.0
    for name in TABLES:
        x, y = getattr(a, name), getattr(b, name)
        same = x.shape == y.shape and x.equals(y)
        rel = 0.0 if same else (max_rel_diff(x, y) if x.shape == y.shape else float("inf"))
        identical &= same
        worst = max(worst, rel)
        print(f"  {label:<14} {name:<8} {'identical' if same else f'DIFFERENT, max rel diff {rel:.3g}'}", flush=True)
    return identical, worst


def nano_config() -> tuple[argparse.Namespace, AnalyzeConfig]:
    """The command line shared with lanes_check.py (--device, --steps, --batch, --layers) and the synthetic
    nemotron-3-nano analysis it asks for."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", default="0,2,4,7")
    args = ap.parse_args()
    cfg = AnalyzeConfig(model="nemotron-3-nano", synthetic=True, steps=args.steps, batch=args.batch,
                        layers=[int(x) for x in args.layers.split(",")], device=args.device)  # fmt: skip
    return args, cfg


def main() -> int:
    args, cfg = nano_config()
    runs = {}
    for label in ("new", "new again", "main", "main again"):
        with mains_arithmetic() if label.startswith("main") else contextlib.nullcontext():
            t0 = time.perf_counter()
            runs[label] = analyze(cfg)
        st = runs[label].stages
        print(f"{label}: {time.perf_counter() - t0:.3f} s (emulate {st['emulate_s']} s, layers {st['layers_wall_s']} s)",
              flush=True)  # fmt: skip
    print("comparisons:")
    new_same, _ = compare("new / new", runs["new"], runs["new again"])
    main_same, main_rel = compare("main / main", runs["main"], runs["main again"])
    vs_same, vs_rel = compare("new / main", runs["new"], runs["main"])
    print(f"new deterministic: {new_same}; main deterministic: {main_same} (max rel diff {main_rel:.3g}); "
          f"new == main: {vs_same} (max rel diff {vs_rel:.3g}, tolerance {TOLERANCE:g})")  # fmt: skip
    ok = new_same and vs_rel <= TOLERANCE
    if torch.device(args.device).type == "cpu":
        ok &= vs_same and main_same  # the CPU's index_add_ adds in order: everything identical
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
