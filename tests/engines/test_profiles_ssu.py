"""The vllm / trtllm profiles: the torch step equals the per-call re-computation the GPU oracle checks against
the engines' kernels (`engines.triton_ssu`), the Triton backend agrees with torch bit for bit on states, GDN
layers under `vllm` are the ideal arithmetic, and what the engines cannot run is refused in their own words.
"""

import numpy as np
import pytest
import torch

from ssmquant.engines import triton_ssu
from ssmquant.engines.emulation import engine_step
from ssmquant.kinds import expand_groups
from ssmquant.models.synthetic import synthetic_inputs
from ssmquant.replay import VariantError, emulate, parse_variant
from ssmquant.simulate import simulate, triton_interpreting

from .test_profiles import _layer as nano_slice

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _layer(steps):
    return nano_slice(steps, heads=2, p=12, n=48, batch=2)


@pytest.mark.parametrize("engine", ["vllm", "trtllm"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_profile_step_equals_the_per_call_recomputation(engine, fmt):
    inp = _layer(9)
    res = emulate(inp, [parse_variant(f"{fmt}@conventional~{engine}")], return_states=True, engine_steps=engine_step)
    da = triton_ssu.ssu_decays(inp.A, inp.dt, engine)
    b = expand_groups(inp.B.float(), inp.num_heads)
    s = torch.zeros(inp.batch, inp.num_heads, inp.rows, inp.state_dim)
    for t in range(inp.steps):
        s = triton_ssu.ssu_update(s, da[:, t], inp.dt[:, t].float(), inp.x[:, t].float(), b[:, t]).to(DT[fmt]).float()
        assert torch.equal(res.states[0][:, t], s), t


def test_profile_differs_from_ideal_only_at_fp32_rounding():
    inp = _layer(64)
    res = emulate(
        inp, [parse_variant("fp32@conventional~vllm"), parse_variant("fp32@conventional")], return_states=True,
        engine_steps=engine_step,
    )
    a, b = res.states[0], res.states[1]
    assert not torch.equal(a, b)  # decay bits, order and FMA differ
    assert float((a - b).norm() / b.norm()) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("spec", ["fp32@conventional~vllm", "bf16@conventional~trtllm", "fp16:sr@conventional~vllm"])
def test_triton_backend_matches_torch(spec):
    from ssmquant.kernels import emulate_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    inp = _layer(13).to(dev)
    v = [parse_variant(spec, seed=5)]
    ref = emulate(inp, v, engine_steps=engine_step).metrics[0].cpu().numpy()
    got = emulate_triton(inp, v)[0].cpu().numpy()
    # identical states: the state error metric agrees to the metric's own FP32 summation order; outputs
    # (the kernel's tl.sum against torch's sum) within 1e-6 of the output norm
    np.testing.assert_allclose(got[..., 0], ref[..., 0], rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(got[..., 1], ref[..., 1], rtol=1e-5)
    dev_ = np.abs(np.sqrt(got[..., 2]) - np.sqrt(ref[..., 2]))
    assert (dev_ <= 1e-6 * np.sqrt(ref[..., 3]) + 1e-3 * np.sqrt(ref[..., 2])).all(), float(dev_.max())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vllm_gdn_is_the_ideal_arithmetic(backend):
    if backend == "triton" and not torch.cuda.is_available() and not triton_interpreting():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    gdn = synthetic_inputs("qwen3.5-0.8b", 0, batch=1, steps=6)
    a = simulate(gdn, ["bf16@conventional"], engine="vllm", backend=backend)
    b = simulate(gdn, ["bf16@conventional"], backend=backend)
    assert a.variants == ["bf16@conventional~vllm"] and b.variants == ["bf16@conventional"]
    np.testing.assert_array_equal(a.mean, b.mean)
    np.testing.assert_array_equal(a.last, b.last)


@pytest.mark.parametrize(
    "engine, spec, message",
    [
        ("vllm", "int8@conventional", "invalid choice"),
        ("trtllm", "fp8_e4m3@conventional", 'Literal\\["auto", "float16", "bfloat16", "float32"\\]'),
        ("vllm", "bf16:sr@conventional", "requires the SSM cache to be float16"),
        ("vllm", "int8@replay16", "float32, bfloat16, float16"),
        ("vllm", "bf16@replay16", "use ~flashinfer"),
        ("trtllm", "bf16@replay16", "Replay kernel requires speculative decoding"),
        ("trtllm", "fp16:sr@conventional", "not modelled"),
        ("vllm", "bf16@spec16x4", "not modelled"),
    ],
)
def test_refused_in_the_engines_words(engine, spec, message):
    with pytest.raises(VariantError, match=message):
        simulate(_layer(4), [spec], engine=engine)


def test_trtllm_gdn_and_vllm_gdn_sr_are_refused():
    gdn = synthetic_inputs("qwen3.5-0.8b", 0, batch=1, steps=4)
    with pytest.raises(VariantError, match="decode kernel was not read"):
        simulate(gdn, ["bf16@conventional"], engine="trtllm")
    with pytest.raises(VariantError, match="Gated DeltaNet"):
        simulate(gdn, ["fp16:sr@conventional"], engine="vllm")
