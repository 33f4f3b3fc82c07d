"""Tiny random-init byte-level hybrid checkpoints for the end-to-end evaluation tests.

Built from configs, with the SSM parameters redrawn so that the state carries signal (see
``tests/models/conftest.py``), saved with save_pretrained and loaded through ``load_model`` on CPU, as a
user's checkpoint is. Byte vocabulary (256 ids, no tokenizer files: the loader picks ``ByteTokenizer``).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.conftest import _KDA_TEXT, _NEMOTRON, _QWEN_TEXT, _save, save_kimi_linear

BYTE_VOCAB = 256
# time_step_min as the real models set it: NemotronH's prefill clamps dt at it and its decode path does not.
NEMOTRON = dict(_NEMOTRON, vocab_size=BYTE_VOCAB, time_step_min=1e-3)
QWEN = dict(_QWEN_TEXT, vocab_size=BYTE_VOCAB)
KDA = dict(_KDA_TEXT, vocab_size=BYTE_VOCAB)


@pytest.fixture(scope="session")
def nemotron_byte_dir(tmp_path_factory):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(11)
    return _save(NemotronHForCausalLM(NemotronHConfig(**NEMOTRON)), tmp_path_factory.mktemp("e2e_nemotron"), 11)


@pytest.fixture(scope="session")
def qwen_byte_dir(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(12)
    return _save(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN)), tmp_path_factory.mktemp("e2e_qwen"), 12)


@pytest.fixture(scope="session")
def kimi_byte_dir(tmp_path_factory):
    """A KDA model (KimiLinearForCausalLM: 3 KDA + 1 MLA) with a byte vocabulary."""
    return save_kimi_linear(KDA, tmp_path_factory.mktemp("e2e_kimi"), 13)


@pytest.fixture(scope="session")
def kimi(kimi_byte_dir):
    from ssmquant.models import load_model

    return load_model(kimi_byte_dir, device="cpu")


@pytest.fixture(scope="session")
def nemotron(nemotron_byte_dir):
    from ssmquant.models import load_model

    return load_model(nemotron_byte_dir, device="cpu")


@pytest.fixture(scope="session")
def qwen(qwen_byte_dir):
    from ssmquant.models import load_model

    return load_model(qwen_byte_dir, device="cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny per-step ops: one thread avoids thread hand-offs that dominate on a busy host (as `evaluate` does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
