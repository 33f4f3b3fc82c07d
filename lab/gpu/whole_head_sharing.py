"""Do whole-head variants gain from sharing a launch? Times, on the GPU, the per-head variants of each kind in the
launches `plan_launches` groups them into against each variant in a launch of its own (the sum of their times).

    python lab/gpu/whole_head_sharing.py [--kinds mamba2,gdn,kda] [--formats fp8_e4m3:head,nvfp4:head,...]
        [--steps 1024] [--batch 16] [--reps 5] [--out FILE.json]

Prints per kind the planned launches, their time, the separate launches' summed time and the ratio; the two are
alternated rep by rep.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import cuda_seconds  # noqa: E402
from benchmarks.emulation import drain, layer_inputs  # noqa: E402
from ssmquant.kernels import emulate_triton_steps, plan_launches  # noqa: E402
from ssmquant.replay import parse_variant  # noqa: E402

HEAD_FORMATS = "fp8_e4m3:head,nvfp4:head,fp8_e4m3:head:sr,nvfp4:head:sr"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="mamba2,gdn,kda")
    ap.add_argument("--formats", default=HEAD_FORMATS)
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("whole_head_sharing times GPU launches: no CUDA device here")
    out = []
    for kind in args.kinds.split(","):
        inputs = layer_inputs(kind, args.batch, args.steps, "cuda")
        variants = [parse_variant(f"{f}@{s}") for f in args.formats.split(",") for s in ("conventional", "replay16")]
        plan = plan_launches(variants, inputs.rows, inputs.state_dim, None, kind)

        def shared(variants=variants, inputs=inputs) -> None:
            drain(emulate_triton_steps(inputs, variants))

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
            f"{kind}: planned {[(len(i), tiling) for i, tiling in plan]}: shared {med['shared'] * 1e3:.1f} ms "
            f"({min(t['shared']) * 1e3:.1f}-{max(t['shared']) * 1e3:.1f}), separate {med['separate'] * 1e3:.1f} ms "
            f"({min(t['separate']) * 1e3:.1f}-{max(t['separate']) * 1e3:.1f}), "
            f"separate / shared {med['separate'] / med['shared']:.2f}",
            flush=True,
        )
        out.append({"kind": kind, "plan": [[i, list(tl)] for i, tl in plan], "seconds": t})
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "runs": out}, indent=1))


if __name__ == "__main__":
    main()
