"""Capture from tiny real checkpoints: the captured inputs, fed to the FP32 reference recurrence, must
reproduce the mixer's own SSM output (the input of its gated norm) and the final state in the cache."""

from __future__ import annotations

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
    """dt is clamped to whatever the mixer applies: transformers 5.24 clamps below at time_step_min, 5.25 at
    config.time_step_limit (0 by default), as the engines do."""
    loaded = load_cpu(nemotron_dir)
    caps = capture_all(loaded, torch.randint(0, VOCAB, (2, STEPS)))
    mixers = find_ssm_mixers(loaded.model)
    for layer, inputs in caps.items():
        assert isinstance(inputs, Mamba2Inputs)
        assert inputs.dt.dtype == torch.float32 and inputs.A.dtype == torch.float32
        lo, _ = mixers[layer].module.time_step_limit
        assert float(inputs.dt.min()) >= lo
        if lo > 0:
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


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_capture_changes_nothing_the_model_computes_and_leaves_no_hook(nemotron_dir):
    """Capture only listens (torch module hooks): the model's logits are bit-identical with and without it, and
    every hook is gone afterwards, also when the prefill stops early."""
    loaded = load_cpu(nemotron_dir)
    ids = torch.randint(0, VOCAB, (1, 12))
    before = _hook_count(loaded.model)
    with torch.no_grad():
        plain = loaded.model(input_ids=ids).logits
    seen = {}

    def during(layer, inputs):
        with torch.no_grad():
            seen[layer] = True

    capture_inputs(loaded, ids, during, stop_early=False)
    with torch.no_grad():
        after = loaded.model(input_ids=ids).logits
    torch.testing.assert_close(after, plain, rtol=0, atol=0)
    assert sorted(seen) == [0, 2, 4] and _hook_count(loaded.model) == before
    capture_all(loaded, ids, layers=[2])  # stops after layer 2
    assert _hook_count(loaded.model) == before


