"""The largest --steps that fits, named when a run is refused for memory (sizing.check_memory)."""

from __future__ import annotations

import re

import pytest
import torch

from ssmquant.sizing import (
    GIB,
    METRIC_BYTES_PER_LOGIT,
    METRIC_CHUNK_BYTES,
    SizingError,
    analyze_memory,
    check_memory,
    largest_fitting_steps,
    layer_dims,
    layer_major_memory,
    metric_chunk_rows,
)


def test_largest_fitting_steps_bisects_a_monotone_need():
    need = lambda s: 100 + 7 * s  # noqa: E731
    assert largest_fitting_steps(need, 100 + 7 * 1234, 10_000) == 1234
    assert largest_fitting_steps(need, 99, 10_000) == 0
    assert largest_fitting_steps(need, 10**9, 50) == 49  # below the run's own steps, which did not fit


def _nano_gpu_estimate(steps: int):
    # Nemotron-3-Nano's Mamba-2 layer, six variants in one launch, synthetic inputs made ahead on the GPU: the
    # run of the H200 refusal (its "drawing them (one sequence's fp32 buffers)" grows with the steps alone)
    return analyze_memory(
        layer_dims("mamba2", 64, 64, 128, 8), batch=8, steps=steps, variants=6, recorded=max(1, steps // 16),
        device=torch.device("cuda"), backend="triton", ahead=True,
    )  # fmt: skip


def test_a_refused_gpu_run_names_steps_that_fit_when_parts_grow_with_the_steps_alone():
    room = int(139.3 * GIB)
    with pytest.raises(SizingError) as refused:
        check_memory(_nano_gpu_estimate(10_000_000), batch=8, steps=10_000_000, free=lambda d: room,
                     at_steps=_nano_gpu_estimate)  # fmt: skip
    fit = int(re.search(r"at most ~(\d+) steps fit at batch 8", str(refused.value)).group(1))
    assert _nano_gpu_estimate(fit).total("device") <= room < _nano_gpu_estimate(fit + 1).total("device")
    # the extrapolation from the batch x steps parts alone counted those parts as fixed: no steps named
    with pytest.raises(SizingError, match=r"lower the batch first"):
        check_memory(_nano_gpu_estimate(10_000_000), batch=8, steps=10_000_000, free=lambda d: room)


def test_the_layer_modes_metrics_stay_within_one_chunk_of_positions():
    """sizing.layer_major_memory: the logits and float64 metrics take one chunk of positions (metric_chunk_rows) at any
    batch x positions; the activations and hidden states grow with them (Nemotron-3-Nano's sizes, 131072 tokens)."""
    config = {"hidden_size": 2688, "intermediate_size": 1856, "chunk_size": 128}
    dims = layer_dims("mamba2", 64, 64, 128, 8)

    def parts(tokens):
        est = layer_major_memory(dims, config, batch=8, tokens=tokens, vocab=131072, device=torch.device("cuda"))
        return {label: nbytes for label, _, nbytes in est.parts}

    short, long = parts(2048), parts(32768)
    metrics = "one chunk of positions' logits and float64 metrics"
    assert short[metrics] == long[metrics] <= METRIC_CHUNK_BYTES
    assert metric_chunk_rows(131072) * 131072 * METRIC_BYTES_PER_LOGIT <= METRIC_CHUNK_BYTES
    assert long["the forward's activations"] == 16 * short["the forward's activations"]
    assert long["the final hidden states of the reference and the variants"] == 8 * 32768 * 2 * 2688 * 4
