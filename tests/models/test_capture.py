"""Capture from tiny real checkpoints: the captured inputs, fed to the FP32 reference recurrence, must
reproduce the mixer's own SSM output (the input of its gated norm) and the final state in the cache."""

from __future__ import annotations

import functools

import pytest
import torch

from ssmquant.kinds import GDNInputs, KDAInputs, Mamba2Inputs
from ssmquant.models import (
    CaptureError,
    capture_all,
    capture_inputs,
    capture_text_batch,
    find_ssm_mixers,
    iter_capture,
)
from ssmquant.replay.reference import reference_decode

from .conftest import VOCAB, load_cpu, relerr

TOL = 1e-4
STEPS = 37  # > NemotronH chunk 8 (several chunks + padding)
GDN_STEPS = 70  # > the GDN torch path's chunk 64


def _model_reference(model, ids):
    """The mixers' own outputs before the gated norm, and the cache's final recurrent states."""
    outs, handles = {}, []
    for i, mixer in find_ssm_mixers(model).items():

        def pre(_m, args, i=i):
            outs[i] = args[0].detach().clone()

        norm = mixer.module.o_norm if mixer.kind == "kda" else mixer.module.norm
        handles.append(norm.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    cache = out.past_key_values
    return outs, {i: _recurrent_state(cache, i) for i in outs}


def _recurrent_state(cache, layer):
    if hasattr(cache, "get_recurrent_state"):
        return cache.get_recurrent_state(layer)
    return cache.layers[layer].recurrent_states[0]  # transformers < 5.2x


CHECKPOINTS = [
    ("nemotron_dir", "mamba2", "NemotronHForCausalLM", STEPS),
    ("qwen35_dir", "gdn", "Qwen3_5ForConditionalGeneration", GDN_STEPS),
    ("qwen35_moe_dir", "gdn", "Qwen3_5MoeForConditionalGeneration", GDN_STEPS),
    ("qwen3_next_dir", "gdn", "Qwen3NextForCausalLM", GDN_STEPS),
    ("glm5_next_dir", "kda", "Glm5NextForConditionalGeneration", GDN_STEPS),  # > chunk_kda's chunk 64
    ("kimi_linear_dir", "kda", "KimiLinearForCausalLM", GDN_STEPS),
]


@pytest.mark.parametrize("fixture,kind,arch,steps", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_captured_inputs_reproduce_the_mixer(request, fixture, kind, arch, steps):
    loaded = load_cpu(request.getfixturevalue(fixture))
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.arch.architecture == arch and loaded.arch.layer_kind == kind
    ids = torch.randint(0, VOCAB, (2, steps))
    caps = capture_all(loaded, ids)
    outs, states = _model_reference(loaded.model, ids)
    assert sorted(caps) == sorted(outs) and len(caps) == 3
    for layer, inputs in caps.items():
        assert inputs.kind == kind and inputs.steps == steps and inputs.batch == 2
        assert inputs.meta["source"] == "checkpoint" and inputs.meta["layer"] == layer
        y, final, _ = reference_decode(inputs)
        y_model = outs[layer].reshape(y.shape)
        state_model = states[layer]
        if kind in ("gdn", "kda"):
            state_model = state_model.transpose(-1, -2)  # transformers [Dk, Dv] -> ours [Dv, Dk]
        else:
            # The recurrence must carry the signal: compare the SSM part without the D skip term too.
            skip = inputs.D.float()[None, None, :, None] * inputs.x.float()
            assert relerr(y - skip, y_model - skip) < TOL
            assert (y - skip).norm() > 0.5 * y.norm()
        assert relerr(y, y_model) < TOL, layer
        assert relerr(final, state_model) < TOL, layer


def test_mamba2_dt_is_after_softplus_and_the_models_clamp(nemotron_dir):
    loaded = load_cpu(nemotron_dir)
    caps = capture_all(loaded, torch.randint(0, VOCAB, (2, STEPS)))
    lo = loaded.model.config.time_step_min
    for inputs in caps.values():
        assert isinstance(inputs, Mamba2Inputs)
        assert inputs.dt.dtype == torch.float32 and inputs.A.dtype == torch.float32
        assert float(inputs.dt.min()) == pytest.approx(lo)  # some steps are clamped
        assert (inputs.A < 0).all()


def test_gdn_q_k_are_normalised_and_q_scaled(qwen35_dir):
    caps = capture_all(load_cpu(qwen35_dir), torch.randint(0, VOCAB, (2, 9)))
    for inputs in caps.values():
        assert isinstance(inputs, GDNInputs)
        dk = inputs.state_dim
        torch.testing.assert_close(inputs.k.norm(dim=-1), torch.ones_like(inputs.k[..., 0]), atol=1e-4, rtol=0)
        torch.testing.assert_close(
            inputs.q.norm(dim=-1) * dk**0.5, torch.ones_like(inputs.q[..., 0]), atol=1e-4, rtol=0
        )
        assert (inputs.g <= 0).all() and ((inputs.beta > 0) & (inputs.beta < 1)).all()


def test_capture_goes_through_whatever_implementation_transformers_picked(nemotron_dir, monkeypatch):
    """mamba_ssm / FLA replace the function body but keep the signature (functools.wraps): capture must
    record the arguments and still call the implementation in place."""
    import transformers.models.nemotron_h.modeling_nemotron_h as mod

    torch_fn = mod.mamba2_chunk_scan
    calls = []

    @functools.wraps(torch_fn)
    def stand_in_kernel(*args, **kwargs):
        calls.append(1)
        return torch_fn(*args, **kwargs)

    monkeypatch.setattr(mod, "mamba2_chunk_scan", stand_in_kernel)
    loaded = load_cpu(nemotron_dir)
    ids = torch.randint(0, VOCAB, (1, 12))
    caps = capture_all(loaded, ids, stop_early=False)
    assert len(calls) == 3 and sorted(caps) == [0, 2, 4]
    assert mod.mamba2_chunk_scan is stand_in_kernel  # restored after the capture


def test_iter_capture_streams_layers_in_order(qwen35_dir):
    loaded = load_cpu(qwen35_dir)
    ids = torch.randint(0, VOCAB, (2, 16))
    seen = [(i, x.steps, x.v.device.type) for i, x in iter_capture(loaded, ids, steps=10)]
    assert seen == [(0, 10, "cpu"), (1, 10, "cpu"), (2, 10, "cpu")]
    # Stopping early ends the prefill and releases the capture for the next one.
    gen = iter_capture(loaded, ids)
    first = next(gen)
    gen.close()
    assert first[0] == 0
    assert sorted(capture_all(loaded, ids, layers=[2])) == [2]


def test_iter_capture_raises_the_prefills_error(nemotron_dir):
    with pytest.raises(CaptureError, match=r"requested 9 steps.*only 8 tokens"):
        list(iter_capture(load_cpu(nemotron_dir), torch.randint(0, VOCAB, (1, 8)), steps=9))


def test_steps_truncate_and_too_many_steps_name_both_numbers(nemotron_dir):
    loaded = load_cpu(nemotron_dir)
    ids = torch.randint(0, VOCAB, (2, 20))
    full = capture_all(loaded, ids, layers=[0])[0]
    part = capture_all(loaded, ids, layers=[0], steps=7)[0]
    assert part.steps == 7 and part.meta["tokens"] == 20
    torch.testing.assert_close(part.x, full.x[:, :7], rtol=0, atol=0)
    with pytest.raises(CaptureError, match=r"requested 21 steps.*only 20 tokens"):
        capture_all(loaded, ids, steps=21)


def test_layer_selection_and_unknown_layers(nemotron_dir):
    loaded = load_cpu(nemotron_dir)
    ids = torch.randint(0, VOCAB, (1, 8))
    order = []
    capture_inputs(loaded, ids, lambda i, x: order.append(i), layers=[4, 2])
    assert order == [2, 4]
    with pytest.raises(CaptureError, match=r"layers \[1\] are not SSM layers.*\[0, 2, 4\]"):
        capture_all(loaded, ids, layers=[1])


def test_dtype_option_casts_the_per_step_tensors(qwen35_dir):
    inputs = capture_all(load_cpu(qwen35_dir), torch.randint(0, VOCAB, (1, 8)), dtype=torch.bfloat16, layers=[0])[0]
    assert {inputs.q.dtype, inputs.k.dtype, inputs.v.dtype, inputs.g.dtype, inputs.beta.dtype} == {torch.bfloat16}


def test_bad_input_ids(nemotron_dir):
    loaded = load_cpu(nemotron_dir)
    with pytest.raises(CaptureError, match="input_ids must be an integer tensor"):
        capture_all(loaded, torch.zeros(2, 3))


def test_text_to_capture_end_to_end(nemotron_dir):
    loaded = load_cpu(nemotron_dir)  # no tokenizer files, vocabulary 300: byte-level
    text = "It was the best of times, it was the worst of times. " * 20
    ids, meta = capture_text_batch(loaded, batch=2, steps=24, seed=3, text=text)
    assert ids.shape == (2, 24) and int(ids.max()) < 256
    caps = capture_all(loaded, ids, meta=meta)
    assert caps[0].meta["text"]["split"] == "calibration" and caps[0].meta["source"] == "checkpoint"


@pytest.mark.parametrize("fixture", ["nemotron_dir", "qwen35_dir"])
def test_micro_batched_prefill_gives_the_same_inputs(fixture, request):
    """Prefill in passes of one sequence (how a model too large for one batched prefill is captured):
    every layer's inputs equal the one-pass capture, joined along the batch."""
    loaded = load_cpu(str(request.getfixturevalue(fixture)))
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(0))
    whole = capture_all(loaded, ids)
    seen = []
    parts = {}
    capture_inputs(loaded, ids, lambda i, x: (seen.append(i), parts.__setitem__(i, x)), micro_batch=1)
    assert seen == sorted(whole)  # layers still arrive in order, once each
    for i, inp in whole.items():
        got = parts[i]
        assert got.batch == 3 and got.meta["batch"] == 3
        for name in ("x", "dt", "B", "C") if isinstance(inp, Mamba2Inputs) else ("q", "k", "v", "g", "beta"):
            torch.testing.assert_close(getattr(got, name), getattr(inp, name), rtol=1e-5, atol=1e-6)
    with pytest.raises(CaptureError, match="micro_batch must be a positive integer, got 0"):
        capture_inputs(loaded, ids, lambda i, x: None, micro_batch=0)


def test_prefill_memory_estimate_sizes_micro_batches(monkeypatch):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from ssmquant.models.capture import auto_micro_batch, prefill_bytes_per_sequence

    with torch.device("meta"):
        net = NemotronHForCausalLM(NemotronHConfig(num_hidden_layers=1, hybrid_override_pattern="M"))
    # Nemotron-H-8B's mixer (128 heads, state 128, chunk 128) at 2048 tokens: 16 chunks of 128 x 128 x 128 x 128
    assert prefill_bytes_per_sequence(net, 2048) == 2 * 16 * 128 * 128 * 128 * 128 * 4  # 16 GiB
    per_seq = prefill_bytes_per_sequence(net, 2048)
    monkeypatch.setattr("ssmquant.models.capture.free_bytes", lambda device: 10 * per_seq)
    assert auto_micro_batch(net, 8, 2048, torch.device("cpu")) == 5  # half the free memory: 5 sequences
    assert auto_micro_batch(net, 4, 2048, torch.device("cpu")) == 4
    monkeypatch.setattr("ssmquant.models.capture.free_bytes", lambda device: per_seq)
    assert auto_micro_batch(net, 8, 2048, torch.device("cpu")) == 1  # never fewer than one sequence


def test_kda_gates_and_normalisation(glm5_next_dir, kimi_linear_dir):
    """GLM-5.3-Flash's gate is bounded below by -5; Kimi-Linear's is not; q, k unit-norm (q scaled)."""
    ids = torch.randint(0, VOCAB, (2, 9))
    for fixture, bounded in ((glm5_next_dir, True), (kimi_linear_dir, False)):
        for inputs in capture_all(load_cpu(fixture), ids).values():
            assert isinstance(inputs, KDAInputs) and inputs.g.shape == (2, 9, 3, 16)
            assert inputs.g.dtype == torch.float32 and (inputs.g <= 0).all()
            if bounded:
                assert (inputs.g >= -5.0).all() and float(inputs.g.min()) < -1.0
            assert float(inputs.g.std(-1).min()) > 0  # one decay per key channel, not one per head
            dk = inputs.state_dim
            torch.testing.assert_close(inputs.k.norm(dim=-1), torch.ones_like(inputs.k[..., 0]), atol=1e-4, rtol=0)
            torch.testing.assert_close(
                inputs.q.norm(dim=-1) * dk**0.5, torch.ones_like(inputs.q[..., 0]), atol=1e-4, rtol=0
            )


def test_a_linear_attention_layer_of_unknown_kind_is_refused_by_name(kimi_linear_dir):
    class MysteryLinearAttention(torch.nn.Module):
        def __init__(self, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx

    loaded = load_cpu(kimi_linear_dir)
    loaded.model.model.layers[1].self_attn = MysteryLinearAttention(1)
    pattern = r"layer 1 is a linear-attention layer .*MysteryLinearAttention.*known kinds: mamba2: .*; gdn: .*; kda: Kimi"
    with pytest.raises(CaptureError, match=pattern):
        find_ssm_mixers(loaded.model)
