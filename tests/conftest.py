"""Shared test settings: deterministic seeds, and the device the GPU variants of tests run on."""

import os
import warnings

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable must be set before any
# kernel is decorated, i.e. before ssmquant.kernels is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

warnings.filterwarnings("ignore", message=".*transformers .* is not tested with current version of modelopt.*")

HAS_CUDA = torch.cuda.is_available()

# pytest-xdist runs one worker per core (`-n 2` on CI's 2 cores); torch's intra-op threads on top of that
# oversubscribe the cores (measured on 2 cores, four of the slowest files: 188 s with torch's default threads,
# 130 s with one per worker). Subprocesses the tests start inherit the count through OMP_NUM_THREADS.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS:
    _threads = max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
