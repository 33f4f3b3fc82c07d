"""The fused kernels' output mode (`kernels.emulate_triton_outputs`): each variant's per-step outputs, against the
torch reference's (`replay.naive.emulate(..., return_outputs=True)`).

The outputs' dot products (S C + D x, S q) sum in the kernel's order and, on a GPU, contract into FMAs; the
delta-rule kernel's state update is an FMA too (`kernels/delta_rule.py`), so a state element at a grid midpoint may
round the other way than torch's. The bound is the form of the kernels' metric bound (tests/kernels/
test_emulation_kernels.py) on the outputs: ||y_kernel - y_torch|| <= 1e-5 ||y_ref|| + slack ||y_torch - y_ref||,
norms over all steps, sequences and heads. Every format, rounding and scheme of the multi-variant
test, several variants per launch, an initial state and a prompt store. Tiny shapes in Triton's CPU interpreter;
the same shapes on a GPU.
"""

import pytest
import torch

from ssmquant.kernels import emulate_triton_outputs, fused_kernels
from ssmquant.kinds import after_prompt
from ssmquant.replay import emulate, parse_variants, reference_decode
from ssmquant.simulate import simulate_outputs, triton_interpreting

from .test_multi_variant import GPU, VARIANTS, tiny

pytestmark = pytest.mark.gpu

needs_triton = pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")

OUTPUT_RTOL = 1e-5
# Measured in the interpreter at these shapes: ||y_kernel - y_torch|| / ||y_ref|| <= 3.0e-5 (kda fp16:sr@conventional,
# one stochastic-rounding flip: 0.073 of that variant's error), every other variant <= 1.9e-7; about twice the largest.
SLACK = {"mamba2": 0.005, "gdn": 0.15, "kda": 0.15}


def _check(inputs, variants, dtype=torch.float32):
    got, final = emulate_triton_outputs(inputs, variants, dtype=dtype, final_state=True)
    ref = emulate(inputs, variants, return_outputs=True)
    _, s_ref, _ = reference_decode(inputs)
    # the reference's final state: bit for bit for Mamba-2 (no FMA in its update), within FP32 noise for the delta rule
    tol = 0.0 if inputs.kind == "mamba2" else OUTPUT_RTOL * s_ref.norm().item()
    assert (final - s_ref).norm().item() <= tol
    y_ref = ref.ref_outputs
    # rounding the outputs to a 16-bit dtype: up to half an ulp of each element, on top
    half_ulp = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    for v, g, want in zip(variants, got, ref.outputs):
        assert g.shape == want.shape and g.dtype == dtype, v.name
        err = (g.float() - want).norm().item()
        bound = (OUTPUT_RTOL + half_ulp) * y_ref.norm().item() + SLACK[inputs.kind] * (want - y_ref).norm().item()
        assert err <= bound, f"{v.name}: ||y_kernel - y_torch|| {err:.3g} > {bound:.3g}"
    return got, ref


@needs_triton
@pytest.mark.slow  # ~10 s each in the interpreter
@pytest.mark.parametrize("kind", ["mamba2", "gdn", "kda"])
def test_outputs_match_torch_reference(kind):
    inp = tiny(kind, batch=2, steps=7)
    variants = parse_variants(VARIANTS[:6])
    _check(inp, variants)
    # an FP32 variant's outputs are the reference's: within summation order, no slack
    (fp32,), ref = _check(inp, parse_variants(["fp32@conventional"]))
    assert (fp32 - ref.ref_outputs).norm() <= OUTPUT_RTOL * ref.ref_outputs.norm()


@needs_triton
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_outputs_after_prompt_store_and_in_model_dtype(kind):
    """A prompt's state as the initial state, stored once in each variant's format (its prompt store where named);
    outputs rounded to bfloat16 as the model takes them."""
    inp = tiny(kind, batch=2, steps=9)
    decode = after_prompt(inp, 3)
    variants = parse_variants(["int8@conventional", "fp8_e4m3@replay4", "bf16@conventional+int8col"])
    _check(decode, variants, dtype=torch.bfloat16)


def test_output_mode_refuses_engine_profiles():
    inp = tiny("mamba2", batch=1, steps=2)
    variants = parse_variants(["fp16@conventional~trtllm"])
    assert fused_kernels(inp, variants) == ["engine"]
    with pytest.raises(ValueError, match="ideal arithmetic only"):
        emulate_triton_outputs(inp, variants)


@needs_triton
def test_prompt_outputs_and_state():
    """An FP32 variant's outputs and the final state (a prompt's), from the kernel and the torch backend."""
    inp = tiny("gdn", batch=1, steps=5)
    y_ref, s_ref, _ = reference_decode(inp)
    for backend in ("triton", "torch"):
        (y,), final, ran = simulate_outputs(inp, ["fp32@conventional"], backend=backend, final_state=True)
        assert ran == backend and (final - s_ref).norm() <= OUTPUT_RTOL * s_ref.norm(), backend
        assert (y - y_ref).norm() <= OUTPUT_RTOL * y_ref.norm(), backend


@needs_triton
def test_simulate_outputs_backends_agree():
    """``simulate_outputs``: the kernels and the torch reference give the same outputs (the bound above), and an
    engine profile's variant takes the torch path under "auto"."""
    inp = tiny("mamba2", batch=1, steps=6)
    vs = ["int8@replay4", "fp16:sr@conventional"]
    fused = simulate_outputs(inp, vs, backend="triton").outputs
    torch_ = simulate_outputs(inp, vs, backend="torch").outputs
    for a, b in zip(fused, torch_):
        assert (a - b).norm() <= OUTPUT_RTOL * b.norm() + 1e-12
    engine = simulate_outputs(inp, ["fp16@conventional~trtllm"], backend="auto")
    assert engine.backend == "torch" and engine.outputs[0].shape == fused[0].shape
