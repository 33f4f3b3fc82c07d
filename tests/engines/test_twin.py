"""The flashinfer profile's Triton twin (`kernels.mamba2_engine`) against its torch reference (`engines.emulation`),
step by step: the states the twin carries must be the torch profile's bit for bit (`engines.twin`).

The probe fingerprints, at every step and per (batch, head), the state the metrics see, the checkpoint's codes
and its decode scales with an order-free integer sum, so the kernel's partial sums over row blocks and torch's
sum over the whole head give the same integer exactly when every bit agrees. Outputs and metrics are sums over
the state's last dimension in each backend's own order: compared with stated tolerances.
"""

import pytest
import torch

from ssmquant.engines.oracle import bf16_inputs
from ssmquant.engines.twin import bit_identical, compare_probes, fingerprint, probe_profile
from ssmquant.models.synthetic import synthetic_inputs
from ssmquant.replay import Mamba2Inputs, parse_variant
from ssmquant.replay.simulate import triton_interpreting

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
kernels = pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")


def _layer(steps=21, heads=2, p=12, n=48, batch=2) -> Mamba2Inputs:
    """The first heads / rows / state columns of the synthetic Nemotron-3-Nano layer, as the engines receive it."""
    inp = bf16_inputs(synthetic_inputs("nemotron-3-nano", 0, batch=batch, steps=steps))
    return Mamba2Inputs(
        x=inp.x[:, :, :heads, :p], dt=inp.dt[:, :, :heads], B=inp.B[:, :, :1, :n], C=inp.C[:, :, :1, :n],
        A=inp.A[:heads], D=inp.D[:heads],
    ).validate().to(DEV)  # fmt: skip


def test_fingerprint_is_order_free_and_sees_every_bit():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 8, 16, generator=g)
    fp = fingerprint(s)
    assert fp.shape == (2, 3) and fp.dtype == torch.int64
    # the kernel adds row blocks' partial sums: the same integer
    w = torch.arange(1, 8 * 16 + 1).reshape(8, 16)
    bits = s.view(torch.int32).to(torch.int64) * w
    assert torch.equal(bits[..., :4, :].sum((-1, -2)) + bits[..., 4:, :].sum((-1, -2)), fp)
    for change in ("one bit", "negative zero", "swap"):
        t = s.clone()
        if change == "one bit":
            t.view(torch.int32)[1, 2, 5, 7] ^= 1
        elif change == "negative zero":
            s[1, 2, 0, 0], t[1, 2, 0, 0] = 0.0, -0.0
            fp = fingerprint(s)
        else:
            t[1, 2, 0, 0], t[1, 2, 0, 1] = s[1, 2, 0, 1], s[1, 2, 0, 0]
        diff = fingerprint(t) != fp
        assert diff[1, 2] and int(diff.sum()) == 1, change
    scales = torch.rand(2, 3, 8, generator=g)
    assert fingerprint(scales, 1).shape == (2, 3)


@kernels
@pytest.mark.parametrize(
    "spec",
    ["int8@replay4", "int8:sr@replay4", "fp8_e4m3:sr@replay8", "fp8_e4m3@replay16", "bf16@replay4",
     "fp16:sr@replay4", "fp16:sr@conventional", "int16@conventional"],
)  # fmt: skip
def test_twin_states_are_the_torch_profiles_bit_for_bit(spec):
    from ssmquant.kernels.mamba2_engine import engine_probe

    inp = _layer()
    v = parse_variant(spec + "~flashinfer", seed=3)
    twin, prof = engine_probe(inp, v), probe_profile(inp, v)
    row = compare_probes(twin, prof, v)
    assert bit_identical(row), row
    kept = [n for n in ("state", "codes", "scales") if f"{n}_identical" in row]
    eight = spec.startswith(("int8", "fp8"))
    assert kept == ["state"] if "conventional" in spec else kept == ["state", "codes"] + ["scales"] * eight
    # outputs: the same terms summed in another order; |diff| within 4 FP32 ulps of the output's scale per head
    y_t, y_p = twin[2].cpu().double(), prof[2].cpu().double()
    scale = y_p.abs().amax(-1, keepdim=True)
    assert ((y_t - y_p).abs() <= 4 * 2.0**-23 * scale).all(), float(((y_t - y_p).abs() / scale).max())
    # the state error curve analyze reports agrees to FP32 summation noise; the output error's, per step and pooled,
    # to the output sums' noise (1e-6 of the output norm: it dominates an int16 state's tiny error) plus 1e-3 of itself
    assert row["state_rel_err_max_rel_diff"] < 1e-5, row
    m_t, m_p = twin[0].cpu().double().sum((1, 2)), prof[0].cpu().double().sum((1, 2))
    gap = (m_t[:, 2].sqrt() - m_p[:, 2].sqrt()).abs()
    assert (gap <= 1e-6 * m_p[:, 3].sqrt() + 1e-3 * m_p[:, 2].sqrt()).all(), float(gap.max())


@kernels
def test_the_probe_changes_no_metric():
    """The probe is a separately compiled kernel; its metrics must be the analysis kernel's, bit for bit."""
    from ssmquant.kernels import emulate_triton
    from ssmquant.kernels.mamba2_engine import engine_probe

    inp = _layer(steps=13)
    for spec in ("fp8_e4m3:sr@replay4", "fp16:sr@conventional"):
        v = parse_variant(spec + "~flashinfer", seed=1)
        assert torch.equal(engine_probe(inp, v)[0], emulate_triton(inp, [v])[0]), spec
