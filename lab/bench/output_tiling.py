"""The fused kernels' output mode (eval --mode layer's recurrence) at several tilings: milliseconds per launch.

    python lab/bench/output_tiling.py --device cuda
    python lab/bench/output_tiling.py --device cpu --steps 4 --shapes mamba2:8:64:128:2 --tilings 16x1,4x1   # a check

The layer mode launches one variant at a time over all T steps of a layer; the launch is a sequential loop over T,
so its time is the per-step latency of one program times T, and the tiling (BLOCK_P rows per program, num_warps)
decides how many elements each thread carries per step and how many programs share the GPU. For each shape
(KIND:HEADS:ROWS:STATE_DIM:GROUPS at --batch sequences and --steps steps) and each variant alone, every tiling that
holds the variant's scale group is timed (CUDA events, median of --reps after a warm-up) and checked against the
default plan's outputs (max abs difference, which is float summation order only). The default plan
(``planning.plan_output_launches``) is marked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ssmquant.kernels import emulate_triton_outputs
from ssmquant.kernels.planning import _rows_needed, plan_output_launches
from ssmquant.replay.variants import parse_variant
from ssmquant.sizing import layer_dims, random_inputs

VARIANTS = "fp32@conventional,fp8_e4m3@conventional,int8@replay16,nvfp4@conventional"
SHAPES = "mamba2:8:64:128:2,mamba2:64:64:128:8,gdn:4:64:64:2,kda:4:64:64:4"
TILINGS = "16x1,16x2,16x4,8x1,8x2,4x1,4x2,2x1,1x1,32x1,32x4,64x4,64x8,64x16"


def _time(inputs, variant, tiling, reps: int, cuda: bool) -> tuple[float, torch.Tensor]:
    out = emulate_triton_outputs(inputs, [variant], tiling=tiling)[0][0]  # warm-up (compiles)
    runs = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            emulate_triton_outputs(inputs, [variant], tiling=tiling)
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            emulate_triton_outputs(inputs, [variant], tiling=tiling)
            runs.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(runs), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated KIND:HEADS:ROWS:STATE_DIM:GROUPS")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--tilings", default=TILINGS, help="comma-separated BLOCK_PxNUM_WARPS")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    where = torch.cuda.get_device_name() if cuda else "CPU (interpreter)"
    print(f"{where}, torch {torch.__version__}; batch {args.batch}, {args.steps} steps; median of {args.reps}")
    print("shape | variant | tiling | ms | default ms / ms | max |diff| vs default")
    tilings = [tuple(int(x) for x in t.split("x")) for t in args.tilings.split(",")]
    for shape in args.shapes.split(","):
        kind, *dims = shape.split(":")
        d = layer_dims(kind, *(int(x) for x in dims))
        inputs = random_inputs(d, args.batch, args.steps, device=args.device, seed=0)
        for name in args.variants.split(","):
            v = parse_variant(name)
            default = plan_output_launches([v], d.rows, d.state_dim, kind)[0][1]
            base_ms, base_out = _time(inputs, v, None, args.reps, cuda)
            print(f"{shape} | {name} | {default[0]}x{default[1]} (default) | {base_ms:.3f} | 1.00 | 0")
            for tiling in tilings:
                if tiling == default or tiling[0] > max(1, 1 << (d.rows - 1).bit_length()):
                    continue
                if _rows_needed(v, d.rows) > tiling[0]:
                    continue
                ms, out = _time(inputs, v, tiling, args.reps, cuda)
                diff = (out.float() - base_out.float()).abs().max().item()
                print(f"{shape} | {name} | {tiling[0]}x{tiling[1]} | {ms:.3f} | {base_ms / ms:.2f} | {diff:.3g}")


if __name__ == "__main__":
    main()
