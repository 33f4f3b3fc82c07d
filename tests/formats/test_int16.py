"""int16 with per-row FP32 scales: FlashInfer's scaled int16 state of selective_state_update.

The engine's rule (conversion.cuh `convertAndStore(int16_t*)`, kernel_selective_state_update_stp.cuh):
encode = 32767 / amax (1 when amax == 0), stored decode scale = 1 / encode, code = round-half-even of
the value clamped to +-32767. Checked bit for bit against an independent numpy formula.
"""

import numpy as np
import torch

from ssmquant import formats as F


def _state(shape, seed):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-10, 10, (*shape[:-1], 1), generator=g).float())
    return torch.randn(shape, generator=g) * mag


def test_int16_codes_and_scales_match_independent_numpy_formula():
    x = _state((3, 8, 40), seed=4)
    x[1, 2] = 0.0
    q = F.parse("int16").quantize(x)
    assert q.codes.dtype == torch.int16
    xn = x.numpy()
    amax = np.abs(xn).max(-1, keepdims=True)
    enc = np.where(amax == 0, np.float32(1.0), np.float32(32767.0) / np.where(amax == 0, 1, amax)).astype(np.float32)
    codes = np.rint(np.clip(xn * enc, -32767, 32767))
    assert np.array_equal(q.codes.numpy().astype(np.float32), codes)
    assert np.array_equal(q.scale.numpy(), (np.float32(1.0) / enc)[..., 0])
    assert np.array_equal(F.parse("int16").fake_quant(x).numpy(), codes * (np.float32(1.0) / enc))


def test_int16_rounds_ties_to_even_and_saturates_static_scales():
    fmt = F.parse("int16:static")
    x = torch.tensor([[[2.5, 3.5, -2.5, 40000.0, -40000.0, 0.5]]])
    q = fmt.quantize(x, scale=torch.tensor([1.0]))
    assert q.codes.tolist() == [[[2, 4, -2, 32767, -32767, 0]]]


def test_int16_footprint_and_stochastic_rounding_is_unbiased():
    fmt = F.parse("int16")
    assert fmt.bytes_per_state((64, 64, 128)) == 2 * 64 * 64 * 128 + 4 * 64 * 64
    x = torch.full((1, 1, 4096), 0.3)
    x[..., 0] = 32767.0  # amax: the scale is 1, every other element sits 0.3 above a code
    mean = torch.stack([F.parse("int16:sr").fake_quant(x, seed=s)[..., 1:].mean() for s in range(8)]).mean()
    assert abs(float(mean) - 0.3) < 0.01
