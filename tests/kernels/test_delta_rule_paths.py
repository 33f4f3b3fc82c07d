"""The delta-rule kernel's fast paths against its generic ones (ssmquant/kernels/delta_rule.py).

`_fake_quant_8bit_rne` (the default FP8 / INT8 RNE write) must return the values of
`rounding.fake_quant_tile` bit for bit, and equal torch's own float8 cast / round-half-even (a zero may come
back +0 where the reference keeps -0: compared as values there; NaN as NaN). Without a GPU: tiles with ties
at every E4M3 exponent, subnormals, saturation, rows scaled from 1e-38 to 1e30, and every E4M3 / INT8 grid
midpoint with its FP32 neighbours, over every FP32 binade from 2^-30 to 2^10, signed, +-inf and NaN. On a
GPU: every one of the 2^32 FP32 bit patterns (static scale 1) and every finite |x| <= QMAX (dynamic scale 1),
compiled with FMA contraction as the kernel is. The whole kernel with fast_round must give the same metrics as
without it, bit for bit, with and without FMA contraction; with contraction (the default) it is compared with
the KDA kernel's test tolerances. Without a GPU these run in Triton's CPU interpreter.
"""

import pytest
import torch
import triton
import triton.language as tl

from ssmquant.formats import Rounding
from ssmquant.kernels.common import BUFFER_CODES, slot_spec
from ssmquant.kernels.delta_rule import _fake_quant_8bit_rne, delta_rule_launch
from ssmquant.kernels.rounding import FMT_FP8, FMT_INT8, FORMAT_CODES, fake_quant_tile
from ssmquant.kinds import KDAInputs, gdn_decays, kda_decays
from ssmquant.replay import parse_variants
from ssmquant.simulate import simulate, triton_interpreting

from ..replay.helpers import gdn_inputs, kda_inputs
from .test_emulation_kernels import assert_metrics_close
from .test_kda_kernel import REF_RTOL, SLACK

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]
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
    rows over decades (1e-38 and 1e-37: amax below QMAX / FP32 max, whose multiplier overflows and is replaced
    by 1; 1e-39 with amax 2e-36: FP32-subnormal elements that the multiplier ~2e38 makes E4M3 values), one
    all-zero row, one row of signed zeros and subnormal-range values."""
    g = torch.Generator().manual_seed(1)
    t = torch.randn(BN, BR, generator=g) * torch.tensor([1.0, 1.0, 1.0, 1e-38, 1e-37, 1e-39, 1e10, 1e30])[None, :]
    t[0, 5] = 2e-36
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


def _same(fast: torch.Tensor, ref: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise: the same FP32 bits, or both zeros (the fast path returns +0 for -0), or both NaN; where the
    input x is NaN only that the fast path returns NaN (`fake_quant_tile` returns +-QMAX there: its clamp is a
    plain minimum; NaN is no storable state, formats.codec refuses it)."""
    same_bits = fast.view(torch.int32) == ref.view(torch.int32)
    same = same_bits | ((fast == 0) & (ref == 0)) | (fast.isnan() & ref.isnan())
    return same if x is None else torch.where(x.isnan(), fast.isnan(), same)


def _run_both(s, scale, fmt, group, static, br=BR):
    """The fast and the generic write of a tile s [BN, br] (compiled with FMA contraction, as the kernel is)."""
    fast, ref = torch.empty_like(s), torch.empty_like(s)
    bn = s.shape[0]
    _both_kernel[(1,)](s, scale, fast, ref, BN=bn, BR=br, FMT=fmt, GROUP=group, STATIC=static, enable_fp_fusion=True,
                       enable_reflect_ftz=False)
    return fast.cpu(), ref.cpu()


def _oracle(x: torch.Tensor, fmt: int) -> torch.Tensor:
    """torch's own rounding of values at scale 1: the saturating float8 cast, or INT8 round-half-even."""
    if fmt == FMT_FP8:
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return torch.round(x.clamp(-127, 127))


