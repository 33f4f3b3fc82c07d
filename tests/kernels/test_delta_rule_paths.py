"""The delta-rule kernel's fast paths against its generic ones (ssmquant/kernels/delta_rule.py).

`_fake_quant_8bit_rne` must return the values of `rounding.fake_quant_tile` bit for bit (a zero may come
back +0 where the reference keeps -0: compared as values there), on tiles with ties at every E4M3
exponent, subnormals, saturation and rows scaled from 1e-30 to 1e30, and equal torch's own float8 cast;
the whole kernel with fast_round must then give the same metrics as without it, bit for bit. The FMA
path (fp_fusion) changes FP32 roundings, so it is compared with the test tolerances of the KDA kernel.
Without a GPU these run in Triton's CPU interpreter.
"""

import pytest
import torch
import triton
import triton.language as tl

from ssmquant.formats import Rounding
from ssmquant.kernels import _BUFFER_CODES
from ssmquant.kernels.common import slot_spec
from ssmquant.kernels.delta_rule import _fake_quant_8bit_rne, delta_rule_launch
from ssmquant.kernels.rounding import FMT_FP8, FMT_INT8, FORMAT_CODES, fake_quant_tile
from ssmquant.replay import parse_variants, simulate
from ssmquant.replay.reference import kda_decays
from ssmquant.replay.simulate import triton_interpreting

from ..replay.helpers import kda_inputs
from .test_emulation_kernels import assert_metrics_close

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")
BN, BR = 64, 8


@triton.jit
def _both_kernel(s_ptr, scale_ptr, fast_ptr, ref_ptr, BN: tl.constexpr, BR: tl.constexpr, FMT: tl.constexpr,
                 GROUP: tl.constexpr, STATIC: tl.constexpr):
    offs = tl.arange(0, BN)[:, None] * BR + tl.arange(0, BR)[None, :]
    s = tl.load(s_ptr + offs)
    scale = tl.load(scale_ptr + tl.arange(0, BR))
    tl.store(fast_ptr + offs, _fake_quant_8bit_rne(s, scale, BN, BR, FMT, GROUP, STATIC))
    tl.store(ref_ptr + offs, fake_quant_tile(s, scale, offs, 0, BN, BR, FMT, GROUP, STATIC, False))


def _tile(fmt: int) -> torch.Tensor:
    """[BN, BR]: column 0 the grid's midpoints (ties) and their neighbours at scale 1, the others random
    rows over 60 decades, one all-zero row, one row of signed zeros and subnormal-range values."""
    g = torch.Generator().manual_seed(1)
    t = torch.randn(BN, BR, generator=g) * torch.logspace(-30, 30, BR)[None, :]
    if fmt == FMT_FP8:  # E4M3 spacing 2^(e-3) at exponent e >= -6; midpoints are odd multiples of half of it
        normal = (torch.arange(8, 16)[None, :] + 0.5) * 2.0 ** (torch.arange(-6, 9)[:, None] - 3.0)
        every = torch.cat([(torch.arange(0, 8) + 0.5) * 2.0**-9, normal.flatten()])  # subnormal ones first
        mid = every[torch.linspace(0, every.numel() - 1, BN // 2).round().long()]
    else:
        mid = torch.arange(-31, 33)[: BN // 2].float() + 0.5  # INT8 midpoints k + 1/2
    col = torch.cat([mid, torch.nextafter(mid[: BN // 4], torch.tensor(0.0)), -mid[: BN // 4]])
    t[:, 0] = col[:BN]
    t[:, 1] = 0.0
    t[:, 2] = torch.tensor([0.0, -0.0] * (BN // 2)) + torch.linspace(-1, 1, BN) * 2.0**-9
    return t.contiguous()


@pytest.mark.parametrize("fmt", [FMT_FP8, FMT_INT8])
@pytest.mark.parametrize("static,group", [(False, 1), (False, BR), (True, 1)])
def test_fast_8bit_rounding_equals_the_generic_tile_fake_quant(fmt, static, group):
    s = _tile(fmt)
    scale = torch.ones(BR)  # static: decode scale 1 on column 0 (its ties are exact), others over decades
    scale[1:] = torch.logspace(-20, 20, BR - 1)
    s, scale = s.to(DEVICE), scale.to(DEVICE)
    fast, ref = torch.empty_like(s), torch.empty_like(s)
    _both_kernel[(1,)](s, scale, fast, ref, BN=BN, BR=BR, FMT=fmt, GROUP=group, STATIC=static)
    fast, ref = fast.cpu(), ref.cpu()
    same_bits = fast.view(torch.int32) == ref.view(torch.int32)
    assert (same_bits | ((fast == 0) & (ref == 0))).all(), (fast[~same_bits], ref[~same_bits])
    if static and fmt == FMT_FP8:  # column 0 at scale 1: torch's own saturating cast is the oracle
        x = s[:, 0].cpu().clamp(-448, 448)
        assert torch.equal(fast[:, 0], x.to(torch.float8_e4m3fn).float())


def _launch(inp, names, fast_round, fp_fusion):
    """All `names` in one launch of the kernel on one tile of rows per head: metrics [NV, T, B, H, 4]."""
    variants = parse_variants(names)
    block_p, warps = triton.next_power_of_2(inp.rows), 1
    specs = tuple(
        slot_spec(
            FORMAT_CODES[v.format.encoding],
            block_p if v.format.granularity.rows is None else v.format.granularity.rows,
            False,
            v.format.rounding is Rounding.SR,
            _BUFFER_CODES[v.scheme.buffer_dtype] if v.scheme.rounds_buffer else 0,
        )
        for v in variants
    )
    write = torch.stack([v.scheme.write_mask(inp.batch, inp.steps).to(inp.device, torch.int8) for v in variants])
    seeds = torch.tensor([v.seed for v in variants], dtype=torch.int64, device=inp.device)
    alpha = kda_decays(inp).contiguous()
    tensors = (inp.q, inp.k, inp.v, alpha, inp.beta.float(), None, write, seeds, None, 1)
    options = dict(specs=specs, block_p=block_p, num_warps=warps, fast_round=fast_round, fp_fusion=fp_fusion)
    return delta_rule_launch(*tensors, **options).sum(4)


NAMES = ["fp8_e4m3", "int8@replay4", "fp8_e4m3:head@replay4", "int8:sr", "nvfp4"]


def test_kernel_fast_round_changes_no_metric_bit():
    inp = kda_inputs(batch=1, steps=9, key_heads=1, value_heads=2, dk=32, dv=8, device=DEVICE)
    assert torch.equal(_launch(inp, NAMES, True, False), _launch(inp, NAMES, False, False))


def test_kernel_with_fma_contraction_matches_the_naive_reference():
    inp = kda_inputs(batch=1, steps=13, key_heads=1, value_heads=2, dk=48, dv=12, device=DEVICE)
    ref = simulate(inp, NAMES, backend="torch")
    got = _launch(inp, NAMES, True, True).double().cpu().numpy()
    for i, name in enumerate(NAMES):
        try:
            assert_metrics_close(ref.mean[i], got[i], 0.10, pooled=True, ref_rtol=1e-4)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
