"""kernels.store_state_triton (the evaluation's in-place state write) against fake_quant_triton: the same values
where the write mask is set, untouched elsewhere, and exact counts of non-finite elements per (sequence, head)."""

from __future__ import annotations

import pytest
import torch

from ssmquant import formats
from ssmquant.kernels import fake_quant_triton, store_state_triton
from ssmquant.simulate import triton_interpreting

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]


@pytest.mark.parametrize("spec", ["fp8_e4m3", "int8:sr", "nvfp4", "fp8_e4m3:rows2", "bf16:sr"])
def test_in_place_store_equals_fake_quant_where_kept(spec):
    fmt = formats.parse(spec)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 2, 6, 40, generator=g) * torch.exp(3 * torch.randn(3, 2, 6, 1, generator=g))).to(DEV)
    x[2, 1, 4, 7] = float("nan")  # sequence 2, head 1: one NaN in, at least one out
    x[0, 0, 1, 3] = float("inf")  # sequence 0 is not kept: counted before and after, left as is
    keep = torch.tensor([0, 1, 1], dtype=torch.int8, device=DEV)
    flags = torch.full((6, 2), -1, dtype=torch.int32, device=DEV)
    want = fake_quant_triton(fmt, x, seed=9, stream=5)
    got = x.clone()
    store_state_triton(fmt, got, flags, keep=keep, seed=9, stream=5)
    assert torch.equal(got[1:].nan_to_num(7.0), want[1:].nan_to_num(7.0))
    assert torch.equal(got[0].nan_to_num(7.0), x[0].nan_to_num(7.0))
    bad_out = (~torch.isfinite(got)).flatten(2).sum(-1).flatten().tolist()
    assert flags[:, 0].tolist() == [1, 0, 0, 0, 0, 1] and flags[:, 1].tolist() == bad_out and bad_out[0] == 1
    everywhere = x.clone()
    store_state_triton(fmt, everywhere, flags, seed=9, stream=5)
    assert torch.equal(everywhere.nan_to_num(7.0), want.nan_to_num(7.0))


def test_bad_inputs_are_refused():
    fmt = formats.parse("int8")
    flags = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous float32"):
        store_state_triton(fmt, torch.zeros(2, 2, 4, 8).transpose(-1, -2), flags)
    with pytest.raises(ValueError, match="flags must be a contiguous int32"):
        store_state_triton(fmt, torch.zeros(2, 2, 4, 8), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="dynamic-scale formats only"):
        store_state_triton(formats.parse("int8:static"), torch.zeros(2, 2, 4, 8), flags)
