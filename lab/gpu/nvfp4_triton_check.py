"""NVFP4 at FP8 speed in the Triton kernels (issue 28): bit-identity and speed of the nvfp4 write, one run on a GPU.

1. Kernels against the previous rounding code: the Mamba-2 (Nemotron-3-Nano: H 64, P 64, N 128, G 8), GDN
   (Qwen3.5-9B: Hk 16, Hv 32, Dk = Dv = 128) and KDA (GLM-5.3-Flash: 64 x 128 x 128) Triton kernels at full head
   shapes (batch --check-batch, --check-steps steps), variants fp8_e4m3, nvfp4, nvfp4:head, nvfp4:sr and
   nvfp4:static at two scales (the states' range, and 1/16 of it: saturating blocks, the write's clamp branch),
   conventional, in one launch and each alone: every per-step metric bit for bit against the same launches with ssmquant/kernels/rounding.py as
   of git ref --baseline-ref (default HEAD, the code before this change: once it is committed, pass its parent),
   run in a subprocess on a copy of the package.
2. The write's tile helper (`fake_quant_triton`, the kernels' own `fake_quant_tile`, both tile orders) against the
   torch reference (`fmt.fake_quant`, formats.codec) bit for bit on every 4th FP32 reference state of the three
   layers over --check-steps steps (batch 1, full heads): nvfp4, nvfp4:head, nvfp4:rows4, nvfp4:sr, nvfp4:static
   (two scales as above). Values compared with torch.equal; zeros whose sign alone differs are counted apart
   (the fast path returns +0 where the reference keeps -0: no metric sees it).
3. The GPU variants of the tests (pytest -m gpu): test_nvfp4_fast_round, test_nvfp4_write, test_rounding_ties,
   test_emulation_kernels, test_multi_variant (tests/kernels).
4. Speed, the Triton kernel alone (KDA's CUDA kernel switched off), batch --batch, --steps steps, median of --reps
   after a warm-up (benchmarks.common.cuda_times): fp8_e4m3 and nvfp4, conventional and replay16, each kind.

Prints one summary (and writes it as JSON to --out if given); exits 1 when a check fails.

    python lab/gpu/nvfp4_triton_check.py [--baseline-ref HEAD] [--steps 4096] [--batch 16] [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the baseline subprocess puts a copy of the package with the previous rounding.py first (NVFP4_CHECK_PKG)
sys.path.insert(0, str(ROOT))
if os.environ.get("NVFP4_CHECK_PKG"):
    sys.path.insert(0, os.environ["NVFP4_CHECK_PKG"])

from benchmarks.common import cuda_times  # noqa: E402
from benchmarks.emulation import drain, layer_inputs  # noqa: E402
from ssmquant import formats, kinds  # noqa: E402
from ssmquant.kernels import emulate_triton, emulate_triton_steps, fake_quant_triton  # noqa: E402
from ssmquant.replay import Variant, parse_variant  # noqa: E402

KINDS = kinds.names()
TESTS = [f"tests/kernels/{name}.py" for name in (
    "test_nvfp4_fast_round", "test_nvfp4_write", "test_rounding_ties", "test_emulation_kernels", "test_multi_variant",
)]  # fmt: skip

os.environ["SSMQUANT_KDA_CUDA"] = "0"  # KDA's eligible variants would run in the CUDA kernel otherwise
# without a GPU (a check of the script: TRITON_INTERPRET=1, small layers, few steps) on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def state_scale(kind: str) -> torch.Tensor:
    """A static second-level scale per (head, row) of the kind's layer: the range of its FP32 reference states over
    64 steps (amax / 2688), batch 1."""
    inputs = layer_inputs(kind, 1, 64, DEVICE)
    amax = None
    for _, s in kinds.of(inputs).reference_states(inputs, every=8):
        a = s[0].abs().amax(-1)  # [H, rows]
        amax = a if amax is None else torch.maximum(amax, a)
    return (amax / 2688.0).clamp(min=1e-30)


def check_variants(kind: str):
    scale = state_scale(kind)
    out = [parse_variant(s) for s in ("fp8_e4m3", "nvfp4", "nvfp4:head", "nvfp4:sr")]
    for label, f in (("nvfp4:static", 1.0), ("nvfp4:static/16", 1 / 16)):
        out.append(Variant(formats.parse("nvfp4:static"), static_scale=scale * f, label=label))
    return out


def kernel_metrics(batch: int, steps: int) -> dict[str, torch.Tensor]:
    """Per-step metrics [V, T, B, H, 4] of the check variants, for each kind: all in one launch (the six-variant
    tiling), then each alone (its own planned tiling, the benchmarks')."""
    out = {}
    for kind in KINDS:
        inputs = layer_inputs(kind, batch, steps, DEVICE)
        variants = check_variants(kind)
        out[kind] = emulate_triton(inputs, variants).cpu()
        out[f"{kind} alone"] = torch.cat([emulate_triton(inputs, [v]).cpu() for v in variants])
    return out


def baseline_metrics(ref: str, batch: int, steps: int) -> dict[str, torch.Tensor]:
    """`kernel_metrics` with rounding.py as of git ref (or the file at path ref, for a machine without the git
    history): a copy of the package in a subprocess."""
    if pathlib.Path(ref).is_file():
        old = pathlib.Path(ref).read_text()
    else:
        old = subprocess.run(["git", "show", f"{ref}:ssmquant/kernels/rounding.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT / "ssmquant", pathlib.Path(tmp) / "ssmquant", ignore=shutil.ignore_patterns("__pycache__"))
        (pathlib.Path(tmp) / "ssmquant" / "kernels" / "rounding.py").write_text(old)
        dump = pathlib.Path(tmp) / "metrics.pt"
        env = dict(os.environ, NVFP4_CHECK_PKG=tmp)
        cmd = [sys.executable, __file__, "--metrics-only", str(dump), "--check-batch", str(batch),
               "--check-steps", str(steps)]  # fmt: skip
        subprocess.run(cmd, env=env, check=True)
        return torch.load(dump)


def compare_kernels(ref: str, batch: int, steps: int) -> dict:
    new, old = kernel_metrics(batch, steps), baseline_metrics(ref, batch, steps)
    out = {}
    for key in new:
        for j, v in enumerate(check_variants(key.split()[0])):
            a, b = new[key][j], old[key][j]
            same = torch.equal(a.view(torch.int32), b.view(torch.int32))
            rel = float(((a - b).abs() / b.abs().clamp(min=1e-30)).max())
            out[f"{key} {v.name}"] = {"bit-identical": same, "max rel diff": rel, "nan": bool(a.isnan().any())}
            print(f"kernel metrics {key} {v.name}: bit-identical {same} (max rel diff {rel:.3g})", flush=True)
    return out


def compare_tiles(steps: int) -> dict:
    """`fake_quant_triton` against `fmt.fake_quant` on every 4th reference state of each kind."""
    out = {}
    for kind in KINDS:
        inputs = layer_inputs(kind, 1, steps, DEVICE)
        scale = state_scale(kind)[None]  # [1, H, rows]
        cases = [(s, None) for s in ("nvfp4", "nvfp4:head", "nvfp4:rows4", "nvfp4:sr")]
        cases += [("nvfp4:static", scale), ("nvfp4:static", scale / 16)]
        stats = {f"{s}{'' if sc is None else f' x{float((sc / scale).max()):g}'}": [0, 0, 0] for s, sc in cases}
        for t, s in kinds.of(inputs).reference_states(inputs, every=4):
            for (spec, sc), key in zip(cases, stats):
                fmt = formats.parse(spec)
                want = fmt.fake_quant(s, scale=sc, seed=3, stream=t)
                for kmajor in (False, True):
                    got = fake_quant_triton(fmt, s, scale=sc, seed=3, stream=t, kmajor=kmajor)
                    stats[key][0] += 1
                    if not torch.equal(got, want):
                        stats[key][1] += 1
                    elif not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                        stats[key][2] += 1  # equal values, a zero's sign differs
        for key, (n, bad, zeros) in stats.items():
            out[f"{kind} {key}"] = {"tiles": n, "mismatches": bad, "zero-sign only": zeros}
            print(f"tiles {kind} {key}: {n} writes, {bad} mismatches, {zeros} zero-sign-only", flush=True)
    return out


def run_tests() -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *TESTS, "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[-30:]), flush=True)
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {"pytest rc": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:], "failed": failed}


def speed(batch: int, steps: int, reps: int) -> list[dict]:
    rows = []
    for kind in KINDS:
        inputs = layer_inputs(kind, batch, steps, DEVICE)
        work = math.prod(inputs.state_shape) * steps
        for name in ("fp8_e4m3@conventional", "nvfp4@conventional", "fp8_e4m3@replay16", "nvfp4@replay16"):
            v = parse_variant(name)
            t = cuda_times(lambda v=v, inputs=inputs: drain(emulate_triton_steps(inputs, [v])), reps)
            rows.append({"kind": kind, "variant": name, "ms": t.median * 1e3, "G elem-steps/s": work / t.median / 1e9,
                         "slowest-fastest G/s": f"{work / t.slowest / 1e9:.1f}-{work / t.fastest / 1e9:.1f}"})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        rate = {r["variant"]: r["G elem-steps/s"] for r in rows if r["kind"] == kind}
        for scheme in ("conventional", "replay16"):
            ratio = rate[f"fp8_e4m3@{scheme}"] / rate[f"nvfp4@{scheme}"]
            rows.append({"kind": kind, "variant": f"nvfp4 time / fp8 time, {scheme}", "ratio": ratio})
            print(f"{kind} {scheme}: nvfp4 takes {ratio:.3f}x fp8's time", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-ref", default="HEAD", help="git ref of the previous rounding.py, or a path to a copy of it")
    ap.add_argument("--check-batch", type=int, default=2)
    ap.add_argument("--check-steps", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--metrics-only", type=pathlib.Path, help=argparse.SUPPRESS)  # the baseline subprocess
    args = ap.parse_args()
    if args.metrics_only:
        torch.save(kernel_metrics(args.check_batch, args.check_steps), args.metrics_only)
        return
    summary = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else None, "torch": torch.__version__}
    import triton

    summary["triton"] = triton.__version__
    summary["kernels vs baseline"] = compare_kernels(args.baseline_ref, args.check_batch, args.check_steps)
    summary["tiles vs torch reference"] = compare_tiles(args.check_steps)
    if not args.skip_tests:
        summary["tests"] = run_tests()
    if not args.skip_speed:
        summary["speed"] = speed(args.batch, args.steps, args.reps)
    ok = all(r["bit-identical"] for r in summary["kernels vs baseline"].values())
    ok &= all(r["mismatches"] == 0 for r in summary["tiles vs torch reference"].values())
    ok &= args.skip_tests or summary["tests"]["pytest rc"] == 0
    summary["ok"] = bool(ok)
    print("\n=== summary ===")
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
