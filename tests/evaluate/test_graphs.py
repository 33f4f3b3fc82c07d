"""Segment graphs of the decode step (evaluate/graphs.py), on the CPU with a backend that replays eagerly.

The plumbing is what these tests check: the head block runs its segment on a static input buffer, followers
pass through, graphs are keyed by the cache's state pointers (a re-indexed cache gets new ones), the warm-up
call runs the step once, recording runs nothing, and the blocks' forwards are restored afterwards. Recording
itself (torch.cuda.graph) needs a GPU: lab/gpu/eval_speed.sh compares graphed and eager runs there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssmquant.evaluate import EvalConfig, TeacherForced, evaluate
from ssmquant.evaluate import run as run_module
from ssmquant.evaluate.graphs import SegmentGraphs, graph_refusal, segments_of


class EagerReplay:
    """``CudaCapture``'s interface on the CPU: warm runs fn; capture runs nothing, and every replay runs fn
    (reading the static input) into one output tensor, as a graph replay rewrites its output."""

    def __init__(self):
        self.captured = 0

    def warm(self, fn):
        return fn()

    def capture(self, fn, like):
        self.captured += 1
        out = torch.empty_like(like)
        return (lambda: out.copy_(fn())), out


def test_segments_are_the_runs_between_attention_layers():
    kinds = ["linear_attention", "mlp", "full_attention", "linear_attention", "moe", "mlp", "linear_attention"]
    assert segments_of(kinds) == [[0, 1], [3], [5, 6]]
    assert segments_of(["full_attention"]) == []


def test_graph_refusal_names_the_reason(nemotron, qwen):
    assert "not on one CUDA device" in graph_refusal(nemotron.model)
    assert "not a NemotronH model" in graph_refusal(qwen.model)


def _decode(net, ids, steps, expand_after_step0=False):
    run = TeacherForced(net, ids)
    out = []
    for t in range(steps):
        logits = run.step(t)
        if t == 0 and expand_after_step0:
            index = torch.arange(ids.shape[0]).repeat(2)
            run.expand(index)
            logits = logits[index]
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.gpu
def test_graphed_decode_gives_the_eager_bits(nemotron, expand):
    net = nemotron.model
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        eager = _decode(net, ids, 8, expand)
        backend = EagerReplay()
        with SegmentGraphs(net, backend) as graphs:
            assert [len(s.blocks) for s in graphs.segments] == [1, 3]  # "M*M-M": [M], [M, -, M]
            graphed = _decode(net, ids, 8, expand)
        assert all("forward" not in b.__dict__ for b in net.model.layers)  # the class forwards again
        again = _decode(net, ids, 8, expand)
    assert torch.equal(graphed, eager) and torch.equal(again, eager)
    # step 0 (empty cache) eager, step 1 the warm-up, step 2 records; steps 2..7 replay, per segment
    assert graphs.stats["graphs"] == backend.captured == 2
    assert graphs.stats["replays"] == 2 * 6 and graphs.stats["warm_calls"] == 2
    assert graphs.broken == []


@pytest.mark.gpu
def test_a_new_cache_gets_its_own_graphs(nemotron):
    net = nemotron.model
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), SegmentGraphs(net, EagerReplay()) as graphs:
        a = _decode(net, ids, 5)
        b = _decode(net, ids, 5)  # another cache: other state tensors, so other keys
    assert torch.equal(a, b)
    assert graphs.stats["graphs"] == 4


def test_a_multi_token_forward_runs_eagerly(nemotron):
    net = nemotron.model
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        eager = net(input_ids=ids).logits
        with SegmentGraphs(net, EagerReplay()) as graphs:
            got = net(input_ids=ids).logits
    assert torch.equal(got, eager)
    assert graphs.stats["graphs"] == 0 and graphs.stats["eager_calls"] == 2


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.gpu
def test_evaluate_with_graphs_gives_the_same_tables(nemotron, monkeypatch, fold):
    variants = ["fp8_e4m3@conventional", "int8@replay4"]
    plain = evaluate(EvalConfig(nemotron, variants, steps=10, batch=2, seed=1, fold=fold, cuda_graphs=False))
    monkeypatch.setattr(run_module, "graph_refusal", lambda net: None)
    monkeypatch.setattr(run_module, "backend_for", lambda device: EagerReplay())
    graphed = evaluate(EvalConfig(nemotron, variants, steps=10, batch=2, seed=1, fold=fold))
    cols = ["kl", "top1_agree", "delta_loss"]
    assert np.array_equal(graphed.positions[cols].to_numpy(), plain.positions[cols].to_numpy())
    assert graphed.reference == plain.reference
    assert graphed.config.cuda_graphs and not plain.config.cuda_graphs
    assert graphed.timing["cuda_graphs"]["replays"] > 0


def test_required_graphs_are_refused_with_the_reason(nemotron):
    from ssmquant.evaluate import EvalError

    with pytest.raises(EvalError, match="cuda_graphs was requested but the model's weights sit on"):
        evaluate(EvalConfig(nemotron, ["int8@conventional"], steps=4, batch=2, cuda_graphs=True))
