"""Code paths and tilings of the fused KDA kernel against its default path and the per-step peers, in one run.

At GLM-5.3-Flash shapes (64 heads x 128 x 128), batch 16, --steps steps, it times the kernel launch alone
(`delta_rule_launch`, metrics every step) for:

- default: `delta_rule_launch` with fast_round and fp_fusion off (the shipped path) at the planned tiling;
- the candidate paths of ssmquant/kernels/delta_rule.py: fast_round (FP8/INT8 RNE writes by the
  magic-number rounding) x fp_fusion (FMA contraction), and tilings (BLOCK_P, num_warps) of the best;
- the same for int8 / nvfp4 conventional, fp8 replay16 and the six-variant launch.

Every candidate's metrics are checked against the default path's on the same inputs: fast_round alone must give
bit-identical metrics (it rounds to the same values), fp_fusion changes the FP32 arithmetic, so its
largest relative difference per metric is printed. Then the peers (`--peers`): the eager per-step loop
and torch.compile of the same per-step function (default mode and mode="reduce-overhead", CUDA graphs),
timed after their warm-up/compile runs. Writes a JSON of every row to --out.

    python benchmarks/gpu/kda_paths.py [--steps 4096] [--batch 16] [--stage paths|peers] --out FILE
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import triton  # noqa: E402
from bench_emulation import STEP_FNS, cuda_time, glm53_flash_inputs, peer_loop  # noqa: E402

from ssmquant.kernels import plan_launches  # noqa: E402
from ssmquant.kernels.common import slot_spec  # noqa: E402
from ssmquant.kernels.delta_rule import delta_rule_launch  # noqa: E402
from ssmquant.kernels.quantize import group_rows_for_kernel  # noqa: E402
from ssmquant.kernels.rounding import FORMAT_CODES  # noqa: E402
from ssmquant.replay import parse_variant  # noqa: E402
from ssmquant.replay.reference import kda_decays  # noqa: E402

SIX = [f"{f}@{s}" for f in ("fp8_e4m3", "int8", "nvfp4") for s in ("conventional", "replay16")]
# (variants, tiling or None for the plan, fast_round, fp_fusion); None in the flags = the default path
CANDIDATES = [
    (["fp8_e4m3@conventional"], None, None, None),
    (["fp8_e4m3@conventional"], None, True, False),
    (["fp8_e4m3@conventional"], None, False, True),
    (["fp8_e4m3@conventional"], None, True, True),
    (["fp8_e4m3@conventional"], (8, 1), True, True),
    (["fp8_e4m3@conventional"], (32, 2), True, True),
    (["int8@conventional"], None, None, None),
    (["int8@conventional"], None, True, True),
    (["nvfp4@conventional"], None, None, None),
    (["nvfp4@conventional"], None, True, True),
    (["fp8_e4m3@replay16"], None, None, None),
    (["fp8_e4m3@replay16"], None, True, True),
    (SIX, None, None, None),
    (SIX, None, True, True),
]
# the final comparison: the default path against fast_round + fp_fusion at the planned tiling
FINAL = [c for c in CANDIDATES if c[1] is None and (c[2] is None or (c[2] and c[3]))]


def launch_args(inputs, names, tiling):
    """The positional tensors, specs and tiling of one launch (as `emulate_triton_steps` prepares them)."""
    variants = [parse_variant(n) for n in names]
    ((idx, plan),) = plan_launches(variants, inputs.rows, inputs.state_dim, tiling)
    block_p, warps = plan
    specs = tuple(
        slot_spec(
            FORMAT_CODES[v.format.encoding],
            block_p if v.format.granularity.rows is None else group_rows_for_kernel(v.format, inputs.rows, block_p),
            False,
            False,
            {"fp32": 0, "bf16": 1, "fp16": 2}[v.scheme.buffer_dtype] if v.scheme.rounds_buffer else 0,
        )
        for v in variants
    )
    dev = inputs.device
    write = torch.stack([v.scheme.write_mask(inputs.batch, inputs.steps).to(device=dev, dtype=torch.int8) for v in variants])
    seeds = torch.tensor([v.seed for v in variants], dtype=torch.int64, device=dev)
    tensors = (
        inputs.q.contiguous(),
        inputs.k.contiguous(),
        inputs.v.contiguous(),
        kda_decays(inputs).contiguous(),
        inputs.beta.float().contiguous(),
        None,
        write.contiguous(),
        seeds,
        None,
        1,
    )
    return tensors, specs, block_p, warps


def paths(args, inputs):
    elems = math.prod(inputs.state_shape)
    rows, ref = [], {}
    for names, tiling, fast, fusion in FINAL if args.final else CANDIDATES:
        tensors, specs, block_p, warps = launch_args(inputs, names, tiling)
        options = {"fast_round": bool(fast), "fp_fusion": bool(fusion)}
        run = functools.partial(
            delta_rule_launch,
            *tensors,
            specs=specs,
            block_p=block_p,
            num_warps=warps,
            **options,
        )
        t0 = time.time()
        m = run().sum(4).double()  # compile + first run; [NV, T, B, H, 4]
        compile_s = time.time() - t0
        t = cuda_time(run, args.reps)
        key = tuple(names)
        row = {
            "variants": "six" if len(names) == 6 else names[0],
            "path": "default" if fast is None else f"fast_round={int(fast)} fp_fusion={int(fusion)}",
            "tiling": [block_p, warps],
            "ms": t * 1e3,
            "G/s per variant": len(names) * elems * inputs.steps / t / 1e9,
            "first call s": compile_s,
        }
        if fast is None:
            ref[key] = m
        elif key in ref:
            base = ref[key]
            rel = ((m - base).abs() / base.abs().clamp_min(1e-30)).amax(dim=(0, 1, 2, 3))
            row["max rel diff vs default [dS2, S2, dy2, y2]"] = [float(x) for x in rel]
            row["bit-identical to default"] = bool(torch.equal(m, base))
            if fast and not fusion and not row["bit-identical to default"]:
                print(f"FAIL: fast_round alone changed the metrics of {names}", flush=True)
                args.failed = True
        rows.append(row)
        print(json.dumps(row), flush=True)
        del m
    return rows


def peers(args, inputs):
    elems = math.prod(inputs.state_shape)
    variant = parse_variant("fp8_e4m3@conventional")
    step_fn = STEP_FNS["kda"]
    out = []
    eager = peer_loop("kda", inputs, variant, args.peer_steps, step_fn)
    t = cuda_time(eager, 1) / args.peer_steps
    out.append({"peer": "eager", "G/s": elems / t / 1e9, "ms per step": t * 1e3})
    print(json.dumps(out[-1]), flush=True)
    for mode in [m for m in args.modes.split(",") if m]:
        torch._dynamo.reset()
        fn = torch.compile(step_fn, dynamic=False, mode=None if mode == "default" else mode)
        comp = peer_loop("kda", inputs, variant, args.peer_steps, fn)
        t0 = time.time()
        comp()
        comp()  # CUDA graphs record on the second call
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        warm = time.time() - t0
        t = cuda_time(comp, 2) / args.peer_steps
        out.append({"peer": f"torch.compile mode={mode}", "G/s": elems / t / 1e9, "ms per step": t * 1e3, "warm-up s": warm})
        print(json.dumps(out[-1]), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--peer-steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stage", default="paths", choices=["paths", "peers"])
    ap.add_argument("--final", action="store_true", help="paths: only the default path and fast_round + fp_fusion (FINAL)")
    ap.add_argument("--modes", default="default,reduce-overhead", help="torch.compile modes of the peer")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script (interpreter)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.failed = False
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("kda_paths.py needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 to check the script)")
    if args.device == "cpu":  # a check of the script: a small KDA layer (one head pair, 32 x 32) in the interpreter
        sys.path.insert(0, str(ROOT / "tests" / "replay"))
        from helpers import kda_inputs

        inputs = kda_inputs(batch=args.batch, steps=args.steps, key_heads=1, value_heads=2, dk=32, dv=32)
    else:
        inputs = glm53_flash_inputs(args.batch, args.steps, args.device)
    info = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (interpreter check)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "batch": args.batch,
        "steps": args.steps,
        "state_shape": list(inputs.state_shape),
    }
    rows = paths(args, inputs) if args.stage == "paths" else peers(args, inputs)
    pathlib.Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    if args.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
