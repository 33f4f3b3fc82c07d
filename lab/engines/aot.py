"""Compile the oracles' FlashInfer modules ahead of time, on any x86-64 Linux machine, no GPU needed.

    python -m lab.engines.aot OUTDIR/bundle                 # CUDA 13.0 toolkit from PyPI wheels
    python -m lab.engines.aot OUTDIR/bundle --cuda-home DIR # an installed toolkit instead

Why: FlashInfer builds each mamba kernel specialisation with nvcc at first use. On the GPU machine that
took 5 min 15 s for the oracle's 14 modules, most of a 10-minute call (benchmarks/RESULTS.md, engine oracles).
The compilation needs nvcc, not a GPU, so it is done here once and the shared objects travel in the
bundle: FlashInfer 0.7.2's `jit/env.py::get_aot_artifacts` loads `flashinfer/data/aot/NAME/NAME.so`
without building when that file exists ("fallback_path"), for every target architecture.

What is compiled: exactly the modules `lab.engines.oracle` asks for (its `prebuild` is run with
FlashInfer's `JitSpec.build_and_load` replaced by a build that records the spec, and the compute
capability FlashInfer reads from the device replaced by the target's), so the names and template
arguments cannot drift from the oracle's. The toolkit is assembled from NVIDIA's PyPI wheels
(`nvidia-cuda-nvcc`, `-runtime`, `-crt`, `nvidia-nvvm`, pinned to the GPU machine's CUDA 13.0), with an
empty `libcuda.so` stub (soname `libcuda.so.1`, as the toolkit's own stub) for the link step: the driver
library is resolved on the GPU machine at load time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bundle import DEVICE_PLATFORMS, MANIFEST, pip_download, unpack_headers

# The GPU machine's toolkit (nvcc V13.0.88, driver 580: KINDS.md); a cubin from this release runs there.
TOOLKIT_WHEELS = {
    "nvidia-cuda-nvcc": "13.0.88",
    "nvidia-cuda-runtime": "13.0.96",
    "nvidia-cuda-crt": "13.0.88",
    "nvidia-nvvm": "13.0.88",
}
# FlashInfer's arch string for an H100 / H200 (sm_90a: the kernels use Hopper-only instructions when present).
DEFAULT_ARCH = "9.0a"
AOT_DIR = Path("flashinfer") / "data" / "aot"


class AotError(RuntimeError):
    """A toolkit or build step failed; the message names the step and what to do."""


def _pip_download(specs: dict[str, str], dest: Path, *, native: bool) -> list[Path]:
    """Download pinned wheels (binary only) into dest; native: for this interpreter, else manylinux x86-64."""
    platforms = [] if native else [a for p in DEVICE_PLATFORMS for a in ("--platform", p)]
    args = ["--only-binary=:all:", *platforms, *(f"{name}=={version}" for name, version in specs.items())]
    return pip_download(args, dest, error=AotError)


def toolkit(cache: Path) -> Path:
    """A CUDA_HOME (bin/nvcc, include, lib64 with libcudart and a libcuda stub) made from PyPI wheels."""
    home = cache / "cuda" / "nvidia" / "cu13"
    if (home / "bin" / "nvcc").exists() and (home / "lib64" / "stubs" / "libcuda.so").exists():
        return home
    import zipfile

    for wheel in _pip_download(TOOLKIT_WHEELS, cache / "toolkit-wheels", native=False):
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                target = z.extract(info, cache / "cuda")
                if info.filename.split("/")[-2:-1] in (["bin"], ["nvvm"]) or "/bin/" in info.filename:
                    os.chmod(target, 0o755)  # wheels do not keep the executable bit
    if not (home / "bin" / "nvcc").exists():
        raise AotError(f"the toolkit wheels did not unpack nvcc to {home / 'bin'}")
    (home / "lib64").unlink(missing_ok=True)
    (home / "lib64").symlink_to("lib")
    lib = home / "lib"
    if not (lib / "libcudart.so").exists():
        (lib / "libcudart.so").symlink_to("libcudart.so.13")
    (lib / "stubs").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "stub.c"
        src.write_text("/* link-time stand-in for the driver library */\n")
        res = subprocess.run(
            ["cc", "-shared", "-o", str(lib / "stubs" / "libcuda.so"), "-Wl,-soname,libcuda.so.1", str(src)],
            capture_output=True,
            text=True,
        )
    if res.returncode != 0:
        raise AotError(f"could not build the libcuda link stub with cc: {res.stderr.strip()[:300]}")
    return home


def _local_tvm_ffi(bundle: Path, cache: Path) -> Path | None:
    """A folder with apache-tvm-ffi for this interpreter when the bundle's (built for the GPU machine's
    Python) does not import here; None when the bundle's own imports."""
    probe = subprocess.run(
        [sys.executable, "-c", "import tvm_ffi"], env={**os.environ, "PYTHONPATH": str(bundle)}, capture_output=True
    )
    if probe.returncode == 0:
        return None
    manifest = json.loads((bundle / MANIFEST).read_text())
    version = manifest["apache-tvm-ffi"].split("-")[1]
    site = cache / f"tvm-ffi-py{sys.version_info.major}{sys.version_info.minor}"
    if not (site / "tvm_ffi").exists():
        import zipfile

        for wheel in _pip_download({"apache-tvm-ffi": version}, cache / "tvm-wheels", native=True):
            zipfile.ZipFile(wheel).extractall(site)
    return site


