"""The GPU lanes of `analyze` (several layers emulated at once, one CUDA stream each) change no output.

Runs analyze() in this process on a few nemotron-3-nano layers with ``analysis.run.GPU_LANES`` 1 and then 2
(and again 1, so that the first run's compiles do not count), checks that traces, heads and summary are
identical (exact), and prints each run's time. Exits 1 on any difference.

    python lab/gpu/lanes_check.py [--device cuda] [--steps 4096] [--batch 8] [--layers 0,2,4,7]
"""

from __future__ import annotations

import sys
import time

from nano_outputs_check import compare, nano_config  # this folder: the same command line and comparison

from ssmquant.analysis import analyze
from ssmquant.analysis import run as run_mod


def main() -> int:
    _, cfg = nano_config()
    results = {}
    for lanes in (1, 2, 1):
        run_mod.GPU_LANES = lanes
        t0 = time.perf_counter()
        res = analyze(cfg)
        print(f"lanes={lanes}: {time.perf_counter() - t0:.3f} s, stages {res.stages}", flush=True)
        results.setdefault(lanes, res)
    identical, _ = compare("1 / 2 lanes", results[1], results[2])
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
