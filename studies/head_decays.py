"""Per-head decay statistics of the layers analysed in the studies (study 4: fragile heads).

For each (model, layer, head): the mean decay a_t (Mamba-2 exp(dt A), GDN exp(g)) over the same inputs
that `ssmquant analyze` used in studies/gpu_run.sh (same seed, batch, steps and device, so the same
synthetic draws / the same text), its mean log, the implied half-life ln 2 / -mean(ln a) in tokens, and
the share of steps with a_t > 0.99.

    python studies/head_decays.py --out studies/data/fragile_heads/decays.csv
    # the CPU-sized tiny-qwen run of studies/cpu_run.sh (same steps and batch as its analyze run):
    python studies/head_decays.py --models tiny-qwen --steps 4096 --batch 2 --device cpu \
        --out studies/data/fragile_heads/decays_tiny-qwen-cpu.csv
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import pandas as pd
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ssmquant.analysis.sources import open_source, resolve_device  # noqa: E402
from ssmquant.replay import Mamba2Inputs  # noqa: E402

MODELS = ("nemotron-3-nano", "qwen3.5-9b", "tiny-nemotron", "tiny-qwen")  # the first two: synthetic presets


def decays(inputs) -> torch.Tensor:
    """a_t per (batch, step, head): [B, T, H] fp32."""
    if isinstance(inputs, Mamba2Inputs):
        return torch.exp(inputs.dt.float() * inputs.A.float())
    return torch.exp(inputs.g.float())


def rows(model: str, synthetic: bool, layers, batch: int, steps: int, device) -> list[dict]:
    src = open_source(model, synthetic=synthetic, batch=batch, steps=steps, seed=0, device=device)
    out = []
    for layer, inp in src.iter_layers(src.select(layers)):
        a = decays(inp.to(device))
        log_a = torch.log(a.clamp(min=1e-30))
        for h in range(a.shape[2]):
            mean_log = float(log_a[:, :, h].mean())
            out.append(
                {
                    "model": model,
                    "data": "synthetic" if synthetic else "shipped",
                    "layer": layer,
                    "head": h,
                    "mean_decay": float(a[:, :, h].mean()),
                    "mean_log_decay": mean_log,
                    "half_life_tokens": math.log(2) / -mean_log if mean_log < 0 else float("inf"),
                    "frac_above_0.99": float((a[:, :, h] > 0.99).float().mean()),
                }
            )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--layers-nano", default="0,14,30,50")
    ap.add_argument("--layers-qwen", default="0,10,20,30")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS))
    args = ap.parse_args()
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; accepted: {', '.join(MODELS)}")
    dev = resolve_device(args.device)
    parse = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    layers = {"nemotron-3-nano": parse(args.layers_nano), "qwen3.5-9b": parse(args.layers_qwen)}
    table = []
    for model in wanted:
        table += rows(model, model in layers, layers.get(model), args.batch, args.steps, dev)
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(table).to_csv(path, index=False)
    print(f"wrote {path} ({len(table)} heads)")


if __name__ == "__main__":
    main()
