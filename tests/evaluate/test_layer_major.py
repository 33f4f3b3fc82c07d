"""Layer-major evaluation (evaluate.layer_major, `eval --mode layer`) against the token-by-token path it replaces:
the same function up to summation order, on the three shipped models, with and without a prompt.

Tolerances, from runs of the shipped models at 128 steps x 2 sequences (CPU, fp32 weights, fp8_e4m3 and nvfp4
conventional, int8 replay16): per-variant mean KL within 0.5x-2x of the decode path's where it exceeds 1e-5 nats
(measured: 0.94x to 1.11x; below 1e-5 nats, int8@replay16's 6e-7 to 2e-6, the two differ by up to 1.9x, float-order
noise), mean top-1 agreement within 1.6 points (measured: up to 0.4 points, one position of 256), the reference loss
within 1%."""

import numpy as np
import pytest
import torch

from ssmquant.evaluate import EvalConfig, EvalError, evaluate
from ssmquant.simulate import triton_interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

VARIANTS = "fp8_e4m3@conventional,int8@replay16,nvfp4@conventional"


def assert_modes_agree(layer, decode):
    """The module docstring's tolerances: per-variant mean KL, mean top-1 agreement, the reference loss."""
    a, b = layer.summary.set_index("variant"), decode.summary.set_index("variant")
    for v in a.index:
        kl_l, kl_d = a.loc[v, "kl_mean"], b.loc[v, "kl_mean"]
        if max(kl_l, kl_d) > 1e-5:
            assert 0.5 < kl_l / kl_d < 2.0, (v, kl_l, kl_d)
        assert abs(a.loc[v, "top1_agree_mean"] - b.loc[v, "top1_agree_mean"]) <= 0.016, v
    assert np.isclose(layer.reference["loss_mean"], decode.reference["loss_mean"], rtol=1e-2)


