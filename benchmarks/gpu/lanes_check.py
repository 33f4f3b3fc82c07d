"""The GPU lanes of `analyze` (several layers emulated at once, one CUDA stream each) change no output.

Runs analyze() in this process on a few nemotron-3-nano layers with ``analysis.run.GPU_LANES`` 1 and then 2
(and again 1, so that the first run's compiles do not count), checks that traces, heads and summary are
identical (exact), and prints each run's time. Exits 1 on any difference.

    python benchmarks/gpu/lanes_check.py [--device cuda] [--steps 4096] [--batch 8] [--layers 0,2,4,7]
"""

from __future__ import annotations

import argparse
import sys
import time

import pandas as pd

from ssmquant.analysis import AnalyzeConfig, analyze
from ssmquant.analysis import run as run_mod


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", default="0,2,4,7")
    args = ap.parse_args()
    cfg = AnalyzeConfig(model="nemotron-3-nano", synthetic=True, steps=args.steps, batch=args.batch,
                        layers=[int(x) for x in args.layers.split(",")], device=args.device)  # fmt: skip
    results = {}
    for lanes in (1, 2, 1):
        run_mod.GPU_LANES = lanes
        t0 = time.perf_counter()
        res = analyze(cfg)
        print(f"lanes={lanes}: {time.perf_counter() - t0:.3f} s, stages {res.stages}", flush=True)
        results.setdefault(lanes, res)
    a, b = results[1], results[2]
    bad = 0
    for name in ("traces", "heads", "summary"):
        try:
            pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), check_exact=True)
            print(f"{name}: identical ({len(getattr(a, name))} rows)")
        except AssertionError as err:
            bad += 1
            print(f"{name}: DIFFERENT\n{err}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
