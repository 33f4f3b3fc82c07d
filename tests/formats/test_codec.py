"""quantize / dequantize against nvidia-modelopt and independent formulas; scales, granularity, edges."""

import warnings

import numpy as np
import pytest
import torch

from ssmquant import formats as F

warnings.filterwarnings("ignore")
TensorQuantizer = pytest.importorskip("modelopt.torch.quantization.nn").TensorQuantizer
QuantizerAttributeConfig = pytest.importorskip("modelopt.torch.quantization.config").QuantizerAttributeConfig
NVFP4QTensor = pytest.importorskip("modelopt.torch.quantization.qtensor").NVFP4QTensor


def state(shape=(3, 8, 64), seed=0, spread=8):
    """Rows of very different magnitudes, like a real SSM state."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-spread, spread, (*shape[:-1], 1), generator=g).float())
    return torch.randn(shape, generator=g) * mag


def test_fp8_per_row_matches_modelopt_tensor_quantizer():
    """modelopt's FP8 path computes the multiplier 448 / amax as reciprocal(amax) * 448 (torch's
    scalar / tensor), which rounds twice; we divide once (IEEE). The multipliers differ by at most one
    ulp, so a code can differ only where x * m falls within an ulp of a rounding boundary (a tie),
    and decoded values of a row differ by at most ~2 ulps."""
    x = state((8, 64, 128))
    tq = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=(0, 1)))  # amax per (head, row)
    ref = tq(x)
    fmt = F.parse("fp8_e4m3")
    got = fmt.fake_quant(x)
    amax = x.abs().amax(-1, keepdim=True)
    m_ieee = torch.div(torch.full_like(amax, 448.0), amax)
    m_modelopt = 448.0 / amax
    assert bool(((m_ieee - m_modelopt).abs() <= torch.finfo(torch.float32).eps * m_ieee).all())
    rel = ((got - ref).abs() / ref.abs().clamp(min=1e-30))[ref != 0]
    codes_differ = (rel > 2.5 * 2.0**-23).sum().item()
    assert codes_differ <= 1e-4 * x.numel(), codes_differ
    # with modelopt's own multiplier, as static scales, the result is bit-exact
    static = F.parse("fp8_e4m3:static").fake_quant(x, scale=(1 / m_modelopt)[..., 0])
    assert torch.equal(static, ref)


def test_int8_per_row_codes_match_modelopt_and_values_within_one_ulp():
    x = state((4, 16, 128), seed=1)
    tq = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, axis=(0, 1)))
    ref = tq(x)
    fmt = F.parse("int8")
    q = fmt.quantize(x)
    # modelopt decodes code / (127 / amax); we multiply by the stored scale 1 / (127 / amax), as
    # FlashInfer multiplies by its state_scale. Codes are identical; values differ by <= 1 ulp.
    mult = 127.0 / x.abs().amax(-1, keepdim=True)
    ref_codes = torch.round(ref * mult)
    assert torch.equal(q.codes.float(), ref_codes)
    got = fmt.dequantize(q)
    top = torch.maximum(ref.abs(), got.abs())
    ulp = torch.nextafter(top, torch.full_like(top, float("inf"))) - top
    assert bool(((got - ref).abs() <= ulp).all())


def test_int8_matches_independent_numpy_formula():
    x = state((2, 8, 40), seed=2)
    q = F.parse("int8").quantize(x)
    xn = x.numpy()
    amax = np.abs(xn).max(-1, keepdims=True)
    mult = np.float32(127.0) / amax
    codes = np.clip(np.rint(xn * mult), -127, 127)
    assert np.array_equal(q.codes.numpy().astype(np.float32), codes)
    assert np.array_equal(q.scale.numpy(), (np.float32(1.0) / mult)[..., 0])


def _unpack(packed):
    codes = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:head"])
def test_nvfp4_matches_modelopt_nvfp4_qtensor(spec):
    x = state((64, 128), seed=3)
    fmt = F.parse(spec)
    q = fmt.quantize(x)
    s2 = q.scale.reshape(()) if spec.endswith("head") else q.scale[:, None]
    qt, block_scale, s2_out = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=s2)
    assert torch.equal(_unpack(qt._quantized_data), q.codes)
    assert torch.equal(block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    ref = qt.dequantize(dtype=torch.float32, scale=block_scale, double_scale=s2_out, block_sizes={-1: 16})
    assert torch.equal(fmt.dequantize(q), ref)


def test_nvfp4_second_level_scale_is_amax_over_6x448():
    x = state((2, 4, 32), seed=4)
    q = F.parse("nvfp4").quantize(x)
    assert torch.equal(q.scale, x.abs().amax(-1) / 2688.0)


@pytest.mark.parametrize("spec", ["fp8_e4m3", "int8", "nvfp4", "bf16", "fp16", "fp32"])
def test_fake_quant_is_dequantize_of_quantize_and_idempotent(spec):
    fmt = F.parse(spec)
    x = state((2, 4, 32), seed=5)
    y = fmt.fake_quant(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y, fmt.dequantize(fmt.quantize(x)))
    if spec in ("bf16", "fp16", "fp32", "int8"):
        assert torch.equal(fmt.fake_quant(y), y)


def test_snr_floor_of_dequantized_values():
    x = state((8, 64, 128), seed=6, spread=4)
    floors = {"bf16": 45.0, "fp16": 65.0, "fp8_e4m3": 28.0, "int8": 38.0, "nvfp4": 17.0}
    for spec, floor in floors.items():
        y = F.parse(spec).fake_quant(x)
        snr = -20 * torch.log10((y - x).norm() / x.norm())
        assert snr > floor, (spec, float(snr))


@pytest.mark.parametrize("spec", ["fp8_e4m3", "int8", "nvfp4", "int8:head", "fp8_e4m3:rows4"])
def test_all_zero_rows(spec):
    x = state((2, 8, 32), seed=7)
    x[0, 1] = 0
    x[1] = 0
    q = F.parse(spec).quantize(x)
    y = F.parse(spec).dequantize(q)
    assert torch.isfinite(y).all() and torch.isfinite(q.scale).all()
    assert bool((y[1] == 0).all()) and bool((y[0, 1] == 0).all())


def test_granularity_scale_shapes_and_bytes():
    x = state((2, 3, 8, 32))
    assert F.parse("int8").quantize(x).scale.shape == (2, 3, 8)
    assert F.parse("int8:head").quantize(x).scale.shape == (2, 3, 1)
    assert F.parse("int8:rows4").quantize(x).scale.shape == (2, 3, 2)
    with pytest.raises(F.FormatError, match="not divisible into groups of 3"):
        F.parse("int8:rows3").quantize(x)
    shape = (64, 64, 128)  # Nemotron-3-Nano layer state
    assert F.parse("fp32").bytes_per_state(shape) == 2 * 2**20
    assert F.parse("int8").bytes_per_state(shape) == 64 * 64 * 128 + 4 * 64 * 64
    assert F.parse("nvfp4").bytes_per_state(shape) == 64 * 64 * 64 + 64 * 64 * 8 + 4 * 64 * 64
    assert F.parse("fp8_e4m3:head").bytes_per_state(shape) == 64 * 64 * 128 + 4 * 64
    assert F.parse("bf16").capacity_factor(shape) == 2.0


def test_head_scale_is_amax_over_whole_head():
    x = state((2, 8, 32), seed=8)
    q = F.parse("fp8_e4m3:head").quantize(x)
    amax = x.abs().amax((-1, -2))
    mult = torch.div(torch.full_like(amax, 448.0), amax)
    assert torch.equal(q.scale[:, 0], torch.div(torch.ones_like(mult), mult))


def test_static_scales_saturate_and_validate():
    x = torch.tensor([[[0.5, -1.0, 3.0, 10.0]]])
    fmt = F.parse("int8:static")
    y = fmt.fake_quant(x, scale=torch.tensor([2.0 / 127]))  # range +-2
    assert y[0, 0].tolist() == pytest.approx([0.5039, -1.0079, 2.0, 2.0], abs=1e-4)  # -63.5 ties to -64
    y8 = F.parse("fp8_e4m3:static").fake_quant(x, scale=torch.tensor([1.0 / 448]))  # range +-1
    assert y8[0, 0, 2:].tolist() == [1.0, 1.0]
    with pytest.raises(F.FormatError, match="is static: pass scale"):
        fmt.quantize(x)
    with pytest.raises(F.FormatError, match="dynamic scales"):
        F.parse("int8").quantize(x, scale=torch.tensor([1.0]))
    with pytest.raises(F.FormatError, match="static scale has shape"):
        fmt.quantize(x, scale=torch.ones(2))
    with pytest.raises(F.FormatError, match="finite and > 0"):
        fmt.quantize(x, scale=torch.tensor([0.0]))


def test_nan_inf_state_is_refused_with_a_clear_message():
    x = state((2, 4, 16))
    x[1, 2, 3] = float("nan")
    with pytest.raises(F.FormatError, match=r"NaN/Inf \(first at index \(1, 2, 3\)\)"):
        F.parse("fp8_e4m3").quantize(x)
    x[1, 2, 3] = float("inf")
    with pytest.raises(F.FormatError, match="NaN/Inf"):
        F.parse("bf16").quantize(x)


def test_nvfp4_needs_blocks_of_16():
    with pytest.raises(F.FormatError, match="divisible by 16"):
        F.parse("nvfp4").quantize(torch.randn(2, 4, 40))
