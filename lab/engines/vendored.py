"""Load the engines' own Triton decode kernels from the bundle, with the few import shims they need.

vLLM and TensorRT-LLM cannot be installed on the GPU machine (no network; vLLM's wheel is hundreds of
MB with compiled extensions, TensorRT-LLM's comes only from NVIDIA's index), but their Mamba-2 decode
kernel is one pure-Triton file each, both descendants of mamba_ssm 2.2.4's `selective_state_update`:

- vLLM 0.33.0 `vllm/model_executor/layers/mamba/ops/mamba_ssm.py` (+ `triton_helpers.py` for
  `fast_exp`, and the tuned launch configs `configs/selective_state_update/*.json`), the kernel of
  `--mamba-backend triton` (the default; `ssu_dispatch.TritonSSUBackend`);
- TensorRT-LLM main@1d2bb3b `tensorrt_llm/_torch/modules/mamba/selective_state_update.py` (+ `softplus.py`),
  the kernel `Mamba2Mixer` calls for decode.

`lab.engines.bundle.build_ssu` copies these files, unmodified except a trimmed TensorRT-LLM tail,
into `BUNDLE/ssu/` with their sha256 in `ssu/MANIFEST.json`. Here their package imports are answered
by small in-memory modules (a logger, `current_platform` saying "CUDA", `NULL_BLOCK_ID = 0`,
`PAD_SLOT_ID = -1`, no tuned-config folder override); the kernels themselves run as shipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

SSU_DIR = "ssu"
SSU_MANIFEST = "MANIFEST.json"
# The sources the shims answer for, by engine: (package of the kernel module, module file, extra files).
VLLM_OPS = "vllm.model_executor.layers.mamba.ops"
TRTLLM_MAMBA = "tensorrt_llm._torch.modules.mamba"
SSU_FILES = {
    "vllm": ("mamba_ssm.py", "triton_helpers.py"),
    "trtllm": ("selective_state_update.py", "softplus.py"),
}
BUNDLE_SSU_HINT = (
    "build it with `python -m lab.engines.bundle OUTDIR --ssu --vllm-wheel WHEEL --trtllm-src DIR` and put "
    "OUTDIR/bundle on PYTHONPATH (or set SSMQUANT_SSU=OUTDIR/bundle/ssu)"
)


class VendoredError(RuntimeError):
    """An engine kernel source that is missing, altered, or cannot be loaded (one line, with the fix)."""


def find_ssu_dir() -> Path:
    """The `ssu` folder of a bundle: $SSMQUANT_SSU, else the first sys.path entry holding ssu/MANIFEST.json."""
    import os

    env = os.environ.get("SSMQUANT_SSU")
    cands = [Path(env)] if env else [Path(p) / SSU_DIR for p in sys.path if p]
    for c in cands:
        if (c / SSU_MANIFEST).is_file():
            return c
    where = f"$SSMQUANT_SSU={env}" if env else "no sys.path entry"
    raise VendoredError(f"the vLLM / TensorRT-LLM decode kernels are not bundled ({where} has ssu/{SSU_MANIFEST}); {BUNDLE_SSU_HINT}")


def manifest(ssu: Path) -> dict:
    return json.loads((ssu / SSU_MANIFEST).read_text())


def _check_files(ssu: Path, engine: str) -> dict:
    man = manifest(ssu)
    if engine not in man:
        raise VendoredError(f"{ssu / SSU_MANIFEST} lists no {engine} sources; {BUNDLE_SSU_HINT}")
    for rel, digest in man[engine]["files"].items():
        path = ssu / engine / rel
        if not path.is_file():
            raise VendoredError(f"{path} is missing; {BUNDLE_SSU_HINT}")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise VendoredError(f"{path} differs from the sha256 in {SSU_MANIFEST}; rebuild the bundle")
    return man[engine]


class _Logger:
    """vllm.logger's interface (info_once / warning_once with `scope=`), on the standard logging module."""

    def __init__(self, name: str):
        self._log = logging.getLogger(name)

    def __getattr__(self, level: str):
        base = level.removesuffix("_once")
        fn = getattr(self._log, base)
        return lambda msg, *args, **kw: fn(msg, *args)


