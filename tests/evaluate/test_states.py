"""StateWriter on a stand-in cache: which rows and steps are stored, in which layout, with which random streams."""

from __future__ import annotations

import pytest
import torch

from ssmquant.evaluate import EvalError, SSMLayer, StateWriter, layer_seed
from ssmquant.evaluate.states import prepare_states
from ssmquant.formats.random import MASK32
from ssmquant.replay import parse_variant


class FakeCache:
    """The two cache methods the writer uses, over a dict of states."""

    def __init__(self, states: dict[int, torch.Tensor]):
        self.states = states

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.states.get(layer_idx)

    def update_recurrent_state(self, state, layer_idx, state_idx=0):
        self.states[layer_idx].copy_(state)
        return self.states[layer_idx]


def _states(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        0: torch.randn(3, 2, 8, 16, generator=g),  # Mamba-2 [B, H, P, N]
        2: torch.randn(3, 2, 16, 8, generator=g),  # GDN [B, Hv, Dk=16, Dv=8]
    }


LAYERS = [SSMLayer(0, "mamba2"), SSMLayer(2, "gdn")]
# Mamba-2 only: contiguous FP32 states, which the GPU path stores in place (kernels.store_state_triton); a GDN
# layer's rows are a transposed view, which takes fake_quant_triton and a copy
MAMBA_LAYERS = [SSMLayer(0, "mamba2"), SSMLayer(1, "mamba2")]


