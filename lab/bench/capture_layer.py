"""Capture one SSM layer's decode inputs from a model for the engine oracle (`--captured` of `lab.engines.oracle`).

The layer's inputs over `--steps` tokens of the shipped corpus (calibration split, seeded), in the form the
recurrence consumes, saved with `lab.engines.oracle.save_captured` under the name
`<model>-layer<N>[-heads<a>-<b>]`. `--heads a:b` keeps heads a..b-1 only (heads of Mamba-2 / GDN / KDA decode
independently given their inputs; for Mamba-2 the kept heads must cover whole groups): it halves the file for a GPU
call whose carried tree is tight.

    python -m lab.bench.capture_layer --model tiny-kda --layer 6 --steps 4096 --heads 0:2 --out captured_kda.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lab.engines.oracle import save_captured
from ssmquant.analysis.sources import load_source_model
from ssmquant.kinds import Mamba2Inputs
from ssmquant.models.capture import capture_inputs, capture_text_batch


def keep_heads(inp, first: int, stop: int):
    """inp restricted to heads first..stop-1 (every per-head tensor sliced on its head dim)."""
    fields = {}
    for name, t in vars(inp).items():
        if not isinstance(t, torch.Tensor):
            continue
        if isinstance(inp, Mamba2Inputs) and name in ("B", "C"):
            per_group = inp.num_heads // inp.num_groups
            if first % per_group or stop % per_group:
                raise SystemExit(f"--heads {first}:{stop} splits a group of {per_group} heads; keep whole groups")
            fields[name] = t[:, :, first // per_group : stop // per_group].contiguous()
        elif isinstance(inp, Mamba2Inputs) and name in ("A", "D"):
            fields[name] = t[first:stop].contiguous()
        elif t.ndim >= 3:
            fields[name] = t[:, :, first:stop].contiguous()
        else:
            fields[name] = t
    return type(inp)(**fields, meta=dict(inp.meta)).validate()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-kda", help="a shipped model, preset or checkpoint directory")
    ap.add_argument("--layer", type=int, required=True, help="decoder layer index of an SSM layer")
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", default=None, help="a:b keeps heads a..b-1")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    loaded = load_source_model(args.model, torch.device("cpu"))
    ids, meta = capture_text_batch(loaded, batch=args.batch, steps=args.steps, seed=args.seed)
    got = {}
    capture_inputs(loaded, ids, lambda i, inp: got.__setitem__(i, inp), layers=[args.layer], meta=meta)
    inp, name = got[args.layer], f"{args.model}-layer{args.layer}"
    if args.heads:
        first, _, stop = args.heads.partition(":")
        if not (first.isdigit() and stop.isdigit() and int(first) < int(stop) <= inp.num_heads):
            raise SystemExit(f"--heads must be a:b with 0 <= a < b <= {inp.num_heads}, got {args.heads!r}")
        inp = keep_heads(inp, int(first), int(stop))
        name += f"-heads{first}-{int(stop) - 1}"
    save_captured({name: inp}, args.out)
    print(f"saved {name} ({type(inp).__name__}, batch {inp.batch}, {inp.steps} steps, {inp.num_heads} heads) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
