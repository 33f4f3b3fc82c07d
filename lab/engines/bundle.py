"""Build the engine bundle: the real serving kernels, trimmed to what the oracles run, for a GPU machine.

    python -m lab.engines.bundle OUTDIR            # downloads from PyPI, writes OUTDIR/bundle
    python -m lab.engines.bundle OUTDIR --wheels DIR   # use wheels already in DIR

The GPU machine may have no network, so everything the oracles import is brought along. The result,
`OUTDIR/bundle`, goes on PYTHONPATH there; `lab.engines.env.engine_status(name)` says what is missing.

What goes in (pinned; see `PINS`):

- FlashInfer (`flashinfer-python`): the Python modules that `import flashinfer.mamba` executes (a static
  closure over module-level imports; the packages `flashinfer`, `flashinfer.jit` and
  `flashinfer.fused_moe` get minimal `__init__.py` files that keep only the names the closure imports
  from them, because their real ones import every kernel family FlashInfer has), the CUDA sources the
  mamba JIT modules compile (`data/csrc`: checkpointing_ssu*, selective_state_update*, and the headers
  they include from `data/include`), and, as one xz archive unpacked on first use, the CUTLASS/CuTe,
  CCCL and spdlog header trees the JIT build puts on its include path (vendored CCCL takes precedence
  over the CUDA toolkit's copy, so it travels whole rather than as a partial closure).
  `flashinfer.gdn_decode` is left out: its kernels are CuTe DSL and need `nvidia-cutlass-dsl`, far over
  the bundle's size budget.
- `apache-tvm-ffi` (FlashInfer's FFI runtime), the CPython 3.12 manylinux x86_64 wheel, unpacked.
- flash-linear-attention and fla-core (pure Triton): the `fla` package.

With `--ssu`, the Triton decode kernels of vLLM and TensorRT-LLM go into `OUTDIR/bundle/ssu` instead
(`build_ssu`; loaded by `lab.engines.vendored`): vLLM's `mamba_ssm.py`, `triton_helpers.py` and tuned
launch configs from its wheel (`SSU_PINS`), and TensorRT-LLM's `selective_state_update.py` and
`softplus.py` from a folder given with `--trtllm-src` (TensorRT-LLM's PyPI package is a stub that
downloads the wheel from NVIDIA's index; the two files are read from its repository at `SSU_PINS`'s
commit, the kernel file trimmed after `selective_state_update`). `ssu/MANIFEST.json` records versions
and sha256 of every file; about 0.1 MiB, to be merged into the main bundle as its `ssu/` folder.

The bundle is build output, never committed.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

# The engine versions the oracles were written against (re-read the sources before changing a pin).
PINS = {
    "flashinfer-python": "0.7.2.post1",
    "flash-linear-attention": "0.6.0",
    "fla-core": "0.6.0",
}
# The GPU machine's Python (KINDS.md: Python 3.12.3, x86-64); tvm-ffi ships a compiled extension.
DEVICE_PYTHON = "3.12"
DEVICE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Packages whose real __init__ imports far more than the mamba kernels need.
STUB_PACKAGES = ("flashinfer", "flashinfer.jit", "flashinfer.fused_moe")
# Module-level closure roots; function-level imports are followed inside these (the JIT build path).
ENTRY_MODULES = ("flashinfer.mamba", "flashinfer.version")
DEEP_PREFIXES = (
    "flashinfer.mamba",
    "flashinfer.jit.core",
    "flashinfer.jit.cpp_ext",
    "flashinfer.jit.env",
    "flashinfer.jit.utils",
    "flashinfer.jit.mamba",
    "flashinfer.utils",
    "flashinfer.api_logging",
    "flashinfer.compilation_context",
    "flashinfer.autotuner",
)
CSRC_PREFIXES = ("checkpointing_ssu", "selective_state_update", "flashinfer_mamba")
# Header trees put on the JIT include path (flashinfer/jit/env.py: CUTLASS_INCLUDE_DIRS, CCCL_INCLUDE_DIRS,
# SPDLOG_INCLUDE_DIR), shipped as one archive below `flashinfer/data`.
HEADER_TREES = (
    "cutlass/include",
    "cutlass/tools/util/include",
    "cccl/cub",
    "cccl/libcudacxx/include",
    "cccl/thrust",
    "spdlog/include",
)
HEADER_ARCHIVE = "headers.tar.xz"
HEADER_MARKER = ".headers-unpacked"
MANIFEST = "MANIFEST.json"
SIZE_BUDGET = 40 * 2**20
# The Triton decode kernels of vLLM and TensorRT-LLM (`build_ssu`); see lab.engines.vendored.
SSU_PINS = {"vllm": "0.33.0", "trtllm": "main@1d2bb3b7f395a79221edbead8e8aac5db58df264"}
VLLM_SSU_FILES = (
    "vllm/model_executor/layers/mamba/ops/mamba_ssm.py",
    "vllm/model_executor/layers/mamba/ops/triton_helpers.py",
)
VLLM_SSU_CONFIGS = "vllm/model_executor/layers/mamba/ops/configs/selective_state_update/"
TRTLLM_SSU_FILES = ("selective_state_update.py", "softplus.py")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


class BundleError(RuntimeError):
    """The bundle cannot be built (download failed, a wheel is missing, the size budget is exceeded)."""


# --- download ----------------------------------------------------------------------------------------


def pip_download(args: list[str], dest: Path, *, error: type[Exception] = BundleError) -> list[Path]:
    """`pip download --no-deps -q -d dest ARGS` (pinned requirements and pip's platform options); returns the
    wheels now in dest. A failure raises ``error`` (the caller's error class) with pip's last line."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise error(f"pip download {' '.join(args)} failed: {res.stderr.strip().splitlines()[-1:]}")
    return sorted(dest.glob("*.whl"))


def _find_wheel(wheels: Path, dist: str, version: str | None = None) -> Path:
    stem = dist.replace("-", "_")
    hits = sorted(p for p in wheels.glob(f"{stem}-*.whl") if version is None or f"-{version}-" in p.name)
    if not hits:
        raise BundleError(f"no {dist}{'==' + version if version else ''} wheel in {wheels}")
    return hits[-1]


def _requirement(wheel: Path, dist: str) -> str:
    """The `Requires-Dist` spec of `dist` in a wheel's METADATA (no extras), e.g. 'apache-tvm-ffi<0.2,>=0.1.11'."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                req = line.split(":", 1)[1].strip()
                if re.match(rf"{re.escape(dist)}\b", req):
                    return req.split(";")[0].replace(" ", "")
    raise BundleError(f"{wheel.name} does not require {dist}")


def download(wheels: Path) -> dict[str, Path]:
    """Fetch the pinned wheels (and the tvm-ffi build FlashInfer requires) into `wheels`; returns their paths."""
    wheels.mkdir(parents=True, exist_ok=True)
    for dist, ver in PINS.items():
        if not list(wheels.glob(f"{dist.replace('-', '_')}-{ver}-*.whl")):
            pip_download([f"{dist}=={ver}"], wheels)
    fi = _find_wheel(wheels, "flashinfer-python", PINS["flashinfer-python"])
    tvm_req = _requirement(fi, "apache-tvm-ffi")
    if not list(wheels.glob("apache_tvm_ffi-*-cp312-*.whl")):
        plat = [a for p in DEVICE_PLATFORMS for a in ("--platform", p)]
        pip_download(
            ["--only-binary=:all:", "--python-version", DEVICE_PYTHON, "--implementation", "cp", *plat, tvm_req],
            wheels,
        )
    return {
        "flashinfer": fi,
        "tvm_ffi": sorted(wheels.glob("apache_tvm_ffi-*-cp312-*.whl"))[-1],
        "fla": _find_wheel(wheels, "flash-linear-attention", PINS["flash-linear-attention"]),
        "fla_core": _find_wheel(wheels, "fla-core", PINS["fla-core"]),
        "tvm_requirement": tvm_req,
    }


# --- the Python closure ------------------------------------------------------------------------------


@dataclass
class _Module:
    name: str
    path: str  # path inside the wheel, e.g. "flashinfer/jit/core.py"
    is_package: bool


def _module_index(names: list[str]) -> dict[str, _Module]:
    """Importable modules of a wheel by dotted name."""
    index = {}
    for n in names:
        if not n.endswith(".py"):
            continue
        parts = n[:-3].split("/")
        if parts[-1] == "__init__":
            index[".".join(parts[:-1])] = _Module(".".join(parts[:-1]), n, True)
        else:
            index[".".join(parts)] = _Module(".".join(parts), n, False)
    return index


def _top_level_nodes(tree: ast.Module):
    """Statements executed at import time: the module body, including inside if / try blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            stack += node.body + node.orelse + getattr(node, "finalbody", [])
            for h in getattr(node, "handlers", []):
                stack += h.body


def _imports(tree: ast.Module, module: _Module, deep: bool, root: str):
    """(module, bound names) pairs imported by a module; relative imports resolved; only `root` packages."""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    nodes = ast.walk(tree) if deep else _top_level_nodes(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == root:
                    yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == root:
                yield target, tuple(a.name for a in node.names)


def python_closure(names: list[str], read, entries=ENTRY_MODULES, stubs=STUB_PACKAGES, deep=DEEP_PREFIXES):
    """Modules of a wheel that importing `entries` executes, and the stub sources of `stubs`.

    names: the wheel's file names; read(path) -> source text. Returns (modules {name: _Module},
    stub_sources {package: text}). A stubbed package keeps only the import statements of its real
    __init__ that bind a name other modules import from it (and is itself not followed).
    """
    index = _module_index(names)
    root = entries[0].split(".")[0]
    seen: dict[str, _Module] = {}
    wanted_from_stub: dict[str, set[str]] = {s: set() for s in stubs}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in seen or name not in index:
            continue
        mod = index[name]
        seen[name] = mod
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        if name in stubs:
            continue
        is_deep = any(name == p or name.startswith(p + ".") for p in deep)
        tree = ast.parse(read(mod.path))
        for target, bound in _imports(tree, mod, is_deep, root):
            todo.append(target)
            for b in bound:
                sub = f"{target}.{b}"
                if sub in index:
                    todo.append(sub)
                elif target in wanted_from_stub:
                    wanted_from_stub[target].add(b)
    stub_sources = {}
    for pkg in stubs:
        if pkg not in seen:
            continue
        stub_sources[pkg] = _stub_source(pkg, read(index[pkg].path), wanted_from_stub[pkg])
        # names re-exported by the stub must be importable too
        stub_tree = ast.parse(stub_sources[pkg])
        for target, bound in _imports(stub_tree, index[pkg], False, root):
            todo.append(target)
            todo += [f"{target}.{b}" for b in bound if f"{target}.{b}" in index]
        while todo:
            name = todo.pop()
            if name in seen or name not in index:
                continue
            seen[name] = index[name]
            mod = index[name]
            is_deep = any(name == p or name.startswith(p + ".") for p in deep)
            for target, bound in _imports(ast.parse(read(mod.path)), mod, is_deep, root):
                todo.append(target)
                todo += [f"{target}.{b}" for b in bound if f"{target}.{b}" in index]
    return seen, stub_sources


def _stub_source(package: str, real: str, wanted: set[str]) -> str:
    """A minimal __init__: the real one's top-level import statements that bind a wanted name."""
    keep = []
    for node in ast.parse(real).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = {(a.asname or a.name).split(".")[0] for a in node.names}
            if bound & wanted:
                keep.append(ast.get_source_segment(real, node))
    header = (
        f'"""{package}, trimmed by lab.engines.bundle: only the names the mamba kernels import from it '
        f'({", ".join(sorted(wanted)) or "none"})."""\n'
    )
    return header + "".join(line + "\n" for line in keep)


# --- the CUDA include closure ------------------------------------------------------------------------


def include_closure(sources: list[Path], search: list[Path]) -> set[Path]:
    """Files reachable from `sources` through #include, found in the sources' folders or `search`.

    Over-approximates on purpose (every #include is followed, whatever #if surrounds it); headers not
    found (system, CUDA toolkit, generated .inc) are left to the machine.
    """
    seen: set[Path] = set()
    todo = [p.resolve() for p in sources]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for name in _INCLUDE_RE.findall(f.read_text(errors="replace")):
            for cand in [f.parent / name] + [d / name for d in search]:
                if cand.is_file():
                    todo.append(cand.resolve())
                    break
    return seen


# --- assembling ---------------------------------------------------------------------------------------


def _unzip(wheel: Path, dest: Path, top: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            if n.split("/")[0] == top and not n.endswith("/"):
                z.extract(n, dest)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(outdir: Path, wheels: Path | None = None) -> Path:
    """Download (unless `wheels` holds them) and assemble `outdir/bundle`; returns its path."""
    outdir = outdir.resolve()
    wheel_dir = wheels or outdir / "wheels"
    found = download(wheel_dir)
    work = outdir / "unpacked"
    bundle = outdir / "bundle"
    for d in (work, bundle):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)

    # flashinfer: unpack the whole wheel to a scratch folder, copy what the closures name
    _unzip(found["flashinfer"], work, "flashinfer")
    src = work / "flashinfer"
    names = [str(p.relative_to(work)) for p in src.rglob("*.py")]
    modules, stubs = python_closure(names, lambda p: (work / p).read_text())
    for mod in modules.values():
        dst = bundle / mod.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        if mod.name in stubs:
            dst.write_text(stubs[mod.name])
        else:
            shutil.copy2(work / mod.path, dst)
    data = src / "data"
    csrc = [p for p in (data / "csrc").iterdir() if p.is_file() and p.name.startswith(CSRC_PREFIXES)]
    search = [data / "include", data / "csrc"]
    for f in include_closure(csrc, search) | {p.resolve() for p in csrc}:
        rel = f.relative_to(data.resolve())
        if rel.parts[0] in ("include", "csrc"):
            dst = bundle / "flashinfer" / "data" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
    with tarfile.open(bundle / "flashinfer" / "data" / HEADER_ARCHIVE, "w:xz") as tar:
        for tree in HEADER_TREES:
            if (data / tree).is_dir():
                tar.add(data / tree, arcname=tree)

    # tvm-ffi and fla: whole packages
    _unzip(found["tvm_ffi"], bundle, "tvm_ffi")
    _unzip(found["fla_core"], bundle, "fla")
    _unzip(found["fla"], bundle, "fla")
    shutil.rmtree(work)

    manifest = {
        "pins": PINS,
        "apache-tvm-ffi": found["tvm_ffi"].name,
        "tvm_requirement": found["tvm_requirement"],
        "flashinfer_modules": len(modules),
        "stubbed": sorted(stubs),
        "device_python": DEVICE_PYTHON,
        "header_archive": HEADER_ARCHIVE,
    }
    manifest["bytes"] = _dir_size(bundle)
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if manifest["bytes"] > SIZE_BUDGET:
        raise BundleError(f"bundle is {manifest['bytes'] / 2**20:.1f} MiB, over the {SIZE_BUDGET / 2**20:.0f} MiB budget")
    return bundle


def build_ssu(outdir: Path, vllm_wheel: Path | None, trtllm_src: Path) -> Path:
    """Write `outdir/bundle/ssu` (vLLM's and TensorRT-LLM's Triton decode kernels, see the module doc).

    vllm_wheel: the vllm==SSU_PINS["vllm"] wheel (None: pip download it into outdir/wheels, ~500 MB);
    trtllm_src: a folder with TensorRT-LLM's selective_state_update.py and softplus.py. Returns the folder.
    """
    import hashlib

    outdir = outdir.resolve()
    if vllm_wheel is None:
        wheels = outdir / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        if not list(wheels.glob(f"vllm-{SSU_PINS['vllm']}-*.whl")):
            pip_download([f"vllm=={SSU_PINS['vllm']}"], wheels)
        vllm_wheel = _find_wheel(wheels, "vllm", SSU_PINS["vllm"])
    if f"-{SSU_PINS['vllm']}-" not in Path(vllm_wheel).name:
        raise BundleError(f"{Path(vllm_wheel).name} is not the vllm {SSU_PINS['vllm']} wheel the oracle was written against")
    ssu = outdir / "bundle" / "ssu"
    shutil.rmtree(ssu, ignore_errors=True)
    files: dict[str, dict[str, str]] = {"vllm": {}, "trtllm": {}}
    with zipfile.ZipFile(vllm_wheel) as z:
        names = [n for n in z.namelist() if n in VLLM_SSU_FILES or (n.startswith(VLLM_SSU_CONFIGS) and n.endswith(".json"))]
        if not set(VLLM_SSU_FILES) <= set(names):
            raise BundleError(f"{Path(vllm_wheel).name} lacks {sorted(set(VLLM_SSU_FILES) - set(names))}")
        for n in names:
            rel = n.removeprefix("vllm/model_executor/layers/mamba/ops/")
            dst = ssu / "vllm" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(z.read(n))
            files["vllm"][rel] = hashlib.sha256(dst.read_bytes()).hexdigest()
    for name in TRTLLM_SSU_FILES:
        src = Path(trtllm_src) / name
        if not src.is_file():
            raise BundleError(f"{src} is missing: give --trtllm-src a folder with {', '.join(TRTLLM_SSU_FILES)}")
        dst = ssu / "trtllm" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        files["trtllm"][name] = hashlib.sha256(dst.read_bytes()).hexdigest()
    man = {
        "vllm": {"version": SSU_PINS["vllm"], "source": f"PyPI wheel {Path(vllm_wheel).name}", "files": files["vllm"]},
        "trtllm": {
            "version": SSU_PINS["trtllm"],
            "source": "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/modules/mamba/ at that commit",
            "files": files["trtllm"],
        },
    }
    man["bytes"] = _dir_size(ssu)
    (ssu / MANIFEST).write_text(json.dumps(man, indent=1) + "\n")
    return ssu


def unpack_headers(bundle: Path) -> bool:
    """Unpack the header archive in place (once); returns True if it unpacked now."""
    data = Path(bundle) / "flashinfer" / "data"
    if (data / HEADER_MARKER).exists() or not (data / HEADER_ARCHIVE).exists():
        return False
    with tarfile.open(data / HEADER_ARCHIVE, "r:xz") as tar:
        tar.extractall(data, filter="data")
    (data / HEADER_MARKER).write_text("unpacked\n")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.engines.bundle", description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path, help="output folder; the bundle is OUTDIR/bundle")
    ap.add_argument("--wheels", type=Path, default=None, help="folder with the wheels (default OUTDIR/wheels)")
    ap.add_argument("--unpack", action="store_true", help="only unpack the header archive of OUTDIR/bundle")
    ap.add_argument("--ssu", action="store_true", help="only build OUTDIR/bundle/ssu (vLLM / TensorRT-LLM Triton kernels)")
    ap.add_argument("--vllm-wheel", type=Path, default=None, help="--ssu: the vllm wheel (default: pip download)")
    ap.add_argument("--trtllm-src", type=Path, default=None, help="--ssu: folder with TensorRT-LLM's kernel files")
    args = ap.parse_args(argv)
    if args.ssu:
        if args.trtllm_src is None:
            ap.error("--ssu needs --trtllm-src DIR (TensorRT-LLM's selective_state_update.py and softplus.py)")
        try:
            ssu = build_ssu(args.outdir, args.vllm_wheel, args.trtllm_src)
        except BundleError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"{ssu}: {json.loads((ssu / MANIFEST).read_text())['bytes'] / 2**10:.0f} KiB ({SSU_PINS})")
        return 0
    if args.unpack:
        done = unpack_headers(args.outdir / "bundle")
        print("headers unpacked" if done else "headers already unpacked (or no archive)")
        return 0
    try:
        bundle = build(args.outdir, args.wheels)
    except BundleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    manifest = json.loads((bundle / MANIFEST).read_text())
    print(f"{bundle}: {manifest['bytes'] / 2**20:.1f} MiB; put it on PYTHONPATH ({manifest['pins']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
