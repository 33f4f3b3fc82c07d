"""The CUDA KDA kernel against the Triton kernel on the same layer, in one process: each eligible default variant
through `emulate_triton_steps` as `simulate` runs it (the CUDA kernel), and again with SSMQUANT_KDA_CUDA=0 (the
Triton kernel), at GLM-5.3-Flash shapes, batch --batch, --steps steps, metrics every step; each time the median of
--reps runs after a warm-up, with the slowest-fastest runs. Inputs: the bench's (fp32 q / k, bf16 v) and the same
values with q / k in bf16, as a model's captured inputs come (the kernel's buffered-replay build spills there). Also
the largest pooled difference of the two kernels' metrics (sqrt of each metric summed over batch and head, per
step), which the tests bound. Writes a JSON to --out.

    python benchmarks/gpu/kda_cuda_vs_triton.py [--steps 4096] [--batch 16] [--reps 5] --out FILE
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_emulation import cuda_times, drain, glm53_flash_inputs, spread  # noqa: E402

from ssmquant.kernels import emulate_triton, emulate_triton_steps, fused_kernels, kda_cuda  # noqa: E402
from ssmquant.replay import KDAInputs, parse_variant, parse_variants  # noqa: E402
from ssmquant.replay.reference import kda_decays  # noqa: E402

NAMES = ["fp8_e4m3@conventional", "int8@conventional", "fp8_e4m3@replay16", "int8@replay16"]


def with_kernel(cuda: bool, fn):
    old = os.environ.get("SSMQUANT_KDA_CUDA")
    os.environ["SSMQUANT_KDA_CUDA"] = "1" if cuda else "0"
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["SSMQUANT_KDA_CUDA"]
        else:
            os.environ["SSMQUANT_KDA_CUDA"] = old


def launch_alone(inp: KDAInputs, always: bool = True, launch=kda_cuda.kda_cuda_launch):
    """A no-argument callable that runs fp8_e4m3 conventional on ``inp`` in the CUDA kernel, the launch only: the
    decays, beta and an all-ones write mask are made here once (`emulate_triton_steps` makes its own on every call).
    always=False reads the mask every step, as a replay variant's launch does."""
    alpha = kda_decays(inp).contiguous()
    beta = inp.beta.float()
    write = torch.ones(inp.batch, inp.steps, dtype=torch.int8, device=inp.device)
    return lambda: launch(inp.q, inp.k, inp.v, alpha, beta, None, write, fmt=3, buf=0, always=always)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kda_cuda_vs_triton.py needs a CUDA GPU")
    base = glm53_flash_inputs(args.batch, args.steps, "cuda")
    bf16 = KDAInputs(q=base.q.bfloat16(), k=base.k.bfloat16(), v=base.v, g=base.g, beta=base.beta)
    layers = {"fp32 q/k": base, "bf16 q/k": bf16}
    elems = math.prod(base.state_shape)
    rate = lambda s: elems * args.steps / s / 1e9  # noqa: E731
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    small = glm53_flash_inputs(2, 512, "cuda")
    both = [with_kernel(c, lambda: emulate_triton(small, parse_variants(NAMES)).double()) for c in (True, False)]
    pooled = [x.sum((2, 3)).sqrt() for x in both]  # [V, T, 4]
    res["pooled max rel diff [dS, S, dy, y] (batch 2, 512 steps)"] = {
        n: [float(v) for v in ((pooled[0][i] - pooled[1][i]).abs() / pooled[1][i].clamp_min(1e-30)).amax(0)]
        for i, n in enumerate(NAMES)
    }
    print(json.dumps(res["pooled max rel diff [dS, S, dy, y] (batch 2, 512 steps)"]), flush=True)
    # the CUDA launch alone (decays, write mask and metric buffer made once) against the path `simulate` takes
    # (`emulate_triton_steps`: decays, mask and buffer on every call, then the row-block sums), fp8 conventional
    for always in (True, False):
        tm = cuda_times(launch_alone(base, always), args.reps)
        row = {
            "launch alone, fp8_e4m3 conventional": {
                "always": always,
                "G/s": rate(tm.median),
                "slowest-fastest": spread(rate, tm),
            }
        }
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    for label, inp in layers.items():
        for name in NAMES:
            v = parse_variant(name)
            row = {"inputs": label, "variant": name}
            for cuda in (True, False):
                kernel = with_kernel(cuda, lambda i=inp, v=v: fused_kernels(i, [v])[0])
                tm = with_kernel(
                    cuda, lambda i=inp, v=v: cuda_times(lambda: drain(emulate_triton_steps(i, [v])), args.reps)
                )
                row[kernel] = {"G/s": rate(tm.median), "slowest-fastest": spread(rate, tm)}
            row["cuda / triton"] = row["cuda"]["G/s"] / row["triton"]["G/s"]
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    pathlib.Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
