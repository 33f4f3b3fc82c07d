"""The CUDA KDA kernel (`ssmquant.kernels.kda_cuda`): which variants it takes, that its source compiles for an H100 /
H200 without spilling (NVRTC, no GPU needed), the arithmetic of its NVFP4 element rounding (an exact transcription,
on the CPU), and on a CUDA GPU its FP8 rounding against torch's cast over every finite FP32 value, its NVFP4 write
bit for bit against `formats.codec` (crafted states that take its exact-division fallback, and every write of the
kernel's own states), and its metrics against the naive reference with the Triton kernel's tolerances
(test_kda_kernel.py: SLACK, REF_RTOL).
"""

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from ssmquant.formats import Encoding
from ssmquant.formats.codec import encode
from ssmquant.formats.grids import E2M1, round_to_grid
from ssmquant.kernels import emulate_triton, fused_kernels, kda_cuda
from ssmquant.kernels.delta_rule import delta_rule_operands
from ssmquant.kernels.host import write_mask_on
from ssmquant.replay import parse_variant, parse_variants
from ssmquant.simulate import simulate

from ..replay.helpers import gdn_inputs, kda_inputs
from .exact_fp32 import fma32, quotient_sequence, rn32
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
    "nvfp4@conventional",
    "nvfp4@replay4",
    "nvfp4@replay16:bf16",
]
NOT_ELIGIBLE = [
    "nvfp4:head@conventional",  # one second-level scale per head
    "nvfp4:rows4@replay4",
    "nvfp4:sr@conventional",
    "fp8_e4m3:sr@conventional",
    "fp8_e4m3:head@replay4",
    "int8:rows4@conventional",
    "bf16@conventional",
    "fp16@replay4",
    "fp32@conventional",
]


@pytest.mark.parametrize("name", ELIGIBLE + NOT_ELIGIBLE)
def test_eligible_variants(name):
    """8-bit or NVFP4 RNE with dynamic per-row scales on KDA heads of Dk = 128 and Dv a multiple of 16; nothing
    else."""
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


def test_format_codes_are_the_encodings_kernel_codes():
    """kda_cuda.cu branches on FMT 3 / 4 / 5: the codes of the Triton kernels (`Encoding.kernel_code`)."""
    assert kda_cuda._FORMATS == {e: e.kernel_code for e in (Encoding.FP8_E4M3, Encoding.INT8, Encoding.NVFP4)}
    assert (Encoding.FP8_E4M3.kernel_code, Encoding.INT8.kernel_code, Encoding.NVFP4.kernel_code) == (3, 4, 5)
    assert kda_cuda.kernel_source(5, 0, True, False, torch.float32, torch.float32).startswith("#define FMT 5\n")
    assert "#define QMAX 2688.0f" in kda_cuda.kernel_source(5, 0, True, False, torch.float32, torch.float32)


def _bits_f32(x: float, mask: int) -> float:
    """The FP32 value of x's bits and mask."""
    return float((np.array([x], np.float32).view(np.uint32) & np.uint32(mask)).view(np.float32)[0])


def _kernel_e2m1(v: float) -> float:
    """kda_cuda.cu's e2m1_rne(v) (the fallback's), operation for operation."""
    a = min(abs(v), 6.0)
    p = _bits_f32(max(a, 1.0), 0x7F800000)
    out = fma32(-p, 2.0**22, fma32(p, 2.0**22, a))
    return math.copysign(out, v)


def _kernel_e2m1_centred(v: float) -> float:
    """kda_cuda.cu's e2m1_rne_centred(v) (the fast path's, |v| < 7), operation for operation (each FMA rounded once)."""
    p = _bits_f32(max(abs(v), 1.0), 0x7F800000)
    return fma32(-p, 1.5 * 2.0**22, fma32(p, 1.5 * 2.0**22, v))


