"""Window statistics: every step is measured, windows aggregate without aliasing the flush cycle.

The oracle is an every-step run (record_every=1) of the same variants: a window's mean must equal the
mean of the per-step metrics over its steps, its max the largest per-step relative error, its last value
the one at its last step; whatever the window length and the flush period.
"""

import numpy as np
import pytest
import torch

from ssmquant.replay import cycle_window, parse_variants, window_ends
from ssmquant.simulate import simulate, triton_interpreting

from .helpers import gdn_inputs, mamba2_inputs

VARIANTS = ["fp8_e4m3@conventional", "fp8_e4m3@replay16", "int8:sr@replay16"]


def pooled_per_step(trace_every_step, quantity):
    """Per-step metrics [V, T, B, H, 2] (err2, ref2) of one quantity from a record_every=1 trace.

    (Sums in float64 in another order than numpy's: comparisons allow 1e-12 relative.)"""
    q = 0 if quantity == "state" else 2
    return trace_every_step.mean[..., q : q + 2]


def window_mean_from_steps(per_step, ends):
    """Pooled relative error per window from per-step (err2, ref2) [V, T, B, H, 2]: [V, R]."""
    starts = np.concatenate([[0], ends[:-1]])
    out = []
    for s, e in zip(starts, ends):
        err2 = per_step[:, s:e, ..., 0].sum((1, 2, 3))
        ref2 = per_step[:, s:e, ..., 1].sum((1, 2, 3))
        out.append(np.sqrt(err2 / ref2))
    return np.stack(out, 1)


def test_window_ends_cover_every_step():
    assert window_ends(40, 16).tolist() == [16, 32, 40]
    assert window_ends(32, 16).tolist() == [16, 32]
    assert window_ends(5, 8).tolist() == [5]
    with pytest.raises(ValueError, match="record_every must be >= 1"):
        window_ends(5, 0)


def test_cycle_window_holds_whole_cycles_of_every_variant():
    assert cycle_window([1, 16], 4096, 1024) == 16  # 4096 / 1024 = 4 -> rounded up to one 16-step cycle
    assert cycle_window([1, 16], 32768, 1024) == 32
    assert cycle_window([8, 12], 4096, 1024) == 24  # lcm
    assert cycle_window([1], 100, 1024) == 1
    assert cycle_window([16], 10, 1024) == 10  # no whole cycle fits: one window of the whole run
    assert cycle_window([16], 4096, 64) == 64


@pytest.mark.parametrize("record_every", [16, 32, 1000])
def test_window_means_equal_the_every_step_mean_torch(record_every):
    inp = mamba2_inputs(batch=2, steps=1040, heads=2, head_dim=8, groups=1, state=16)
    every = simulate(inp, VARIANTS, record_every=1)
    win = simulate(inp, VARIANTS, record_every=record_every)
    ends = window_ends(inp.steps, record_every)
    assert win.steps.tolist() == ends.tolist()
    for quantity in ("state", "out"):
        expect = window_mean_from_steps(pooled_per_step(every, quantity), ends)
        np.testing.assert_allclose(win.rel_err(quantity), expect, rtol=1e-12, atol=0)
        # the max: the largest per-step pooled relative error inside each window
        per_step = every.rel_err(quantity)  # [V, T]
        starts = np.concatenate([[0], ends[:-1]])
        expect_max = np.stack([per_step[:, s:e].max(1) for s, e in zip(starts, ends)], 1)
        np.testing.assert_allclose(win.rel_err(quantity, stat="max"), expect_max, rtol=1e-12, atol=0)
        np.testing.assert_allclose(win.rel_err(quantity, stat="last"), per_step[:, ends - 1], rtol=1e-12, atol=0)
        # per head and per sequence maxima likewise
        for per_head, per_batch in ((True, False), (False, True), (True, True)):
            ph = every.rel_err(quantity, per_head=per_head, per_batch=per_batch)
            exp = np.stack([ph[:, s:e].max(1) for s, e in zip(starts, ends)], 1)
            got = win.rel_err(quantity, stat="max", per_head=per_head, per_batch=per_batch)
            np.testing.assert_allclose(got, exp, rtol=1e-12, atol=0)


