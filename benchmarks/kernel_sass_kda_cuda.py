"""Instructions per element-step of the CUDA KDA kernel's time loop (`ssmquant/kernels/kda_cuda.py`), without a GPU.

Compiles the kernel for sm_90 with NVRTC (the nvidia-cuda-nvrtc dev wheel), disassembles it with the nvdisasm that
ships with Triton, finds the time loop (the longest backward branch) and counts its instructions, less the division
slow-path calls (3 instructions each, not taken for normal scales), per element-step (/ 64: each lane holds 64
elements of each state). Conventional (every step writes, no branch), fp32 q / k, bf16 v. A static count of one
lane's work, not a timing.

    python benchmarks/kernel_sass_kda_cuda.py
"""

from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from ssmquant.kernels import kda_cuda  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "kernels"))
from nvrtc_offline import nvrtc_compile, nvrtc_library  # noqa: E402


def cubin(source: str) -> bytes:
    rc, log, out = nvrtc_compile(source, list(kda_cuda.NVRTC_OPTIONS))
    if rc != 0:
        sys.exit(f"NVRTC failed:\n{log}")
    return out


def loop_counts(fmt: int) -> collections.Counter:
    nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin(kda_cuda.kernel_source(fmt, 0, True, False, torch.float32, torch.bfloat16)))
        f.flush()
        text = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    lines = text.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if ".text.kda_emulate_8bit" in line) :]
    labels = {line[:-1]: i for i, line in enumerate(body) if re.match(r"\.L_x_\d+:$", line)}
    loops = [
        (labels[m.group(1)], i)
        for i, line in enumerate(body)
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i
    ]
    start, end = max(loops, key=lambda se: se[1] - se[0])
    ops = collections.Counter()
    for line in body[start : end + 1]:
        if re.search(r"/\*[0-9a-f]{4}\*/", line):
            ops[re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]] += 1
    return ops


def main():
    if nvrtc_library() is None:
        sys.exit("needs the nvidia-cuda-nvrtc wheel (pip install -e .[dev])")
    for fmt, name in ((3, "fp8_e4m3"), (4, "int8")):
        ops = loop_counts(fmt)
        total = sum(ops.values()) - 3 * ops["CALL"]
        print(f"{name}: {total} instructions per step, {total / 64:.2f} per element-step; top: {ops.most_common(8)}")


if __name__ == "__main__":
    main()
