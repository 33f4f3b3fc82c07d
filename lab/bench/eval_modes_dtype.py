"""eval's two modes on a random-weight slice of a preset, in float32 and in bfloat16: do they agree?

    python lab/bench/eval_modes_dtype.py [--preset nemotron-3-nano] [--layers 6] [--steps 32] [--batch 2]

Prints each mode's per-variant mean KL and top-1 agreement and the reference loss, per weight dtype. With random
weights the state rounding moves the logits by little (KL ~1e-10 in float32); in bfloat16 both modes sit at the
noise floor of bf16 rounding flips that the random network amplifies (benchmarks/RESULTS.md, eval-cuda).
"""

from __future__ import annotations

import argparse

from ssmquant.evaluate import EvalConfig, evaluate
from ssmquant.models.build import build_random_model

VARIANTS = "fp8_e4m3@conventional,nvfp4@conventional"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="nemotron-3-nano")
    ap.add_argument("--layers", type=int, default=6, help="the preset's first N decoder layers")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for dtype in ("float32", "bfloat16"):
        model = build_random_model(
            args.preset, devices=args.device, num_layers=args.layers, dtype=dtype, progress=lambda *a: None
        )
        for mode in ("decode", "layer"):
            cfg = EvalConfig(model, VARIANTS, steps=args.steps, batch=args.batch, mode=mode, device=args.device)
            r = evaluate(cfg)
            table = r.summary[["variant", "kl_mean", "top1_agree_mean"]].to_string(index=False)
            print(f"{dtype} {mode} (reference loss {r.reference['loss_mean']:.6f})\n{table}\n", flush=True)


if __name__ == "__main__":
    main()
