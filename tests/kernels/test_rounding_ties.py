"""Round-to-nearest-even of the saturating grids in the Triton tile helper (`rounding.round_to_grid`, which
adds and subtracts 2^23 spacings) at exact ties, against `formats.codec`, bit for bit.

Each row's amax is the grid's max code, so that the encode multiplier is exactly 1 and the row's other
elements reach the rounding step unchanged: every midpoint between neighbouring E4M3 values (subnormal
and normal binades) and every k + 1/2 of the INT8 / INT16 grids, both signs, each beside its neighbours
one ulp away. A rounding that breaks ties away from even, or a grid spacing off by a binade, fails.
"""

import pytest
import torch

from ssmquant import formats
from ssmquant.kernels import fake_quant_triton
from ssmquant.simulate import triton_interpreting

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]


def e4m3_midpoints() -> torch.Tensor:
    """Midpoints between neighbouring E4M3 values below 448: subnormal spacing 2^-9, then 8 per binade."""
    sub = [(k + 0.5) * 2.0**-9 for k in range(0, 8)]
    normal = [(1 + (m + 0.5) / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    return torch.tensor([v for v in sub + normal if v < 448.0])


def tie_rows(ties: torch.Tensor, max_code: float, width: int) -> torch.Tensor:
    """Rows [R, width] of max_code followed by ties and their one-ulp neighbours with both signs (zero-padded)."""
    bits = ties.float().view(torch.int32)
    near = torch.cat([ties.float(), (bits - 1).view(torch.float32), (bits + 1).view(torch.float32)])
    vals = torch.cat([near, -near])
    rows = -(-vals.numel() // (width - 1))
    out = torch.zeros(rows * (width - 1))
    out[: vals.numel()] = vals
    out = out.reshape(rows, width - 1)
    return torch.cat([torch.full((rows, 1), max_code), out], dim=1)


@pytest.mark.parametrize(
    "spec, ties, max_code",
    [
        ("fp8_e4m3", e4m3_midpoints(), 448.0),
        ("int8", torch.arange(0, 127) + 0.5, 127.0),
        ("int16", torch.arange(0, 32767, 97) + 0.5, 32767.0),
    ],
)
def test_saturating_grid_rne_is_bit_exact_at_ties(spec, ties, max_code):
    fmt = formats.parse(spec)
    x = tie_rows(ties, max_code, 64)[None].to(DEVICE)  # [1, rows, 64]: one head
    got = fake_quant_triton(fmt, x)
    assert torch.equal(got, fmt.fake_quant(x))
    vals = x.abs().flatten()
    tie = torch.isin(vals, ties.float().to(DEVICE))
    assert tie.sum() == 2 * ties.numel()  # every tie, with both signs, reached the rounding
    out = got.abs().flatten()[tie]
    assert (out > vals[tie]).any() and (out < vals[tie]).any()  # to even: some up, some down
