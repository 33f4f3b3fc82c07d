"""The CUDA KDA kernel (`ssmquant.kernels.kda_cuda`): which variants it takes, that its source compiles for an H100 /
H200 without spilling (NVRTC, no GPU needed), and on a CUDA GPU its FP8 rounding against torch's cast over every
finite FP32 value and its metrics against the naive reference with the Triton kernel's tolerances
(test_kda_kernel.py: SLACK, REF_RTOL).
"""

import math
import re

import pytest
import torch

from ssmquant.kernels import emulate_triton, fused_kernels, kda_cuda
from ssmquant.replay import parse_variant, parse_variants
from ssmquant.simulate import simulate

from ..replay.helpers import gdn_inputs, kda_inputs
from .nvrtc_offline import nvrtc_compile, nvrtc_library
from .test_emulation_kernels import assert_metrics_close
from .test_kda_kernel import REF_RTOL, SLACK

pytestmark = pytest.mark.gpu  # runs on a CUDA GPU at the real shapes when one is present (`pytest -m gpu`)

GPU = torch.cuda.is_available() and kda_cuda.available(torch.device("cuda"))
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU of compute capability >= 8.9")

ELIGIBLE = [
    "fp8_e4m3@conventional",
    "int8@conventional",
    "fp8_e4m3@replay16",
    "int8@replay4",
    "fp8_e4m3@spec8x2:p0.5",
    "int8@replay4:fp32",
    "fp8_e4m3@replay4:fp16",
]
NOT_ELIGIBLE = [
    "nvfp4@conventional",
    "fp8_e4m3:sr@conventional",
    "fp8_e4m3:head@replay4",
    "int8:rows4@conventional",
    "bf16@conventional",
    "fp16@replay4",
    "fp32@conventional",
]


@pytest.mark.parametrize("name", ELIGIBLE + NOT_ELIGIBLE)
def test_eligible_variants(name):
    """8-bit RNE with dynamic per-row scales on KDA heads of Dk = 128 and Dv a multiple of 16; nothing else."""
    v = parse_variant(name)
    assert kda_cuda.eligible(v, "kda", 128, 128) is (name in ELIGIBLE)
    assert not kda_cuda.eligible(v, "gdn", 128, 128)
    assert not kda_cuda.eligible(v, "kda", 64, 128)  # the kernel is written for Dk = 128
    assert not kda_cuda.eligible(v, "kda", 128, 24)  # rows in warps of 16


def test_cpu_inputs_run_in_triton(monkeypatch):
    inp = kda_inputs(batch=1, steps=3, key_heads=1, value_heads=1, dk=128, dv=16)
    assert fused_kernels(inp, parse_variants(ELIGIBLE)) == ["triton"] * len(ELIGIBLE)
    assert not kda_cuda.available(torch.device("cpu"))
    monkeypatch.setenv("SSMQUANT_KDA_CUDA", "0")
    assert not kda_cuda.available(torch.device("cuda"))


def test_write_masks_are_cached_per_scheme_and_shape():
    """The launch path reuses one device mask per (scheme, batch, steps, device): equal to the scheme's own mask."""
    from ssmquant.kernels.host import write_mask_on

    scheme = parse_variant("int8@spec8x2:p0.5").scheme
    mask, always = write_mask_on(scheme, 3, 40, torch.device("cpu"))
    assert torch.equal(mask, scheme.write_mask(3, 40).to(torch.int8)) and not always
    assert write_mask_on(scheme, 3, 40, torch.device("cpu"))[0] is mask
    assert write_mask_on(parse_variant("int8").scheme, 3, 40, torch.device("cpu"))[1]  # conventional: every step


# --- the source, compiled without a GPU ------------------------------------------------------------------------------


needs_nvrtc = pytest.mark.skipif(
    nvrtc_library() is None, reason="needs the nvidia-cuda-nvrtc wheel (pip install -e .[dev])"
)


@needs_nvrtc
@pytest.mark.parametrize("fmt", [3, 4])
@pytest.mark.parametrize(
    "buf,always,has_s0,qk",
    [
        (0, True, False, torch.float32),
        (0, True, True, torch.bfloat16),
        (1, False, False, torch.float32),
        (2, False, True, torch.bfloat16),
        (0, False, False, torch.float16),
    ],
)
def test_source_compiles_for_sm90(fmt, buf, always, has_s0, qk):
    """Every configuration compiles for sm_90; the conventional ones (buffer-free, the speed bar's) without a spill:
    a spill there would cost the kernel its speed (benchmarks/RESULTS.md)."""
    source = kda_cuda.kernel_source(fmt, buf, always, has_s0, qk, torch.bfloat16)
    rc, log, _ = nvrtc_compile(source, [*kda_cuda.NVRTC_OPTIONS, "--ptxas-options=-v"])
    assert rc == 0, log
    usage = re.search(
        r"Compiling entry function 'kda_emulate_8bit'.*?(\d+) bytes spill stores.*?Used (\d+) registers", log, re.S
    )
    if usage is None:  # the pinned dev wheel (13.0.88) prints ptxas's usage; the NVRTC of a GPU machine's torch may not
        pytest.skip(f"this NVRTC's log has no ptxas resource usage: {log[-200:]!r}")
    if buf == 0 and always:
        assert int(usage.group(1)) == 0, f"spills {usage.group(1)} bytes"


