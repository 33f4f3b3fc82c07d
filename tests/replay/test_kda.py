"""Kimi Delta Attention in the naive references: state form vs literal checkpoint + buffer form, scheme
identities, the per-key-channel decay, and input validation at the entry point."""

import numpy as np
import pytest
import torch

from ssmquant.kinds import GDNInputs, InputError, KDAInputs
from ssmquant.replay import emulate, parse_variant, parse_variants, reference_decode
from ssmquant.simulate import simulate

from .helpers import gdn_inputs, kda_inputs

# Same FP32 noise budget as tests/replay/test_naive.py: the two forms sum the same terms in another order.
FORM_TOL = 2e-5


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("scheme", ["conventional", "replay1", "replay4", "replay16", "spec8x3:p0.6"])
def test_literal_form_equals_state_form_in_fp32(scheme):
    """Awkward sizes (T=63, Dv=60, Dk=40, Hv = 2 Hk); fp32 state, fp32 buffer."""
    inp = kda_inputs()
    v = [parse_variant(f"fp32@{scheme}" + (":fp32" if scheme != "conventional" else ""))]
    a = emulate(inp, v, form="state", return_outputs=True, return_states=True)
    b = emulate(inp, v, form="literal", return_outputs=True, return_states=True)
    assert rel(b.outputs[0], a.outputs[0]) < FORM_TOL
    assert rel(b.states[0], a.states[0]) < FORM_TOL
    y, _, _ = reference_decode(inp)
    assert rel(b.outputs[0], y) < FORM_TOL


def test_literal_form_equals_state_form_at_real_sizes():
    inp = kda_inputs(1, 24, 2, 2, 128, 128)
    v = parse_variants(["fp32@replay16:fp32", "fp32@replay16"])
    a = emulate(inp, v, form="state", return_outputs=True)
    b = emulate(inp, v, form="literal", return_outputs=True)
    for i in range(2):
        assert rel(b.outputs[i], a.outputs[i]) < FORM_TOL


def test_forms_agree_on_quantized_error_traces():
    inp = kda_inputs(steps=40, dk=32)
    vs = parse_variants(["fp8_e4m3@replay8", "int8@replay16", "nvfp4@replay4"])
    a = simulate(inp, vs, form="state").rel_err("out")
    b = simulate(inp, vs, form="literal").rel_err("out")
    assert np.allclose(a, b, rtol=0.05, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "nvfp4", "bf16", "int8:head"])
def test_replay1_with_fp32_buffer_equals_conventional_exactly(fmt):
    """u_t is computed, not an input, so only an fp32 buffer makes replay(1) conventional decoding."""
    inp = kda_inputs(dk=32)
    vs = [parse_variant(f"{fmt}@conventional"), parse_variant(f"{fmt}@replay1:fp32")]
    r = emulate(inp, vs, return_outputs=True, return_states=True)
    assert torch.equal(r.states[0], r.states[1])
    assert torch.equal(r.outputs[0], r.outputs[1])
    assert torch.equal(r.metrics[0], r.metrics[1])


def test_a_uniform_gate_is_gated_deltanet():
    """With the same log decay on every key channel KDA is GDN, bit for bit (the same ops in the same order)."""
    gdn = gdn_inputs(steps=30)
    kda = KDAInputs(
        q=gdn.q, k=gdn.k, v=gdn.v, g=gdn.g[..., None].expand(*gdn.g.shape, gdn.state_dim).contiguous(), beta=gdn.beta
    )
    vs = parse_variants(["fp32", "int8@replay4", "fp8_e4m3:sr@conventional"])
    a = emulate(gdn, vs, return_outputs=True, return_states=True)
    b = emulate(kda, vs, return_outputs=True, return_states=True)
    for i in range(len(vs)):
        assert torch.equal(a.states[i], b.states[i]) and torch.equal(a.outputs[i], b.outputs[i])
    assert torch.equal(reference_decode(gdn)[0], reference_decode(kda)[0])


def test_the_decay_acts_on_key_channels_the_columns_of_the_state():
    """A key channel with log decay -30 forgets at once: the last step equals one undecayed step from the
    previous state with that column (not row) zeroed."""
    inp = kda_inputs(batch=1, steps=8, key_heads=1, value_heads=1, dk=8, dv=6, dtype=torch.float32)
    inp.g = torch.zeros_like(inp.g)
    inp.g[..., 3] = -30.0
    _, _, states = reference_decode(inp, return_states=True)  # [B, T, H, Dv, Dk]
    prev = states[:, -2].clone()
    assert prev[..., 3].abs().max() > 0
    prev[..., 3] = 0.0
    last = KDAInputs(
        **{f: getattr(inp, f)[:, -1:] for f in ("q", "k", "v", "beta")}, g=torch.zeros_like(inp.g[:, -1:])
    )
    last.initial_state = prev
    torch.testing.assert_close(reference_decode(last)[1], states[:, -1], rtol=1e-6, atol=1e-6)


def test_error_invariants_and_replay_beats_conventional():
    inp = kda_inputs(steps=200, dk=32)
    tr = simulate(inp, ["fp32", "fp32@replay16:fp32", "bf16", "fp8_e4m3", "fp8_e4m3@replay16"])
    final = tr.final("state")
    assert final["fp32@conventional"] == 0.0 and final["fp32@replay16:fp32"] == 0.0
    assert 0 < final["bf16@conventional"] < final["fp8_e4m3@conventional"]
    assert final["fp8_e4m3@replay16"] < final["fp8_e4m3@conventional"]
    assert tr.meta["kind"] == "kda"


def test_a_gate_per_head_is_refused_with_a_clear_message():
    inp = kda_inputs(steps=5)
    inp.g = inp.g[..., 0]
    with pytest.raises(InputError, match=r"one decay per head: that is Gated DeltaNet \(use GDNInputs\)"):
        simulate(inp, "int8")
    inp = kda_inputs(steps=5)
    inp.g = inp.g[..., :-1]
    with pytest.raises(InputError, match=r"g has shape \(2, 5, 4, 39\), expected \(2, 5, 4, 40\)"):
        simulate(inp, "int8")


def test_positive_log_decays_are_refused_naming_where():
    inp = kda_inputs(steps=5)
    inp.g = inp.g.clone()
    inp.g[1, 2, 3, 7] = 0.25
    with pytest.raises(InputError, match=r"g must be <= 0 .* got 0.25 at batch 1, step 2, head 3, key channel 7"):
        reference_decode(inp)


def test_kda_inputs_are_not_gdn_inputs():
    """Code that dispatches on GDNInputs must never take a KDA layer for a GDN one."""
    assert not isinstance(kda_inputs(steps=2), GDNInputs)
