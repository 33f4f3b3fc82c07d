"""The shipped tiny models: they load offline through the same loader as any checkpoint, are the trained
weights (they reproduce the held-out loss recorded at training time), and work end to end."""

import json
import math

import pytest
import torch

from ssmquant.models import SHIPPED_MODELS, available_shipped_models, load_model, ssm_layout
from ssmquant.models.text import CORPUS_PATH

SHIPPED = sorted(SHIPPED_MODELS)


def test_the_shipped_models_are_installed():
    assert set(available_shipped_models()) == {"tiny-nemotron", "tiny-qwen", "tiny-kda"}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_reproduces_its_recorded_heldout_loss(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(name, device="cpu")
    assert loaded.source.kind == "shipped" and loaded.dtype == torch.float32
    record = json.loads((available_shipped_models()[name] / "eval.json").read_text())
    proto = record["protocol"]
    data = CORPUS_PATH.read_bytes()
    assert len(data) == proto["text_bytes"]
    total, count = 0.0, 0
    with torch.no_grad():
        for off in proto["offsets"]:
            ids = torch.tensor(list(data[off : off + proto["length"]]), dtype=torch.long)[None]
            logits = loaded.model(input_ids=ids, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            total += float(nll)
            count += ids.shape[1] - 1
    nats = total / count
    # the training script measured this on the saved bf16 weights in fp32; a different CPU / torch
    # changes only the summation order
    assert abs(nats - record["loss_nats_per_byte"]) < 1e-3 * record["loss_nats_per_byte"]
    assert nats / math.log(2) < 2.0  # far below the ~4.4 bits/byte of a unigram model


@pytest.mark.parametrize(
    "name,kind,layers",
    [
        ("tiny-nemotron", "mamba2", (0, 2, 4, 6, 8)),
        ("tiny-qwen", "gdn", (0, 1, 2, 4, 5, 6)),
        ("tiny-kda", "kda", (0, 1, 2, 4, 5, 6)),
    ],
)
def test_shipped_model_layout(name, kind, layers):
    layout = ssm_layout(load_model(name, device="cpu", with_tokenizer=False).model.config)
    assert layout["layer_kind"] == kind and layout["ssm_layers"] == layers
