"""The naive references: state form vs literal checkpoint+buffer form, scheme identities, simulate."""

import numpy as np
import pytest
import torch

from ssmquant import formats
from ssmquant.kinds import InputError
from ssmquant.replay import Variant, emulate, parse_variant, parse_variants, reference_decode
from ssmquant.replay.variants import VariantError
from ssmquant.simulate import BackendError, simulate

from .helpers import gdn_inputs, mamba2_inputs

KINDS = {"mamba2": mamba2_inputs, "gdn": gdn_inputs}
# FP32 arithmetic noise: the two forms sum the same terms in different orders (cumsum of dt and
# exp of differences vs step-by-step products), ~1e-7 relative per step, growing mildly with T.
FORM_TOL = 2e-5


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme", ["conventional", "replay1", "replay4", "replay16", "spec8x3:p0.6"])
def test_literal_form_equals_state_form_in_fp32(kind, scheme):
    """Awkward sizes (T=63, rows=60, state_dim=40); fp32 state, fp32 buffer: exact arithmetic equals."""
    inp = KINDS[kind]()
    v = [parse_variant(f"fp32@{scheme}" + (":fp32" if scheme != "conventional" else ""))]
    a = emulate(inp, v, form="state", return_outputs=True, return_states=True)
    b = emulate(inp, v, form="literal", return_outputs=True, return_states=True)
    assert rel(b.outputs[0], a.outputs[0]) < FORM_TOL
    assert rel(b.states[0], a.states[0]) < FORM_TOL
    y, s, _ = reference_decode(inp)
    assert rel(b.outputs[0], y) < FORM_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_literal_form_equals_state_form_at_real_sizes(kind):
    inp = mamba2_inputs(1, 24, 4, 64, 1, 128) if kind == "mamba2" else gdn_inputs(1, 24, 2, 4, 128, 128)
    v = [parse_variant("fp32@replay16:fp32"), parse_variant("fp32@replay16")]
    a = emulate(inp, v, form="state", return_outputs=True)
    b = emulate(inp, v, form="literal", return_outputs=True)
    for i in range(2):
        assert rel(b.outputs[i], a.outputs[i]) < FORM_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_forms_agree_on_quantized_error_traces(kind):
    """With rounding at flushes, FP32 noise can flip a rounding decision; the error traces still agree."""
    inp = mamba2_inputs(state=48) if kind == "mamba2" else gdn_inputs(dk=48)
    vs = parse_variants(["fp8_e4m3@replay8", "int8@replay16", "nvfp4@replay4"])
    a = simulate(inp, vs, form="state").rel_err("out")
    b = simulate(inp, vs, form="literal").rel_err("out")
    assert np.allclose(a, b, rtol=0.05, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "nvfp4", "bf16", "fp16", "int8:head"])
def test_replay1_equals_conventional_exactly(kind, fmt):
    """Inputs are bf16 (as models compute them), so a bf16 buffer stores Mamba-2 inputs losslessly; GDN
    buffers the computed u_t, so only an fp32 buffer makes replay(1) identical to conventional."""
    inp = KINDS[kind]() if fmt != "nvfp4" else (mamba2_inputs(state=48) if kind == "mamba2" else gdn_inputs(dk=32))
    buf = "" if kind == "mamba2" else ":fp32"
    vs = [parse_variant(f"{fmt}@conventional"), parse_variant(f"{fmt}@replay1{buf}")]
    r = emulate(inp, vs, return_outputs=True, return_states=True)
    assert torch.equal(r.states[0], r.states[1])
    assert torch.equal(r.outputs[0], r.outputs[1])
    assert torch.equal(r.metrics[0], r.metrics[1])


@pytest.mark.parametrize("kind", KINDS)
def test_spec_all_accepted_without_early_flush_equals_replay(kind):
    inp = KINDS[kind]()
    vs = parse_variants(["int8@spec16x1", "int8@replay16", "fp8_e4m3:sr@spec8x0", "fp8_e4m3:sr@replay8"])
    r = emulate(inp, vs, return_outputs=True)
    assert torch.equal(r.outputs[0], r.outputs[1]) and torch.equal(r.metrics[0], r.metrics[1])
    assert torch.equal(r.outputs[2], r.outputs[3])


