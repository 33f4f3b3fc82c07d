"""One launch for several variants: every variant's metrics are those of a launch that carries it alone at the same
tiling, for every format, rounding, scheme, scale mode and batch slice: bit for bit, except the output metrics of the
delta-rule kernel on a GPU (below).

The multi-variant kernels share each step's inputs and the FP32 reference between the variants they
carry; a slot that read another slot's state, seed, write mask or static scales, or a reference that
drifted, would change some bits here. Tiny shapes in Triton's CPU interpreter; the same shapes on a GPU.
`plan_launches` (pure Python) is checked at the real models' shapes.
"""

import pytest
import torch

from ssmquant import formats, kinds
from ssmquant.kernels import MAX_SLOTS, emulate_triton, emulate_triton_steps, plan_launches, plan_output_launches
from ssmquant.kernels.common import MAX_REGISTERS, REGISTER_FILE, REGISTER_GRANULE, register_cap
from ssmquant.replay import Variant, parse_variant, parse_variants, reference_decode
from ssmquant.simulate import triton_interpreting

from ..replay.helpers import gdn_inputs, kda_inputs, mamba2_inputs

pytestmark = pytest.mark.gpu  # runs on a CUDA GPU at the real shapes when one is present (`pytest -m gpu`)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
needs_triton = pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")

VARIANTS = [
    "fp8_e4m3@conventional",
    "int8:sr@replay4",
    "nvfp4@conventional",
    "nvfp4:sr@spec8x2:p0.5",
    "int16@replay4",
    "fp16:sr@conventional",
    "bf16@replay4:fp32",
    "fp8_e4m3:rows4:sr@replay4",
    "int8:head@conventional",
    "fp32@conventional",
]


def tiny(kind, batch=2, steps=9):
    if kind == "mamba2":
        return mamba2_inputs(batch=batch, steps=steps, heads=2, head_dim=12, groups=1, state=48, device=DEVICE)
    if kind == "gdn":
        return gdn_inputs(batch=batch, steps=steps, key_heads=1, value_heads=2, dk=48, dv=12, device=DEVICE)
    return kda_inputs(batch=batch, steps=steps, key_heads=1, value_heads=2, dk=48, dv=12, device=DEVICE)


def with_static(inp):
    """VARIANTS plus a static-scale int8 variant whose scales half the reference's amax (some saturate)."""
    _, _, states = reference_decode(inp, return_states=True)
    amax = states.abs().amax(dim=(0, 1, 4))  # [H, rows]
    static = Variant(formats.parse("int8:static"), static_scale=amax * 0.5 / 127, seed=4)
    vs = parse_variants(VARIANTS)
    return vs[:3] + [static] + vs[3:]  # the static slot between dynamic ones


@needs_triton
@pytest.mark.slow  # 10-20 s each in the interpreter: 12 launches
@pytest.mark.parametrize("kind", kinds.names())
def test_each_variant_of_a_shared_launch_is_bit_identical_to_its_own_launch(kind):
    inp = tiny(kind)
    inp.initial_state = torch.randn(inp.state_shape, device=inp.device) * 0.1
    variants = with_static(inp)
    assert len(variants) > MAX_SLOTS  # two launches, both carrying several variants
    tiling = (16, 1)  # 12 rows: one block, so per-head and rows4 variants share the launch
    shared = emulate_triton(inp, variants, tiling=tiling)
    assert torch.isfinite(shared).all()
    for i, v in enumerate(variants):
        alone = emulate_triton(inp, [v], tiling=tiling)[0]
        if kind == "mamba2" or not GPU:
            assert torch.equal(shared[i], alone), v.name
            continue
        # The delta-rule kernel compiles with FMA contraction (as the engines' Triton kernels do), and how the
        # compiler contracts the products of the output's sums y = S q (and its norm) depends on the code around
        # them, so on a GPU the output metrics of a shared launch and of a launch alone differ in the last bits:
        # at most 2.24e-7 relative on an H200 (lab/gpu/shared_launch.py; the states were equal in every case, and
        # with fp_fusion off every metric was equal, as test_without_contraction_... checks). The states, and so
        # the state metrics, must still be equal bit for bit.
        assert torch.equal(shared[i][..., :2], alone[..., :2]), v.name
        torch.testing.assert_close(shared[i][..., 2:], alone[..., 2:], rtol=1e-6, atol=0, msg=v.name)


@needs_triton
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_without_contraction_a_shared_delta_rule_launch_is_bit_identical_to_its_own(kind):
    """The delta-rule kernel with fp_fusion off: every metric of a shared launch equals its own launch's, on a GPU
    too (the output metrics' last bits above come from FMA contraction alone)."""
    from .test_delta_rule_paths import _launch

    inp = tiny(kind)
    names = VARIANTS[:6]
    shared = _launch(inp, names, True, False)
    for i, name in enumerate(names):
        assert torch.equal(shared[i], _launch(inp, [name], True, False)[0]), name