# --- on a GPU ---------------------------------------------------------------------------------------------------------


@gpu_only
def test_e4m3_round_trip_matches_torch_cast_for_every_fp32_value():
    """Every finite FP32 value with |x| <= 448 (the dynamic scales keep |x| <= 448 (1 + 2^-23)), both signs, against
    torch's float8_e4m3fn cast; values up to 464 round to +-448 (saturating), as RNE does."""
    top = int(torch.tensor([448.0]).view(torch.int32))
    chunk = 1 << 27
    for sign in (0, -(2**31)):
        for lo in range(0, top + 1, chunk):
            bits = torch.arange(lo, min(lo + chunk, top + 1), device="cuda", dtype=torch.int64)
            if bits.numel() % 2:  # the kernel rounds pairs
                bits = torch.cat([bits, bits[-1:]])
            x = (bits + sign).to(torch.int32).view(torch.float32)
            got = kda_cuda.round_e4m3(x)
            want = x.to(torch.float8_e4m3fn).float()
            assert torch.equal(got, want), f"mismatch near {x[(got != want).nonzero()[0]].item()}"
    edge = torch.tensor([448.0 * (1 + 2**-23), 463.99, -463.99, 2.0**-10, -(2.0**-10), 2.0**-9 * 1.5], device="cuda")
    assert kda_cuda.round_e4m3(edge).tolist() == [448.0, 448.0, -448.0, 0.0, -0.0, 2.0**-8]  # ties to even


def _full(**kw):
    return kda_inputs(batch=2, steps=96, key_heads=64, value_heads=64, dk=128, dv=128, device="cuda", **kw)


@gpu_only
@pytest.mark.parametrize("case", ["bf16", "fp32+s0", "grouped-heads"])
def test_cuda_kernel_matches_naive_reference(case):
    """GLM-5.3-Flash's head shapes; every eligible scheme and buffer dtype; bf16 or fp32 inputs, an initial state,
    two value heads per key head."""
    if case == "bf16":
        inp = _full()
    elif case == "fp32+s0":
        inp = _full(dtype=torch.float32)
        # a view 4 bytes past a 16-byte boundary: the kernel's 16-byte loads need (and get) an aligned copy
        flat = torch.randn(math.prod(inp.state_shape) + 1, device="cuda") * 0.1
        inp.initial_state = flat[1:].view(inp.state_shape)
    else:
        inp = kda_inputs(batch=2, steps=96, key_heads=8, value_heads=16, dk=128, dv=64, device="cuda")
    ref = simulate(inp, ELIGIBLE, backend="torch")
    got = simulate(inp, ELIGIBLE, backend="triton")
    assert set(got.meta["kernels"].values()) == {"cuda"}
    per_step = emulate_triton(inp, parse_variants(ELIGIBLE)).double().cpu().numpy()
    for i, name in enumerate(ELIGIBLE):
        try:
            assert_metrics_close(ref.mean[i], got.mean[i], SLACK, pooled=True, ref_rtol=REF_RTOL)
            assert_metrics_close(ref.mean[i], per_step[i], SLACK, pooled=True, ref_rtol=REF_RTOL)
        except AssertionError as err:
            raise AssertionError(f"{case} {name}: {err}") from None


@gpu_only
def test_cuda_and_triton_kernels_agree(monkeypatch):
    """The two kernels on the same layer, within the tests' bound; the other variants stay in Triton."""
    inp = _full()
    names = ELIGIBLE + ["nvfp4@conventional", "fp8_e4m3:sr@replay4"]
    cuda = emulate_triton(inp, parse_variants(names)).double().cpu().numpy()
    assert fused_kernels(inp, parse_variants(names)) == ["cuda"] * len(ELIGIBLE) + ["triton"] * 2
    monkeypatch.setenv("SSMQUANT_KDA_CUDA", "0")
    tri = emulate_triton(inp, parse_variants(names)).double().cpu().numpy()
    for i in range(len(names)):
        assert_metrics_close(tri[i], cuda[i], SLACK, pooled=True, ref_rtol=REF_RTOL)


@gpu_only
def test_gdn_never_takes_the_kda_kernel():
    inp = gdn_inputs(batch=1, steps=4, key_heads=2, value_heads=4, dk=128, dv=128, device="cuda")
    assert fused_kernels(inp, parse_variants(["fp8_e4m3@conventional"])) == ["triton"]
