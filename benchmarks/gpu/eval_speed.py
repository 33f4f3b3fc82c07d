"""Folded vs unfolded `evaluate` on one loaded checkpoint: decode steps/s of each, and how far their metrics
differ (batch-size-dependent GEMM kernels may change the last bits). Part of benchmarks/gpu/eval_speed.sh.

    python3 benchmarks/gpu/eval_speed.py CKPT OUT_JSON --steps 32 --batch 8 --device cuda --variants a,b,c
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from ssmquant.evaluate import evaluate
from ssmquant.models import load_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out_json")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", required=True)
    ap.add_argument("--exact-until", type=int, default=16, help="first positions of the replay variant that must be exact")
    args = ap.parse_args(argv)

    t = time.time()
    loaded = load_model(args.model, device=torch.device(args.device))
    print(f"loaded {args.model} in {time.time() - t:.1f} s", flush=True)
    evaluate(loaded, args.variants, steps=2, batch=args.batch)  # warm-up: CUDA context, cuBLAS handles, allocator
    runs = {}
    for fold in (True, False):
        r = evaluate(loaded, args.variants, steps=args.steps, batch=args.batch, fold=fold)
        name = "folded" if fold else "unfolded"
        runs[name] = r
        print(f"{name}: {r.timing['decode_steps_per_s']:.2f} decode steps/s ({r.timing})", flush=True)
    a, b = (runs[k].positions.sort_values(["variant", "position"]).reset_index(drop=True) for k in runs)
    diff = {m: float(np.abs(a[m].to_numpy() - b[m].to_numpy()).max()) for m in ("kl", "top1_agree", "delta_loss")}
    rel_kl = float(np.abs(a.kl - b.kl).max() / max(b.kl.abs().max(), 1e-300))
    # A replay variant's slice is exact until its first flush: in the folded batch its logits must equal the
    # reference slice's bit for bit (KL exactly 0), which holds when the kernels treat every row alike.
    replay = [v for v in runs["folded"].config.variants if "@replay" in v]
    exact_ok = None
    if replay:
        kl = a[a.variant == replay[0]].kl.to_numpy()[: args.exact_until]
        exact_ok = bool((kl == 0).all())
    res = {
        "model": args.model,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
        "batch": args.batch,
        "variants": runs["folded"].config.variants,
        "folded": runs["folded"].timing,
        "unfolded": runs["unfolded"].timing,
        "speedup": runs["folded"].timing["decode_steps_per_s"] / runs["unfolded"].timing["decode_steps_per_s"],
        "max_abs_diff_folded_vs_unfolded": diff,
        "max_rel_diff_kl": rel_kl,
        "replay_slice_exact_before_first_flush": exact_ok,
        "summary_folded": runs["folded"].summary.to_dict(orient="records"),
        "summary_unfolded": runs["unfolded"].summary.to_dict(orient="records"),
    }
    with open(args.out_json, "w") as f:
        json.dump(res, f, indent=2, default=str)
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("summary")}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
