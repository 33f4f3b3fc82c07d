"""The Triton tile fake-quant of int16 equals `formats.codec` bit for bit (interpreter or GPU)."""

import pytest
import torch

from ssmquant import formats
from ssmquant.kernels import fake_quant_triton
from ssmquant.simulate import triton_interpreting

GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]


@pytest.mark.parametrize("spec", ["int16", "int16:sr", "int16:head", "int16:rows4:sr"])
def test_int16_tile_fake_quant_is_bit_exact(spec):
    fmt = formats.parse(spec)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, 40, generator=g) * torch.exp2(torch.randint(-12, 12, (2, 12, 1), generator=g).float())
    x[0, 3] = 0.0
    x = x.to("cuda" if GPU else "cpu")
    assert torch.equal(fake_quant_triton(fmt, x, seed=7, stream=3), fmt.fake_quant(x, seed=7, stream=3))