def test_sampling_at_flush_steps_would_alias_but_window_means_do_not():
    """The bug this replaces: one step in every 16 under replay16 sees the flush-step minimum only.

    Every head decays by a = exp(-0.22) ~ 0.8 per step and the buffer is FP32, so the only error is the
    checkpoint's rounding, which decays by 0.8^15 from the first step after a flush to the next flush.
    """
    inp = mamba2_inputs(batch=2, steps=512, heads=4, head_dim=16, groups=1, state=32)
    inp.dt = torch.full_like(inp.dt, 0.1)
    inp.A = torch.full_like(inp.A, -2.2)
    tr = simulate(inp, "fp8_e4m3@replay16:fp32", record_every=16)
    sampled = tr.rel_err("out", stat="last")[0, 4:]  # the value at each flush step (what sampling kept)
    mean = tr.rel_err("out")[0, 4:]
    peak = tr.rel_err("out", stat="max")[0, 4:]
    assert (sampled < 0.2 * mean).all()  # the flush step is the cycle's low point
    assert (mean < peak).all()
    # and the mean over the whole run does not depend on how the steps are windowed
    a = simulate(inp, "fp8_e4m3@replay16:fp32", record_every=512).rel_err("out")[0, 0]
    w = simulate(inp, "fp8_e4m3@replay16:fp32", record_every=48)  # windows of 48 and a last one of 32 steps
    lengths = np.diff(np.concatenate([[0], w.steps]))
    sums = (w.mean[0, ..., 2:].sum((1, 2)) * lengths[:, None]).sum(0)  # (err2, ref2) summed over all steps
    assert a == pytest.approx(np.sqrt(sums[0] / sums[1]), rel=1e-12)


def test_horizon_is_the_last_full_window():
    inp = mamba2_inputs(batch=1, steps=40, heads=2, head_dim=8, groups=1, state=16)
    tr = simulate(inp, "fp8_e4m3@replay16", record_every=16)
    assert tr.steps.tolist() == [16, 32, 40] and tr.horizon_index == 1
    assert tr.final("out") == {"fp8_e4m3@replay16": tr.rel_err("out")[0, 1]}


GPU = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_triton_windows_match_torch_and_batch_slicing_is_exact(kind):
    from ssmquant.kernels import emulate_triton, emulate_triton_steps

    dev = "cuda" if GPU else "cpu"
    if kind == "mamba2":
        inp = mamba2_inputs(batch=3, steps=40, heads=2, head_dim=8, groups=1, state=16, device=dev)
    else:
        inp = gdn_inputs(batch=3, steps=40, key_heads=1, value_heads=2, dk=16, dv=8, device=dev)
    variants = parse_variants(VARIANTS)
    whole = emulate_triton(inp, variants)  # one launch per variant
    sliced = torch.full_like(whole, float("nan"))
    for i, b0, m in emulate_triton_steps(inp, variants, metric_budget=1):  # one sequence per launch
        assert m.shape[1] == 1
        sliced[i, :, b0 : b0 + 1] = m
    # bit-exact: SR draws count elements over the whole batch, whatever the slice
    assert torch.equal(whole, sliced)
    tri = simulate(inp, variants, backend="triton", record_every=16)
    ref = simulate(inp, variants, backend="torch", record_every=16)
    for quantity in ("state", "out"):
        for stat in ("mean", "max", "last"):
            np.testing.assert_allclose(
                tri.rel_err(quantity, stat=stat), ref.rel_err(quantity, stat=stat), rtol=0.1, atol=1e-6
            )


@pytest.mark.parametrize("steps,record_every", [(64, 16), (50, 16), (10, 1), (7, 7), (5, 8), (33, 32)])
def test_window_sums_add_in_step_order_as_a_sequential_index_add(steps, record_every):
    """The window means are sums in step order: the bits of the CPU's sequential index_add_ (which CUDA's
    atomic index_add_ does not give: its order changes from run to run), whatever the window layout."""
    from ssmquant.replay.trace import WindowAccumulator

    gen = torch.Generator().manual_seed(steps)
    m = torch.randn(steps, 2, 3, 4, generator=gen, dtype=torch.float64)
    m = m * 10.0 ** torch.randint(-9, 9, (steps, 1, 1, 1), generator=gen)  # magnitudes whose order matters
    acc = WindowAccumulator(steps, record_every, 2, 3)
    ends = torch.as_tensor(window_ends(steps, record_every))
    assert torch.equal(acc.window_of_step, torch.searchsorted(ends, torch.arange(1, steps + 1), right=False))
    expected = torch.zeros(len(ends), 2, 3, 4, dtype=torch.float64).index_add_(0, acc.window_of_step, m)
    assert torch.equal(acc._window_sums(m), expected)
