"""Code paths and tilings of the fused KDA kernel against its default path and the per-step peers, in one run.

At GLM-5.3-Flash shapes (64 heads x 128 x 128), batch 16, --steps steps, it times the kernel launch alone
(`delta_rule_launch`, metrics every step) for:

- default: `delta_rule_launch` with its defaults (fast_round and fp_fusion on) at the planned tiling;
- previous: both off (the default before 2026-12-01: the generic rounding, every product rounded);
- fast_round off with FMA contraction on, which must give the default's metrics bit for bit (the fast
  8-bit write rounds to the same values; a difference fails the run);
- (sweep) tilings (BLOCK_P, num_warps) of the default;
- the same for int8 / nvfp4 conventional, fp8 replay16 and the six-variant launch.

Every candidate's metrics are checked against the default path's on the same inputs: the largest relative
difference per metric is printed (the previous path rounds products before their sums: FP32 noise, and a
write rounding that flips with it). Then the peers (`--stage peers`): the eager per-step loop and
torch.compile of the same per-step function (`benchmarks.emulation.compiled_peers`: mode default and
reduce-overhead), timed after their warm-up/compile runs. Writes a JSON of every row to --out.

    python lab/gpu/kda_paths.py [--steps 4096] [--batch 16] [--stage paths|peers] [--final] --out FILE
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

import triton  # noqa: E402

from benchmarks.emulation import compiled_peers, cuda_time, glm53_flash_inputs, peer_loop  # noqa: E402
from ssmquant import kinds  # noqa: E402
from ssmquant.kernels import plan_launches  # noqa: E402
from ssmquant.kernels.common import BUFFER_CODES, slot_spec  # noqa: E402
from ssmquant.kernels.delta_rule import delta_rule_launch  # noqa: E402
from ssmquant.kernels.quantize import group_rows_for_kernel  # noqa: E402
from ssmquant.kernels.rounding import FORMAT_CODES  # noqa: E402
from ssmquant.kinds import kda_decays  # noqa: E402
from ssmquant.replay import parse_variant  # noqa: E402

SIX = [f"{f}@{s}" for f in ("fp8_e4m3", "int8", "nvfp4") for s in ("conventional", "replay16")]
# (variants, tiling or None for the plan, fast_round, fp_fusion); None in the flags = the launcher's defaults
DEFAULT, PREVIOUS, GENERIC_ROUND = (None, None), (False, False), (False, True)
CANDIDATES = [
    (["fp8_e4m3@conventional"], None, *DEFAULT),
    (["fp8_e4m3@conventional"], None, *PREVIOUS),
    (["fp8_e4m3@conventional"], None, *GENERIC_ROUND),
    (["fp8_e4m3@conventional"], None, True, False),
    (["fp8_e4m3@conventional"], (8, 1), *DEFAULT),
    (["fp8_e4m3@conventional"], (32, 2), *DEFAULT),
    (["int8@conventional"], None, *DEFAULT),
    (["int8@conventional"], None, *PREVIOUS),
    (["int8@conventional"], None, *GENERIC_ROUND),
    (["nvfp4@conventional"], None, *DEFAULT),
    (["nvfp4@conventional"], None, *PREVIOUS),
    (["fp8_e4m3@replay16"], None, *DEFAULT),
    (["fp8_e4m3@replay16"], None, *PREVIOUS),
    (SIX, None, *DEFAULT),
    (SIX, None, *PREVIOUS),
]
# the final comparison at the planned tiling: the default against the previous default, and (fp8) fast_round off alone
FINAL = [
    c
    for c in CANDIDATES
    if c[1] is None and (c[2:] in (DEFAULT, PREVIOUS) or (c[2:] == GENERIC_ROUND and c[0] == ["fp8_e4m3@conventional"]))
]


def bench_layer(script: str, device: str, batch: int, steps: int):
    """The KDA layer a GPU script measures: GLM-5.3-Flash's shapes on CUDA; on the CPU (a check of the script in the
    Triton interpreter, not a timing) the emulation benchmark's small KDA layer (2 heads of 32 x 32)."""
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 to check the script)")
    return glm53_flash_inputs(batch, steps, device, small=device == "cpu")


def launch_args(inputs, names, tiling):
    """The positional tensors, specs and tiling of one launch (as `emulate_triton_steps` prepares them)."""
    variants = [parse_variant(n) for n in names]
    ((idx, plan),) = plan_launches(variants, inputs.rows, inputs.state_dim, tiling, inputs.kind)
    block_p, warps = plan
    specs = tuple(
        slot_spec(
            FORMAT_CODES[v.format.encoding],
            block_p if v.format.granularity.rows is None else group_rows_for_kernel(v.format, inputs.rows, block_p),
            False,
            False,
            BUFFER_CODES[v.scheme.buffer_dtype] if v.scheme.rounds_buffer else 0,
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
    )
    return tensors, specs, block_p, warps


def paths(args, inputs):
    elems = math.prod(inputs.state_shape)
    rows, ref = [], {}
    for names, tiling, fast, fusion in FINAL if args.final else CANDIDATES:
        tensors, specs, block_p, warps = launch_args(inputs, names, tiling)
        options = {} if fast is None else {"fast_round": fast, "fp_fusion": fusion}
        run = functools.partial(delta_rule_launch, *tensors, specs=specs, block_p=block_p, num_warps=warps, **options)
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
        if fast is None and tiling is None:
            ref[key] = m
        elif key in ref:
            base = ref[key]
            rel = ((m - base).abs() / base.abs().clamp_min(1e-30)).amax(dim=(0, 1, 2, 3))
            row["max rel diff vs default [dS2, S2, dy2, y2]"] = [float(x) for x in rel]
            row["bit-identical to default"] = bool(torch.equal(m, base))
            if (fast, fusion) == GENERIC_ROUND and not row["bit-identical to default"]:
                print(f"FAIL: the fast 8-bit write changed the metrics of {names}", flush=True)
                args.failed = True
        rows.append(row)
        print(json.dumps(row), flush=True)
        del m
    return rows


def peers(args, inputs):
    elems = math.prod(inputs.state_shape)
    variant = parse_variant("fp8_e4m3@conventional")
    step_fn = kinds.get("kda").emulation_step
    out = []
    eager = peer_loop(inputs, variant, args.peer_steps, step_fn)
    t = cuda_time(eager, 1) / args.peer_steps
    out.append({"peer": "eager", "G/s": elems / t / 1e9, "ms per step": t * 1e3})
    print(json.dumps(out[-1]), flush=True)
    args.compile_modes = args.modes
    for mode, r in compiled_peers(inputs, variant, args, step_fn, eager()).items():
        out.append({"peer": f"torch.compile mode={mode}", "G/s": None if r is None else elems / r.timing.median / 1e9})
        print(json.dumps(out[-1]), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--peer-steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stage", default="paths", choices=["paths", "peers"])
    ap.add_argument("--final", action="store_true", help="paths: only FINAL (the default, the previous default, fp8 with fast_round off)")
    ap.add_argument("--modes", default="default,reduce-overhead", help="torch.compile modes of the peer")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script (interpreter)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.failed = False
    inputs = bench_layer("kda_paths.py", args.device, args.batch, args.steps)
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
