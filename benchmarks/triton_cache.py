"""Does a second process recompile the emulation kernels, and what does a warm first launch cost?

    python benchmarks/triton_cache.py --json out.json        # on a GPU
    TRITON_INTERPRET=1 python benchmarks/triton_cache.py --device cpu --steps 4 --batch 1   # a CPU check

Runs the same child twice against one fresh TRITON_CACHE_DIR: process 1 compiles, process 2 should only
load. Each child times `simulate` on one Nemotron-3-Nano layer (synthetic inputs) with analyze's six default
variants, the way `analyze` calls it: the first call (Triton hashes the kernel sources, builds or loads each
specialisation's binary, CUDA loads the module), a second and third call on the same layer, and a call on
another layer (same shapes: no new specialisation may appear). It lists each kernel's in-memory
specialisations after the calls; the parent reports the cache entries each process added (process 2 must
add none). The per-call time of a warm tiny run is the fixed cost per layer (launches, buffers, the
window statistics' transfer) that `analyze` pays 23 times.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def kernel_specialisations() -> dict[str, int]:
    """{kernel name: specialisations compiled in this process} for every @triton.jit kernel of ssmquant.kernels
    (Triton keeps them per device in JITFunction.device_caches; the layout differs between versions)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import ssmquant.kernels as pkg

    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"ssmquant.kernels.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and name.endswith("kernel"):
                caches = getattr(obj, "device_caches", None) or {}
                n = 0
                for entry in caches.values():
                    cache = entry[0] if isinstance(entry, tuple) else entry
                    n += len(cache) if hasattr(cache, "__len__") else 0
                if n:
                    found[f"{info.name}.{name}"] = n
    return found


def child(args) -> None:
    import torch

    from ssmquant.analysis import AnalyzeConfig, build_variants
    from ssmquant.models import get_preset, synthetic_inputs
    from ssmquant.replay import simulate

    device = torch.device(args.device)
    preset = get_preset("nemotron-3-nano")
    variants = build_variants(AnalyzeConfig())
    layers = list(preset.ssm_layers)[:2]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(layer_inputs):
        sync()
        t0 = time.perf_counter()
        simulate(layer_inputs, variants, backend="triton", record_every=min(args.record_every, args.steps))
        sync()
        return time.perf_counter() - t0

    inputs = [synthetic_inputs(preset, layer, batch=args.batch, steps=args.steps, device=device) for layer in layers]
    if device.type == "cuda":
        torch.zeros(1, device=device).sum().item()  # the CUDA context, outside the timings
    calls = {
        "first_call_s": timed(inputs[0]),
        "second_call_s": timed(inputs[0]),
        "third_call_s": timed(inputs[0]),
        "other_layer_call_s": timed(inputs[1]),
    }
    print(json.dumps({"variants": [v.name for v in variants], **calls, "specialisations": kernel_specialisations()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--record-every", type=int, default=16)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    cache = pathlib.Path(tempfile.mkdtemp(prefix="triton-cache-probe-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(cache))
    cmd = [sys.executable, __file__, "--child", "--device", args.device, "--steps", str(args.steps),
           "--batch", str(args.batch), "--record-every", str(args.record_every)]  # fmt: skip
    rows = []
    for process in (1, 2):
        before = {p.name for p in cache.iterdir()}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"process {process} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        added = sorted({p.name for p in cache.iterdir()} - before)
        row.update(process=process, wall_s=wall, cache_entries_added=len(added),
                   cache_files_added=sorted(f.name for d in added for f in (cache / d).iterdir()))  # fmt: skip
        rows.append(row)
        print(
            f"process {process}: wall {wall:.2f} s; simulate on one layer ({len(row['variants'])} variants, "
            f"{args.steps} steps x batch {args.batch}): 1st call {row['first_call_s']:.3f} s, 2nd "
            f"{row['second_call_s']:.3f} s, 3rd {row['third_call_s']:.3f} s, other layer "
            f"{row['other_layer_call_s']:.3f} s; cache entries added {len(added)}; "
            f"specialisations {row['specialisations']}",
            flush=True,
        )
    warm = rows[1]
    verdict = "no recompilation" if warm["cache_entries_added"] == 0 else "RECOMPILED in the second process"
    print(f"second process: {verdict}; warm first-call overhead {warm['first_call_s'] - warm['third_call_s']:.3f} s")
    if args.json:
        args.json.write_text(json.dumps({"cache_dir": str(cache), "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
