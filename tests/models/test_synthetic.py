"""Synthetic inputs: exact shapes for every preset, seeded, labelled, distributed as the family's init."""

from __future__ import annotations

import math

import pytest
import torch

from ssmquant.models import PresetError, get_preset, list_presets, synthetic_inputs, synthetic_layers
from ssmquant.replay.inputs import GDNInputs, KDAInputs, Mamba2Inputs
from ssmquant.replay.reference import reference_decode


@pytest.mark.parametrize("name", list_presets())
def test_shapes_of_every_preset(name):
    p = get_preset(name)
    layer = p.ssm_layers[-1]
    x = synthetic_inputs(p, layer, batch=2, steps=3, seed=0)
    heads, rows, sdim = p.state_shape
    assert x.state_shape == (2, heads, rows, sdim)
    assert x.meta["source"] == "synthetic" and x.meta["model"] == name and x.meta["layer"] == layer
    if p.layer_kind == "mamba2":
        s = p.shape
        assert isinstance(x, Mamba2Inputs)
        assert x.x.shape == (2, 3, s.num_heads, s.head_dim) and x.B.shape == (2, 3, s.n_groups, s.state_size)
        assert x.x.dtype == torch.bfloat16 and x.dt.dtype == torch.float32
    elif p.layer_kind == "kda":
        s = p.shape
        assert isinstance(x, KDAInputs)
        assert x.q.shape == (2, 3, s.num_heads, s.head_dim) and x.g.shape == (2, 3, s.num_heads, s.head_dim)
        assert x.v.dtype == torch.bfloat16 and x.g.dtype == torch.float32 and x.meta["gate"]
    else:
        s = p.shape
        assert isinstance(x, GDNInputs)
        assert x.q.shape == (2, 3, s.num_key_heads, s.key_head_dim) and x.v.shape == (
            2,
            3,
            s.num_value_heads,
            s.value_head_dim,
        )
        assert x.v.dtype == torch.bfloat16 and x.g.dtype == torch.float32


def test_seeded_per_seed_and_layer():
    a = synthetic_inputs("qwen3.5-0.8b", 0, batch=1, steps=4, seed=7)
    b = synthetic_inputs("qwen3.5-0.8b", 0, batch=1, steps=4, seed=7)
    c = synthetic_inputs("qwen3.5-0.8b", 1, batch=1, steps=4, seed=7)
    d = synthetic_inputs("qwen3.5-0.8b", 0, batch=1, steps=4, seed=8)
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.v, c.v) and not torch.equal(a.v, d.v)


def test_mamba2_follows_the_nemotron_h_init():
    p = get_preset("nemotron-3-nano")
    s = p.shape
    x = synthetic_inputs(p, 0, batch=4, steps=256, seed=1, dtype=torch.float32)
    assert torch.equal(x.A, -torch.arange(1, s.num_heads + 1, dtype=torch.float32))
    assert torch.equal(x.D, torch.ones(s.num_heads))
    dt0 = torch.nn.functional.softplus(x.meta["params"]["dt_bias"])
    assert ((dt0 >= s.time_step_min * 0.999) & (dt0 <= s.time_step_max * 1.001)).all()
    assert float(x.dt.min()) >= s.time_step_min  # the model's clamp
    # SiLU outputs: bounded below by min(silu) = -0.2785
    assert float(x.x.min()) > -0.279 and float(x.B.min()) > -0.279
    decay = torch.exp(x.dt * x.A).mean(dim=(0, 1))
    assert float(decay.max()) > 0.95 and float(decay.min()) < 0.2  # long- and short-memory heads