@pytest.mark.parametrize("fixture,kind,arch,steps", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_every_capture_is_verified_and_says_how_close(request, fixture, kind, arch, steps):
    """meta["capture_error"]: the verification's relative error, far below the fp32 tolerance."""
    from ssmquant.models.capture import VERIFY_TOLERANCE

    caps = capture_all(load_cpu(request.getfixturevalue(fixture)), torch.randint(0, VOCAB, (2, steps)))
    for inputs in caps.values():
        assert 0 <= inputs.meta["capture_error"] < VERIFY_TOLERANCE[torch.float32] / 10


def _perturbed_taps(monkeypatch, family: str, field: str, factor: float):
    """Make the tap of ``family`` hand on ``field`` scaled by ``factor`` (a derivation gone wrong)."""
    import dataclasses

    from ssmquant.models import taps

    def perturb(tap):
        def derive(mixer, recorded):
            raw = tap.derive(mixer, recorded)
            return dict(raw, **{field: raw[field] * factor})

        return dataclasses.replace(tap, derive=derive) if tap.family == family else tap

    monkeypatch.setattr(taps, "TAPS", tuple(perturb(t) for t in taps.TAPS))


@pytest.mark.parametrize(
    "fixture,family,field",
    [("nemotron_dir", "nemotron_h", "dt"), ("qwen35_dir", "qwen3_5", "beta"), ("kimi_linear_dir", "kimi_delta", "g")],
)
def test_a_capture_that_does_not_reproduce_its_layer_names_the_layer_and_version(
    request, monkeypatch, fixture, family, field
):
    import transformers

    from ssmquant.models.capture import CaptureVerificationError

    loaded = load_cpu(request.getfixturevalue(fixture))
    _perturbed_taps(monkeypatch, family, field, 1.05)
    first = min(find_ssm_mixers(loaded.model))
    pattern = (
        rf"layer {first} \(\w+\): the FP32 recurrence on the captured inputs does not reproduce the layer's own "
        rf"output \(relative error .* tolerance 0.001\) with transformers {transformers.__version__}, read as the "
        rf"{family} layout"
    )
    with pytest.raises(CaptureVerificationError, match=pattern):
        capture_all(loaded, torch.randint(0, VOCAB, (2, 20)))


def test_a_mixer_of_an_unknown_layout_is_refused_by_name(nemotron_dir):
    loaded = load_cpu(nemotron_dir)
    mixer = find_ssm_mixers(loaded.model)[2].module
    mixer.in_projection = mixer.in_proj
    del mixer.in_proj
    with pytest.raises(
        CaptureError, match=r"layer 2 \(NemotronHMamba2Mixer\): capture knows no layout.*nemotron_h \(in_proj, norm\)"
    ):
        capture_all(loaded, torch.randint(0, VOCAB, (1, 8)))


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
    # Nemotron-H-8B's mixer (128 heads of 64 rows, state 128, chunk 128; hidden 4096, MLP 21504) at 2048 tokens:
    # the einsum scan's [chunk, H], [H, P, N] / chunk, [H, N] and [H, P] terms, the MLP and residual, in fp32, x 1.5
    c, h, p, n = 128, 128, 64, 128
    per_token = 6 * c * h + 4 * h * p * n // c + 4 * h * n + 10 * h * p + 16 * 4096 + 2 * 21504
    assert prefill_bytes_per_sequence(net, 2048) == 2048 * int(1.5 * 4 * per_token)  # 4.8 GiB
    per_seq = prefill_bytes_per_sequence(net, 2048)
    monkeypatch.setattr("ssmquant.models.capture.free_bytes", lambda device: 10 * per_seq)
    assert auto_micro_batch(net, 8, 2048, torch.device("cpu")) == 5  # half the free memory: 5 sequences
    assert auto_micro_batch(net, 4, 2048, torch.device("cpu")) == 4
    monkeypatch.setattr("ssmquant.models.capture.free_bytes", lambda device: per_seq)
    assert auto_micro_batch(net, 8, 2048, torch.device("cpu")) == 1  # never fewer than one sequence


def test_the_micro_batches_of_a_long_prefill_count_the_attention_scores():
    """tiny-kda's MLA attention (query / key head dim 48, value 32) takes sdpa's math path on the CPU and holds
    [heads, L, L] scores (measured: 6.3 GB beyond the model at 1 x 12288 tokens): one sequence's estimate counts them
    (sizing.prefill_layer_peak), so with 24 GB free the capture runs fewer than 8 sequences per pass. tiny-qwen's
    attention (equal head dims) runs torch's CPU flash kernel: no scores, all 8 at once."""
    from ssmquant.models import attention_dims, load_model, ssm_layout
    from ssmquant.models.capture import auto_micro_batch, prefill_bytes_per_sequence
    from ssmquant.sizing import AttentionDims, layout_dims, prefill_bytes_per_token, scan_pair_bytes

    cpu, tokens, free = torch.device("cpu"), 12288, lambda device: 24 * 10**9
    kda = load_model("tiny-kda", device="cpu").model
    assert attention_dims(kda.config) == AttentionDims(layers=2, heads=4, implementation="sdpa", value_dim_differs=True)
    linear = tokens * prefill_bytes_per_token(layout_dims(ssm_layout(kda.config)), kda.config.get_text_config().to_dict())
    assert prefill_bytes_per_sequence(kda, tokens, cpu) == linear + 4 * tokens**2 * 4 * 3  # 7.8 GB
    assert auto_micro_batch(kda, 8, tokens, cpu, free=free) == 1
    # sdpa on CUDA: no L x L matrix; KDA's torch scan decays instead (none where fla's kernel runs)
    cuda, dims = torch.device("cuda"), layout_dims(ssm_layout(kda.config))
    pairs = scan_pair_bytes(dims, kda.config.get_text_config().to_dict(), tokens, cuda)
    assert prefill_bytes_per_sequence(kda, tokens, cuda) == linear + pairs
    qwen = load_model("tiny-qwen", device="cpu").model
    assert attention_dims(qwen.config).value_dim_differs is False
    assert auto_micro_batch(qwen, 8, tokens, cpu, free=free) == 8


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
    pattern = (
        r"layer 1 is a linear-attention layer .*MysteryLinearAttention.*known kinds: mamba2: .*; gdn: .*; kda: Kimi"
    )
    with pytest.raises(CaptureError, match=pattern):
        find_ssm_mixers(loaded.model)


@pytest.mark.slow
def test_full_size_random_init_slice_is_verified_on_the_cpu():
    """A real model's shapes (Nemotron-3-Nano's first Mamba-2 layers, transformers' own random initialisation,
    fp32 on the CPU): the capture of every layer verified."""
    from ssmquant.models.build import build_random_model
    from ssmquant.models.capture import VERIFY_TOLERANCE

    loaded = build_random_model(
        "nemotron-3-nano", devices="cpu", dtype="float32", num_layers=3, progress=lambda _: None
    )
    caps = capture_all(loaded, torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(0)))
    assert sorted(caps) == [0, 2]
    for inputs in caps.values():
        assert inputs.meta["capture_error"] < VERIFY_TOLERANCE[torch.float32] / 10
