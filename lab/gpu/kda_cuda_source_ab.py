"""A/B of versions of the KDA CUDA kernel's source (`ssmquant/kernels/kda_cuda.cu`) on the GPU, in one process.

Each arm is a source file (a path, or git:REV for the file at a commit); every arm times its variants on the
emulation benchmark's KDA layer (GLM-5.3-Flash: 64 heads x 128 x 128, batch 16, `benchmarks.emulation.layer_inputs`)
through `emulate_triton_steps`, the arms alternating rep by rep so that clock and thermal drift fall on all of them.
Every arm's metrics of a variant must be the first arm's, bit for bit (a rewrite of the kernel's arithmetic that
changes a result fails the run).

    python lab/gpu/kda_cuda_source_ab.py --arm shipped=git:HEAD --arm new=ssmquant/kernels/kda_cuda.cu
        [--formats fp8_e4m3,nvfp4] [--steps 1024] [--batch 16] [--reps 5] [--out FILE.json]

Prints, per variant and arm, G elem-steps/s median (slowest-fastest), and each arm's median time over the same
arm's fp8_e4m3 time (the issue's "x fp8 time"; --formats starting with fp8_e4m3).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import cuda_seconds  # noqa: E402
from benchmarks.emulation import layer_inputs  # noqa: E402
from ssmquant.kernels import emulate_triton_steps, fused_kernels, kda_cuda  # noqa: E402
from ssmquant.replay import parse_variant  # noqa: E402


def arm_source(spec: str) -> str:
    """The kernel source of an arm: git:REV (kda_cuda.cu at that commit) or a path."""
    if spec.startswith("git:"):
        rev = spec[4:]
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:ssmquant/kernels/{kda_cuda.SOURCE_FILE}"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    return pathlib.Path(spec).read_text()


def arm_compiler(text: str):
    """A stand-in for kda_cuda._compiled that builds the kernel from `text` (cached per configuration)."""

    @functools.cache
    def compiled(kernel: str, *config):
        shipped = kda_cuda._source
        kda_cuda._source = lambda: text
        try:
            source = kda_cuda.kernel_source(*config)
        finally:
            kda_cuda._source = shipped
        return torch.cuda._compile_kernel(source, kernel, nvcc_options=list(kda_cuda.NVRTC_OPTIONS))

    return compiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME=SOURCE (a path or git:REV); two or more")
    ap.add_argument("--formats", default="fp8_e4m3,nvfp4")
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON of every run's rate")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not kda_cuda.available(torch.device("cuda")):
        sys.exit("kda_cuda_source_ab times the KDA CUDA kernel: no CUDA device (compute capability >= 8.9) here")
    arms = dict(a.split("=", 1) for a in args.arm)
    if len(arms) < 2:
        sys.exit(f"--arm NAME=SOURCE at least twice (distinct names), got {args.arm}")
    compilers = {name: arm_compiler(arm_source(spec)) for name, spec in arms.items()}
    inputs = layer_inputs("kda", args.batch, args.steps, "cuda")
    elems = math.prod(inputs.state_shape) * args.steps
    first = next(iter(arms))
    out, fp8_median = [], {}
    for fmt in args.formats.split(","):
        variants = [parse_variant(fmt)]
        if fused_kernels(inputs, variants) != ["cuda"]:
            sys.exit(f"{fmt}: not a variant of the CUDA kernel ({fused_kernels(inputs, variants)})")
        results, rates = {}, {name: [] for name in arms}

        def run(compiled, keep: bool = False, variants=variants):
            kda_cuda._compiled = compiled
            got = [m for _, _, m in emulate_triton_steps(inputs, variants)]
            return torch.cat([m.flatten() for m in got]) if keep else None

        for name, compiled in compilers.items():  # warm-up (and compile), and the arms' results
            results[name] = run(compiled, keep=True)
            if not torch.equal(results[name].view(torch.int32), results[first].view(torch.int32)):
                sys.exit(f"{fmt}: arm {name}'s metrics differ from arm {first}'s")
        torch.cuda.synchronize()
        for _ in range(args.reps):
            for name, compiled in compilers.items():
                rates[name].append(elems / cuda_seconds(lambda c=compiled: run(c)) / 1e9)
        for name in arms:
            med = sorted(rates[name])[len(rates[name]) // 2]
            if fmt == "fp8_e4m3":
                fp8_median[name] = med
            ratio = f", x fp8 time {fp8_median[name] / med:.3f} (the arm's own fp8_e4m3)" if name in fp8_median else ""
            print(f"{fmt} {name}: {med:.1f} G/s ({min(rates[name]):.1f}-{max(rates[name]):.1f}){ratio}", flush=True)
        out.append({"format": fmt, "rates": rates})
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                      "arms": arms, "runs": out}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
