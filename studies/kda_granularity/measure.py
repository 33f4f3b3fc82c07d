#!/usr/bin/env python3
"""Does KDA need a scale granularity over the key channels? A quick measurement (issue 14).

A KDA state row (one value channel, over the Dk key channels) mixes key channels that decay at their own
rates, so one scale per row must cover fast- and slow-decaying channels at once; one scale per key column
(over the Dv value channels of one key channel) would not. This script compares, on synthetic inputs of a
preset's first KDA layer (the family's initialisation, `ssmquant.models.synthetic_inputs`):

- row:    the default, one scale per (head, value channel), amax over Dk (`fmt.fake_quant(S)`);
- head:   one scale per head (`:head`);
- column: one scale per (head, key channel), amax over Dv: the same format applied to S^T.

It runs the state-form recurrence of `ssmquant.replay.naive.kda_advance` (bf16 buffer under replay) and
reports the relative error of the state and of the output, RMS over the last 64 steps (4 whole flush
cycles of replay16, so no phase of the cycle is favoured), against the FP32 reference.

    python studies/kda_granularity/measure.py [--preset glm-5.3-flash] [--steps 512] [--batch 1]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from ssmquant import formats  # noqa: E402
from ssmquant.kinds import (  # noqa: E402
    expand_groups,
    kda_advance,  # noqa: E402
    kda_decays,
)
from ssmquant.models import get_preset, synthetic_inputs  # noqa: E402

WINDOW = 64


def store(fmt, s, granularity):
    if granularity == "column":
        return fmt.fake_quant(s.transpose(-1, -2)).transpose(-1, -2)
    return fmt.fake_quant(s)


def run(inputs, encoding, granularity, scheme):
    fmt = formats.parse(encoding + (":head" if granularity == "head" else ""))
    heads = inputs.num_heads
    alpha = kda_decays(inputs)
    q, k = expand_groups(inputs.q.float(), heads), expand_groups(inputs.k.float(), heads)
    kb = k.bfloat16().float() if scheme != "conventional" else k
    buf = torch.bfloat16 if scheme != "conventional" else torch.float32
    v, beta = inputs.v.float(), inputs.beta.float()
    every = 1 if scheme == "conventional" else int(scheme.removeprefix("replay"))
    s_ref = torch.zeros(inputs.state_shape)
    s_var = torch.zeros_like(s_ref)
    err = {"state": [0.0, 0.0], "out": [0.0, 0.0]}
    for t in range(inputs.steps):
        s_ref, y_ref = kda_advance(s_ref, alpha[:, t], k[:, t], v[:, t], beta[:, t], q[:, t])
        s_var, y_var = kda_advance(s_var, alpha[:, t], kb[:, t], v[:, t], beta[:, t], q[:, t], buf)
        if (t + 1) % every == 0:
            s_var = store(fmt, s_var, granularity)
        if t >= inputs.steps - WINDOW:
            for name, a, b in (("state", s_var, s_ref), ("out", y_var, y_ref)):
                err[name][0] += float(((a - b) ** 2).sum())
                err[name][1] += float((b**2).sum())
    return {name: (e / r) ** 0.5 for name, (e, r) in err.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    p = get_preset(args.preset)
    inputs = synthetic_inputs(p, p.ssm_layers[0], batch=args.batch, steps=args.steps, seed=args.seed)
    t0 = time.time()
    print(f"{p.name} layer {p.ssm_layers[0]}, synthetic (family init), batch {args.batch}, {args.steps} steps; "
          f"relative error RMS over the last {WINDOW} steps\n")
    print("| format | scheme | row: out / state | head: out / state | column: out / state | row / column (out) |")
    print("|---|---|---|---|---|---|")
    for enc in ("fp8_e4m3", "int8", "nvfp4"):
        for scheme in ("conventional", "replay16"):
            r = {g: run(inputs, enc, g, scheme) for g in ("row", "head", "column")}
            cells = " | ".join(f"{r[g]['out']:.3g} / {r[g]['state']:.3g}" for g in ("row", "head", "column"))
            print(f"| {enc} | {scheme} | {cells} | {r['row']['out'] / r['column']['out']:.2f} |", flush=True)
    print(f"\n{time.time() - t0:.0f} s; command: python studies/kda_granularity/measure.py --preset {p.name} "
          f"--steps {args.steps} --batch {args.batch} --seed {args.seed}")


if __name__ == "__main__":
    main()
