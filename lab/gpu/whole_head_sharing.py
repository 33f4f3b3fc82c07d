"""Do whole-head variants gain from sharing a launch? Times, on the GPU, the per-head variants of each kind in
shared launches (--share variants each, the whole head over --warps warps) against each variant in a launch of its
own at its planned tiling (the sum of their times), the two alternated rep by rep.

    python lab/gpu/whole_head_sharing.py [--kinds mamba2,gdn,kda] [--formats fp8_e4m3:head,nvfp4:head,...]
        [--share N] [--warps W] [--steps 1024] [--batch 16] [--reps 5] [--out FILE.json]

--share / --warps default to how `plan_launches` grouped them before it gave each whole-head variant its own
launch: six per launch over 16 warps on Mamba-2's 64-row heads (of eight, the last two then over 8 warps, here 16),
three over 16 warps on the 128-row heads of GDN and KDA. Prints per kind both times and their ratio.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import cuda_seconds  # noqa: E402
from benchmarks.emulation import drain, layer_inputs  # noqa: E402
from ssmquant.kernels import emulate_triton_steps  # noqa: E402
from ssmquant.replay import parse_variant  # noqa: E402

HEAD_FORMATS = "fp8_e4m3:head,nvfp4:head,fp8_e4m3:head:sr,nvfp4:head:sr"
FORMER_SHARING = {"mamba2": (6, 16), "gdn": (3, 16), "kda": (3, 16)}  # variants per launch, warps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="mamba2,gdn,kda")
    ap.add_argument("--formats", default=HEAD_FORMATS)
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--share", type=int, default=None, help="variants per shared launch [default: the former plan's]")
    ap.add_argument("--warps", type=int, default=None, help="warps of a shared launch [default: the former plan's]")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("whole_head_sharing times GPU launches: no CUDA device here")
    out = []
    for kind in args.kinds.split(","):
        inputs = layer_inputs(kind, args.batch, args.steps, "cuda")
        variants = [parse_variant(f"{f}@{s}") for f in args.formats.split(",") for s in ("conventional", "replay16")]
        share = args.share or FORMER_SHARING[kind][0]
        tiling = (triton.next_power_of_2(inputs.rows), args.warps or FORMER_SHARING[kind][1])
        groups = [variants[i : i + share] for i in range(0, len(variants), share)]

        def shared(groups=groups, inputs=inputs, tiling=tiling) -> None:
            for group in groups:
                drain(emulate_triton_steps(inputs, group, tiling=tiling))

        def separate(variants=variants, inputs=inputs) -> None:
            for v in variants:
                drain(emulate_triton_steps(inputs, [v]))

        shared(), separate()
        t = {"shared": [], "separate": []}
        for _ in range(args.reps):
            t["shared"].append(cuda_seconds(shared))
            t["separate"].append(cuda_seconds(separate))
        med = {k: statistics.median(v) for k, v in t.items()}
        print(
            f"{kind}: {[len(g) for g in groups]} per launch at {tiling}: shared {med['shared'] * 1e3:.1f} ms "
            f"({min(t['shared']) * 1e3:.1f}-{max(t['shared']) * 1e3:.1f}), separate {med['separate'] * 1e3:.1f} ms "
            f"({min(t['separate']) * 1e3:.1f}-{max(t['separate']) * 1e3:.1f}), "
            f"separate / shared {med['separate'] / med['shared']:.2f}",
            flush=True,
        )
        out.append({"kind": kind, "groups": [len(g) for g in groups], "tiling": list(tiling), "seconds": t})
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "runs": out}, indent=1))


if __name__ == "__main__":
    main()
