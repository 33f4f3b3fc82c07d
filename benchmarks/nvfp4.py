"""Throughput of the fused Mamba-2 emulation kernel for nvfp4, beside fp8, at Nemotron-3-Nano shapes.

Times `emulate_triton_steps` (one launch for all T steps, metrics every step) for a list of cases, each a variant
list with the planned tiling or a forced (BLOCK_P, num_warps), at each batch size: H=64 heads, P=64, N=128, G=8
groups, inputs drawn on the GPU (silu of Gaussians, dt = softplus(z - 4) >= 1e-3). Each time is the median of --reps
timed runs after a warm-up (CUDA events); --runs N times every case N times over (one pass over all cases, then the
next), so that the table shows each pass's rate, their median and their spread (max / min - 1: the noise to read
any ratio against). G/s = G state-element-steps per second per variant (B x H x P x N x T x variants / time).

    python benchmarks/run.py nvfp4 [--steps 4096] [--batch 8,16] [--cases all] [--reps 3] [--runs 2]
    python benchmarks/run.py nvfp4 --warm          # every case on 32 steps: compiles the kernels into Triton's cache
    python benchmarks/run.py nvfp4 --device cpu --steps 4 --batch 1     # a check in Triton's interpreter (2 heads)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchmarks.common import MIN_REPS, Result, Section, Timing, cuda_times, fmt_cell
from ssmquant.kernels import emulate_triton_steps, plan_launches
from ssmquant.kinds import Mamba2Inputs
from ssmquant.replay import parse_variants

SIX = ["fp8_e4m3", "fp8_e4m3@replay16", "int8", "int8@replay16", "nvfp4", "nvfp4@replay16"]
# name -> (variants, tiling or None for the plan, with an initial state); the nvfp4 conventional tilings around
# the planned (16, 1); an initial state is one more load before the time loop, which must not change its layout
CASES = {
    "fp8_conv": (["fp8_e4m3"], None, False),
    "nvfp4_conv": (["nvfp4"], None, False),
    "nvfp4_conv_s0": (["nvfp4"], None, True),
    "nvfp4_conv_8x1": (["nvfp4"], (8, 1), False),
    "nvfp4_conv_16x2": (["nvfp4"], (16, 2), False),
    "nvfp4_conv_32x2": (["nvfp4"], (32, 2), False),
    "nvfp4_conv_64x4": (["nvfp4"], (64, 4), False),
    "nvfp4_replay16": (["nvfp4@replay16"], None, False),
    "six": (SIX, None, False),
}


def nano_inputs(batch: int, steps: int, device: str, shape=(64, 64, 128, 8)) -> Mamba2Inputs:
    """Nemotron-3-Nano Mamba-2 layer inputs drawn on the device (the CPU takes seconds for these sizes)."""
    h, p, n, grp = shape
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=g, device=device)

    silu = torch.nn.functional.silu
    x = silu(randn(batch, steps, h, p)).bfloat16()
    b = silu(randn(batch, steps, grp, n)).bfloat16()
    c = silu(randn(batch, steps, grp, n)).bfloat16()
    dt = torch.nn.functional.softplus(randn(batch, steps, h) - 4.0).clamp(min=1e-3)
    a = -torch.exp(torch.linspace(-1.0, 2.0, h, device=device))
    return Mamba2Inputs(x=x, dt=dt, B=b, C=c, A=a, D=torch.ones(h, device=device))


def with_initial_state(inputs: Mamba2Inputs) -> Mamba2Inputs:
    """The same inputs starting from a Gaussian state [B, H, P, N] (std 0.1) instead of zeros."""
    g = torch.Generator(device=inputs.device).manual_seed(1)
    s0 = 0.1 * torch.randn(*inputs.state_shape, generator=g, device=inputs.device)
    return Mamba2Inputs(
        x=inputs.x, dt=inputs.dt, B=inputs.B, C=inputs.C, A=inputs.A, D=inputs.D, initial_state=s0
    )


def run_case(inputs, variants, tiling) -> None:
    for _ in emulate_triton_steps(inputs, variants, tiling=tiling):
        pass


def time_case(inputs, variants, tiling, reps: int) -> Timing:
    """Seconds of reps runs after one warm-up, sorted (CUDA events; wall clock on the CPU)."""
    return cuda_times(lambda: run_case(inputs, variants, tiling), reps)


def add_arguments(ap) -> None:
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", default="8,16", help="comma-separated batch sizes")
    ap.add_argument("--cases", default="all", help=f"comma-separated among {', '.join(CASES)}, or all")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per case and pass: the median is reported")
    ap.add_argument("--runs", type=int, default=1, help="passes over all cases (their spread is the noise)")
    ap.add_argument("--warm", action="store_true", help="run each case on 32 steps (compile only), time nothing")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script (interpreter)")


def run(args) -> Result:
    names = list(CASES) if args.cases == "all" else [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        sys.exit(f"--cases takes a comma-separated subset of {', '.join(CASES)} or all, got {args.cases!r}")
    if args.reps < MIN_REPS:
        sys.exit(f"--reps must be at least {MIN_REPS} (each time is a median with its spread), got {args.reps}")
    if args.runs < 1:
        sys.exit(f"--runs takes a positive number, got {args.runs}")
    batches = [int(b) for b in args.batch.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("the nvfp4 benchmark needs a CUDA GPU (or --device cpu, in Triton's interpreter, to check it)")
    small = args.device == "cpu"
    shape = (2, 64, 128, 1) if small else (64, 64, 128, 8)
    steps = 32 if args.warm else args.steps
    records = []
    save = getattr(args, "save_partial", None) or (lambda raw: None)
    for batch in batches:
        plain = nano_inputs(batch, steps, args.device, shape)
        started = with_initial_state(plain) if any(CASES[c][2] for c in names) else None
        elems = batch * shape[0] * shape[1] * shape[2]
        for run_index in range(1, 1 + (1 if args.warm else args.runs)):
            for name in names:
                spec, tiling, s0 = CASES[name]
                inputs = started if s0 else plain
                variants = parse_variants(spec)
                plan = [t for _, t in plan_launches(variants, shape[1], shape[2], tiling)]
                if args.warm:
                    t0 = time.perf_counter()
                    run_case(inputs, variants, tiling)
                    print(f"warm {name} batch {batch}: {time.perf_counter() - t0:.1f} s", flush=True)
                    continue
                timing = time_case(inputs, variants, tiling, args.reps)
                work = len(variants) * elems * steps / 1e9
                gps = work / timing.median
                records.append(dict(case=name, variants=spec, tiling=plan, batch=batch, steps=steps, run=run_index,
                                    ms=timing.median * 1e3, gps=gps, gps_slowest=work / timing.slowest,
                                    gps_fastest=work / timing.fastest, runs_ms=[t * 1e3 for t in timing]))  # fmt: skip
                print(f"{name:16s} batch {batch:2d} pass {run_index} tiling {plan}: {timing.median * 1e3:8.2f} ms "
                      f"{gps:7.1f} G/s", flush=True)  # fmt: skip
                save({"records": records})  # a run stopped by its time limit keeps what it measured
        del plain, started
    raw = {"records": records}
    if args.warm:
        return Result({}, raw, measurement=False)
    body = (
        f"{'Small (a CPU check)' if small else 'Nemotron-3-Nano'} shapes (H={shape[0]}, P={shape[1]}, N={shape[2]}, "
        f"G={shape[3]}), T={steps} steps, metrics "
        f"every step; each time the median of {args.reps} runs after a warm-up, (slowest-fastest run); {args.runs} "
        "pass(es) over the cases; G/s per variant; spread = max / min - 1 of the passes' medians.\n\n" + table(records)
    )
    return Result({"nvfp4": Section("Mamba-2 kernel: nvfp4 beside fp8", body)}, raw, measurement=not small)


def table(records: list[dict]) -> str:
    """One row per (batch, case): each pass's G/s, their median and their spread (max / min - 1)."""
    passes = sorted({r["run"] for r in records})
    gps: dict[tuple, dict[int, float]] = {}
    cell: dict[tuple, dict[int, str]] = {}
    first: dict[tuple, dict] = {}
    for r in records:
        key = (r["batch"], r["case"])
        gps.setdefault(key, {})[r["run"]] = r["gps"]
        cell.setdefault(key, {})[r["run"]] = f"{fmt_cell(r['gps'])} ({fmt_cell(r['gps_slowest'])}-{fmt_cell(r['gps_fastest'])})"
        first.setdefault(key, r)
    lines = [
        "| case | variants | tiling (BLOCK_P, warps) | batch | " + " | ".join(f"pass {n} G/s" for n in passes)
        + " | median G/s | spread |",
        "|---|---|---|---|" + "---|" * len(passes) + "---|---|",
    ]
    order = {name: i for i, name in enumerate(CASES)}
    for key in sorted(gps, key=lambda k: (k[0], order[k[1]])):
        r, got = first[key], gps[key]
        tiling = " + ".join(f"({p}, {w})" for p, w in r["tiling"])
        cells = " | ".join(cell[key].get(n, "—") for n in passes)
        spread = f"{max(got.values()) / min(got.values()) - 1:.1%}" if len(got) > 1 else "—"
        lines.append(
            f"| {r['case']} | {', '.join(r['variants'])} | {tiling} | {r['batch']} | {cells} | "
            f"{fmt_cell(statistics.median(got.values()))} | {spread} |"
        )
    return "\n".join(lines) + "\n"
