#!/usr/bin/env python3
"""The layer-major metrics' two paths side by side: `evaluate.layer_major.chunk_metrics` with the fused kernel
(`kernels.metrics`) and with the torch float64 definition, on one set of random final hidden states through a random
output head of a model's size (default Nemotron-3-Nano's: 2688 -> 131072, bfloat16), 2048 steps x 8 sequences.

    PYTHONPATH=. python lab/bench/metrics_paths.py --device cuda [--rows 16384 --variants 3 --reps 5]

Prints each path's median wall time over --reps (after one untimed run, synchronised), the ratio, and the largest
relative difference of the KL, delta nll and reference nll between the two, and whether top-1 agreement is equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ssmquant.evaluate.layer_major import chunk_metrics


class Head(torch.nn.Module):
    """A stand-in model: chunk_metrics reads only its output embedding."""

    def __init__(self, width: int, vocab: int, dtype: torch.dtype, device: str):
        super().__init__()
        self.lm_head = torch.nn.Linear(width, vocab, bias=False, dtype=dtype, device=device)
        torch.nn.init.normal_(self.lm_head.weight, std=width**-0.5)

    def get_output_embeddings(self):
        return self.lm_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=int, default=2688)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--rows", type=int, default=2048 * 8)
    ap.add_argument("--variants", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    net = Head(args.width, args.vocab, dtype, args.device)
    ref = torch.randn(args.rows, args.width, device=args.device)
    hidden = [ref.to(dtype)] + [(ref + s * torch.randn_like(ref)).to(dtype) for s in (0.01, 0.03, 0.1)[: args.variants]]
    targets = torch.randint(0, args.vocab, (args.rows,), device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results, times = {}, {}
    with torch.no_grad():
        for fused in (True, False, True, False):  # interleaved: the second round is timed
            name = "fused kernel" if fused else "torch float64"
            if name not in results:
                results[name] = chunk_metrics(net, hidden, targets, fused=fused)
                continue
            runs = []
            for _ in range(args.reps):
                sync()
                t0 = time.perf_counter()
                chunk_metrics(net, hidden, targets, fused=fused)
                sync()
                runs.append(time.perf_counter() - t0)
            times[name] = runs
    (nll_f, got), (nll_t, want) = results["fused kernel"], results["torch float64"]

    def rel(a, b):
        return ((a - b).abs() / b.abs().clamp_min(1e-300)).max().item()

    print(f"{args.rows} positions x {args.variants} variants, head {args.width} -> {args.vocab} {args.dtype} on {args.device}")
    for name, runs in times.items():
        print(f"  {name:14s} median {statistics.median(runs) * 1e3:9.1f} ms  (min {min(runs) * 1e3:.1f}, max {max(runs) * 1e3:.1f}, {len(runs)} reps)")
    print(f"  torch / fused: {statistics.median(times['torch float64']) / statistics.median(times['fused kernel']):.1f}x")
    print(f"  max relative difference: kl {rel(got[:, 0], want[:, 0]):.2e}, delta nll "
          f"{(got[:, 2] - want[:, 2]).abs().max().item():.2e} (absolute), nll {rel(nll_f, nll_t):.2e}; "
          f"top-1 agreement equal: {torch.equal(got[:, 1], want[:, 1])}; mean kl {want[:, 0].mean(-1).tolist()}")


if __name__ == "__main__":
    main()