def test_nvfp4_element_rounding_arithmetic():
    """The kernel's two E2M1 roundings against formats.grids.round_to_grid, in exact arithmetic: the fallback's
    (e2m1_rne) everywhere, bit for bit; the fast path's (e2m1_rne_centred, |v| < 7) with the same values (a zero
    may come back +0 where the reference keeps -0), on random values and on values around every rounding midpoint
    and power of two, both signs."""
    rng = np.random.default_rng(0)
    vals = [*(rng.standard_normal(300) * 3), *rng.uniform(-7.0, 7.0, 300), 0.0, -0.0, 1e-30, -1e-30, 6.5, -6.9, 6.99]
    for m in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 6.5):
        spacing = 0.5 if m < 2 else 1.0 if m < 4 else 2.0
        for up in (np.float32(np.inf), np.float32(-np.inf)):
            y = np.float32(m)
            for _ in range(5):
                y = np.nextafter(y, up)
                vals += [float(y), -float(y)]
        vals += [s * (m + t * spacing * 2.0**-k) for s in (1, -1) for t in (1, -1) for k in (17, 18, 19)]
    vals = np.array(vals, dtype=np.float32)
    want = round_to_grid(torch.from_numpy(vals), E2M1).numpy()
    same = lambda a, b: np.float32(a).view(np.uint32) == np.float32(b).view(np.uint32)  # noqa: E731
    for v, w in zip(vals.tolist(), want.tolist()):
        assert same(_kernel_e2m1(v), w), (v, _kernel_e2m1(v), w)
        if abs(v) < 7.0:
            assert _kernel_e2m1_centred(v) == w, (v, _kernel_e2m1_centred(v), w)  # == : -0 == +0


