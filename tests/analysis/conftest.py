"""A tiny byte-level NemotronH checkpoint (random init, energised SSM parameters) for analyze tests."""

import pytest
import torch

from ..models.conftest import _NEMOTRON, energise


@pytest.fixture(scope="session")
def byte_nemotron_dir(tmp_path_factory):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(5)
    model = NemotronHForCausalLM(NemotronHConfig(**dict(_NEMOTRON, vocab_size=256)))
    energise(model, 5)
    path = tmp_path_factory.mktemp("byte_nemotron")
    model.save_pretrained(path)
    return path
