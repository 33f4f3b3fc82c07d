"""Throughput of the fused Mamba-2 emulation kernel for nvfp4, beside fp8, at Nemotron-3-Nano shapes.

Times `emulate_triton_steps` (one launch for all T steps, metrics every step) for a list of cases, each a
variant list with the planned tiling or a forced (BLOCK_P, num_warps), at each batch size: H=64 heads,
P=64, N=128, G=8 groups, inputs drawn on the GPU (silu of Gaussians, dt = softplus(z - 4) >= 1e-3).
benchmarks/gpu/kernels_nvfp4.sh runs the main cases twice; --report sets the runs side by side, with the
spread between them (the noise to read any ratio against). The kernel before the rewrite of 2026-12-01 (nvfp4
write, FMA contraction, k-major tile, initial-state hint) was timed beside this one in the same run then;
those numbers are in benchmarks/results/emulation_mamba2.md and the switches that selected it are gone.
G/s = G state-element-steps per second per variant (B x H x P x N x T x variants / time).

    python benchmarks/bench_nvfp4.py [--steps 4096] [--batch 8,16] [--cases all] [--reps 3] [--json FILE]
        [--warm] [--device cpu]
    python benchmarks/bench_nvfp4.py --report RUN.json [RUN.json ...] --out TABLE.md

--warm runs every case on 32 steps and exits (compiles the kernels into Triton's cache, for a parallel
warm-up); --device cpu checks the script in Triton's interpreter (tiny shapes, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402

from ssmquant.kernels import emulate_triton_steps, plan_launches  # noqa: E402
from ssmquant.replay import Mamba2Inputs, parse_variants  # noqa: E402

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


def time_case(inputs, variants, tiling, reps: int) -> float:
    """Median seconds over reps runs after one warm-up (CUDA events; wall clock on the CPU)."""
    run_case(inputs, variants, tiling)
    times = []
    for _ in range(reps):
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_case(inputs, variants, tiling)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run_case(inputs, variants, tiling)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", default="8,16", help="comma-separated batch sizes")
    ap.add_argument("--cases", default="all", help=f"comma-separated among {', '.join(CASES)}, or all")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here (a list of records)")
    ap.add_argument("--warm", action="store_true", help="run each case on 32 steps (compile only) and exit")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--report", nargs="+", default=None, help="JSON files of earlier runs: write a table and exit")
    ap.add_argument("--out", default=None, help="the table's file (--report)")
    args = ap.parse_args()
    if args.report:
        report(args.report, args.out)
        return
    names = list(CASES) if args.cases == "all" else [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        sys.exit(f"--cases takes a comma-separated subset of {', '.join(CASES)} or all, got {args.cases!r}")
    batches = [int(b) for b in args.batch.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_nvfp4.py needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 to check the script)")
    small = args.device == "cpu"
    shape = (2, 64, 128, 1) if small else (64, 64, 128, 8)
    steps = 32 if args.warm else args.steps
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (Triton interpreter, not a measurement)"
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d"))
    records = []
    for batch in batches:
        plain = nano_inputs(batch, steps, args.device, shape)
        started = with_initial_state(plain) if any(CASES[c][2] for c in names) else None
        elems = batch * shape[0] * shape[1] * shape[2]
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
            t = time_case(inputs, variants, tiling, args.reps)
            gps = len(variants) * elems * steps / t / 1e9
            rec = dict(case=name, variants=spec, tiling=plan, batch=batch, steps=steps, ms=t * 1e3, gps=gps)
            records.append({**meta, **rec})
            print(f"{name:16s} batch {batch:2d} tiling {plan}: {t * 1e3:8.2f} ms {gps:7.1f} G/s", flush=True)
            if args.json:  # after every case: a run stopped by its time limit keeps what it measured
                pathlib.Path(args.json).write_text(json.dumps(records, indent=1))
        del plain, started, inputs


def report(files: list[str], out: str | None) -> None:
    """A markdown table of the runs' records (a run = one JSON file, named by its stem), one row per (batch, case):
    each run's G/s, their median and their spread (max / min - 1)."""
    runs = {pathlib.Path(f).stem: json.loads(pathlib.Path(f).read_text()) for f in files}
    recs = [r for rs in runs.values() for r in rs]
    if not recs:
        sys.exit(f"no records in {files}")
    gps: dict[tuple, dict[str, float]] = {}
    first: dict[tuple, dict] = {}
    for run, rs in runs.items():
        for r in rs:
            gps.setdefault((r["batch"], r["case"]), {})[run] = r["gps"]
            first.setdefault((r["batch"], r["case"]), r)
    names = list(runs)
    lines = [
        f"GPU: {recs[0]['gpu']}; torch {recs[0]['torch']}; triton {recs[0]['triton']}; date {recs[0]['date']}; "
        f"T={recs[0]['steps']} steps, metrics every step. G/s per variant, one column per run; spread = max / min - 1 "
        "over the runs of a case (the noise to read differences against).",
        "",
        "| case | variants | tiling (BLOCK_P, warps) | batch | " + " | ".join(f"{n} G/s" for n in names)
        + " | median G/s | spread |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for key in sorted(gps):
        r, got = first[key], gps[key]
        tiling = " + ".join(f"({p}, {w})" for p, w in r["tiling"])
        cells = " | ".join(f"{got[n]:.1f}" if n in got else "—" for n in names)
        spread = f"{max(got.values()) / min(got.values()) - 1:.1%}" if len(got) > 1 else "—"
        lines.append(
            f"| {r['case']} | {', '.join(r['variants'])} | {tiling} | {r['batch']} | {cells} | "
            f"{statistics.median(got.values()):.1f} | {spread} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        pathlib.Path(out).write_text(text)


if __name__ == "__main__":
    main()
