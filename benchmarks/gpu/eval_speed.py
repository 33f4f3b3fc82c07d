"""`evaluate` speed on one model: decode steps/s of the default loop, the folded loop and the eager loop (no CUDA
graphs), and how far their metrics differ. Part of benchmarks/gpu/eval_speed.sh.

    python3 benchmarks/gpu/eval_speed.py MODEL OUT_JSON --steps 256 --compare-steps 64 --batch 8 --device cuda

MODEL: a preset (built in memory with random weights: ``models.build.build_random_model``) or anything
``load_model`` takes (a checkpoint directory, a shipped model). Runs, each a fresh ``evaluate`` on the same model:

- ``default``: what ``ssmquant eval`` runs (one forward per slice, CUDA graphs where allowed, fused writes);
- ``folded``: ``fold=True`` (the reference and the variants in one batch);
- ``short``, ``eager``: the default loop with and without CUDA graphs (``cuda_graphs=False``) on
  ``--compare-steps`` steps: their metrics must be equal bit for bit (graphs replay the same kernels on the same
  addresses); ``folded_short``, ``folded_eager``: the same for ``fold=True``. (Runs of different lengths read
  different sequences: the held-out text is cut into ``steps + 1``-token pieces.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import numpy as np
import torch

from ssmquant.evaluate import EvalError, evaluate
from ssmquant.models import load_model

METRICS = ["kl", "top1_agree", "delta_loss"]


def _load(spec: str, device: str):
    from ssmquant.models.presets import get_preset

    try:
        get_preset(spec)
    except Exception:
        return load_model(spec, device=torch.device(device)), "loaded"
    from ssmquant.models.build import build_random_model

    return build_random_model(spec, devices=device), "built in memory (random weights)"


def _diff(a, b, steps: int) -> dict:
    """Largest |a - b| of each metric over the first ``steps`` positions of every variant."""
    a = a.positions[a.positions.position <= steps].sort_values(["variant", "position"]).reset_index(drop=True)
    b = b.positions[b.positions.position <= steps].sort_values(["variant", "position"]).reset_index(drop=True)
    return {m: float(np.abs(a[m].to_numpy() - b[m].to_numpy()).max()) for m in METRICS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out_json")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--compare-steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", required=True)
    ap.add_argument("--runs", default="eager,short,default,folded,folded_short,folded_eager")
    args = ap.parse_args(argv)

    t = time.time()
    loaded, how = _load(args.model, args.device)
    load_s = time.time() - t
    print(f"{args.model}: {how} in {load_s:.1f} s", flush=True)
    t = time.time()
    # CUDA context, cuBLAS, Triton kernels; eager: a failure of graph recording must not hide the other numbers
    evaluate(loaded, args.variants, steps=4, batch=args.batch, notify=None, cuda_graphs=False)
    print(f"warm-up (4 steps, kernels compiled or loaded from the cache) {time.time() - t:.1f} s", flush=True)

    settings = {
        "default": dict(steps=args.steps),
        "folded": dict(steps=args.steps, fold=True),
        "short": dict(steps=args.compare_steps),
        "eager": dict(steps=args.compare_steps, cuda_graphs=False),
        "folded_short": dict(steps=args.compare_steps, fold=True),
        "folded_eager": dict(steps=args.compare_steps, fold=True, cuda_graphs=False),
    }
    runs, res = {}, {}
    for name in args.runs.split(","):
        kw = settings[name]
        print(f"== {name}: {kw}", flush=True)
        t = time.time()
        try:
            r = evaluate(loaded, args.variants, batch=args.batch, notify=lambda line: print("  " + line, flush=True), **kw)
        except EvalError as err:
            print(f"  {name} FAILED: {err}", flush=True)
            res[name] = {"error": str(err), "wall_s": round(time.time() - t, 2), **kw}
            continue
        except Exception as err:  # a bug (e.g. in graph recording): keep the other runs' numbers
            traceback.print_exc()
            res[name] = {"error": f"{type(err).__name__}: {err}", "wall_s": round(time.time() - t, 2), **kw}
            continue
        runs[name] = r
        res[name] = {
            **kw,
            "wall_s": round(time.time() - t, 2),
            "timing": r.timing,
            "summary": r.summary.to_dict(orient="records"),
            "notes": r.notes,
        }
        print(f"  {name}: {r.timing['decode_steps_per_s']:.2f} decode steps/s at batch {args.batch} "
              f"({kw['steps']} steps, {r.timing['decode_s']:.1f} s; graphs {r.timing.get('cuda_graphs')})", flush=True)  # fmt: skip
    compare = {}
    pairs = (("short", "eager"), ("folded_short", "folded_eager"), ("default", "folded"), ("short", "folded_short"))
    for a, b in pairs:
        if a in runs and b in runs:
            n = runs[a].config.steps
            compare[f"{a}_vs_{b}"] = {"positions": n, "max_abs_diff": _diff(runs[a], runs[b], n)}
            print(f"{a} vs {b}, first {n} positions: max |diff| {compare[f'{a}_vs_{b}']['max_abs_diff']}", flush=True)
    out = {
        "model": args.model,
        "how": how,
        "load_s": round(load_s, 2),
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "variants": args.variants.split(","),
        "runs": res,
        "compare": compare,
    }
    with open(args.out_json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
