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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
