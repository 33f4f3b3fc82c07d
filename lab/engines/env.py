"""Is a real engine kernel runnable here? One clear line when it is not, naming what to get and how."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .bundle import PINS, unpack_headers

BUNDLE_HINT = "build the bundle with `python -m lab.engines.bundle OUTDIR` and put OUTDIR/bundle on PYTHONPATH"
MIN_CAPABILITY = (8, 0)  # checkpointing_ssu.py: "all kernel variants need cp.async + mma.sync.m16n8k16 -> SM80+"

ENGINES = {
    "flashinfer": ("flashinfer.mamba", "flashinfer-python", PINS["flashinfer-python"]),
    "fla": ("fla.ops.gated_delta_rule", "flash-linear-attention", PINS["flash-linear-attention"]),
}


@dataclass(frozen=True)
class EngineStatus:
    name: str
    ok: bool
    reason: str  # one line; "" when ok
    version: str | None = None


def _version(package_module) -> str | None:
    root = importlib.import_module(package_module.__name__.split(".")[0])
    v = getattr(root, "__version__", None)
    if v is None and root.__name__ == "flashinfer":
        v = importlib.import_module("flashinfer.version").__version__
    return v


def engine_status(name: str) -> EngineStatus:
    """Whether engine `name` ("flashinfer" or "fla") can run its decode kernels on this machine."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; accepted: {', '.join(ENGINES)}")
    module, dist, pin = ENGINES[name]
    if not torch.cuda.is_available():
        return EngineStatus(name, False, f"{dist} kernels need a CUDA GPU; none is visible to torch")
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return EngineStatus(
            name, False, f"{dist} kernels need compute capability >= 8.0 (cp.async, mma.sync); this GPU is {cap}"
        )
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure is reported as one line
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return EngineStatus(name, False, f"{dist}=={pin} is not importable ({first}); {BUNDLE_HINT}")
    version = _version(mod)
    if version != pin:
        return EngineStatus(
            name, False, f"{dist} is version {version}, the oracles are written against {pin}; {BUNDLE_HINT}", version
        )
    if name == "flashinfer":
        unpack_headers(Path(importlib.import_module("flashinfer").__file__).parent.parent)
        import shutil

        if shutil.which("nvcc") is None:
            return EngineStatus(name, False, "FlashInfer compiles its mamba kernels with nvcc at first use; nvcc is not on PATH")
    return EngineStatus(name, True, "", version)


def require(name: str) -> EngineStatus:
    """engine_status(name), raising RuntimeError with its one-line reason when the engine cannot run."""
    st = engine_status(name)
    if not st.ok:
        raise RuntimeError(st.reason)
    return st
