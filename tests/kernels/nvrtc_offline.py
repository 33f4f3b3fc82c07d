"""CUDA source compiled without a GPU: NVRTC from the nvidia-cuda-nvrtc wheel (a dev dependency), through ctypes.

Used by tests/kernels/test_kda_cuda.py (the kernel compiles for sm_90 without spilling) and
benchmarks/sass.py (its machine code, to count instructions).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import pathlib


@functools.cache
def nvrtc_library():
    """libnvrtc of the wheel, with its builtins loaded first (libnvrtc opens them by name), or None without it."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        libs = sorted(pathlib.Path(root).glob("cu*/lib/libnvrtc.so.*"))
        builtins = sorted(pathlib.Path(root).glob("cu*/lib/libnvrtc-builtins.so.*"))
        if libs and builtins:
            ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(libs[0]))
    return None


def nvrtc_compile(source: str, options: list[str], arch: str = "sm_90") -> tuple[int, str, bytes | None]:
    """(NVRTC's result code, its log, the cubin or None on failure) of compiling ``source`` for ``arch``."""
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}", *options]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    cubin = None
    if rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
        cubin = out.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(), cubin
