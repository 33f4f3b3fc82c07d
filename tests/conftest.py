"""Shared test settings: deterministic seeds, and the device the GPU variants of tests run on."""

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*transformers .* is not tested with current version of modelopt.*")

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