@pytest.mark.parametrize("fmt", [FMT_FP8, FMT_INT8])
@pytest.mark.parametrize("static,group", [(False, 1), (False, BR), (True, 1)])
def test_fast_8bit_rounding_equals_the_generic_tile_fake_quant(fmt, static, group):
    s = _tile(fmt)
    scale = torch.ones(BR)  # static: decode scale 1 on column 0 (its ties are exact), others over decades
    scale[1:] = torch.logspace(-20, 20, BR - 1)
    fast, ref = _run_both(s.to(DEVICE), scale.to(DEVICE), fmt, group, static)
    ok = _same(fast, ref)
    assert ok.all(), (fast[~ok], ref[~ok])
    if static:  # column 0 at scale 1: torch's own rounding is the oracle
        assert torch.equal(fast[:, 0], _oracle(s[:, 0], fmt))


def _critical_values(fmt: int) -> torch.Tensor:
    """Positive FP32 values where RNE can go wrong: every grid midpoint of the format and every grid value,
    each with its FP32 neighbours 1 and 2 ulps away, and in every FP32 binade from 2^-30 to 2^10 the values
    whose 20 mantissa bits below E4M3's 3 are 0, 1, half - 1, half, half + 1 or all ones (INT8's ties are
    the grid midpoints k + 1/2 above)."""
    if fmt == FMT_FP8:
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    else:
        grid = torch.arange(0, 128).float()
    pts = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid[-1:] + 16])  # midpoints exact in FP32
    bits = pts.view(torch.int32)
    near = torch.cat([bits + d for d in (-2, -1, 0, 1, 2)]).clamp_min(0)
    e = torch.arange(-30, 11, dtype=torch.int32)
    kept = torch.arange(8, dtype=torch.int32) << 20  # the 3 mantissa bits E4M3 keeps
    low = torch.tensor([0, 1, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF], dtype=torch.int32)
    binades = ((e + 127) << 23)[:, None, None] | kept[None, :, None] | low[None, None, :]
    return torch.cat([near, binades.flatten()]).view(torch.float32).unique()


@pytest.mark.parametrize("fmt", [FMT_FP8, FMT_INT8])
@pytest.mark.parametrize("static", [True, False])
def test_fast_8bit_rounding_at_every_tie_and_binade(fmt, static):
    """Scale 1 (static: decode scale 1; dynamic: every row holds +-QMAX, so its multiplier is QMAX / QMAX = 1):
    the written values are the format's own rounding of the inputs, signed, with +-inf and NaN (static)."""
    qmax = 448.0 if fmt == FMT_FP8 else 127.0
    x = _critical_values(fmt)
    x = torch.cat([x, -x])
    if static:
        x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-45])])
    else:
        x = x[x.abs() <= qmax]
    br, bn = 64, 64
    per_tile = (bn - 1) * br
    x = torch.cat([x, torch.zeros(-x.numel() % per_tile)])
    rows = x.reshape(-1, br, bn - 1)  # [tiles, rows, values]: one more entry per row holds +-QMAX
    sign = torch.where(torch.arange(br) % 2 == 0, 1.0, -1.0)[None, :, None]
    tiles = torch.cat([rows, (qmax * sign).expand(rows.shape[0], br, 1)], -1).transpose(1, 2)  # [tiles, bn, br]
    scale = torch.ones(br, device=DEVICE)
    for tile in tiles:
        tile = tile.contiguous()
        fast, ref = _run_both(tile.to(DEVICE), scale, fmt, br, static, br=br)
        ok = _same(fast, ref, tile)
        assert ok.all(), (tile[~ok], fast[~ok], ref[~ok])
        want = _oracle(tile, fmt)
        ok = _same(fast, want)
        assert ok.all(), (tile[~ok], fast[~ok], want[~ok])


