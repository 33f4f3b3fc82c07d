"""TeacherForced with the attention layers' KV caches in preallocated buffers (decode.KVBuffer) against
transformers' DynamicLayer, which grows by concatenation: the same logits bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicLayer

from ssmquant.evaluate import EvalConfig, TeacherForced, evaluate
from ssmquant.evaluate.decode import KVBuffer
from ssmquant.models.text import calibration_batch

STEPS = 12


def _logits(loaded, ids, buffer: bool, index=None, capacity=None) -> tuple[torch.Tensor, list]:
    run = TeacherForced(loaded.model, ids)
    out = []
    with torch.inference_mode():
        for t in range(STEPS):
            logits = run.step(t)
            if t == 0 and index is not None:
                run.expand(index)
                logits = logits[index]
            if t == 0 and buffer:
                assert run.preallocate_kv() > 0
                if capacity is not None:
                    for layer in run.cache.layers:
                        if isinstance(layer, KVBuffer):
                            layer.capacity = capacity
            out.append(logits)
    return torch.stack(out), [type(layer) for layer in run.cache.layers]


@pytest.mark.parametrize("model", ["nemotron", "qwen"])
def test_kv_buffer_gives_the_same_logits(model, request):
    loaded = request.getfixturevalue(model)
    ids = calibration_batch(2, STEPS + 1, tokenizer=loaded.tokenizer, split="heldout")
    plain, plain_types = _logits(loaded, ids, buffer=False)
    buffered, types = _logits(loaded, ids, buffer=True)
    assert DynamicLayer in plain_types and KVBuffer in types and DynamicLayer not in types
    assert torch.equal(plain, buffered)
    # re-indexed after step 0 (folding: reorder_cache replaces the keys), and a capacity too small (re-allocation)
    index = torch.tensor([0, 1, 1, 0])
    plain, _ = _logits(loaded, ids, buffer=False, index=index)
    for capacity in (None, 3):
        buffered, _ = _logits(loaded, ids, buffer=True, index=index, capacity=capacity)
        assert torch.equal(plain, buffered), capacity


def test_evaluate_with_and_without_the_kv_buffer(nemotron):
    variants = ["int8@conventional", "nvfp4@replay4"]
    with_buffer = evaluate(EvalConfig(nemotron, variants, steps=10, batch=2, seed=1, fold=True, kv_buffer=True))
    concat = evaluate(EvalConfig(nemotron, variants, steps=10, batch=2, seed=1, fold=True))  # the default: growing cache
    cols = ["kl", "top1_agree", "delta_loss"]
    assert (with_buffer.positions.kl > 0).sum() > 5
    np.testing.assert_array_equal(with_buffer.positions[cols].to_numpy(), concat.positions[cols].to_numpy())
    assert with_buffer.config.kv_buffer and not concat.config.kv_buffer