@needs_triton
@pytest.mark.slow  # ~10 s each in the interpreter
@pytest.mark.parametrize("kind", ["mamba2", "kda"])
def test_batch_slices_of_a_shared_launch_are_bit_identical(kind):
    """One sequence per launch (batch_offset 1, 2): the SR draws count elements over the whole batch."""
    inp = tiny(kind, batch=3, steps=5)
    variants = with_static(inp)[:MAX_SLOTS]
    whole = emulate_triton(inp, variants)
    sliced = torch.full_like(whole, float("nan"))
    for i, b0, m in emulate_triton_steps(inp, variants, metric_budget=1):
        assert m.shape[1] == 1
        sliced[i, :, b0 : b0 + 1] = m
    assert torch.equal(whole, sliced)


DEFAULTS = [f"{f}@{s}" for f in ("fp8_e4m3", "int8", "nvfp4") for s in ("conventional", "replay16")]


def test_the_six_default_variants_share_one_launch_at_the_real_shapes():
    vs = parse_variants(DEFAULTS)
    # Nemotron-3-Nano (P=64, N=128) and GLM-5.3-Flash / Qwen3.5 (128 x 128): 7 states in 16 x 7 registers
    # per thread -> a [128, 4] tile per warp
    assert plan_launches(vs, 64, 128) == [(list(range(6)), (4, 1))]
    assert plan_launches(vs, 128, 128) == [(list(range(6)), (4, 1))]
    # one variant alone: today's single-variant tiling, one warp per 16 x 128 tile
    assert plan_launches(vs[:1], 64, 128) == [([0], (16, 1))]


def test_variants_needing_whole_heads_get_their_own_launches():
    vs = parse_variants(DEFAULTS + ["fp8_e4m3:head@conventional", "int8:head@replay16", "int8:rows8"])
    plan = plan_launches(vs, 64, 128)
    assert plan[0] == ([0, 1, 2, 3, 4, 5], (4, 1))
    # a whole 64-row head per program, one variant per launch (shared ones ran slower: plan_launches):
    # 2 states -> 64 per thread -> 16 rows per warp
    assert plan[1:3] == [([6], (64, 4)), ([7], (64, 4))]
    assert plan[3] == ([8], (16, 1))  # alone: 16 rows per warp, two scale groups
    # 128-row heads: 8 warps each
    heads = parse_variants([f"{f}:head@{s}" for f in ("fp8_e4m3", "int8", "nvfp4") for s in ("conventional", "replay16")])
    assert plan_launches(heads, 128, 128) == [([i], (128, 8)) for i in range(6)]


def test_the_output_mode_spreads_one_warp_launches_over_eight_row_programs():
    # eval --mode layer's launches are latency-bound: 8 rows per one-warp program where the scale groups allow
    for rows, sdim, kind in ((64, 128, "mamba2"), (64, 64, "gdn"), (128, 128, "gdn"), (128, 128, "kda")):
        for name in ("fp32@conventional", "fp8_e4m3@conventional", "nvfp4@replay16", "int8:rows8"):
            assert plan_output_launches(parse_variants([name]), rows, sdim, kind) == [([0], (8, 1))]
    # six variants in one launch already take 4 rows per warp; whole-head scale groups keep the throughput plan
    vs = parse_variants(DEFAULTS + ["int8:head@replay16", "int8:rows16"])
    assert plan_output_launches(vs, 64, 128) == [(list(range(6)), (4, 1)), ([6], (64, 4)), ([7], (16, 1))]


def test_engine_variants_are_left_to_their_kernel_and_a_too_small_tiling_is_refused():
    vs = [parse_variant("fp8_e4m3"), Variant(formats.parse("fp8_e4m3"), engine="flashinfer")]
    assert plan_launches(vs, 64, 128) == [([0], (16, 1))]
    with pytest.raises(ValueError, match="smaller than the scale group of int8:head"):
        plan_launches(parse_variants(["int8:head"]), 64, 128, tiling=(16, 1))


def test_the_register_cap_of_every_planned_launch_fits_its_block_in_the_register_file():
    # a cap above what the block can hold fails the launch (Triton: "out of resource: threads, Required: 512,
    # Hardware limit: 256" at 16 warps capped at 255): each planned tiling, and 16 and 32 warps (a tiling override)
    plans = [t for rows in (64, 128) for nv in range(1, MAX_SLOTS + 1)
             for _, t in plan_launches(parse_variants([f"fp8_e4m3:head@replay{2 ** i}" for i in range(nv)]), rows, 128)]
    plans += [t for rows in (64, 128) for _, t in plan_launches(parse_variants(DEFAULTS), rows, 128)]
    warps = sorted({w for _, w in plans} | {2, 4, 16, 32})
    assert {1, 4, 8} <= set(warps)
    for w in warps:
        cap = register_cap(w)
        if w == 1:
            assert cap is None  # one warp: ptxas's own choice (the per-row tilings do not spill)
            continue
        assert cap % REGISTER_GRANULE == 0 or cap == MAX_REGISTERS
        assert cap * 32 * w <= REGISTER_FILE and cap <= MAX_REGISTERS
    assert register_cap(8) == 255 and register_cap(16) == 128 and register_cap(32) == 64