def test_nvfp4_quotient_arithmetic():
    """The fast path's quotients (reciprocal, then Markstein's correction) are the correctly rounded ones, in exact
    arithmetic, at every E2M1 midpoint times decode scales d = bs s2 across the fast range, and 1-2 ulps beside."""
    bs_values = [k * 2.0**-9 for k in range(1, 8)] + [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    wrong, ties = [], 0
    for s2 in (2.0**-68 * 1.37, 1.3e-9, 0.77, 5.1e22, 2.0**90 * 0.93):
        for bs in bs_values[::3]:
            d = rn32(Fraction(bs) * Fraction(s2))
            for m in MIDPOINTS:
                x0 = np.float32(rn32(Fraction(m) * Fraction(d)))
                for x in (np.nextafter(np.nextafter(x0, np.float32(0)), np.float32(0)), np.nextafter(x0, np.float32(0)),
                          x0, np.nextafter(x0, np.float32(np.inf))):  # fmt: skip
                    exact = rn32(Fraction(float(x)) / Fraction(d))
                    ties += exact == m
                    if quotient_sequence(float(x), d) != exact:
                        wrong.append((float(x), d))
    assert not wrong, wrong[:4]
    assert ties > 50


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
@pytest.mark.parametrize("fmt", [3, 4, 5])
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
    from benchmarks.sass import _triton_bin, cubin_resources

    rc, log, cubin = nvrtc_compile(source, list(kda_cuda.NVRTC_OPTIONS))
    assert rc == 0, log
    if not _triton_bin("cuobjdump").exists():
        pytest.skip(f"no cuobjdump beside Triton ({_triton_bin('cuobjdump')}) to read the cubin's resource usage")
    usage = cubin_resources(cubin, "kda_emulate")
    assert usage["REG"] <= 255
    if buf == 0 and always:  # a spill lives in the stack frame (local memory)
        # These builds sit at 255 registers. One CI run saw a spilling build (STACK 8) of (fmt 5, has_s0, bf16) that
        # 12 compiles in one process and every other run did not give: a source change that spills spills in every
        # compile, so a spill is confirmed by two more compiles before the test fails, and a spill that does not
        # repeat is reported as a warning.
        usages = [usage]
        while (usages[-1]["STACK"] or usages[-1]["LOCAL"]) and len(usages) < 3:
            usages.append(cubin_resources(nvrtc_compile(source, list(kda_cuda.NVRTC_OPTIONS))[2], "kda_emulate"))
        assert usages[-1]["STACK"] == 0 and usages[-1]["LOCAL"] == 0, usages
        if len(usages) > 1:
            warnings.warn(f"NVRTC gave a spilling build before a spill-free one: {usages}", stacklevel=1)


@needs_nvrtc
@pytest.mark.parametrize(
    "buf,qk,is_async", [(0, torch.float32, True), (1, torch.float32, False), (0, torch.bfloat16, False)]
)
def test_step_vectors_load_by_cp_async_where_they_need_no_conversion(buf, qk, is_async):
    """fp32 q and k without a buffered copy of k travel to shared memory by cp.async (LDGSTS: no registers held in
    flight); otherwise through registers (their conversion on the way), in the machine code."""
    from benchmarks.sass import _triton_bin, kda_cuda_nvdisasm

    if not _triton_bin("nvdisasm").exists():
        pytest.skip(f"no nvdisasm beside Triton ({_triton_bin('nvdisasm')})")
    sass = kda_cuda_nvdisasm(5, buf, qk)
    body = sass[sass.index(".text.kda_emulate") :]
    assert ("LDGSTS" in body) is is_async


@needs_nvrtc
@pytest.mark.parametrize("always", [True, False])
def test_debug_states_build_compiles(always):
    """The tests' build (DEBUG_STATES: the state before and after every write) and the NVFP4 write check kernel."""
    source = kda_cuda.kernel_source(5, 0, always, True, torch.float32, torch.bfloat16, debug_states=True)
    rc, log, _ = nvrtc_compile(source, [*kda_cuda.NVRTC_OPTIONS])
    assert rc == 0, log


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
    names = ELIGIBLE + ["nvfp4:head@conventional", "fp8_e4m3:sr@replay4"]
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


# --- NVFP4, bit for bit ----------------------------------------------------------------------------------------------

NVFP4 = parse_variant("nvfp4").format
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # E2M1's rounding midpoints


def nvfp4_reference(x: torch.Tensor) -> torch.Tensor:
    """formats.codec's NVFP4 store and reload (per-row s2) of an fp32 state [..., rows, 128], on the CPU."""
    x = x.detach().float().cpu()
    return encode(NVFP4, x).decode(NVFP4)


def _near_midpoints(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """x [rows, 128] with every element but each block's largest moved to within a few ulps of (or onto) an E2M1
    rounding midpoint times its block's decode scale d (the row and block amax, so s2 and d, stay): every quotient
    x / d lies within 2^-20 spacings of a midpoint, where a quotient off by an ulp would round the other way."""
    enc = encode(NVFP4, x)
    d = (enc.block_scale * enc.group_scale[..., None]).repeat_interleave(16, -1)  # [rows, 128]
    mid = torch.tensor(MIDPOINTS)[torch.randint(len(MIDPOINTS), x.shape, generator=gen)]
    y = mid * d  # FP32 products: within half an ulp of the midpoint times d
    for _ in range(3):  # nudge some by an ulp or two either way
        step = torch.randint(-1, 2, x.shape, generator=gen)
        y = torch.where(step > 0, torch.nextafter(y, torch.full_like(y, math.inf)), y)
        y = torch.where(step < 0, torch.nextafter(y, torch.zeros_like(y)), y)
    y = y * torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
    blocks = x.abs().reshape(x.shape[0], -1, 16)
    keep = (blocks == blocks.amax(-1, keepdim=True)).reshape(x.shape)
    return torch.where(keep, x, y)


def crafted_nvfp4_states() -> list[tuple[str, torch.Tensor, bool | None]]:
    """(name, state [16, 128] fp32 on the CPU, whether its warp must take the exact-division fallback: True, False
    or None for either): random rows, rows near the E2M1 midpoints, zero rows and blocks, tiny and huge s2,
    E4M3 block-scale ties, clamped block scales, values on the grid."""
    gen = torch.Generator().manual_seed(7)
    rnd = lambda: torch.randn(16, 128, generator=gen)  # noqa: E731
    cases = [("gaussian", rnd(), None), ("gaussian x 1e-3", rnd() * 1e-3, None)]
    # the fast path's quotients are the correctly rounded ones: midpoints need no fallback
    cases.append(("near midpoints", _near_midpoints(rnd(), gen), False))
    cases.append(("near midpoints x 1e20", _near_midpoints(rnd() * 1e20, gen), False))
    zeros = rnd()
    zeros[0] = 0.0  # amax 0: s2 = 1
    zeros[1, 16:] = 0.0  # one nonzero block
    zeros[2, :112] = 0.0
    zeros[3] = 0.0
    zeros[3, 77] = -3.0  # a single element
    zeros[4:8, 32:64] = 0.0  # zero blocks beside nonzero ones
    cases.append(("zero rows and blocks", zeros, None))
    cases.append(("all zero", torch.zeros(16, 128), False))
    cases.append(("tiny s2 (< 2^-68)", rnd() * 2.0**-62, True))  # row amax < 2^-57: s2 < 2^-68
    cases.append(("s2 underflows to 0 (s2 = 1)", rnd() * 2.0**-142, None))
    huge = rnd().clamp(-3.0, 3.0) * 2.0**99
    huge[:, 5] = 2.0**101.5  # every row's amax > 2688 x 2^90
    cases.append(("huge s2 (> 2^90)", huge, True))
    cases.append(("large s2 (in range)", rnd() * 2.0**85, False))
    far = rnd()
    far[:, 16:32] *= 1e-35  # a block whose scale quotient bam / (6 s2) < 2^-100: its elements round to 0 either way
    cases.append(("block 10^35 below its row", far, False))
    gone = rnd() * 1e29  # s2 ~ 10^26, inside the fast range
    gone[:, 16:32] = rnd()[:, 16:32] * 1e-44  # subnormal blocks: their scale quotient underflows to 0 (the reference's
    # block scale: 1, the fast path's: 2^-9)
    cases.append(("block scale quotient underflows to 0", gone, False))
    sub = rnd().clamp(-2.9, 2.9)
    sub[:, 0] = 3.0  # the row amax: s2 = 3 / 2688
    # block amax / (6 s2) = 2.45 x 2^-9, an E4M3 subnormal that rounds down to 2 x 2^-9: quotients up to 7.35
    sub[:, 16:32] *= 6.0 * 3.0 / 2688.0 * 2.45 * 2.0**-9 / sub[:, 16:32].abs().amax(-1, keepdim=True)
    cases.append(("subnormal block scale rounded down (quotients > 6.5)", sub, True))
    ties = torch.rand(16, 128, generator=gen) * 2.0**-10
    ties[:, 0] = 2688.0  # s2 = 1, 6 s2 = 6
    ties[:, 16] = 6.0 * 1.0625  # bam / 6 on E4M3 midpoints (ties to even) ...
    ties[:, 32] = 6.0 * 1.1875
    ties[:, 48] = 6.0 * 1.5 * 2.0**-9  # ... also among its subnormals
    ties[:, 64] = 6.0 * 2.5 * 2.0**-9
    ties[:, 80] = 6.0 * (2.0**-6 + 2.0**-10)
    ties[:, 96] = 6.0 * 240.0  # 232 / 248 ... 240 is on the grid: its neighbours' midpoint is not
    ties[:, 112] = 6.0 * 232.0
    cases.append(("E4M3 block-scale ties", ties, None))
    clamp = rnd() * 1e-6
    clamp[:, 0] = 1e3  # the other blocks' bam / (6 s2) < 2^-9: block scales clamp to E4M3's smallest
    cases.append(("clamped block scales", clamp, None))
    enc = encode(NVFP4, rnd())
    d = (enc.block_scale * enc.group_scale[..., None]).repeat_interleave(16, -1)
    cases.append(("on the grid", enc.values * d, None))
    return cases


def bits_differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where got's bits differ from want's, other than a zero's sign: the fast path returns +0 where the reference
    keeps a -0 (no metric and no nonzero value sees it); the fallback keeps it."""
    return (got.view(torch.int32) != want.view(torch.int32)) & ~((got == 0) & (want == 0))


@gpu_only
def test_nvfp4_write_matches_codec_on_crafted_states():
    """The kernel's NVFP4 write (`kda_cuda.nvfp4_write`, the main kernel's device code) against formats.codec, bit
    for bit (a zero's sign aside); the crafted states that must take the exact-division fallback take it, and
    those that need not do not."""
    cases = crafted_nvfp4_states()
    x = torch.cat([c[1] for c in cases]).float()
    got, fallback = kda_cuda.nvfp4_write(x.cuda())
    want = nvfp4_reference(x)
    for i, (name, _, must) in enumerate(cases):
        g, w = got[16 * i : 16 * i + 16].cpu(), want[16 * i : 16 * i + 16]
        diff = bits_differ(g, w).nonzero()
        assert len(diff) == 0, (
            f"{name}: {len(diff)} elements differ, first {diff[0].tolist()}: {g[tuple(diff[0])]} vs {w[tuple(diff[0])]}"
        )
        if must is not None:
            assert bool(fallback[i]) is must, f"{name}: fallback {int(fallback[i])}"


@gpu_only
def test_nvfp4_write_matches_codec_on_random_states():
    """4096 random rows per scale, from 2^-120 to 2^120 (s2 inside and outside the fast path's range): bit for
    bit (a zero's sign aside); inside the range (unit scale, 2^-50, 2^50) no warp takes the fallback."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    for scale in (1.0, 2.0**-120, 2.0**-60, 2.0**-50, 2.0**50, 2.0**60, 2.0**120):
        x = torch.randn(4096, 128, device="cuda", generator=gen) * scale
        x[::7] *= torch.rand(x[::7].shape, device="cuda", generator=gen)  # uneven blocks
        got, fallback = kda_cuda.nvfp4_write(x)
        want = nvfp4_reference(x)
        assert not bits_differ(got.cpu(), want).any(), f"scale {scale}"
        if scale in (1.0, 2.0**-50, 2.0**50):
            assert not fallback.any(), f"scale {scale}: {int(fallback.sum())} fallbacks"


def _kernel_states(inp, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(metrics, states [T, 2, B, Hv, Dv, 128] on the CPU, write mask [B, T]) of variant `name` on inputs `inp`
    from the DEBUG_STATES build; its metrics must be the production build's, bit for bit."""
    v = parse_variant(name)
    ops = delta_rule_operands(inp)
    fmt, buf = kda_cuda.variant_config(v)
    bsz, steps, hv, dv = ops["v"].shape
    write, always = write_mask_on(v.scheme, bsz, steps, inp.device)
    s0 = None if inp.initial_state is None else inp.initial_state.float().contiguous()
    args = (ops["q"], ops["k"], ops["v"], ops["alpha"], ops["beta"], s0, write)
    states = torch.full((steps, 2, bsz, hv, dv, 128), math.nan, device=inp.device)
    metrics = kda_cuda.kda_cuda_launch(*args, fmt=fmt, buf=buf, always=always, states=states)
    plain = kda_cuda.kda_cuda_launch(*args, fmt=fmt, buf=buf, always=always)
    # the same bits (NaN where a huge crafted state overflows a metric)
    torch.testing.assert_close(metrics, plain, rtol=0, atol=0, equal_nan=True, msg="the DEBUG_STATES build differs")
    return metrics, states.cpu(), v.scheme.write_mask(bsz, steps)


def _assert_writes_match_codec(states: torch.Tensor, mask: torch.Tensor, label: str) -> None:
    """Every step's state after the write is the codec's store and reload of the state before it (write steps) or
    that state unchanged (steps that do not write), bit for bit (a zero's sign aside: `bits_differ`)."""
    pre, post = states[:, 0], states[:, 1]
    assert bool(torch.isfinite(pre).all()), label
    want = torch.where(mask.T[:, :, None, None, None], nvfp4_reference(pre), pre)
    bad = bits_differ(post, want).nonzero()
    assert len(bad) == 0, f"{label}: {len(bad)} elements differ, first at [t, b, h, row, col] = {bad[0].tolist()}"


@gpu_only
@pytest.mark.parametrize("name", ["nvfp4@conventional", "nvfp4@replay4", "nvfp4@replay16:bf16"])
@pytest.mark.parametrize("case", ["bf16", "fp32+s0"])
def test_nvfp4_kernel_writes_match_codec(name, case):
    """Every write of the kernel's own states (KDA steps on random inputs, conventional and replay, with and without
    an initial state) rounds as formats.codec does, bit for bit."""
    if case == "bf16":
        inp = kda_inputs(batch=2, steps=40, key_heads=2, value_heads=4, dk=128, dv=64, device="cuda")
    else:
        inp = kda_inputs(
            batch=2, steps=40, key_heads=2, value_heads=4, dk=128, dv=64, device="cuda", dtype=torch.float32
        )
        inp.initial_state = torch.randn(inp.state_shape, device="cuda") * 0.3
    _, states, mask = _kernel_states(inp, name)
    _assert_writes_match_codec(states, mask, f"{case} {name}")


@gpu_only
@pytest.mark.parametrize("name", ["nvfp4@conventional", "nvfp4@replay4"])
def test_nvfp4_kernel_writes_crafted_initial_states(name):
    """The crafted states as the initial state of a layer whose steps leave the state as it is (k = 0, decays 1):
    the kernel's first write takes the exact-division fallback where they demand it; every write, bit for bit."""
    cases = crafted_nvfp4_states()
    s0 = torch.cat([c[1] for c in cases]).float()  # [rows, 128]
    rows = s0.shape[0]
    inp = kda_inputs(batch=1, steps=6, key_heads=1, value_heads=1, dk=128, dv=rows, device="cuda", dtype=torch.float32)
    inp.k = torch.zeros_like(inp.k)
    inp.g = torch.zeros_like(inp.g)  # decays exp(0) = 1
    inp.initial_state = s0.reshape(inp.state_shape).cuda()
    _, states, mask = _kernel_states(inp, name)
    assert torch.equal(states[0, 0].reshape(rows, 128), s0), "the steps changed the state"
    _assert_writes_match_codec(states, mask, name)
