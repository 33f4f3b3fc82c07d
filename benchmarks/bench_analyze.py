"""Wall-clock time of `ssmquant analyze`, start-up included, against the issue's targets.

    python benchmarks/bench_analyze.py gpu    # nemotron-3-nano synthetic, 4096 steps, batch 8 (target < 30 s on an H200)
    python benchmarks/bench_analyze.py cpu    # the same at 512 steps, batch 1 (target < 2 min on 2 cores)

Each run is a fresh `ssmquant analyze` process (imports, input synthesis, kernel compilation on a cold
cache, all 23 layers x 6 variants, tables, JSON and plots). The result replaces this machine kind's
section of benchmarks/results/analyze.md, with the hardware and versions.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "analyze.md"
RUNS = {
    "gpu": ["--steps", "4096", "--batch", "8", "--device", "cuda"],
    "cpu": ["--steps", "512", "--batch", "1", "--device", "cpu"],
}
TARGET = {"gpu": "< 30 s on one H200", "cpu": "< 2 min on 2 CPU cores"}


def hardware(kind: str) -> str:
    import torch

    if kind == "gpu":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(RUNS))
    ap.add_argument("--cold-cache", action="store_true", help="empty Triton's kernel cache first (GPU)")
    args = ap.parse_args()
    out = pathlib.Path(tempfile.mkdtemp()) / "run"
    cmd = [
        sys.executable, "-m", "ssmquant.cli", "analyze", "--model", "nemotron-3-nano", "--synthetic",
        "--formats", "fp8_e4m3,int8,nvfp4", "--schemes", "conventional,replay", *RUNS[args.kind],
        "--out", str(out), "-q",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if args.cold_cache:
        cache = pathlib.Path(tempfile.mkdtemp())
        env["TRITON_CACHE_DIR"] = str(cache)
    t0 = time.time()
    subprocess.run(cmd, check=True, env=env)
    wall = time.time() - t0
    import json

    report = json.loads((out / "report.json").read_text())
    inner = report["elapsed_s"]
    shutil.rmtree(out.parent, ignore_errors=True)
    shown = " ".join("ssmquant" if c == sys.executable else c for c in cmd[2:]).replace(str(out), "DIR")
    section = (
        f"## {args.kind.upper()}\n\n"
        f"`{shown}`\n\n"
        f"| hardware | date | wall clock (start-up included) | inside analyze() | target |\n|---|---|---|---|---|\n"
        f"| {hardware(args.kind)} | {datetime.date.today().isoformat()} | {wall:.1f} s | {inner:.1f} s | {TARGET[args.kind]} |\n"
        f"{'Triton cache: cold (kernels compiled in the run)' if args.cold_cache else ''}\n"
    )
    text = RESULTS.read_text() if RESULTS.exists() else "# `ssmquant analyze` wall-clock time\n\n"
    pattern = re.compile(rf"## {args.kind.upper()}\n.*?(?=\n## |\Z)", re.S)
    text = pattern.sub(section.rstrip("\n"), text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")
    print(section)


if __name__ == "__main__":
    main()
