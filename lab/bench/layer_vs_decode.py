"""eval's layer mode against its decode mode, position by position, on the shipped models.

    python lab/bench/layer_vs_decode.py [--steps 2048] [--batch 2] [--device cpu] [--models tiny-nemotron,...]

For each model and variant: the positions whose top-1 agreement (mean over the batch) differs between the modes,
the per-position KL ratio layer / decode (median and 5-95% range over positions with KL > 1e-6 in both), the mean
KL of each mode, and the reference loss of each mode.
"""

from __future__ import annotations

import argparse

import numpy as np

from ssmquant.evaluate import EvalConfig, evaluate
from ssmquant.models import load_model

VARIANTS = "fp8_e4m3@conventional,int8@replay16,nvfp4@conventional"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-nemotron,tiny-qwen,tiny-kda")
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for name in args.models.split(","):
        loaded = load_model(name, device=args.device)
        runs = {
            mode: evaluate(EvalConfig(loaded, VARIANTS, steps=args.steps, batch=args.batch, mode=mode))
            for mode in ("decode", "layer")
        }
        pos = {m: r.positions.set_index(["variant", "position"]) for m, r in runs.items()}
        loss = {m: r.reference["loss_mean"] for m, r in runs.items()}
        print(f"{name}: {args.steps} steps x {args.batch} sequences on {args.device}; reference loss decode "
              f"{loss['decode']:.6f}, layer {loss['layer']:.6f}")  # fmt: skip
        for v in runs["decode"].summary["variant"]:
            d, la = pos["decode"].loc[v], pos["layer"].loc[v]
            flips = int((d["top1_agree"] != la["top1_agree"]).sum())
            both = (d["kl"] > 1e-6) & (la["kl"] > 1e-6)
            ratio = (la["kl"][both] / d["kl"][both]).to_numpy()
            q = np.percentile(ratio, [5, 50, 95]) if len(ratio) else [np.nan] * 3
            print(f"  {v}: top-1 agreement differs at {flips} of {len(d)} positions; KL ratio layer/decode median "
                  f"{q[1]:.3f} (5-95%: {q[0]:.3f}-{q[2]:.3f}, {len(ratio)} positions); mean KL decode "
                  f"{d['kl'].mean():.4g}, layer {la['kl'].mean():.4g}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
