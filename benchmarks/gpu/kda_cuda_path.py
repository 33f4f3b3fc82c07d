"""Where the CUDA KDA kernel's time goes on the path `simulate` takes, run by run (a diagnostic).

Through `emulate_triton_steps` the kernel measured 2-25% slower than its launch alone, and unevenly
(benchmarks/results/emulation_kda.md, runs c4-c7). This alternates the two, --rounds times, for fp8_e4m3 conventional
at GLM-5.3-Flash shapes (batch --batch, --steps steps): each run is timed with CUDA events around the whole call
and, inside it, around the kernel launch alone (a wrapper around `kda_cuda.kda_cuda_launch`), while nvidia-smi samples
the SM clock, power, temperature and the active clock-event reasons every 100 ms. A slow call whose kernel is slow
points at the GPU (clocks, power); a slow call whose kernel is not, at the work around it. Writes every run and
every sample to --out (JSON).

    python benchmarks/gpu/kda_cuda_path.py [--rounds 6] [--steps 4096] [--batch 16] --out FILE
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

from bench_emulation import drain, glm53_flash_inputs  # noqa: E402
from kda_cuda_vs_triton import launch_alone  # noqa: E402

import ssmquant.kernels as kernels  # noqa: E402
from ssmquant.kernels import kda_cuda  # noqa: E402
from ssmquant.replay import parse_variant  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kda_cuda_path.py needs a CUDA GPU")
    inp = glm53_flash_inputs(args.batch, args.steps, "cuda")
    variant = parse_variant("fp8_e4m3@conventional")
    work = math.prod(inp.state_shape) * args.steps
    alone = launch_alone(inp)  # binds the unwrapped launch, before the wrapper below replaces it
    launches = []  # (start, end) events of each kernel launch inside the path
    real_launch = kda_cuda.kda_cuda_launch

    def timed_launch(*a, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real_launch(*a, **kw)
        end.record()
        launches.append((start, end))
        return out

    def path():
        drain(kernels.emulate_triton_steps(inp, [variant]))

    kda_cuda.kda_cuda_launch = timed_launch
    smi = subprocess.Popen(
        [
            "nvidia-smi",
            "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
            "--format=csv,noheader",
            "-lms",
            "100",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    runs = []
    try:
        alone(), path()  # compile and warm up
        torch.cuda.synchronize()
        for r in range(args.rounds):
            for label, fn in (("alone", alone), ("path", path)) if r % 2 == 0 else (("path", path), ("alone", alone)):
                for _ in range(3):
                    launches.clear()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t_host = time.time()
                    start.record()
                    fn()
                    end.record()
                    torch.cuda.synchronize()
                    total = start.elapsed_time(end) / 1e3
                    kernel = launches[0][0].elapsed_time(launches[0][1]) / 1e3 if launches else total
                    runs.append(
                        {
                            "round": r,
                            "what": label,
                            "wall clock": t_host,
                            "call ms": total * 1e3,
                            "kernel ms": kernel * 1e3,
                            "call G/s": work / total / 1e9,
                            "kernel G/s": work / kernel / 1e9,
                        }
                    )
                    print(json.dumps(runs[-1]), flush=True)
    finally:
        kda_cuda.kda_cuda_launch = real_launch
        smi.terminate()
    samples = smi.communicate()[0].splitlines()
    pathlib.Path(args.out).write_text(
        json.dumps({"gpu": torch.cuda.get_device_name(), "runs": runs, "nvidia-smi": samples}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
