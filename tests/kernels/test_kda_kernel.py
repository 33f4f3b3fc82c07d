"""The fused KDA kernel against the naive reference (`replay.naive`, state form).

Without a GPU: Triton's CPU interpreter on small awkward shapes (T=13, Dv=12, Dk=48, Hv = 2 Hk); on a
CUDA GPU: GLM-5.3-Flash's layer shape (64 heads x 128 x 128). Tolerances are GDN's
(tests/kernels/test_emulation_kernels.py): reference norms to 1e-5 relative; errors pooled over
(batch, head) per step within 1e-5 of the reference norm plus 10% of the error, because the reduction
S k that feeds the state runs in another order than torch's and a value within an ulp of a rounding
boundary can round the other way.
"""

import pytest
import torch

from ssmquant.kernels import emulate_triton
from ssmquant.replay import parse_variants
from ssmquant.simulate import simulate, triton_interpreting

from ..replay.helpers import kda_inputs
from .test_emulation_kernels import ENCODINGS, assert_metrics_close

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]
# Measured noise (`python lab/gpu/kernel_noise.py`, as test_emulation_kernels.py's SLACK): on an H200 at the GLM
# shapes 0.0015 (nvfp4:head@conventional; 9 of 37 variants above 0); in the interpreter's small shapes 0.0066
# (fp16@conventional). About twice the largest seen.
SLACK = 0.015
# The FP32 reference itself runs the reductions S k and S q every step in another order on the GPU, and the
# KDA decay is per key channel: at the full GLM shapes on an H200 one output norm of 24576 (a tiny one,
# 1.07e-8) differed by 2.0e-5 relative; 1e-4 bounds that float noise.
REF_RTOL = 1e-4


@pytest.fixture(autouse=True)
def triton_kernel_only(monkeypatch):
    """These tests are the Triton kernel's: on a GPU its 8-bit variants would otherwise run in the CUDA kernel
    (tested in test_kda_cuda.py)."""
    monkeypatch.setenv("SSMQUANT_KDA_CUDA", "0")


def small_or_full():
    if GPU:
        return kda_inputs(batch=2, steps=96, key_heads=64, value_heads=64, dk=128, dv=128, device=DEVICE)
    return kda_inputs(batch=1, steps=13, key_heads=1, value_heads=2, dk=48, dv=12)


def _variants():
    out = []
    for enc in ENCODINGS:
        for scheme in ("conventional", "replay4", "spec8x2:p0.5"):
            for rnd in ("", ":sr"):
                if enc == "fp32" and rnd:
                    continue
                out.append(f"{enc}{rnd}@{scheme}")
    return out + ["fp8_e4m3:head@replay4", "int8:rows4:sr@conventional", "nvfp4:head@conventional", "bf16@replay4:fp32"]


@pytest.mark.slow  # ~25 s in the interpreter: 43 variants
def test_kda_kernel_matches_naive_reference():
    inp = small_or_full()
    variants = _variants()
    ref = simulate(inp, variants, backend="torch")
    got = emulate_triton(inp, parse_variants(variants)).double().cpu().numpy()  # every step
    for i, name in enumerate(variants):
        try:
            assert_metrics_close(ref.mean[i], got[i], SLACK, pooled=True, ref_rtol=REF_RTOL)
        except AssertionError as err:
            raise AssertionError(f"kda {name}: {err}") from None
    assert (got[variants.index("fp32@conventional"), ..., 0] == 0).all()


def test_kda_kernel_with_initial_state_and_windows():
    inp = small_or_full()
    inp.initial_state = torch.randn(inp.state_shape, device=inp.device) * 0.1
    vs = ["int8@replay4", "nvfp4:sr", "fp8_e4m3@spec8x2:p0.5"]
    ref = simulate(inp, vs, backend="torch", record_every=3)
    got = simulate(inp, vs, backend="triton", record_every=3)
    assert got.meta["kind"] == "kda"
    for i in range(len(vs)):
        assert_metrics_close(ref.mean[i], got.mean[i], SLACK, pooled=True)
