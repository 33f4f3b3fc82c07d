"""eval --mode layer on a GPU: the measured peak memory beyond the weights against the run's own estimate.

    python lab/bench/layer_memory.py --preset nemotron-3-nano --layers 14 --runs 4096x1,16384x1,8192x2

For each run (steps x sequences), one layer-mode evaluation of a random-weight preset slice (bfloat16): the
estimate it printed before the work (``sizing.layer_major_memory``, the parts of one forward's batch) and the
peak of torch's allocator over the evaluation less what the weights held before it
(``torch.cuda.max_memory_allocated``). The estimate must not be below the peak; how far above it is says how much
room the memory check gives away.
"""

from __future__ import annotations

import argparse
import time

import torch

from ssmquant.evaluate import EvalConfig, evaluate
from ssmquant.models.build import build_random_model

VARIANTS = "fp8_e4m3@conventional,int8@replay16,nvfp4@conventional"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="nemotron-3-nano")
    ap.add_argument("--layers", type=int, default=None, help="the preset's first N decoder layers (default: all)")
    ap.add_argument("--runs", default="4096x1,16384x1", help="comma-separated STEPSxSEQUENCES")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--text", default=None, help="a text file (default: the shipped corpus)")
    ap.add_argument("--text-split", default="heldout", choices=("heldout", "all"))
    args = ap.parse_args()
    model = build_random_model(args.preset, devices="cuda", num_layers=args.layers, progress=lambda *a: None)
    print(f"{args.preset} ({args.layers or 'all'} layers), {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("steps x seqs | forward batch | estimate GiB | measured peak GiB | estimate / peak | wall s")
    for run in args.runs.split(","):
        steps, batch = (int(x) for x in run.split("x"))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        res = evaluate(EvalConfig(model, args.variants, steps=steps, batch=batch, mode="layer", device="cuda",
                                  text=args.text, text_split=args.text_split))  # fmt: skip
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        est = res.timing["memory_estimate_GiB"]["device"]
        print(f"{steps} x {batch} | {res.timing['forward_batch']} | {est:.2f} | {peak:.2f} | {est / peak:.2f}x | "
              f"{wall:.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