class _Platform:
    """The part of vllm.platforms.current_platform that mamba_ssm.py reads: a CUDA platform."""

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


def _package(name: str, path: list[str] | None = None, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = path or []
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _parents(dotted: str) -> None:
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            _package(name)


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _claim(top: str) -> None:
    """Refuse to shadow a real installed package with the shims."""
    mod = sys.modules.get(top)
    if mod is not None and not getattr(mod, "_ssmquant_shim", False):
        raise VendoredError(f"a real `{top}` package is imported; the bundled kernel is loaded only where {top} is absent")
    if mod is None and importlib.util.find_spec(top) is not None:
        raise VendoredError(f"`{top}` is installed here; run the oracle where it is not, or use the installed engine")


_LOADED: dict[str, Callable] = {}


def load_vllm_ssu(ssu: Path | None = None) -> Callable:
    """vLLM 0.33.0's Triton `selective_state_update` (mamba_ssm.py), loaded from the bundle."""
    if "vllm" in _LOADED:
        return _LOADED["vllm"]
    import triton
    import triton.language as tl

    ssu = ssu or find_ssu_dir()
    _check_files(ssu, "vllm")
    _claim("vllm")
    root = _package("vllm", _ssmquant_shim=True)
    sys.modules["vllm.envs"] = types.SimpleNamespace(VLLM_TUNED_CONFIG_FOLDER=None)
    root.envs = sys.modules["vllm.envs"]
    root._custom_ops = _package("vllm._custom_ops")
    _package("vllm.logger", init_logger=_Logger)
    _package("vllm.platforms", current_platform=_Platform())
    _package("vllm.triton_utils", HAS_TRITON=True, tl=tl, triton=triton)
    _parents("vllm.utils.platform_utils")
    import re

    _package(
        "vllm.utils.platform_utils",
        get_device_name_as_file_name=lambda device_id=0: re.sub(r"[\s/]+", "_", _Platform().get_device_name(device_id)),
    )
    _parents("vllm.v1.attention.backends.utils")
    _package("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=0)  # vllm/v1/attention/backends/utils.py @ 0.33.0
    _parents(VLLM_OPS + ".x")
    sys.modules[VLLM_OPS].__path__ = [str(ssu / "vllm")]
    mod = _exec_file(VLLM_OPS + ".mamba_ssm", ssu / "vllm" / "mamba_ssm.py")
    _LOADED["vllm"] = mod.selective_state_update
    return mod.selective_state_update


def load_trtllm_ssu(ssu: Path | None = None) -> Callable:
    """TensorRT-LLM's Triton `selective_state_update` (tensorrt_llm/_torch/modules/mamba), from the bundle."""
    if "trtllm" in _LOADED:
        return _LOADED["trtllm"]
    ssu = ssu or find_ssu_dir()
    _check_files(ssu, "trtllm")
    _claim("tensorrt_llm")
    _package("tensorrt_llm", _ssmquant_shim=True)
    _parents(TRTLLM_MAMBA + ".x")
    # tensorrt_llm/_torch/modules/mamba/__init__.py: PAD_SLOT_ID = -1
    _package(TRTLLM_MAMBA, [str(ssu / "trtllm")], PAD_SLOT_ID=-1)
    mod = _exec_file(TRTLLM_MAMBA + ".selective_state_update", ssu / "trtllm" / "selective_state_update.py")
    _LOADED["trtllm"] = mod.selective_state_update
    return mod.selective_state_update


@contextlib.contextmanager
def cpu_device_guard(device: torch.device):
    """TensorRT-LLM's wrapper enters `torch.cuda.device(x.device.index)`, which fails for a CPU tensor; under
    the Triton interpreter (CPU tensors) that context is made a no-op. On a GPU nothing changes."""
    if device.type != "cpu":
        yield
        return
    real = torch.cuda.device
    torch.cuda.device = lambda index: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.device = real