@pytest.mark.parametrize("kind", KINDS)
def test_error_invariants(kind):
    """fp32 has zero error; bf16 error is above zero and below fp8's; replay16 beats conventional for fp8."""
    inp = KINDS[kind](steps=200)
    tr = simulate(inp, ["fp32", "fp32@replay16:fp32", "bf16", "fp8_e4m3", "fp8_e4m3@replay16"])
    final = tr.final("state")
    assert final["fp32@conventional"] == 0.0 and final["fp32@replay16:fp32"] == 0.0
    assert 0 < final["bf16@conventional"] < final["fp8_e4m3@conventional"]
    assert final["fp8_e4m3@replay16"] < final["fp8_e4m3@conventional"]


def test_sr_variants_are_reproducible_and_seed_dependent():
    inp = mamba2_inputs(steps=30)
    a = simulate(inp, [Variant(parse_variant("int8:sr").format, seed=1)]).mean
    b = simulate(inp, [Variant(parse_variant("int8:sr").format, seed=1)]).mean
    c = simulate(inp, [Variant(parse_variant("int8:sr").format, seed=2)]).mean
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_static_scale_variant():
    inp = mamba2_inputs(steps=40)
    _, s, states = reference_decode(inp, return_states=True)
    amax = states.abs().amax(dim=(0, 1, 4))  # [H, P] over time and batch: a max calibration
    v = Variant(formats.parse("int8:static"), seed=0, static_scale=amax / 127)
    tr = simulate(inp, [v, "int8"])
    assert 0 < tr.final()["int8:static@conventional"] < 0.05


def test_trace_frame_and_record_every():
    inp = mamba2_inputs(steps=40)
    tr = simulate(inp, "fp8_e4m3,fp8_e4m3@replay16", record_every=8)
    df = tr.to_frame()
    assert list(df.columns) == [
        "variant",
        "step",
        "window_start",
        "state_rel_err",
        "state_rel_err_max",
        "state_rel_err_last",
        "out_rel_err",
        "out_rel_err_max",
        "out_rel_err_last",
        "state_snr_db",
        "out_snr_db",
    ]
    assert df.step.unique().tolist() == [8, 16, 24, 32, 40]
    assert len(df) == 10 and df.state_rel_err.notna().all()
    ph = tr.to_frame(per_head=True)
    assert len(ph) == 10 * inp.num_heads and "head" in ph.columns
    assert tr.meta["kind"] == "mamba2" and tr.meta["backend"] == "torch"


def test_bad_inputs_name_the_tensor_and_shapes():
    inp = mamba2_inputs(steps=5)
    inp.C = inp.C[:, :, :, :-1]
    with pytest.raises(InputError, match=r"C has shape \(2, 5, 2, 39\), expected \(2, 5, 2, 40\)"):
        simulate(inp, "int8")
    inp = mamba2_inputs(steps=5)
    inp.x = inp.x.clone()
    inp.x[1, 3, 0, 0] = float("nan")
    with pytest.raises(InputError, match="x contains NaN/Inf \\(first at batch 1, step 3\\)"):
        simulate(inp, "int8")
    inp = mamba2_inputs(steps=5)
    inp.A = -inp.A
    with pytest.raises(InputError, match="A must be < 0"):
        simulate(inp, "int8")
    g = gdn_inputs(steps=5)
    g.q = g.q[:, :, :1]
    with pytest.raises(InputError, match="q has shape"):
        simulate(g, "int8")
    with pytest.raises(BackendError, match="unknown backend 'cuda'; accepted: auto, torch, triton"):
        simulate(mamba2_inputs(steps=5), "int8", backend="cuda")
    with pytest.raises(VariantError, match="cannot store a state of shape .*divisible by 16"):
        simulate(mamba2_inputs(steps=5), "nvfp4")
    bad = Variant(formats.parse("int8:static"), static_scale=torch.ones(3))
    with pytest.raises(VariantError, match="static_scale has shape \\(3,\\); expected \\(4, 60\\)"):
        simulate(mamba2_inputs(steps=5), [bad])


