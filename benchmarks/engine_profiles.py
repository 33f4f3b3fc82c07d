"""How far the `ideal` emulation is from the `flashinfer` profile, per format, over a long horizon.

Runs `simulate` with both profiles on the same inputs and prints a markdown table of the relative
state and output errors (window means, pooled over batch and heads) at the last window and averaged over
the horizon, with the ratio flashinfer / ideal. Inputs: a synthetic Nemotron-3-Nano layer (a subset of
its 64 heads, every `--head-stride`-th, to fit a CPU) and, with --captured, the tiny-nemotron layer
captured by `ssmquant.engines.oracle.save_captured`.

    python benchmarks/engine_profiles.py [--steps 4096] [--captured FILE] [--device cpu]
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch

from ssmquant.engines.oracle import bf16_inputs, load_captured
from ssmquant.models.synthetic import synthetic_inputs
from ssmquant.replay import Mamba2Inputs, simulate

VARIANTS = [
    "int8@replay16",
    "fp8_e4m3@replay16",
    "int8:sr@replay16",
    "fp8_e4m3:sr@replay16",
    "bf16@replay16",
    "fp32@replay16",
    "bf16@conventional",
    "fp16:sr@conventional",
]


def nano_subset(steps: int, stride: int, device) -> Mamba2Inputs:
    full = bf16_inputs(synthetic_inputs("nemotron-3-nano", 0, batch=1, steps=steps, device=device))
    heads = torch.arange(0, full.num_heads, stride, device=device)
    groups = heads // (full.num_heads // full.num_groups)
    # one group per kept head keeps each head's own B, C
    return Mamba2Inputs(
        x=full.x[:, :, heads], dt=full.dt[:, :, heads], B=full.B[:, :, groups], C=full.C[:, :, groups],
        A=full.A[heads], D=full.D[heads], meta={"source": f"synthetic nemotron-3-nano layer 0, heads 0::{stride}"},
    ).validate()  # fmt: skip


def compare(inp, steps: int, window: int) -> list[dict]:
    ideal = simulate(inp, VARIANTS, record_every=window)
    prof = simulate(inp, VARIANTS, record_every=window, engine="flashinfer")
    rows = []
    for i, v in enumerate(VARIANTS):
        row = {"variant": v}
        for q in ("state", "out"):
            a, b = ideal.rel_err(q)[i], prof.rel_err(q)[i]
            row[f"{q}_ideal_last"], row[f"{q}_fi_last"] = float(a[-1]), float(b[-1])
            row[f"{q}_ideal_mean"], row[f"{q}_fi_mean"] = float(a.mean()), float(b.mean())
        rows.append(row)
    return rows


def table(title: str, rows: list[dict]) -> str:
    out = [f"**{title}**", "", "| variant | state err ideal | state err flashinfer | ratio | out err ideal | out err flashinfer | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["variant"]]
        for q in ("state", "out"):
            a, b = r[f"{q}_ideal_last"], r[f"{q}_fi_last"]
            cells += [f"{a:.3e}", f"{b:.3e}", f"{b / a:.2f}" if a > 0 else "—"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--head-stride", type=int, default=8)
    ap.add_argument("--captured", type=pathlib.Path, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sources = [nano_subset(args.steps, args.head_stride, dev)]
    if args.captured:
        sources += [i for i in load_captured(args.captured, dev).values() if isinstance(i, Mamba2Inputs)]
    for inp in sources:
        t0 = time.time()
        rows = compare(inp, args.steps, args.window)
        title = f"{inp.meta.get('source')}: last window (steps {args.steps - args.window + 1}-{args.steps}), batch {inp.batch}, {inp.num_heads} heads"
        print(table(title, rows), flush=True)
        print(f"\n({time.time() - t0:.0f} s on {dev})\n", flush=True)


if __name__ == "__main__":
    main()