@pytest.mark.skipif(not GPU, reason="2^32 inputs: on a GPU only")
@pytest.mark.parametrize("fmt", [FMT_FP8, FMT_INT8])
@pytest.mark.parametrize("static", [True, False])
def test_fast_8bit_rounding_over_every_fp32_input(fmt, static):
    """Every FP32 bit pattern (static, decode scale 1) or every one with |x| <= QMAX (dynamic, each row of 64
    holding +-QMAX in its last place, so the multiplier is 1): the fast write equals the generic one and
    torch's own rounding."""
    qmax = 448.0 if fmt == FMT_FP8 else 127.0
    top = torch.tensor(qmax).view(torch.int32).item()
    bn, br = 64, 64
    chunk = 1 << 26
    scale = torch.ones(br, device="cuda")
    ranges = [(0, 1 << 32)] if static else [(0, top + 1), (1 << 31, (1 << 31) + top + 1)]
    for lo, hi in ranges:
        for start in range(lo, hi, chunk):
            bits = torch.arange(start, min(start + chunk, hi), device="cuda", dtype=torch.int64)
            x = (bits - (bits >= 1 << 31).long() * (1 << 32)).int().view(torch.float32)
            if not static:  # rows of bn - 1 values and +-QMAX
                x = torch.cat([x, torch.zeros(-x.numel() % (bn - 1), device="cuda")]).reshape(-1, bn - 1)
                x = torch.cat([x, torch.full((x.shape[0], 1), qmax, device="cuda")], 1).flatten()
            x = torch.cat([x, torch.zeros(-x.numel() % (bn * br), device="cuda")])
            fast, ref = torch.empty_like(x), torch.empty_like(x)
            _flat_kernel[(x.numel() // (bn * br),)](
                x, scale, fast, ref, BN=bn, BR=br, FMT=fmt, STATIC=static, enable_fp_fusion=True, enable_reflect_ftz=False
            )
            bad = ~_same(fast, ref, x) | ~_same(fast, _oracle(x, fmt))
            assert not bad.any(), (x[bad][:8], fast[bad][:8], ref[bad][:8])


@triton.jit
def _flat_kernel(s_ptr, scale_ptr, fast_ptr, ref_ptr, BN: tl.constexpr, BR: tl.constexpr, FMT: tl.constexpr,
                 STATIC: tl.constexpr):
    """Program i: BR rows of BN consecutive values, s_ptr[i * BN * BR + r * BN + c], as a tile [BN, BR]."""
    offs = tl.program_id(0).to(tl.int64) * BN * BR + tl.arange(0, BR)[None, :] * BN + tl.arange(0, BN)[:, None]
    s = tl.load(s_ptr + offs)
    scale = tl.load(scale_ptr + tl.arange(0, BR))
    tl.store(fast_ptr + offs, _fake_quant_8bit_rne(s, scale, BN, BR, FMT, 1, STATIC))
    tl.store(ref_ptr + offs, fake_quant_tile(s, scale, offs, 0, BN, BR, FMT, 1, STATIC, False))


def _launch(inp, names, fast_round, fp_fusion, block_p=None, **options):
    """All `names` in one launch of the kernel (default: one tile of rows per head; options: delta_rule_launch's
    prefetch / row_blocks_first): metrics [NV, T, B, H, 4]."""
    variants = parse_variants(names)
    block_p, warps = block_p or triton.next_power_of_2(inp.rows), 1
    specs = tuple(
        slot_spec(
            FORMAT_CODES[v.format.encoding],
            block_p if v.format.granularity.rows is None else v.format.granularity.rows,
            False,
            v.format.rounding is Rounding.SR,
            BUFFER_CODES[v.scheme.buffer_dtype] if v.scheme.rounds_buffer else 0,
        )
        for v in variants
    )
    write = torch.stack([v.scheme.write_mask(inp.batch, inp.steps).to(inp.device, torch.int8) for v in variants])
    seeds = torch.tensor([v.seed for v in variants], dtype=torch.int64, device=inp.device)
    alpha = (kda_decays(inp) if isinstance(inp, KDAInputs) else gdn_decays(inp)).contiguous()
    tensors = (inp.q, inp.k, inp.v, alpha, inp.beta.float(), None, write, seeds, None)
    options = dict(specs=specs, block_p=block_p, num_warps=warps, fast_round=fast_round, fp_fusion=fp_fusion, **options)
    return delta_rule_launch(*tensors, **options).sum(4)


NAMES = ["fp8_e4m3", "int8@replay4", "fp8_e4m3:head@replay4", "int8:sr", "nvfp4"]


@pytest.mark.parametrize("fp_fusion", [True, False])
def test_kernel_fast_round_changes_no_metric_bit(fp_fusion):
    inp = kda_inputs(batch=1, steps=9, key_heads=1, value_heads=2, dk=32, dv=8, device=DEVICE)
    assert torch.equal(_launch(inp, NAMES, True, fp_fusion), _launch(inp, NAMES, False, fp_fusion))


@pytest.mark.parametrize(
    "kind, prefetch, row_blocks_first",
    [("kda", True, False), ("kda", False, True), ("kda", True, True), ("gdn", True, True)],
)
def test_kernel_prefetch_and_grid_order_change_no_metric_bit(kind, prefetch, row_blocks_first):
    """Loading each step's inputs a step ahead and launching a head's row blocks together change when loads are
    issued and which program runs when, not what is computed: the same metrics bit for bit as neither, with 2 row
    blocks per head (so the two grid orders differ) and a batch of 2 (the prefetch crosses no sequence's end)."""
    make = kda_inputs if kind == "kda" else gdn_inputs
    inp = make(batch=2, steps=5, key_heads=1, value_heads=1, dk=16, dv=8, device=DEVICE)
    names = ["fp8_e4m3", "int8@replay4", "nvfp4"]  # the fast 8-bit write (its byte prefetched) and the generic one
    base = _launch(inp, names, True, True, block_p=4, prefetch=False, row_blocks_first=False)
    got = _launch(inp, names, True, True, block_p=4, prefetch=prefetch, row_blocks_first=row_blocks_first)
    assert not base.isnan().any()
    assert torch.equal(got, base)


def test_row_blocks_first_default_only_where_measured(monkeypatch):
    """The default grid order follows ROW_BLOCKS_FIRST_DEFAULT (KDA at 16 rows x 1 warp): recorded from the launch."""
    from ssmquant.kernels import delta_rule

    grids = []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *a, **kw: None

    monkeypatch.setattr(delta_rule, "_delta_rule_emulate_kernel", Spy())
    kda = kda_inputs(batch=3, steps=3, key_heads=1, value_heads=1, dk=16, dv=32, device=DEVICE)
    gdn = gdn_inputs(batch=3, steps=3, key_heads=1, value_heads=1, dk=16, dv=32, device=DEVICE)
    _launch(kda, ["fp8_e4m3"], True, True, block_p=16)  # (kda, 16, 1): row blocks first, grid (NPB 2, B * Hv 3)
    _launch(kda, ["fp8_e4m3"], True, True, block_p=8)  # not measured: grid (B * Hv 3, NPB 4)
    _launch(gdn, ["fp8_e4m3"], True, True, block_p=16)  # GDN not measured: grid (B * Hv 3, NPB 2)
    assert grids == [(2, 3), (3, 4), (3, 2)]


@pytest.mark.parametrize("fp_fusion", [True, False])
def test_kernel_matches_the_naive_reference_with_and_without_fma_contraction(fp_fusion):
    """Both arithmetic paths within the KDA kernel tests' tolerances (test_kda_kernel.py: SLACK, REF_RTOL)."""
    inp = kda_inputs(batch=1, steps=13, key_heads=1, value_heads=2, dk=48, dv=12, device=DEVICE)
    ref = simulate(inp, NAMES, backend="torch")
    got = _launch(inp, NAMES, True, fp_fusion).double().cpu().numpy()
    for i, name in enumerate(NAMES):
        try:
            assert_metrics_close(ref.mean[i], got[i], SLACK, pooled=True, ref_rtol=REF_RTOL)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