def _mamba_states(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {0: torch.randn(3, 2, 8, 16, generator=g), 1: 3 * torch.randn(3, 2, 8, 16, generator=g)}


def _kernel_available() -> bool:
    from ssmquant.simulate import triton_interpreting

    return torch.cuda.is_available() or triton_interpreting()


def _on_kernel_device(states: dict, kernel: bool) -> dict:
    """The states where the kernel path runs them: on the GPU where there is one (else the interpreter's CPU)."""
    dev = "cuda" if kernel and torch.cuda.is_available() else "cpu"
    return {k: s.to(dev) for k, s in states.items()}


def test_conventional_stores_every_layer_in_rows_layout():
    v = parse_variant("int8@conventional")
    before = _states()
    cache = FakeCache({k: s.clone() for k, s in before.items()})
    StateWriter(v, LAYERS, batch=3, steps=4)(cache, 2)
    fmt = v.format
    torch.testing.assert_close(cache.states[0], fmt.fake_quant(before[0], stream=2), rtol=0, atol=0)
    # GDN rows are value channels: quantised over Dk, i.e. on the transposed [B, Hv, Dv, Dk] state
    gdn = fmt.fake_quant(before[2].transpose(-1, -2), seed=layer_seed(0, 2), stream=2).transpose(-1, -2)
    torch.testing.assert_close(cache.states[2], gdn, rtol=0, atol=0)
    wrong = fmt.fake_quant(before[2], seed=layer_seed(0, 2), stream=2)
    assert not torch.equal(cache.states[2], wrong)


def test_replay_leaves_non_write_steps_untouched():
    v = parse_variant("nvfp4@replay4")
    writer = StateWriter(v, LAYERS, batch=3, steps=12)
    before = _states()
    for t in range(12):
        cache = FakeCache({k: s.clone() for k, s in before.items()})
        writer(cache, t)
        changed = any(not torch.equal(cache.states[k], before[k]) for k in before)
        assert changed == ((t + 1) % 4 == 0), t


def test_spec_writes_only_the_sequences_that_flush():
    v = parse_variant("fp8_e4m3@spec8x2:a0-2-1")
    writer = StateWriter(v, LAYERS, batch=3, steps=20)
    mask = v.scheme.write_mask(3, 20)
    assert torch.equal(writer.mask, mask)
    # make the rows' schedules differ: a per-sequence mask from a random acceptance rate
    v = parse_variant("fp8_e4m3@spec8x3:p0.5:seed3")
    writer = StateWriter(v, LAYERS, batch=3, steps=40)
    mixed = [t for t in range(40) if writer.mask[:, t].any() and not writer.mask[:, t].all()]
    assert mixed, "the test needs a step where only some sequences flush"
    t = mixed[0]
    before = _states(1)
    cache = FakeCache({k: s.clone() for k, s in before.items()})
    writer(cache, t)
    full = v.format.fake_quant(before[0], seed=layer_seed(v.seed, 0), stream=t)
    for b in range(3):
        expect = full[b] if writer.mask[b, t] else before[0][b]
        assert torch.equal(cache.states[0][b], expect), (b, t)


def test_fp32_is_never_touched_and_sr_streams_differ_per_step_and_layer():
    before = _states()
    cache = FakeCache({k: s.clone() for k, s in before.items()})
    StateWriter(parse_variant("fp32@conventional"), LAYERS, 3, 2)(cache, 0)
    assert all(torch.equal(cache.states[k], before[k]) for k in before)
    fmt = parse_variant("int8:sr").format
    x = before[0]
    assert not torch.equal(fmt.fake_quant(x, seed=0, stream=0), fmt.fake_quant(x, seed=0, stream=1))
    assert layer_seed(7, 0) == 7
    seeds = {layer_seed(7, i) for i in range(64)}
    assert len(seeds) == 64 and all(0 <= s <= MASK32 for s in seeds)


def test_missing_state_and_wrong_shape_are_named():
    cache = FakeCache({0: torch.zeros(3, 2, 8, 16)})
    with pytest.raises(EvalError, match="layer 2: the cache holds no recurrent state after decode step 5"):
        StateWriter(parse_variant("int8"), LAYERS, 3, 8)(cache, 5)
    with pytest.raises(EvalError, match=r"layer 0 \(mamba2\): the cached state has shape"):
        prepare_states(cache, LAYERS[:1], batch=3, state_shape=(2, 16, 8))


def test_prepare_states_switches_a_low_precision_state_to_fp32():
    class Layer:
        def __init__(self, s):
            self.recurrent_states = {0: s}

    class Cache(FakeCache):
        def __init__(self, s):
            self.layers = [Layer(s)]
            super().__init__({})

        def get_recurrent_state(self, layer_idx, state_idx=0):
            return self.layers[layer_idx].recurrent_states[0]

    cache = Cache(torch.randn(3, 2, 8, 16).bfloat16())
    notes = prepare_states(cache, LAYERS[:1], batch=3, state_shape=(2, 8, 16))
    assert cache.get_recurrent_state(0).dtype == torch.float32
    assert notes and "switched to float32" in notes[0]


def test_horizon_window_holds_whole_flush_cycles():
    from ssmquant.evaluate.metrics import horizon_window

    assert horizon_window(512, 0.1, 1) == 52
    assert horizon_window(512, 0.1, 16) == 64  # 52 rounded up to whole 16-step cycles
    assert horizon_window(20, 0.5, 16) == 16
    assert horizon_window(10, 0.5, 16) == 10  # capped at the run


@pytest.mark.parametrize(
    "spec", ["int8@conventional", "fp8_e4m3:sr", "nvfp4:sr", "nvfp4:head", "bf16:sr", "fp16", "int8:rows4:sr@spec8x3:p0.5:seed3"]
)
@pytest.mark.parametrize("group_elements", [2**25, 1])  # all layers in one group; one layer per group
def test_a_slice_of_a_folded_batch_is_stored_as_a_run_of_its_own(spec, group_elements, monkeypatch):
    """Variant slice = sequences 3..5 of a batch of 9: stored exactly as fake_quant stores that slice alone
    (same random words), layer by layer; the other sequences are not touched."""
    from ssmquant.evaluate import states

    monkeypatch.setattr(states, "WRITE_GROUP_ELEMENTS", group_elements)
    v = parse_variant(spec, seed=5)
    layers = [SSMLayer(0, "mamba2"), SSMLayer(1, "mamba2"), SSMLayer(3, "gdn"), SSMLayer(4, "gdn")]
    g = torch.Generator().manual_seed(2)
    before = {
        0: torch.randn(9, 2, 8, 16, generator=g),
        1: 30 * torch.randn(9, 2, 8, 16, generator=g),
        3: torch.randn(9, 2, 16, 8, generator=g),
        4: 1e-3 * torch.randn(9, 2, 16, 8, generator=g),
    }
    writer = StateWriter(v, layers, batch=3, steps=12)
    for t in range(12):
        if not writer.any[t]:
            continue
        cache = FakeCache({k: s.clone() for k, s in before.items()})
        writer(cache, t, 3)
        for layer in layers:
            x = before[layer.index]
            rows = x[3:6].transpose(-1, -2) if layer.kind == "gdn" else x[3:6]
            expect = v.format.fake_quant(rows, seed=layer_seed(v.seed, layer.index), stream=t)
            keep = writer.mask[:, t][:, None, None, None]
            expect = torch.where(keep, expect, rows)
            expect = expect.transpose(-1, -2) if layer.kind == "gdn" else expect
            got = cache.states[layer.index]
            torch.testing.assert_close(got[3:6], expect, rtol=0, atol=0)
            assert torch.equal(got[:3], x[:3]) and torch.equal(got[6:], x[6:])
    assert writer.first_nonfinite() is None


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,layers", [(False, LAYERS), (True, MAMBA_LAYERS)])
def test_a_non_finite_state_is_named_at_the_next_check(kernel, layers):
    if kernel and not _kernel_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    v = parse_variant("int8@conventional")
    make = _states if layers is LAYERS else _mamba_states
    states = _on_kernel_device(make(), kernel)
    bad = layers[1].index
    states[bad][1, 0, 3, 2] = float("nan")
    writer = StateWriter(v, layers, batch=3, steps=8, kernel=kernel)
    writer(FakeCache({k: s.clone() for k, s in _on_kernel_device(make(), kernel).items()}), 0)
    assert writer.first_nonfinite() is None
    writer(FakeCache(states), 1)  # no error here: the loop reads the flags once per window
    assert writer.first_nonfinite() == (
        f"variant int8@conventional, layer {bad}, decode step 1: cannot store the state: it contains NaN/Inf"
    )


# A finite state row whose amax lies below max_code / FLT_MAX (fp8_e4m3: 448 / 3.4e38 = 1.3e-36; int8: 3.7e-37)
# used to get an infinite encode multiplier (formats.codec.scales_from_amax), so its zero elements became
# 0 x inf = NaN: a candidate for the H200's folded nemotron-h-8b run that stopped at "fp8_e4m3@conventional,
# layer 44, decode step 110" (lab/gpu/eval_profile.sh dumps whether the input of that write was finite).
# Such a row is now stored as a zero row is, on the torch and the Triton path alike.
@pytest.mark.gpu
@pytest.mark.parametrize("kernel,layers", [(False, LAYERS), (True, LAYERS), (True, MAMBA_LAYERS)])
@pytest.mark.parametrize("spec", ["fp8_e4m3@conventional", "int8@conventional", "int8:sr@conventional"])
def test_a_finite_state_with_a_vanishing_row_is_stored_finite(spec, kernel, layers):
    if kernel and not _kernel_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    states = _on_kernel_device(_states() if layers is LAYERS else _mamba_states(), kernel)
    row = states[0][1, 0, 3]  # one Mamba-2 row (sequence 1, head 0, head_dim 3): finite, amax 1e-37, zeros
    row.zero_()
    row[5] = 1e-37
    writer = StateWriter(parse_variant(spec), layers, batch=3, steps=4, kernel=kernel)
    cache = FakeCache(states)
    writer(cache, 0)
    assert writer.first_nonfinite() is None
    assert torch.isfinite(cache.states[0]).all()
    assert (cache.states[0][1, 0, 3] == 0).all()  # rounds to zero, as a zero row


def test_a_non_finite_value_made_by_the_encode_is_told_from_a_non_finite_state(monkeypatch):
    from ssmquant.evaluate import states as states_module
    from ssmquant.formats.codec import Encoded, encode

    def nan_encode(fmt, x, **kw):
        e = encode(fmt, x, **kw)
        return Encoded(e.values * float("nan"), e.group_scale, e.block_scale)

    monkeypatch.setattr(states_module, "encode", nan_encode)
    writer = StateWriter(parse_variant("fp8_e4m3@conventional"), LAYERS, batch=3, steps=4, kernel=False)
    writer(FakeCache(_states()), 1)
    assert writer.first_nonfinite() == (
        "variant fp8_e4m3@conventional, layer 0, decode step 1: the state was finite but its stored fp8_e4m3 value "
        "is not (NaN/Inf made by the format's encode, e.g. a row whose amax is so small that max_code / amax "
        "overflows FP32)"
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "spec", ["fp8_e4m3@conventional", "int8:sr@conventional", "nvfp4@conventional", "bf16:sr@conventional",
             "nvfp4:sr@replay4", "fp8_e4m3:rows2@spec4x2"],
)  # fmt: skip
@pytest.mark.parametrize("mamba_only", [False, True])
def test_the_fused_kernel_write_gives_the_torch_bits(spec, mamba_only):
    # the GPU path (a Triton kernel per layer; here in Triton's interpreter) against the torch path, on a slice of
    # a folded batch; at steps where the scheme writes for all, some or none of the sequences. Mamba-2 only: the
    # in-place store_state_triton; with a GDN layer: fake_quant_triton and a copy.
    if not _kernel_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    v = parse_variant(spec, seed=5)
    layers, states = (MAMBA_LAYERS, _mamba_states(1)) if mamba_only else (LAYERS, _states(1))
    big = {k: torch.cat([s, s.flip(0) * 3, s * 0.5]).to(dev) for k, s in states.items()}  # 9 sequences
    writers = {k: StateWriter(v, layers, batch=3, steps=8, kernel=k) for k in (False, True)}
    caches = {k: FakeCache({i: s.clone() for i, s in big.items()}) for k in writers}
    for t in range(8):
        for k in writers:
            writers[k](caches[k], t, offset=3)
        for i in big:
            assert torch.equal(caches[True].states[i], caches[False].states[i]), (spec, t, i)
        got, want = writers[True].finite, writers[False].finite  # None until the first write
        assert (got is None and want is None) or torch.equal(got[: t + 1], want[: t + 1])
    assert (("flags", big[0].device) in writers[True]._on) == mamba_only  # the in-place kernel ran
    assert not torch.equal(caches[True].states[0], big[0])
    assert torch.equal(caches[True].states[0][:3], big[0][:3]) and torch.equal(caches[True].states[0][6:], big[0][6:])


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["fp8_e4m3@conventional", "int8:sr@replay4", "nvfp4@conventional"])
def test_in_place_and_copy_back_kernel_writes_give_the_same_bits(spec):
    # in_place=False takes fake_quant_triton + a copy back for every state (the earlier GPU writes, which
    # lab/gpu/eval_speed.py compares with); the default stores contiguous FP32 states in place
    if not _kernel_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    v = parse_variant(spec, seed=2)
    base = {k: s.to(dev) for k, s in _mamba_states(4).items()}
    base[1][2, 1, 5, 3] = float("inf")  # a non-finite state: flagged alike
    writers = {p: StateWriter(v, MAMBA_LAYERS, batch=3, steps=6, kernel=True, in_place=p) for p in (True, False)}
    caches = {p: FakeCache({i: s.clone() for i, s in base.items()}) for p in writers}
    for t in range(6):
        for p in writers:
            writers[p](caches[p], t)
        for i in base:
            assert torch.equal(caches[True].states[i].nan_to_num(7.0), caches[False].states[i].nan_to_num(7.0)), (t, i)
    assert torch.equal(writers[True].finite, writers[False].finite)
    assert writers[True].first_nonfinite() == writers[False].first_nonfinite() is not None
    flags = ("flags", base[0].device)
    assert flags in writers[True]._on and flags not in writers[False]._on  # which path each took
