"""Process start-up and exit of the command line: overlap the CUDA context's creation and Triton's first-call work
with the imports, and end a command that succeeded without the interpreter's teardown. Nothing here changes a
result; it only moves time off the critical path."""

from __future__ import annotations

import importlib.util
import os
import sys


def finish(done: SystemExit) -> None:
    """End the process after a command: a command that succeeded exits without the interpreter's teardown
    (unloading torch, Triton and CUDA's context: a large part of a short GPU run's wall clock); every command has
    written and renamed its files, joined its worker threads and printed its output by then, and only stdout and
    stderr remain to flush. Any other status is raised again."""
    if done.code in (0, None):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    raise done


def start_devices(device: str) -> None:
    """Create the CUDA context in a background thread while the command imports the rest (pandas, Triton,
    the analysis modules): torch's ops release the GIL, so the driver's start-up overlaps the imports. torch
    itself is imported here, in the calling thread, before that thread starts.

    Triton's warm-up (``_warm_up_triton``) runs in a thread of its own, started before torch's import where an
    NVIDIA GPU is likely (``_likely_nvidia_gpu``: no torch needed to tell), else once torch sees a GPU. Its
    import of ``triton.runtime.cache`` does not import torch, nor does torch's import import Triton, so the two
    imports cannot wait on each other; should the command's own import of Triton meet it, Python's per-module
    import locks make one wait for the other. Started after torch's import, it would race the first launch, which then
    spends its host time reading and hashing libtriton.so (lab/DESIGN_NOTES.md). Errors are left to the command's
    own device checks, which name the problem."""
    if device == "cpu":
        return
    import threading

    def warm_triton():
        try:
            _warm_up_triton()
        except Exception:  # noqa: BLE001, S110 - the first launch computes it, or fails with its own message
            pass

    early = _likely_nvidia_gpu()
    if early:
        # before torch's import, which takes seconds and holds the GIL while the hash does not: the hash is done
        # by the first launch instead of racing it
        threading.Thread(target=warm_triton, name="ssmquant-triton-key", daemon=True).start()

    import torch

    def start():
        try:
            if torch.cuda.is_available():
                if not early:
                    threading.Thread(target=warm_triton, name="ssmquant-triton-key", daemon=True).start()
                dev = torch.device(device) if device.startswith("cuda:") else torch.device("cuda", 0)
                torch.zeros(1, device=dev)
        except Exception:  # noqa: BLE001, S110 - reported by the command itself
            pass

    threading.Thread(target=start, name="ssmquant-cuda-start", daemon=True).start()


def _likely_nvidia_gpu() -> bool:
    """Whether an NVIDIA GPU is likely usable, judged without importing torch: the driver's control device
    exists, CUDA_VISIBLE_DEVICES does not hide every GPU, and Triton is installed. Used to start Triton's warm-up
    before torch's import; a wrong guess costs a background hash on an idle core, never a result."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") and importlib.util.find_spec("triton") is not None


def _warm_up_triton() -> None:
    """Compute what Triton's first kernel call in a process computes whatever the kernel: the hash of Triton's
    own installation that keys its cache (``triton.runtime.cache.triton_key``, Triton >= 3.3: a SHA-256 of its
    compiler sources and of libtriton.so, about 500 MB; 0.28 s on the 2-core CPU machine), cached for the
    process by ``functools.lru_cache``. Called from a thread of ``_start_cuda``: hashing and reading release the
    GIL, so it overlaps the command's imports, the CUDA context's creation and the first layer's inputs.
    Should the first launch come first, it computes the same value itself; nothing depends on this having run."""
    from triton.runtime.cache import triton_key

    triton_key()
