"""Launch configurations of the fused KDA kernel at GLM-5.3-Flash shapes: which one issues best.

The kernel is issue-bound at 59-64 % of its instruction ceiling (benchmarks/RESULTS.md): at the
planned tiling (BLOCK_P 16 rows, one warp: 64 elements of each state per thread) a thread uses 238 registers
(ptxas, sm_90a), so an SM holds 8 one-warp programs, two per scheduler, and a step's input loads stall the
warp that issued them (benchmarks/sass.py: they are issued at the top of the step and consumed at
once). For fp8_e4m3 and int8 conventional (one variant, the issue's bar), batch 16, --steps steps, metrics every
step, it times `delta_rule_launch` for each configuration (BLOCK_P, num_warps, prefetch, row_blocks_first):

- tiling: rows per program and warps per program, i.e. elements per thread (registers, so programs per SM) and
  threads per row (the in-thread share of each Dk reduction);
- prefetch: each step loads the next step's inputs before its own arithmetic (`delta_rule_launch(prefetch=)`);
- row_blocks_first: grid (NPB, B * Hv), a head's row blocks launched together (they read the same inputs).

Each time is the median of --reps runs after a warm-up run, with the slowest and fastest run. Prefetch and grid
order change no arithmetic: their metrics must equal those of the same tiling without them bit for bit (checked
here at full shape; a difference fails the run). Another tiling may change the order of the Dk reductions and of
the row-block partial sums, so it is compared with the planned one as the largest relative difference per
metric. Writes every row and the fastest configuration per format to --out (JSON).

    python lab/gpu/kda_tiles.py [--steps 4096] [--batch 16] [--reps 5] [--formats fp8_e4m3,int8] --out FILE
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
from kda_paths import bench_layer, launch_args  # noqa: E402  (this folder)

from benchmarks.common import MIN_REPS, cuda_times, spread  # noqa: E402
from ssmquant.kernels import plan_launches  # noqa: E402
from ssmquant.kernels.delta_rule import ROW_BLOCKS_FIRST_DEFAULT, delta_rule_launch  # noqa: E402
from ssmquant.replay import parse_variant  # noqa: E402

# (BLOCK_P, num_warps, prefetch, row_blocks_first); the first is the planned tiling in the previous grid order, the
# third the launcher's default (row blocks first, chosen from GPU run s1's sweep of this list). Registers per thread
# (Triton 3.9, ptxas 13.4, sm_90a, fp8_e4m3, without / with prefetch): (16, 1) 238 / 249, (8, 1) 155 / 167,
# (4, 1) 72 / 95, (16, 2) 186 / 200, (32, 4) 219 / 165; (32, 2) and (64, 4) spill (255 + 96 bytes), left out.
CONFIGS = [
    (16, 1, False, False),
    (16, 1, True, False),
    (16, 1, False, True),
    (16, 1, True, True),
    (8, 1, False, False),
    (8, 1, True, True),
    (4, 1, False, False),
    (4, 1, True, True),
    (16, 2, False, False),
    (16, 2, True, True),
    (32, 4, False, False),
    (32, 4, True, True),
]


def parse_configs(text: str) -> list[tuple[int, int, bool, bool]]:
    """'16x1,8x1+pf+rb' -> [(16, 1, False, False), (8, 1, True, True)] (pf: prefetch, rb: row blocks first)."""
    out = []
    for item in text.split(","):
        head, *flags = item.strip().split("+")
        try:
            block_p, warps = (int(x) for x in head.split("x"))
        except ValueError:
            sys.exit(f"--configs: {item!r} is not BLOCK_PxWARPS[+pf][+rb] (e.g. 16x1+pf+rb)")
        if set(flags) - {"pf", "rb"}:
            sys.exit(f"--configs: unknown flag in {item!r}; the flags are +pf (prefetch) and +rb (row blocks first)")
        out.append((block_p, warps, "pf" in flags, "rb" in flags))
    return out


def label(config) -> str:
    block_p, warps, prefetch, rows_first = config
    return f"{block_p}x{warps}" + ("+pf" if prefetch else "") + ("+rb" if rows_first else "")


def sweep(args, inputs, fmt: str, save) -> list[dict]:
    """Time every configuration of args.configs for one conventional variant of format fmt; save(rows) after each
    (a run cut short keeps what it measured)."""
    elems = math.prod(inputs.state_shape)
    name = f"{fmt}@conventional"
    planned = plan_launches([parse_variant(name)], inputs.rows, inputs.state_dim, None, inputs.kind)[0][1]
    rows, plain, default = [], {}, None
    for config in args.configs:
        block_p, warps, prefetch, rows_first = config
        if block_p > triton.next_power_of_2(inputs.rows):
            continue
        tensors, specs, block_p, warps = launch_args(inputs, [name], (block_p, warps))
        run = functools.partial(
            delta_rule_launch, *tensors, specs=specs, block_p=block_p, num_warps=warps, prefetch=prefetch,
            row_blocks_first=rows_first,
        )
        t0 = time.time()
        m = run().sum(4).double()  # compile + first run; [1, T, B, H, 4]
        first_s = time.time() - t0
        t = cuda_times(run, args.reps)

        def rate_of(x):
            return elems * inputs.steps / x / 1e9

        row = {
            "variant": name,
            "config": label(config),
            "BLOCK_P": block_p,
            "num_warps": warps,
            "prefetch": prefetch,
            "row_blocks_first": rows_first,
            # the launcher's default: the planned tiling, no prefetch, its default grid order
            "planned": (block_p, warps) == planned and not prefetch
            and rows_first == (("kda", block_p, warps) in ROW_BLOCKS_FIRST_DEFAULT),
            "ms": t.median * 1e3,
            "G/s": rate_of(t.median),
            "G/s (slowest-fastest)": spread(rate_of, t),
            "runs ms": [x * 1e3 for x in t],
            "first call s": first_s,
        }
        if not prefetch and not rows_first:
            plain[(block_p, warps)] = m
        elif (block_p, warps) in plain:  # the same arithmetic: must be bit-identical
            row["bit-identical to the same tiling without prefetch / row_blocks_first"] = same = bool(
                torch.equal(m, plain[(block_p, warps)])
            )
            if not same:
                print(f"FAIL: {name} {label(config)} changed the metrics of tiling {block_p}x{warps}", flush=True)
                args.failed = True
        if row["planned"]:
            default = m
        elif default is not None:
            rel = ((m - default).abs() / default.abs().clamp_min(1e-30)).amax(dim=(0, 1, 2, 3))
            row["max rel diff vs planned [dS2, S2, dy2, y2]"] = [float(x) for x in rel]
        rows.append(row)
        save(rows)
        print(json.dumps({k: v for k, v in row.items() if k != "runs ms"}), flush=True)
        del m
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--formats", default="fp8_e4m3,int8", help="comma-separated formats, conventional decoding")
    ap.add_argument("--configs", default=None, help="BLOCK_PxWARPS[+pf][+rb],... (default: CONFIGS)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script (interpreter)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.failed = False
    args.configs = CONFIGS if args.configs is None else parse_configs(args.configs)
    if args.reps < MIN_REPS:
        sys.exit(f"--reps must be at least {MIN_REPS}, got {args.reps}")
    inputs = bench_layer("kda_tiles.py", args.device, args.batch, args.steps)
    info = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (interpreter check, not a timing)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "batch": args.batch,
        "steps": args.steps,
        "state_shape": list(inputs.state_shape),
        "reps": args.reps,
    }
    rows, best = [], {}

    def save(fmt_rows):
        pathlib.Path(args.out).write_text(json.dumps({"info": info, "best": best, "rows": rows + fmt_rows}, indent=1))

    for fmt in args.formats.split(","):
        fmt_rows = sweep(args, inputs, fmt, save)
        rows += fmt_rows
        base = next((r for r in fmt_rows if r["planned"]), None)
        top = max(fmt_rows, key=lambda r: r["G/s"])
        best[fmt] = {
            "config": top["config"],
            "G/s": top["G/s"],
            "G/s (slowest-fastest)": top["G/s (slowest-fastest)"],
            "planned G/s": None if base is None else base["G/s"],
            "speed-up over planned (medians)": None if base is None else top["G/s"] / base["G/s"],
        }
        print(f"BEST {fmt}: {json.dumps(best[fmt])}", flush=True)
        save([])
    if args.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
