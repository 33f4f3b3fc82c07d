"""Engine profiles: the flashinfer profile equals the engine's per-call re-computation, torch and Triton
agree, and what the engine cannot run is refused with its own constraint.

The per-call re-computation (`engines.flashinfer.checkpointing_ssu_reference`) is what the GPU oracle
compares with the real kernel; the profile (`engines.emulation`, `kernels.mamba2_engine`) reorganises it
for a whole trajectory with precomputed coefficient tables. Checkpoints must agree bit for bit; outputs
(stored in bf16 by the engine) to one bf16 ulp, as the coefficient dot products are summed by
different torch routines.
"""

import numpy as np
import pytest
import torch

from lab.engines.oracle import bf16_inputs
from ssmquant.engines import flashinfer as fi
from ssmquant.engines import philox
from ssmquant.engines.emulation import engine_step
from ssmquant.kinds import Mamba2Inputs
from ssmquant.models.synthetic import synthetic_inputs
from ssmquant.replay import VariantError, emulate, parse_variant
from ssmquant.simulate import simulate, triton_interpreting


def _layer(steps, heads=2, p=64, n=128, batch=1):
    inp = bf16_inputs(synthetic_inputs("nemotron-3-nano", 0, batch=batch, steps=steps))
    return Mamba2Inputs(
        x=inp.x[:, :, :heads, :p], dt=inp.dt[:, :, :heads], B=inp.B[:, :, :1, :n], C=inp.C[:, :, :1, :n],
        A=inp.A[:heads], D=inp.D[:heads],
    ).validate()  # fmt: skip


def _per_call(inp, state, window, seed, sr):
    """Drive the per-call re-computation one token per call; returns (stored states after each write, outputs)."""
    bsz, steps, heads, p = inp.x.shape
    n = inp.state_dim
    dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}[state]
    st = torch.zeros(bsz, heads, p, n, dtype=dtype)
    sc = torch.ones(bsz, heads, p) if dtype in fi.EIGHT_BIT else None
    ring = window + 1
    xc = torch.zeros(bsz, heads, ring, p, dtype=torch.bfloat16)
    bc = torch.zeros(bsz, 1, ring, n, dtype=torch.bfloat16)
    dc = torch.zeros(bsz, heads, ring)
    start = torch.zeros(bsz, dtype=torch.int32)
    pnat = torch.zeros(bsz, dtype=torch.int32)
    stored, outs = {}, []
    for t in range(steps):
        prev = int(pnat[0])
        rs = philox.engine_seed(seed, t) if sr else None
        y = fi.checkpointing_ssu_reference(
            st, sc, xc, bc, dc, start, pnat, inp.x[:, t : t + 1], inp.dt[:, t : t + 1], inp.A,
            inp.B[:, t : t + 1], inp.C[:, t : t + 1], inp.D, rand_seed=rs,
        )  # fmt: skip
        outs.append(y[:, 0])
        if prev + 1 > window:  # this call flushed the ring of steps t - window .. t - 1
            stored[t - 1] = fi.dequantize_state(st, sc).clone()
            start = (start + prev) % ring
            pnat.fill_(1)
        else:
            pnat += 1
    return stored, torch.stack(outs, 1)


@pytest.mark.parametrize(
    "spec", ["int8@replay4", "int8:sr@replay4", "fp8_e4m3@replay8", "fp8_e4m3:sr@replay16", "bf16@replay4", "fp32@replay8"]
)
def test_flashinfer_profile_equals_the_per_call_recomputation(spec):
    inp = _layer(26)
    v = parse_variant(spec + "~flashinfer", seed=5)
    res = emulate(inp, [v], return_outputs=True, return_states=True, engine_steps=engine_step)
    stored, outs = _per_call(inp, v.format.encoding.value, v.scheme.buffer_len, 5, ":sr" in spec)
    assert stored, "no flush in the horizon"
    for t, s in stored.items():
        assert torch.equal(res.states[0][:, t], s), f"checkpoint after step {t}"
    got = res.outputs[0].to(torch.bfloat16)
    same = (got.view(torch.int16) == outs.view(torch.int16)).float().mean()
    assert same >= 0.98, float(same)
    ulp = (got.float() - outs.float()).abs() <= outs.float().abs() * 2.0**-7 + 1e-30
    assert bool(ulp.all())


