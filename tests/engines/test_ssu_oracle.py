"""vLLM's and TensorRT-LLM's own Triton decode kernels against the profiles' re-computation (ssmquant.engines.triton_ssu).

Runs wherever the kernels can: compiled on a CUDA GPU, or in the Triton interpreter on CPU (conftest sets
TRITON_INTERPRET=1 there), and only when the bundle's `ssu` folder is found (else skipped with the reason).
Thresholds: fp32 and fp16 states bit-identical after 16 steps (the re-computation has the kernels' decay
bits, operation order, FMA and store); bf16 on a GPU >= 99.9% (the float64-emulated FMA can differ at an
exact float32 tie, and a 1-ulp state difference can flip a later bf16 rounding). In the interpreter bf16 is
skipped: Triton 3.9's interpreter converts fp32 -> bf16 by truncation, not as the compiled kernel does.
"""

import os

import pytest
import torch

from lab.engines import oracle_ssu, vendored
from ssmquant.engines import triton_ssu

pytestmark = pytest.mark.gpu  # runs on a CUDA GPU at the real shapes when one is present (`pytest -m gpu`)


def _ssu_or_skip():
    try:
        return vendored.find_ssu_dir()
    except vendored.VendoredError as err:
        pytest.skip(str(err))


def _device():
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    return "cpu"


@pytest.mark.parametrize("engine", ["vllm", "trtllm"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_kernel_matches_profile(engine, dtype):
    _ssu_or_skip()
    dev = _device()
    if dtype == "bf16" and dev == "cpu":
        pytest.skip("the Triton interpreter truncates fp32 -> bf16; the compiled kernel rounds to nearest")
    shape = (2, 8, 64, 128, 2) if dev == "cuda" else (1, 4, 8, 16, 2)
    case = oracle_ssu.run_case(engine, dtype, 16, shape, dev)
    floor = 0.999 if dtype == "bf16" else 1.0
    assert case.identical_profile[16] >= floor, case.identical_profile
    assert case.curve_gap_profile <= 1e-3


def test_decays_are_exp_within_ulps():
    dev = _device()
    a = -(torch.rand(8) + 0.1)
    dt = torch.rand(3, 8) * 0.099 + 0.001
    for engine in ("vllm", "trtllm"):
        got = triton_ssu.ssu_decays(a.to(dev), dt.to(dev), engine).cpu()
        ref = torch.exp(dt * a)
        assert ((got - ref).abs() <= 8 * torch.finfo(torch.float32).eps * ref).all()


def test_fused_update_rounds_once():
    # fma(s, a, p) differs from s*a + p exactly where the product's rounding matters; the float64 form is
    # one rounding: it equals the exactly rounded sum for values whose products are exact in float64
    s = torch.tensor([[[[1.0 + 2**-23]]]])
    a = torch.tensor([[1.0 - 2**-24]])
    dt = torch.tensor([[1.0]])
    x = torch.tensor([[[-1.0]]])
    b = torch.tensor([[[1.0]]])
    fused = triton_ssu.ssu_update(s, a, dt, x, b, fused=True)
    split = triton_ssu.ssu_update(s, a, dt, x, b, fused=False)
    exact = (1.0 + 2**-23) * (1.0 - 2**-24) - 1.0
    assert float(fused) == pytest.approx(exact, rel=2**-24)
    assert float(split) != float(fused)


def test_missing_bundle_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("SSMQUANT_SSU", str(tmp_path))
    with pytest.raises(vendored.VendoredError, match="not bundled"):
        vendored.find_ssu_dir()
