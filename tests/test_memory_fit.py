"""The largest --steps that fits, named when a run is refused for memory (sizing.check_memory)."""

from __future__ import annotations

import re

import pytest
import torch

from ssmquant.sizing import (
    GIB,
    METRIC_BYTES_PER_LOGIT,
    METRIC_CHUNK_BYTES,
    AttentionDims,
    SizingError,
    analyze_memory,
    attention_score_bytes,
    check_memory,
    largest_fitting_steps,
    layer_dims,
    layer_major_memory,
    metric_chunk_rows,
    prefill_layer_peak,
    scan_pair_bytes,
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
    bf16 = layer_major_memory(dims, config, batch=8, tokens=32768, vocab=131072, device=torch.device("cuda"),
                              hidden_bytes=2)  # fmt: skip
    assert dict((label, n) for label, _, n in bf16.parts)["the final hidden states of the reference and the variants"] \
        == 8 * 32768 * 2 * 2688 * 2


# tiny-kda's attention: 2 MLA layers of 4 heads, query / key head dim 48 against value 32, under sdpa
TINY_KDA_ATTENTION = AttentionDims(layers=2, heads=4, implementation="sdpa", value_dim_differs=True)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_attention_scores_of_a_prefill_are_one_layers_heads_x_l2_fp32_x3_where_materialised():
    """sizing.attention_score_bytes: heads x L^2 x 4 bytes x 3 copies for one sequence (one layer live at a time),
    on the CPU where sdpa takes its math path (MLA's unequal head dims) and wherever attention is eager; nothing where
    the model has no attention layer, under sdpa on CUDA (flash / memory-efficient kernels) or under sdpa on the CPU
    with equal head dims (torch's CPU flash kernel)."""
    assert attention_score_bytes(TINY_KDA_ATTENTION, 12288, CPU) == 4 * 12288**2 * 4 * 3  # 6.75 GiB
    assert attention_score_bytes(TINY_KDA_ATTENTION, 8192, CPU) == 4 * attention_score_bytes(TINY_KDA_ATTENTION, 4096, CPU)
    assert attention_score_bytes(TINY_KDA_ATTENTION, 12288, CUDA) == 0
    eager = AttentionDims(layers=2, heads=4, implementation="eager")
    assert attention_score_bytes(eager, 1000, CUDA) == attention_score_bytes(eager, 1000, CPU) == 4 * 1000**2 * 12
    unknown = AttentionDims(layers=2, heads=4, implementation=None)
    assert attention_score_bytes(unknown, 1000, CUDA) == 4 * 1000**2 * 12  # counted as eager
    assert attention_score_bytes(AttentionDims(layers=2, heads=4, implementation="sdpa"), 12288, CPU) == 0
    assert attention_score_bytes(AttentionDims(layers=0, heads=4, implementation="eager"), 12288, CPU) == 0
    assert attention_score_bytes(None, 12288, CPU) == 0


def test_kdas_torch_scan_holds_three_chunk_x_heads_x_dk_decays_per_token_and_the_larger_layer_peak_counts(monkeypatch):
    """sizing.scan_pair_bytes: KDA's torch prefill scan holds decay_mask [chunk, chunk, Dk] per chunk and head and two
    products of its size (3 x chunk x H x Dk fp32 per token); Mamba-2 and GDN hold none; where fla's kernel runs (CUDA
    with fla installed) KDA holds none either. prefill_layer_peak takes the larger of it and one attention layer's
    scores: different layers hold them."""
    from ssmquant import kinds

    kda, config = layer_dims("kda", 4, 64, 64, 4), {"hidden_size": 256}
    assert scan_pair_bytes(kda, config, 2048, CPU) == 2048 * 4 * 3 * 64 * 4 * 64
    assert scan_pair_bytes(kda, dict(config, chunk_size=32), 2048, CPU) == 2048 * 4 * 3 * 32 * 4 * 64
    assert scan_pair_bytes(layer_dims("gdn", 4, 64, 64, 2), config, 2048, CPU) == 0
    assert scan_pair_bytes(layer_dims("mamba2", 8, 64, 128, 2), config, 2048, CPU) == 0
    monkeypatch.setattr(type(kinds.get("kda")), "fused_prefill_package", "no_such_package_for_ssmquant")
    assert scan_pair_bytes(kda, config, 2048, CUDA) == 2048 * 4 * 3 * 64 * 4 * 64  # torch's scan on CUDA too
    monkeypatch.setattr(type(kinds.get("kda")), "fused_prefill_package", "torch")  # an importable package
    assert scan_pair_bytes(kda, config, 2048, CUDA) == 0
    assert prefill_layer_peak(kda, config, TINY_KDA_ATTENTION, 2048, CPU) == ("pairs", 2048 * 4 * 3 * 64 * 4 * 64)
    assert prefill_layer_peak(kda, config, TINY_KDA_ATTENTION, 12288, CPU) == ("scores", 4 * 12288**2 * 12)
    assert prefill_layer_peak(layer_dims("gdn", 4, 64, 64, 2), config, None, 2048, CPU) == ("scores", 0)


def test_the_prefill_estimates_count_the_attention_scores_and_a_refusal_names_them():
    """analyze_memory's one-sequence prefill of the capture and layer_major_memory's forward of `batch` sequences add
    the scores (quadratic in the positions) on the pool the prefill runs on; a refusal names them."""
    dims = layer_dims("kda", 4, 64, 64, 4)
    config = {"hidden_size": 256, "intermediate_size": 256}
    kw = dict(batch=8, steps=4096, variants=1, recorded=256, device=CPU, backend="torch", prefill=config, prompt=8192)
    plain, scored = analyze_memory(dims, **kw), analyze_memory(dims, attention=TINY_KDA_ATTENTION, **kw)
    label = "attention scores of the capture's prefill (one sequence; one layer's [heads, L, L] fp32 x 3)"
    assert dict((lbl, b) for lbl, _, b in scored.parts)[label] == 4 * 12288**2 * 12
    # without attention layers, KDA's scan decays are the prefill's largest one-layer part; with them, the scores
    assert scored.total("host") - plain.total("host") == 4 * 12288**2 * 12 - scan_pair_bytes(dims, config, 12288, CPU)
    on_gpu = dict(kw, device=CUDA)
    assert analyze_memory(dims, attention=TINY_KDA_ATTENTION, **on_gpu).parts == analyze_memory(dims, **on_gpu).parts
    with pytest.raises(SizingError, match=re.escape(label)):
        check_memory(scored, batch=8, steps=4096, free=lambda d: plain.total("host") + GIB)

    one = layer_major_memory(dims, config, batch=1, tokens=12288, vocab=256, device=CPU, attention=TINY_KDA_ATTENTION)
    eight = layer_major_memory(dims, config, batch=8, tokens=4096, vocab=256, device=CPU, attention=TINY_KDA_ATTENTION)
    label = "attention scores of the forward (one layer's [batch, heads, L, L] fp32 x 3)"
    assert dict((lbl, b) for lbl, _, b in one.parts)[label] == 4 * 12288**2 * 12
    assert dict((lbl, b) for lbl, _, b in eight.parts)[label] == 8 * 4 * 4096**2 * 12
    # the forward's parts against its measured peak RSS beyond the loaded model (tiny-kda on the CPU, use_cache=False,
    # logits_to_keep=1): 6.3 GB at 1 x 12288 and 7.1 GB at 8 x 4096 tokens; the estimates are above, by less than 2x
    def forward(est):
        prefix = ("attention scores of the forward", "the KDA scan's decays of the forward", "the forward's activations")
        return sum(b for lbl, _, b in est.parts if lbl.startswith(prefix))

    assert 6.3e9 <= forward(one) < 2 * 6.3e9 and 7.1e9 <= forward(eight) < 2 * 7.1e9
    # 8 x 2048 tokens (3.5-3.6 GB measured): the scan's decays, not the scores, set the peak
    short = layer_major_memory(dims, config, batch=8, tokens=2048, vocab=256, device=CPU, attention=TINY_KDA_ATTENTION)
    assert "the KDA scan's decays of the forward (one layer's [chunk, chunk, Dk] per chunk and head, fp32 x 3)" in {
        lbl for lbl, _, _ in short.parts
    }
    assert 3.6e9 <= forward(short) < 2 * 3.5e9
    no_attention = layer_major_memory(dims, config, batch=1, tokens=12288, vocab=256, device=CPU)
    assert label not in {lbl for lbl, _, _ in no_attention.parts}