def test_flashinfer_profile_conventional_is_the_ideal_arithmetic_except_the_sr_stream():
    inp = _layer(12, p=16, n=32)
    ideal = simulate(inp, ["bf16@conventional", "int16@conventional"], record_every=1)
    prof = simulate(inp, ["bf16@conventional", "int16@conventional"], record_every=1, engine="flashinfer")
    assert prof.variants == ["bf16@conventional~flashinfer", "int16@conventional~flashinfer"]
    assert prof.meta["engines"] == ["flashinfer"]
    np.testing.assert_array_equal(prof.rel_err("state"), ideal.rel_err("state"))
    # fp16 SR: the engine's stream and software conversion, which flushes magnitudes below 2^-14 (fp16
    # subnormals) to zero: a state of small elements loses more than under the ideal's unbiased SR
    a = simulate(inp, ["fp16:sr@conventional"], engine="flashinfer").rel_err("state")
    b = simulate(inp, ["fp16:sr@conventional"]).rel_err("state")
    assert not np.array_equal(a, b)
    tiny = torch.tensor([3e-5, -5e-5, 2.0**-14, 1.5])
    assert philox.sr_fp16(tiny, torch.zeros(4, dtype=torch.int64)).tolist() == [0.0, 0.0, 2.0**-14, 1.5]


