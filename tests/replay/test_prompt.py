"""A prompt, then decoding: `kinds.after_prompt` and the store of the initial state (`replay.naive`).

Oracles: the FP32 reference decode of the whole sequence (the state a prompt leaves) and the kind's own step
functions applied by hand (the first decode steps from the stored state), compared bit for bit where the same
torch operations run, and to 1e-6 where two code paths sum in another order.
"""

import pytest
import torch

from ssmquant import formats, kinds
from ssmquant.formats.codec import element_index, encode
from ssmquant.formats.random import keyed_bits, stream_key, uniform_from_bits
from ssmquant.replay import parse_variant, reference_decode
from ssmquant.replay.naive import INITIAL_STREAM, StateStore, emulate, stored_initial_states
from ssmquant.simulate import simulate

from .helpers import gdn_inputs, kda_inputs, mamba2_inputs

MAKERS = {"mamba2": mamba2_inputs, "gdn": gdn_inputs, "kda": kda_inputs}


def small(kind, steps=12):
    """State dimension 48: whole NVFP4 blocks of 16."""
    dims = {"state": 48} if kind == "mamba2" else {"dk": 48}
    return MAKERS[kind](batch=2, steps=steps, **dims).validate()


@pytest.mark.parametrize("kind", list(MAKERS))
def test_the_prompt_leaves_the_reference_state_and_the_rest_decodes(kind):
    inp = small(kind)
    _, _, states = reference_decode(inp, return_states=True)  # [B, T, H, rows, state_dim]
    after = kinds.after_prompt(inp, 5)
    assert after.steps == inp.steps - 5 and after.meta["prompt"] == 5
    torch.testing.assert_close(after.initial_state, states[:, 4], rtol=1e-6, atol=1e-7)
    for name in type(inp).SEQUENCE_FIELDS:
        assert torch.equal(getattr(after, name), getattr(inp, name)[:, 5:]), name
    # decoding from the prompt's state is the rest of the whole sequence's reference
    _, _, rest = reference_decode(after, return_states=True)
    torch.testing.assert_close(rest, states[:, 5:], rtol=1e-5, atol=1e-6)


def test_a_prompt_continues_from_a_given_initial_state():
    inp = small("mamba2")
    inp.initial_state = torch.randn(inp.state_shape) * 0.1
    _, _, states = reference_decode(inp, return_states=True)
    torch.testing.assert_close(kinds.after_prompt(inp, 3).initial_state, states[:, 2], rtol=1e-6, atol=1e-7)


def test_no_prompt_is_the_inputs_themselves():
    inp = small("gdn")
    assert kinds.after_prompt(inp, 0) is inp


@pytest.mark.parametrize("bad", [-1, 12, 13, 2.5, True, "4"])
def test_a_prompt_that_leaves_nothing_to_decode_is_refused(bad):
    with pytest.raises(ValueError, match=r"prompt must be a whole number of steps in \[0, 12\)"):
        kinds.after_prompt(small("kda"), bad)


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "fp8_e4m3:head", "nvfp4", "int8:sr", "nvfp4:sr"])
def test_each_variant_stores_the_initial_state_once_in_its_format(name):
    inp = small("mamba2")
    s0 = torch.randn(inp.state_shape) * 0.3
    inp.initial_state = s0
    v = parse_variant(name)
    (got,) = stored_initial_states(inp, [v])
    uniform = bits = None
    if v.format.rounding is formats.Rounding.SR:
        bits = keyed_bits(stream_key(v.seed, INITIAL_STREAM), element_index(inp.state_shape, "cpu"))
        uniform = uniform_from_bits(bits)
    want = encode(v.format, s0, uniform=uniform, bits=bits).decode(v.format)
    assert torch.equal(got, want)
    assert torch.equal(got, s0) == (name == "fp32")
    assert stored_initial_states(small("mamba2"), [v]) is None  # no initial state: zeros, stored exactly


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("name", ["int8@conventional", "fp8_e4m3@replay4", "nvfp4:sr@conventional"])
def test_decoding_starts_from_the_stored_state_while_the_reference_starts_exact(kind, name):
    inp = kinds.after_prompt(small(kind, steps=16), 8)
    v = parse_variant(name)
    res = emulate(inp, [v], return_states=True)
    (stored,) = stored_initial_states(inp, [v])
    physics = kinds.of(inp).physics(inp)
    buffered = physics.buffered(v.scheme.buffer_torch_dtype if v.scheme.rounds_buffer else torch.float32)
    s1, _ = physics.advance(stored, 0, buffered)
    if v.scheme.write_mask(inp.batch, inp.steps)[0, 0]:  # conventional: stored again after the step
        store = StateStore(v.format, inp.state_shape, inp.device, v.seed, v.static_scale)
        s1 = store(s1, store.key(0))
    assert torch.equal(res.states[0][:, 0], s1)
    # the reference starts from the prompt's state itself: its first step is the exact one
    ref1, _ = physics.advance(inp.initial_state.float(), 0)
    assert torch.equal(res.ref_states[:, 0], ref1)
    # the store is visible from the first decode step on: a nonzero error where the format rounds
    assert res.metrics[0, 0, ..., 0].sum() > 0


def test_fp32_state_after_a_prompt_has_no_error_and_8bit_has_one_from_the_first_step():
    inp = kinds.after_prompt(small("gdn", steps=20), 10)
    tr = simulate(inp, ["fp32", "fp32@replay4:fp32", "int8", "int8@replay4"], record_every=1)
    err = tr.rel_err("state", per_head=True, per_batch=True)  # [V, R, B, H]
    assert float(err[0].max()) == 0.0 and float(err[1].max()) == 0.0
    assert float(err[2, 0].min()) > 0 and float(err[3, 0].min()) > 0  # every sequence and head, from step 1


def test_a_nan_in_the_prompt_is_refused_before_it_becomes_a_nan_state():
    inp = MAKERS["gdn"](batch=1, steps=12, dk=48)  # not validated
    inp.v[0, 2, 0, 0] = float("nan")
    with pytest.raises(kinds.InputError, match="v contains NaN/Inf"):
        kinds.after_prompt(inp, 5)
