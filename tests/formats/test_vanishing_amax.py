"""Dynamic fp8/int8/int16 scales of a group whose amax is so small that max_code / amax overflows FP32.

Below max_code / FLT_MAX (fp8_e4m3: 1.3e-36, int8: 3.7e-37, int16: 9.6e-35) the encode multiplier would be
infinite and the group's zeros 0 x inf = NaN (an H200 eval of a random-weight nemotron-h-8b met such a state
row). Such a group is scaled as a zero group (multiplier and decode scale 1), so its elements round to zero;
the Triton tile does the same, bit for bit.
"""

import pytest
import torch

from ssmquant import formats
from ssmquant.formats import scales_from_amax

FLT_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("spec", ["fp8_e4m3", "int8", "int16"])
def test_the_multiplier_is_finite_on_both_sides_of_the_overflow(spec):
    fmt = formats.parse(spec)
    edge = fmt.encoding.max_code / FLT_MAX
    amax = torch.tensor([0.0, edge * 0.5, edge * 0.999, edge * 1.01, 1e-30, 1.0])
    mult, dec = scales_from_amax(fmt, amax)
    assert torch.isfinite(mult).all() and torch.isfinite(dec).all() and (dec > 0).all()
    assert mult[:3].tolist() == [1.0, 1.0, 1.0] and dec[:3].tolist() == [1.0, 1.0, 1.0]
    assert mult[3] > 1e38 and mult[5] == fmt.encoding.max_code  # above the edge: max_code / amax as before


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["fp8_e4m3", "int8", "int8:sr", "fp8_e4m3:sr", "int16", "fp8_e4m3:head"])
def test_a_vanishing_row_is_stored_as_zeros_and_the_tile_agrees(spec):
    from ssmquant.simulate import triton_interpreting

    fmt = formats.parse(spec)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    x[0, 1] = 0.0
    x[0, 1, 3] = 1e-38  # finite, amax far below the edge
    x[1, 2] = 2e-37
    got = fmt.fake_quant(x, seed=3, stream=2)
    assert torch.isfinite(got).all()
    if fmt.granularity.rows is None:  # per row: the vanishing rows alone round to zero
        assert (got[0, 1] == 0).all() and (got[1, 2] == 0).all()
    if torch.cuda.is_available() or triton_interpreting():
        from ssmquant.kernels import fake_quant_triton

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        assert torch.equal(fake_quant_triton(fmt, x.to(dev), seed=3, stream=2).cpu(), got)