@pytest.mark.parametrize(
    "spec, shape, message",
    [
        ("int8@replay16", (32, 128), "head_dim 64 and d_state 128"),
        ("int8@conventional", (64, 128), "selective_state_update stores"),
        ("nvfp4@replay16", (64, 128), "checkpointing_ssu stores"),
        ("bf16:sr@replay16", (64, 128), "to nearest"),
        ("bf16:sr@conventional", (64, 128), "only fp16"),
        ("int8@spec16x4", (64, 128), "one token per call"),
        ("fp8_e4m3:head@replay16", (64, 128), "(head, dim) row"),
        ("bf16@replay16:fp32", (64, 128), "2-byte input dtype"),
    ],
)
def test_flashinfer_profile_refuses_what_the_engine_cannot_run(spec, shape, message):
    inp = _layer(4, p=shape[0], n=shape[1])
    with pytest.raises(VariantError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate(inp, [spec], engine="flashinfer")


def test_unknown_engine_and_gdn_layers_are_refused():
    with pytest.raises(VariantError, match="accepted: ideal, flashinfer, vllm, trtllm, sglang"):
        parse_variant("int8@replay16~lmdeploy")
    gdn = synthetic_inputs("qwen3.5-0.8b", 0, batch=1, steps=4)
    with pytest.raises(VariantError, match="gdn layer is not modelled"):
        simulate(gdn, ["bf16@conventional"], engine="flashinfer")


@pytest.mark.parametrize("kind", ["int8", "e4m3", "fp16"])
def test_engine_stochastic_conversions_are_unbiased(kind):
    """Statistical equivalence of the engine's SR (floor(v + r) for int8, add-and-truncate for e4m3 and
    fp16) to unbiased rounding: the mean over 2^16 draws equals the value within sampling error."""
    g = torch.Generator().manual_seed(0)
    v = (torch.rand(64, generator=g) * 200 - 100) if kind == "int8" else torch.randn(64, generator=g) * 50
    draws = torch.randint(0, 2**32, (4096, 64), generator=g, dtype=torch.int64)
    vv = v.expand_as(draws)
    if kind == "int8":
        q = philox.sr_int8(vv, draws & 0xFFFF)
        step = torch.ones_like(v)
    elif kind == "e4m3":
        q = philox.sr_e4m3(vv, draws & 0xFFFF)
        step = torch.exp2(torch.floor(torch.log2(v.abs())) - 3)
    else:
        q = philox.sr_fp16(vv, draws)
        step = torch.exp2(torch.floor(torch.log2(v.abs())) - 10)
    assert bool(((q.max(0).values - q.min(0).values) <= step * (1 + 1e-6)).all()), "two neighbouring grid values"
    err = (q.mean(0) - v).abs() / step  # in grid steps; the sd of a mean of 4096 draws is <= 0.5 / 64
    assert float(err.max()) < 4 * 0.5 / 64 + 2**-16, float(err.max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "spec",
    ["int8@replay4", "fp8_e4m3:sr@replay8", "int8:sr@replay4", "bf16@replay4", "fp16:sr@conventional", "int16@conventional"],
)
def test_triton_engine_kernel_matches_the_torch_profile(spec):
    from ssmquant.kernels import emulate_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    inp = _layer(21, heads=2, p=12, n=48, batch=2).to(dev)
    v = [parse_variant(spec + "~flashinfer", seed=3)]
    ref = emulate(inp, v, engine_steps=engine_step).metrics[0].cpu().numpy()
    got = emulate_triton(inp, v)[0].cpu().numpy()
    # same codes at every write: state errors agree to FP32 summation noise (a flipped code would
    # move a head's error by ~1e-3 of itself); outputs sum their dot products in another order
    for e, r, share in ((0, 1, 1e-5), (2, 3, 1e-3)):
        dev_ = np.abs(np.sqrt(got[..., e]) - np.sqrt(ref[..., e]))
        assert (dev_ <= 1e-6 * np.sqrt(ref[..., r]) + share * np.sqrt(ref[..., e])).all(), (e, float(dev_.max()))
    np.testing.assert_allclose(got[..., 1], ref[..., 1], rtol=1e-5)


def test_sglang_profile_computes_as_the_kernels_it_runs():
    """SGLang's Mamba-2 decode is FlashInfer's selective_state_update (--mamba-backend flashinfer): the sglang
    profile's numbers are the flashinfer profile's, its fp16 stochastic rounding included; its GDN / KDA decode is
    fla's fused recurrent arithmetic: the ideal profile's numbers. A ReplaySSM ring in the SSM dtype runs."""
    from ssmquant.engines.profiles import arithmetic

    assert [arithmetic("sglang", k) for k in ("mamba2", "gdn", "kda")] == ["flashinfer", "ideal", "ideal"]
    m = synthetic_inputs("nemotron-3-nano", 0, batch=1, steps=24)
    for v in ("fp16:sr@conventional", "bf16@conventional"):
        a = simulate(m, [f"{v}~sglang"]).to_frame()
        b = simulate(m, [f"{v}~flashinfer"]).to_frame()
        assert a["out_rel_err"].tolist() == b["out_rel_err"].tolist(), v
    gdn = synthetic_inputs("qwen3.5-0.8b", 0, batch=1, steps=24)
    a = simulate(gdn, ["bf16@replay16:bf16~sglang"]).to_frame()
    b = simulate(gdn, ["bf16@replay16:bf16"]).to_frame()
    assert a["out_rel_err"].tolist() == b["out_rel_err"].tolist()


@pytest.mark.parametrize(
    "kind,variant,words",
    [
        ("mamba2", "int8@conventional~sglang", "live SSM state is float32, bfloat16 or float16"),
        ("mamba2", "bf16@replay16~sglang", "decodes Mamba-2 layers conventionally"),
        ("mamba2", "bf16:sr@conventional~sglang", "requires --mamba-ssm-dtype float16, got 'bf16'"),
        ("gdn", "fp16:sr@conventional~sglang", "GDN and KDA decode take no rounding option"),
        ("gdn", "bf16@replay16:fp32~sglang", "ring holds the inputs in the SSM dtype"),
        ("gdn", "bf16@spec8x2:p0.5~sglang", "use fp32 state"),
    ],
)
def test_sglang_profile_refuses_what_sglang_does_not_run(kind, variant, words):
    preset = "nemotron-3-nano" if kind == "mamba2" else "qwen3.5-0.8b"
    inp = synthetic_inputs(preset, 0, batch=1, steps=4)
    with pytest.raises(VariantError, match=words):
        simulate(inp, [variant])
