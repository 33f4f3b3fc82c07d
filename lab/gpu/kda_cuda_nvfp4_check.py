"""NVFP4 in the KDA CUDA kernel (issue 28): its bit-exactness checks and a speed comparison, in one run on a GPU.

1. Checks (the GPU tests of tests/kernels/test_kda_cuda.py, run here through pytest): the NVFP4 write against
   formats.codec bit for bit (a zero's sign aside) on crafted states (near E2M1 midpoints, which the fast path
   decides; amax-0 rows; s2 outside the fast range, blocks far below their row: the warps that must take the
   exact-division fallback take it) and on random states; every write of the kernel's own states
   (DEBUG_STATES build) bit for bit, conventional and replay, with and without an initial state; the metrics
   against the torch reference and the Triton kernel within the tests' bound.
2. The fast path's fallback rate on the kernel's own states at GLM-5.3-Flash's head (random KDA inputs).
3. Speed at GLM-5.3-Flash shapes (B 16, Hv 64, Dk = Dv = 128, T 1024), the kernel launch alone, median of 5
   after a warm-up: fp8_e4m3 in the CUDA kernel, nvfp4 in the CUDA kernel, nvfp4 in the Triton kernel
   (`delta_rule_launch` at the planned tiling), all conventional; and nvfp4@replay16 in both.

Prints one summary (and writes it as JSON to --out if given); exits 1 when a check fails.

    python lab/gpu/kda_cuda_nvfp4_check.py [--steps 1024] [--batch 16] [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.emulation import cuda_time, glm53_flash_inputs  # noqa: E402
from ssmquant.kernels import kda_cuda, plan_launches  # noqa: E402
from ssmquant.kernels.common import BUFFER_CODES, slot_spec  # noqa: E402
from ssmquant.kernels.delta_rule import delta_rule_launch, delta_rule_operands  # noqa: E402
from ssmquant.kernels.host import write_mask_on  # noqa: E402
from ssmquant.kernels.rounding import FORMAT_CODES  # noqa: E402
from ssmquant.replay import parse_variant  # noqa: E402

GPU_TESTS = "tests/kernels/test_kda_cuda.py"


def run_tests() -> dict:
    """The GPU tests of the CUDA kernel (every one, the FP8 / INT8 ones included): pytest's summary line."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", GPU_TESTS, "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    lines = proc.stdout.strip().splitlines()
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    print("\n".join(lines[-40:]), flush=True)
    return {"pytest rc": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:], "failed": failures}


def fallback_rate(batch: int, steps: int) -> dict:
    """How often a warp's write takes the fallback on the kernel's own states: the DEBUG_STATES build's states
    before each write, through the write alone (`kda_cuda.nvfp4_write`, the same device code)."""
    inp = glm53_flash_inputs(batch, steps, "cuda")
    ops = delta_rule_operands(inp)
    write, always = write_mask_on(parse_variant("nvfp4").scheme, batch, steps, inp.device)
    states = torch.empty(steps, 2, batch, 64, 128, 128, device="cuda")
    kda_cuda.kda_cuda_launch(
        ops["q"], ops["k"], ops["v"], ops["alpha"], ops["beta"], None, write,
        fmt=kda_cuda.FMT_NVFP4, buf=0, always=always, states=states,
    )  # fmt: skip
    taken = total = 0
    for t in range(steps):
        _, fb = kda_cuda.nvfp4_write(states[t, 0].reshape(-1, 128).contiguous())
        taken += int(fb.sum())
        total += fb.numel()
    return {"warp writes": total, "fallbacks": taken, "rate": taken / total}


def triton_launch(inputs, name: str):
    """A closure launching the Triton kernel for one variant as `emulate_triton_steps` would (planned tiling)."""
    v = parse_variant(name)
    ((_, (block_p, warps)),) = plan_launches([v], inputs.rows, inputs.state_dim, None, inputs.kind)
    spec = slot_spec(
        FORMAT_CODES[v.format.encoding],
        1,
        False,
        False,
        BUFFER_CODES[v.scheme.buffer_dtype] if v.scheme.rounds_buffer else 0,
    )
    ops = delta_rule_operands(inputs)
    write = (
        v.scheme.write_mask(inputs.batch, inputs.steps).to(device=inputs.device, dtype=torch.int8)[None].contiguous()
    )
    seeds = torch.tensor([v.seed], dtype=torch.int64, device=inputs.device)
    args = (ops["q"], ops["k"], ops["v"], ops["alpha"], ops["beta"], None, write, seeds, None)
    return lambda: delta_rule_launch(*args, specs=(spec,), block_p=block_p, num_warps=warps), (block_p, warps)