def test_validation_reads_the_values_back_once_and_reports_the_first_problem_in_order(monkeypatch):
    """validate() asks the device for all value checks at once, and still raises the error the checks one by
    one would: a NaN in x before a bad dtype of D, a bad shape of B before a NaN in C, dt's sign before A's."""
    inp = mamba2_inputs(steps=5)
    inp.x = inp.x.clone()
    inp.x[0, 2, 1, 1] = float("inf")
    inp.D = inp.D.to(torch.int32)
    with pytest.raises(InputError, match=r"x contains NaN/Inf \(first at batch 0, step 2\)"):
        inp.validate()
    inp = mamba2_inputs(steps=5)
    inp.B = inp.B[:, :4]
    inp.C = inp.C.clone()
    inp.C[0, 0, 0, 0] = float("nan")
    with pytest.raises(InputError, match=r"B has shape \(2, 4, 2, 40\), expected \(2, 5, 2, 40\)"):
        inp.validate()
    inp = mamba2_inputs(steps=5)
    inp.dt = -inp.dt
    inp.A = -inp.A
    with pytest.raises(InputError, match="dt must be > 0"):
        inp.validate()
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    mamba2_inputs(steps=5).validate()
    gdn_inputs(steps=5).validate()
    assert reads == [torch.Size([8]), torch.Size([7])]  # six / five tensors and their sign rules, one read each


def test_inputs_validated_unchanged_are_not_validated_again_and_a_change_is_caught(monkeypatch):
    """simulate skips validate() for inputs that passed it and are unchanged (same tensors, same in-place version
    counters, also through to() onto their own device); a replaced or in-place changed tensor is checked again."""
    from ssmquant.kinds import Mamba2Inputs, is_validated

    calls = []
    validate = Mamba2Inputs.validate
    monkeypatch.setattr(Mamba2Inputs, "validate", lambda self: calls.append(1) or validate(self))
    inp = mamba2_inputs(steps=5)
    assert not is_validated(inp)
    inp.validate()
    assert is_validated(inp) and is_validated(inp.to("cpu")) and len(calls) == 1
    simulate(inp.to("cpu"), "int8")
    assert len(calls) == 1
    inp.x[0, 1, 0, 0] = float("nan")  # in place: the version counter moves
    assert not is_validated(inp)
    with pytest.raises(InputError, match=r"x contains NaN/Inf \(first at batch 0, step 1\)"):
        simulate(inp, "int8")
    inp = mamba2_inputs(steps=5).validate()
    inp.D = inp.D.clone()
    assert not is_validated(inp)
    g = gdn_inputs(steps=5).validate()
    assert is_validated(g) and is_validated(g.to("cpu")) and not is_validated(g.slice_steps(0, 3))


def test_the_validation_record_keeps_no_tensor_alive():
    """The record of a passed validate() must not hold a tensor the container dropped (a replaced field, or the
    host copy that to() moved elsewhere): it would keep memory alive that the run believes freed."""
    import gc
    import weakref

    from ssmquant.kinds import is_validated

    inp = mamba2_inputs(steps=5).validate()
    old_x = weakref.ref(inp.x)
    inp.x = inp.x.clone()
    gc.collect()
    assert old_x() is None and not is_validated(inp)
    host = mamba2_inputs(steps=5).validate()
    host_dt = weakref.ref(host.dt)
    copy = host.to("meta")  # another device: every tensor copied (as to("cuda") does), the record carried along
    del host
    gc.collect()
    assert host_dt() is None and not is_validated(copy)


def test_triton_backend_on_cpu_tensors_outside_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="needs CUDA tensors"):
        simulate(mamba2_inputs(steps=5), "int8", backend="triton")