def _build_in_this_process(bundle: Path, arch: str, captured_shapes: list[tuple[int, int]], jobs: int) -> dict:
    """Run the oracle's prebuild with FlashInfer's loader replaced by build-and-record; copy the .so files."""
    import importlib

    import torch
    from flashinfer.jit import core

    # the module, not the function of the same name that `flashinfer.mamba` re-exports over it
    fi_ssu = importlib.import_module("flashinfer.mamba.selective_state_update")

    from . import oracle

    major = int(arch.split(".")[0])
    fi_ssu.get_compute_capability = lambda device: (major, int(arch.split(".")[1].rstrip("a")))
    built: dict[str, core.JitSpec] = {}

    def build_only(spec, *args, **kwargs):
        spec.build(need_lock=True)
        built[spec.name] = spec

    core.JitSpec.build_and_load = build_only
    ckpt, long, ssu, _ = oracle.default_cases(256, 4096)
    # a device object for the arguments only: FlashInfer reads nothing from it but the (patched) capability
    device = torch.device("cuda", 0)
    report = {"nano": oracle.prebuild(ckpt + long, ssu, 64, 8, device, max_workers=jobs)}
    for heads, groups in captured_shapes:
        report[f"h{heads}g{groups}"] = oracle.prebuild(
            [oracle.CkptCase("int8", 16)], [], heads, groups, device, max_workers=jobs
        )
    errors = {k: v for r in report.values() for k, v in r["errors"].items()}
    if errors:
        raise AotError(f"{len(errors)} module(s) failed to compile: {errors}")
    out = bundle / AOT_DIR
    for name, spec in built.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, out / name / f"{name}.so")
    return {"modules": sorted(built), "arch": arch, "seconds": sum(r["seconds"] for r in report.values())}


def build(bundle: Path, *, arch: str = DEFAULT_ARCH, cuda_home: Path | None = None, cache: Path | None = None,
          captured_shapes: list[tuple[int, int]] = ((8, 2),), jobs: int | None = None) -> dict:  # fmt: skip
    """Compile the oracles' modules into `bundle/flashinfer/data/aot`; returns {modules, arch, seconds, nvcc}.

    captured_shapes: (heads, groups) of captured Mamba-2 layers the oracle runs besides Nemotron-3-Nano's
    (64, 8); the default is tiny-nemotron's (8, 2).
    """
    bundle = bundle.resolve()
    if not (bundle / MANIFEST).exists():
        raise AotError(f"{bundle} is not a bundle (no {MANIFEST}); build one with `python -m lab.engines.bundle OUTDIR`")
    cache = (cache or Path(tempfile.gettempdir()) / "ssmquant-aot").resolve()
    home = cuda_home.resolve() if cuda_home else toolkit(cache)
    nvcc = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    if nvcc.returncode != 0:
        raise AotError(f"{home / 'bin' / 'nvcc'} does not run: {nvcc.stderr.strip()[:200]}")
    unpack_headers(bundle)
    tvm = _local_tvm_ffi(bundle, cache)
    repo = Path(__file__).resolve().parents[2]
    path = [str(p) for p in (tvm, repo, bundle) if p is not None]
    workspace = cache / "workspace"  # kept: ninja rebuilds only what changed on a second run
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "CUDA_HOME": str(home),
        "PATH": f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLASHINFER_CUDA_ARCH_LIST": arch,
        "FLASHINFER_WORKSPACE_BASE": str(workspace),
    }
    shapes = ",".join(f"{h}x{g}" for h, g in captured_shapes)
    cmd = [sys.executable, "-m", "lab.engines.aot", str(bundle), "--child", "--arch", arch,
           "--captured-shapes", shapes, "--jobs", str(jobs or os.cpu_count() or 1)]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise AotError(f"compiling FlashInfer's modules failed:\n{res.stderr.strip()[-2000:]}")
    result = json.loads(res.stdout.strip().splitlines()[-1])
    result["nvcc"] = nvcc.stdout.strip().splitlines()[-1]
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["aot"] = {k: result[k] for k in ("modules", "arch", "nvcc")}
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return result


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        heads, _, groups = item.partition("x")
        if not (heads.isdigit() and groups.isdigit()):
            raise argparse.ArgumentTypeError(f"expected HEADSxGROUPS[,HEADSxGROUPS...], e.g. 8x2; got {item!r}")
        out.append((int(heads), int(groups)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.engines.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path, help="the bundle folder made by `python -m lab.engines.bundle`")
    ap.add_argument("--arch", default=DEFAULT_ARCH, help=f"FlashInfer CUDA arch (default {DEFAULT_ARCH}: H100/H200)")
    ap.add_argument("--cuda-home", type=Path, default=None, help="an installed CUDA 13 toolkit (default: PyPI wheels)")
    ap.add_argument("--cache", type=Path, default=None, help="where the toolkit wheels are kept")
    ap.add_argument("--captured-shapes", type=_parse_shapes, default=[(8, 2)], help="HEADSxGROUPS of captured layers")
    ap.add_argument("--jobs", type=int, default=None, help="modules compiled at once (default: CPU count)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = _build_in_this_process(args.bundle, args.arch, args.captured_shapes, args.jobs or 1)
        print(json.dumps(result))
        return 0
    t0 = time.perf_counter()
    try:
        result = build(args.bundle, arch=args.arch, cuda_home=args.cuda_home, cache=args.cache,
                       captured_shapes=args.captured_shapes, jobs=args.jobs)  # fmt: skip
    except AotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"{len(result['modules'])} FlashInfer modules for {result['arch']} in {time.perf_counter() - t0:.0f} s "
        f"({result['nvcc']}) -> {args.bundle / AOT_DIR}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