def cuda_launch(inputs, name: str):
    """A closure launching the CUDA kernel for one variant, as `kda_cuda.variant_steps` does (the whole batch)."""
    v = parse_variant(name)
    assert kda_cuda.eligible(v, "kda", inputs.state_dim, inputs.rows), name
    fmt, buf = kda_cuda.variant_config(v)
    ops = delta_rule_operands(inputs)
    q, k = ops["q"], ops["k"]
    if q.dtype != k.dtype:
        q, k = q.float(), k.float()
    write, always = write_mask_on(v.scheme, inputs.batch, inputs.steps, inputs.device)
    args = (q, k, ops["v"], ops["alpha"], ops["beta"], None, write)
    return lambda: kda_cuda.kda_cuda_launch(*args, fmt=fmt, buf=buf, always=always)


def speed(batch: int, steps: int, reps: int) -> list[dict]:
    inputs = glm53_flash_inputs(batch, steps, "cuda")
    elems = math.prod(inputs.state_shape) * steps
    rows = []
    cases = [
        ("fp8_e4m3@conventional", "cuda"),
        ("nvfp4@conventional", "cuda"),
        ("nvfp4@conventional", "triton"),
        ("nvfp4@replay16", "cuda"),
        ("nvfp4@replay16", "triton"),
    ]
    for name, kernel in cases:
        tiling = None
        if kernel == "cuda":
            fn = cuda_launch(inputs, name)
        else:
            fn, tiling = triton_launch(inputs, name)
        fn()  # compile, warm up
        torch.cuda.synchronize()
        t = cuda_time(fn, reps)
        rows.append(
            {"variant": name, "kernel": kernel, "tiling": tiling, "ms": t * 1e3, "G elem-steps/s": elems / t / 1e9}
        )
        print(json.dumps(rows[-1]), flush=True)
    base = {(r["variant"], r["kernel"]): r["ms"] for r in rows}
    fp8 = base[("fp8_e4m3@conventional", "cuda")]
    for r in rows:
        r["x fp8 cuda time"] = r["ms"] / fp8
    for name in ("nvfp4@conventional", "nvfp4@replay16"):
        print(f"{name}: triton / cuda = {base[(name, 'triton')] / base[(name, 'cuda')]:.2f}x", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and kda_cuda.available(torch.device("cuda"))):
        sys.exit("needs a CUDA GPU of compute capability >= 8.9 and torch's NVRTC wrapper")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    ok = True
    if not args.skip_tests:
        out["tests"] = run_tests()
        ok = out["tests"]["pytest rc"] == 0
    out["fallback rate (B 2, T 64, GLM-5.3-Flash heads)"] = fallback_rate(2, 64)
    print(json.dumps(out["fallback rate (B 2, T 64, GLM-5.3-Flash heads)"]), flush=True)
    out["speed"] = speed(args.batch, args.steps, args.reps)
    print("\n=== summary ===")
    print(f"device: {out['device']}, torch {out['torch']}")
    if "tests" in out:
        print(f"tests: {out['tests']['summary']}" + "".join(f"\n  {f}" for f in out["tests"]["failed"]))
    fr = out["fallback rate (B 2, T 64, GLM-5.3-Flash heads)"]
    print(f"fallback: {fr['fallbacks']} of {fr['warp writes']} warp writes ({fr['rate']:.2e})")
    print(f"speed (B {args.batch}, T {args.steps}, median of {args.reps}):")
    for r in out["speed"]:
        print(f"  {r['variant']:24s} {r['kernel']:7s} {r['ms']:9.2f} ms  {r['x fp8 cuda time']:.2f}x fp8-cuda time")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
