"""The torch.compile peer of one KDA variant in a process of its own, measured three ways, with diagnostics.

Why: the same fp8_e4m3 conventional peer (the same step function and loop, torch 2.11, H200) ran at 123.1 G/s in
GPU run 5 and at 69.5 G/s in run s1 (each the first peer compiled in its process, within-run spread 66.5-74.1),
so the issue's ">= 10x compiled" ratio moved with it. This script measures that peer again, alone in a fresh
process (no kernel, no other peer before it), so that the bench's number can be told from the peer's own
variation, and says where the time goes:

1. default: compiled with the inductor caches as they are (in benchmarks/gpu/kda_speed.sh: an empty cache dir,
   so it compiles and autotunes from scratch; the bench stage run after it then reuses these kernels);
2. reduce-overhead (CUDA graphs, the in-place loop);
3. default again, inductor caches off (torch._inductor.config.force_disable_caches): the same graph compiled and
   its kernels' launch configurations autotuned a second time in the same process.

Each is `bench_emulation.compiled_peers`: isolated, warmed up, the median of --reps timed runs of --peer-steps
steps, no recompile allowed while timed; then its host enqueue time per step (a host-bound peer's host time
reaches its time per step) and one profiled run (the GPU's busy time per step and the kernels taking it). The
first measurement is timed before any profiler runs in the process. Inductor's autotuning log (every candidate
configuration's time, `torch._inductor.runtime.triton_heuristics` at DEBUG) goes to stderr, so a different pick
between 1 and 3 shows. GPU clocks, temperature, power and the host's load are logged before each.

    python benchmarks/gpu/kda_peer.py [--variant fp8_e4m3@conventional] [--steps 4096] [--batch 16]
        [--peer-steps 64] [--reps 5] [--device cpu] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_emulation import (  # noqa: E402
    MIN_REPS,
    SCHEMES,
    STEP_FNS,
    compiled_peers,
    gpu_state,
    layer_inputs,
    peer_loop,
)

from ssmquant.replay import parse_variant  # noqa: E402

FORMATS = ("fp8_e4m3", "int8", "nvfp4")
MEASUREMENTS = (  # (label, torch.compile mode, inductor caches off)
    ("default", "default", False),
    ("reduce-overhead", "reduce-overhead", False),
    ("default, caches off (compiled again)", "default", True),
)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="fp8_e4m3@conventional")
    ap.add_argument("--steps", type=int, default=4096, help="steps of the layer's inputs (the peer runs the first ones)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--peer-steps", type=int, default=64, help="steps per timed run of the peer loop")
    ap.add_argument("--reps", type=int, default=5, help=f"timed runs per measurement (>= {MIN_REPS})")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script")
    ap.add_argument("--out", required=True, help="JSON file")
    args = ap.parse_args()
    names = [f"{f}@{s}" for f in FORMATS for s in SCHEMES]
    if args.variant not in names:
        sys.exit(f"--variant takes one of {', '.join(names)}, got {args.variant!r}")
    if args.reps < MIN_REPS:
        sys.exit(f"--reps must be at least {MIN_REPS}, got {args.reps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("kda_peer.py needs a CUDA GPU (or --device cpu to check the script)")
    args.failed = False
    logging.basicConfig(stream=sys.stderr, format="[%(name)s] %(message)s")
    logging.getLogger("torch._inductor.runtime.triton_heuristics").setLevel(logging.DEBUG)

    variant = parse_variant(args.variant)
    inputs = layer_inputs("kda", args.batch, args.steps, args.device)
    elems = math.prod(inputs.state_shape)
    step_fn = STEP_FNS["kda"]
    eager_m = peer_loop("kda", inputs, variant, args.peer_steps, step_fn)()  # the metrics the peers must reproduce
    doc = {
        "variant": args.variant,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "none (CPU check)",
        "torch": torch.__version__,
        "command": "python benchmarks/gpu/kda_peer.py " + " ".join(sys.argv[1:]),
        "state elements": elems,
        "gpu at start": gpu_state(),
        "measurements": {},
    }
    print(f"kda {args.variant}: {doc['gpu at start']}", flush=True)
    for label, mode, caches_off in MEASUREMENTS:
        print(f"== {label}", flush=True)  # kda_speed.sh logs stdout and stderr (the autotuning log) together
        args.compile_modes = mode
        try:
            with torch._inductor.config.patch(force_disable_caches=caches_off):
                result = compiled_peers("kda", inputs, variant, args, step_fn, eager_m, profile=True)[mode]
        except Exception as err:  # noqa: BLE001 - e.g. a config this torch lacks: reported, the others still run
            print(f"  {label} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:300]}", flush=True)
            result = None
        doc["measurements"][label] = None if result is None else result.summary(elems)
        if result is not None and "top" in result.profile:
            top = result.profile["top"][:4]
            print("   top kernels (us per step): " + "; ".join(f"{k['name'][:60]} {k['us per step']:.1f}" for k in top))
        elif result is not None:
            print(f"   profile: {result.profile}", flush=True)
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")  # a run cut short keeps its rows
    doc["gpu at end"] = gpu_state()
    doc["failed"] = args.failed or any(m is None for m in doc["measurements"].values())
    pathlib.Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if doc["failed"]:
        sys.exit("FAILED: a peer measurement failed or recompiled while timed (above)")


if __name__ == "__main__":
    main()
