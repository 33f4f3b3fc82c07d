"""Run the studies' simulations at a scale and write their summary tables (studies/<study>/data/).

    python -m studies.run --scale cpu                 # what the committed tables were made with (CPU)
    SCALE=smoke python -m studies.run --data /tmp/s   # seconds: the smallest end-to-end pipeline
    python -m studies.run --scale cpu --only conv_vs_replay --runs tiny-nemotron   # one run again
    python -m studies.run --scale gpu --device cuda   # the long horizons, on a GPU (Triton kernels)
    python -m studies.run --scale gpu --device cuda --only e2e_horizon --dtype float32 --data /tmp/fp32
                                                      # the end-to-end study with float32 weights (bfloat16's floor)

Then `python studies/make_pages.py [--data DIR --out DIR]` builds the pages from those tables.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from studies.common.context import SCALES, Context  # noqa: E402

# the studies whose runs load a model and evaluate it end to end: the only ones a weights dtype changes
WEIGHT_DTYPE_STUDIES = ("e2e_horizon",)
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")

STUDIES = (
    "conv_vs_replay",
    "buffer_length",
    "granularity_calibration",
    "fragile_heads",
    "speculative",
    "synthetic_profiles",
    "e2e_horizon",
)


def study_module(name: str):
    return importlib.import_module(f"studies.{name}.study")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default=os.environ.get("SCALE", "cpu"), help=f"one of {', '.join(SCALES)} [env SCALE]")
    ap.add_argument("--data", default=str(ROOT / "studies"), help="root of the study data (default: studies/)")
    ap.add_argument("--only", default=None, help=f"comma-separated studies (default: all): {', '.join(STUDIES)}")
    ap.add_argument("--runs", default=None, help="comma-separated run names inside the studies (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--dtype", default=None, choices=sorted(WEIGHT_DTYPES),
                    help="the models' weights dtype, for the studies that evaluate end to end "
                         f"({', '.join(WEIGHT_DTYPE_STUDIES)}; default: bfloat16 on CUDA, float32 on the CPU); "
                         "write such a run's data under another --data root")  # fmt: skip
    args = ap.parse_args(argv)
    if args.scale not in SCALES:
        ap.error(f"unknown scale {args.scale!r}; accepted: {', '.join(SCALES)}")
    only = STUDIES if args.only is None else tuple(s.strip() for s in args.only.split(",") if s.strip())
    bad = [s for s in only if s not in STUDIES]
    if bad:
        ap.error(f"unknown studies {bad}; accepted: {', '.join(STUDIES)}")
    if args.dtype is not None and set(only) - set(WEIGHT_DTYPE_STUDIES):
        ap.error(f"--dtype applies to {', '.join(WEIGHT_DTYPE_STUDIES)} only; the others emulate captured layers in "
                 f"float32: pass --only {','.join(WEIGHT_DTYPE_STUDIES)}")  # fmt: skip
    runs = None if args.runs is None else {r.strip() for r in args.runs.split(",") if r.strip()}
    ctx = Context(args.scale, pathlib.Path(args.data), args.device, args.backend, runs, dtype=args.dtype)
    t0 = time.time()
    for name in only:
        study_module(name).collect(ctx)
    for k, v in ctx.timings.items():
        print(f"{k}: {v} s")
    print(f"done in {time.time() - t0:.0f} s")
    return ctx.timings


if __name__ == "__main__":
    main()