@pytest.mark.parametrize("model,prompt", [("tiny-nemotron", 0), ("tiny-qwen", 16), ("tiny-kda", 0)])
def test_layer_major_computes_what_token_by_token_decoding_computes(model, prompt):
    kw = dict(steps=64, batch=2, device="cpu", prompt=prompt)
    layer = evaluate(EvalConfig(model, VARIANTS, mode="layer", **kw))
    decode = evaluate(EvalConfig(model, VARIANTS, mode="decode", **kw))
    assert layer.timing["mode"] == "layer" and layer.config.mode == "layer"
    assert layer.timing["recurrences"] == ["torch reference"] and layer.timing["metrics"] == "torch"
    assert_modes_agree(layer, decode)
    # the positions line up: the same steps, variants and metrics
    assert list(layer.positions.columns) == list(decode.positions.columns)
    assert len(layer.positions) == len(decode.positions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the fused kernels' output mode")
@pytest.mark.parametrize("model,prompt", [("tiny-nemotron", 0), ("tiny-qwen", 64), ("tiny-kda", 0)])
def test_layer_major_on_the_fused_kernels_computes_what_decoding_computes(model, prompt):
    """On a GPU the layer mode (its default there) runs the recurrences in the fused kernels' output mode: the same
    tolerances against the token-by-token path, at 512 steps x 4 sequences."""
    kw = dict(steps=512, batch=4, device="cuda", prompt=prompt)
    layer = evaluate(EvalConfig(model, VARIANTS, **kw))
    decode = evaluate(EvalConfig(model, VARIANTS, mode="decode", **kw))
    assert layer.config.mode == "layer" and layer.timing["recurrences"] == ["fused kernels (output mode)"]
    assert layer.timing["metrics"] == "fused kernel"
    assert_modes_agree(layer, decode)


def test_the_mode_defaults_to_decode_on_a_cpu():
    r = evaluate(EvalConfig("tiny-nemotron", "int8", steps=4, batch=1, device="cpu"))
    assert r.config.mode == "decode" and r.timing["mode"] == "decode"


def test_layer_mode_refuses_the_decode_modes_options():
    with pytest.raises(EvalError, match="unknown mode 'prefill'; accepted: decode, layer"):
        evaluate(EvalConfig("tiny-nemotron", "int8", steps=4, batch=1, device="cpu", mode="prefill"))
    with pytest.raises(EvalError, match="cuda_graphs, fold and kv_buffer are the decode mode's"):
        evaluate(EvalConfig("tiny-nemotron", "int8", steps=4, batch=1, device="cpu", mode="layer", fold=True))


def test_layer_mode_checks_its_memory_before_the_work(monkeypatch):
    """sizing.layer_major_memory: the forward's activations, one layer's emulation, the final hidden states and one
    chunk of positions' logits; where B sequences do not fit the free memory, fewer run per forward (the same
    numbers); where one does not, the run is refused before any forward, naming the parts."""
    kw = dict(steps=24, batch=2, device="cpu", mode="layer")
    whole = evaluate(EvalConfig("tiny-nemotron", VARIANTS, **kw))
    assert whole.timing["memory_estimate_GiB"]["host"] > 0 and whole.timing["forward_batch"] == 2
    one = whole.timing["memory_estimate_GiB"]["host"] * 2**30 * 0.6  # room for one sequence, not two
    monkeypatch.setattr("ssmquant.evaluate.run.free_bytes", lambda device: int(one))
    halves = evaluate(EvalConfig("tiny-nemotron", VARIANTS, **kw))
    assert halves.timing["forward_batch"] == 1
    assert any("runs 1 of the 2 sequences per forward (2 forwards per variant)" in n for n in halves.notes)
    assert np.allclose(halves.sequences[["kl_mean", "top1_agree_mean"]], whole.sequences[["kl_mean", "top1_agree_mean"]],
                       rtol=1e-6, atol=1e-12)  # fmt: skip
    assert halves.reference["loss_mean"] == pytest.approx(whole.reference["loss_mean"], rel=1e-9)
    monkeypatch.setattr("ssmquant.evaluate.run.free_bytes", lambda device: 1024)
    with pytest.raises(EvalError, match="the forward's activations .* lower --steps"):
        evaluate(EvalConfig("tiny-nemotron", "int8", steps=8, batch=1, device="cpu", mode="layer"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_counts_the_kept_hidden_states_in_the_heads_dtype(dtype):
    """The final hidden states that layer_major_pass keeps until the metrics are in the output head's dtype: the
    estimate's part is exactly their bytes, (1 + V) x B x T x D elements of the dtype's size."""
    from ssmquant.evaluate.layer_major import variant_hidden
    from ssmquant.evaluate.run import _layer_major_memory
    from ssmquant.models import load_model
    from ssmquant.models.loading import ssm_layout
    from ssmquant.replay.variants import parse_variant

    lm = load_model("tiny-nemotron", device="cpu", dtype=dtype, with_tokenizer=False)
    net = lm.model
    ids = torch.randint(0, net.config.vocab_size, (2, 17))
    hidden = variant_hidden(net, ids, parse_variant("int8"))
    assert hidden.dtype == dtype
    est = _layer_major_memory(net, ssm_layout(net.config), 2, 17, torch.device("cpu"), 3, scans_skipped=False)
    part = dict((label, n) for label, _, n in est.parts)["the final hidden states of the reference and the variants"]
    assert part == 4 * hidden.numel() * hidden.element_size()


def test_layer_mode_forms_logits_in_chunks_of_positions(monkeypatch):
    """The metrics compare logits in chunks of positions (sizing.metric_chunk_rows): chunks of 7 positions give what
    one chunk of all positions gives."""
    kw = dict(steps=24, batch=2, device="cpu", mode="layer")
    whole = evaluate(EvalConfig("tiny-qwen", VARIANTS, **kw))
    monkeypatch.setattr("ssmquant.evaluate.layer_major.metric_chunk_rows", lambda vocab: 7)
    chunked = evaluate(EvalConfig("tiny-qwen", VARIANTS, **kw))
    assert np.allclose(chunked.sequences.iloc[:, 2:], whole.sequences.iloc[:, 2:], rtol=1e-9, atol=1e-15)
    assert chunked.reference["loss_mean"] == pytest.approx(whole.reference["loss_mean"], rel=1e-12)


@pytest.mark.skipif(
    not torch.cuda.is_available() and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_metrics_give_the_torch_paths_values(monkeypatch, dtype):
    """chunk_metrics' fused path (kernels.metrics, CUDA's default) against its torch path on the final hidden states
    of tiny-qwen's reference and three variants (one made to diverge at two positions, one at its last), both in
    chunks of 5 positions: kl and the nlls within the kernel test's float64 tolerance, top-1 agreement exact. The
    diverged positions are measured again by the torch path (their logits formed from those rows alone), so there
    the NaN / Inf results are the torch path's; a reference that is not finite is an EvalError."""
    from ssmquant.evaluate.layer_major import chunk_metrics
    from ssmquant.models import load_model

    net = load_model("tiny-qwen", device=DEVICE, dtype=dtype, with_tokenizer=False).model
    g = torch.Generator().manual_seed(0)
    width = net.get_output_embeddings().weight.shape[1]
    ref = torch.randn(23, width, generator=g)
    hidden = [ref] + [ref + s * torch.randn(23, width, generator=g) for s in (1e-3, 1e-2, 1e-1)]
    hidden[1][9] = float("nan")  # the first variant's: the reference's nll there still comes from the kernel
    hidden[2][[4, 11]] = float("nan")
    hidden[3][22, 0] = float("inf")
    hidden = [h.to(device=DEVICE, dtype=dtype) for h in hidden]
    targets = torch.randint(0, net.config.vocab_size, (23,), generator=g).to(DEVICE)
    monkeypatch.setattr("ssmquant.evaluate.layer_major.metric_chunk_rows", lambda vocab, *size: 5)
    with torch.inference_mode():
        nll_f, fused = chunk_metrics(net, hidden, targets, fused=True)
        nll_t, plain = chunk_metrics(net, hidden, targets, fused=False)
    assert torch.all((nll_f - nll_t).abs() <= 1e-12 + 1e-9 * nll_t.abs())
    for metric in (0, 2):
        a, b = fused[:, metric], plain[:, metric]
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()), metric
        ok = b.isfinite()
        assert torch.all((a[ok] - b[ok]).abs() <= 1e-12 + 1e-9 * b[ok].abs()), metric
    assert torch.equal(fused[:, 1], plain[:, 1])
    assert fused[1, 0, [4, 11]].isnan().all() and (fused[1, 1, [4, 11]] == 0).all()
    assert not fused[2, 0, 22].isfinite()
    hidden[0][7] = float("nan")
    with pytest.raises(EvalError, match="reference's logits are not finite"), torch.inference_mode():
        chunk_metrics(net, hidden, targets, fused=True)


def test_the_reference_logits_of_a_chunk_are_formed_once_for_all_variants(monkeypatch):
    """The output head runs 1 + V times per chunk of positions (the reference's logits serve every variant), plus
    once per forward for variant_hidden's check of the last position: with 3 variants, 48 positions in chunks of 7
    (7 chunks), 4 x 7 + 4 = 32 head calls, where a reference formed again per variant would take 7 x 7 + 4 = 53."""
    import ssmquant.evaluate.layer_major as lm

    calls = []
    real = lm.head_logits
    monkeypatch.setattr(lm, "head_logits", lambda net, hidden: calls.append(hidden.shape[0]) or real(net, hidden))
    monkeypatch.setattr(lm, "metric_chunk_rows", lambda vocab: 7)
    evaluate(EvalConfig("tiny-qwen", VARIANTS, steps=24, batch=2, device="cpu", mode="layer"))
    assert len(calls) == 32 and sum(calls) == 4 * 48 + 4 * 2


def test_a_prompt_store_is_evaluated_layer_major_and_refused_token_by_token():
    """A variant with a prompt store (bf16@conventional+int8col) starts from the restored prompt state in the layer
    mode, which the decode mode's cache writer cannot emulate: there it is refused, never silently stored as bf16."""
    kw = dict(steps=8, batch=1, device="cpu", prompt=16)
    r = evaluate(EvalConfig("tiny-qwen", "bf16@conventional,bf16@conventional+int8col", mode="layer", **kw))
    s = r.summary.set_index("variant")
    assert s.loc["bf16@conventional+int8col", "kl_mean"] > s.loc["bf16@conventional", "kl_mean"]
    with pytest.raises(EvalError, match="emulated by --mode layer only"):
        evaluate(EvalConfig("tiny-qwen", "bf16@conventional+int8col", mode="decode", **kw))
    with pytest.raises(EvalError, match="give --prompt N"):
        evaluate(EvalConfig("tiny-qwen", "bf16@conventional+int8col", mode="layer", **{**kw, "prompt": 0}))


def test_layer_mode_refuses_a_head_that_is_not_the_output_embedding(monkeypatch):
    """The chunked logits come from the output embedding of the final hidden states; where that does not reproduce
    the model's own last-position logits (here: a head doubled, as a logit scale would), the run is refused."""
    monkeypatch.setattr(
        "ssmquant.evaluate.layer_major.head_logits", lambda net, hidden: 2 * net.get_output_embeddings()(hidden).float()
    )
    with pytest.raises(EvalError, match="logits are not its output embedding .* use --mode decode"):
        evaluate(EvalConfig("tiny-kda", "int8", steps=8, batch=1, device="cpu", mode="layer"))


def test_a_slice_without_attention_layers_runs_layer_major_and_is_refused_token_by_token():
    """The layer mode's forward keeps no cache, so a model without attention layers (a one-layer Mamba-2 slice of a
    preset) runs; token by token, transformers' cache cannot build its causal mask, and the run is refused."""
    from ssmquant.models.build import build_random_model

    model = build_random_model("nemotron-3-nano", devices="cpu", num_layers=1, dtype="float32",
                               overrides={"vocab_size": 512}, progress=lambda *a: None)  # fmt: skip
    assert model.model.config.layer_types == ["linear_attention"]
    r = evaluate(EvalConfig(model, "fp8_e4m3", steps=8, batch=1, device="cpu", mode="layer"))
    assert 0 < r.summary["kl_mean"].iloc[0] < 1e-3
    with pytest.raises(EvalError, match="no attention layer .* use --mode layer"):
        evaluate(EvalConfig(model, "fp8_e4m3", steps=8, batch=1, device="cpu", mode="decode"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch's allocator peak")
@pytest.mark.parametrize("preset,layers", [("nemotron-3-nano", 6), ("qwen3.5-0.8b", 4)])
def test_layer_mode_peak_memory_stays_within_its_estimate(preset, layers):
    """The estimate the memory check reads (sizing.layer_major_memory) is not below the allocator's peak beyond
    the weights, on a random-weight full-width slice (Mamba-2 with MoE and attention; GDN with attention) at 4096
    steps x 2 sequences."""
    from ssmquant.models.build import build_random_model

    model = build_random_model(preset, devices="cuda", num_layers=layers, progress=lambda *a: None)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = evaluate(EvalConfig(model, VARIANTS, steps=4096, batch=2, device="cuda", mode="layer", text_split="all"))
    peak = torch.cuda.max_memory_allocated() - base
    assert r.timing["forward_batch"] == 2
    estimate = r.timing["memory_estimate_GiB"]["device"] * 2**30
    assert peak <= estimate, (peak / 2**30, estimate / 2**30)