def test_gdn_follows_the_qwen_init_with_long_memory_heads():
    p = get_preset("qwen3.5-9b")
    s = p.shape
    x = synthetic_inputs(p, 0, batch=2, steps=128, seed=3, long_memory_fraction=0.25)
    torch.testing.assert_close(x.k.norm(dim=-1), torch.ones(x.k.shape[:-1]), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.q.norm(dim=-1), torch.full(x.q.shape[:-1], s.key_head_dim**-0.5), atol=1e-5, rtol=0)
    a = torch.exp(x.meta["params"]["A_log"])
    assert ((a >= s.a_init_low) & (a <= s.a_init_high)).all()
    # Stratified: exactly one head per 1/Hv band of U(0.01, 16).
    bands = ((a - s.a_init_low) / (s.a_init_high - s.a_init_low) * s.num_value_heads).floor().long()
    assert sorted(bands.tolist()) == list(range(s.num_value_heads))
    assert torch.equal(x.meta["params"]["dt_bias"], torch.ones(s.num_value_heads))
    long_heads = x.meta["params"]["long_memory_heads"]
    assert len(long_heads) == 8
    decay = torch.exp(x.g).mean(dim=(0, 1))
    assert float(decay[long_heads].min()) > 0.9 and float(decay.min()) < 0.01
    pure = synthetic_inputs(p, 0, batch=1, steps=4, seed=3, long_memory_fraction=0.0)
    assert pure.meta["params"]["long_memory_heads"] == []


@pytest.mark.parametrize("name", ["glm-5.3-flash", "kimi-linear-48b-a3b"])
def test_kda_follows_the_family_init(name):
    """Per-channel dt_bias = softplus^-1(dt), dt in [1e-3, 1e-1]; GLM's gate in [-5, 0] with A_log = 0,
    Kimi's A in [1, 16]; every head mixes fast and slow key channels."""
    p = get_preset(name)
    s = p.shape
    x = synthetic_inputs(p, p.ssm_layers[0], batch=2, steps=64, seed=2)
    dt0 = torch.nn.functional.softplus(x.meta["params"]["dt_bias"])
    assert x.meta["params"]["dt_bias"].shape == (s.num_heads * s.head_dim,)
    assert ((dt0 >= s.time_step_min * 0.999) & (dt0 <= s.time_step_max * 1.001)).all()
    a = torch.exp(x.meta["params"]["A_log"])
    if s.gate_lower_bound is not None:
        assert torch.equal(a, torch.ones(s.num_heads)) and float(x.g.min()) >= s.gate_lower_bound
    else:
        assert ((a >= s.a_init_low) & (a <= s.a_init_high)).all()
    torch.testing.assert_close(x.k.norm(dim=-1), torch.ones(x.k.shape[:-1]), atol=1e-5, rtol=0)
    decay = torch.exp(x.g).mean(dim=(0, 1))  # [H, Dk]
    assert float(decay.max(-1).values.min()) > 0.98 and float(decay.min(-1).values.max()) < 0.95


def test_reference_decode_runs_on_synthetic_inputs():
    for name in ("nemotron-h-8b", "qwen3-next-80b", "glm-5.3-flash"):
        y, final, _ = reference_decode(synthetic_inputs(name, get_preset(name).ssm_layers[0], batch=1, steps=16))
        assert torch.isfinite(y).all() and torch.isfinite(final).all() and final.abs().max() > 0


def test_synthetic_layers_streams_every_ssm_layer():
    p = get_preset("qwen3.5-0.8b")
    got = [i for i, _ in synthetic_layers(p, batch=1, steps=2)]
    assert got == list(p.ssm_layers)


def test_bad_arguments():
    with pytest.raises(PresetError, match=r"layer 5 of nemotron-3-nano is not an SSM layer.*\[0, 2, 4, 7"):
        synthetic_inputs("nemotron-3-nano", 5, batch=1, steps=2)
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        synthetic_inputs("nemotron-3-nano", 0, batch=0, steps=2)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        synthetic_inputs("nemotron-3-nano", 0, batch=1, steps=2.5)
    with pytest.raises(ValueError, match="dtype must be one of"):
        synthetic_inputs("nemotron-3-nano", 0, batch=1, steps=2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"long_memory_fraction must lie in \[0, 1\]"):
        synthetic_inputs("qwen3.5-0.8b", 0, batch=1, steps=2, long_memory_fraction=1.5)
    with pytest.raises(PresetError, match="unknown preset"):
        synthetic_inputs("mamba-7b", 0, batch=1, steps=2)


def test_projection_scale_matches_the_init():
    """sigma = initializer_range * sqrt(hidden): the pre-sigmoid b has that std, so beta spreads around 1/2."""
    p = get_preset("qwen3.5-0.8b")
    x = synthetic_inputs(p, 0, batch=8, steps=256, seed=0, dtype=torch.float32)
    b = torch.logit(x.beta.double())
    assert abs(float(b.std()) - p.initializer_range * math.sqrt(p.hidden_size)) < 0.05
