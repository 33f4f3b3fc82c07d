"""Folding the reference and the variants into one batch (evaluate(fold=True); the default on a GPU) against one
forward per run (fold=False; the default on the CPU), and the memory plan that splits variants into passes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ssmquant.evaluate import EvalConfig, EvalError
from ssmquant.evaluate import evaluate as _evaluate
from ssmquant.evaluate import run as run_module
from ssmquant.evaluate.loop import CPU_ROW_MULTIPLE, REFERENCE, Pass, plan_passes

# evaluate folds by default only on a GPU; these tests are about the folded path, on the CPU


def evaluate(cfg: EvalConfig, **kwargs):
    """`evaluate` folded unless the config says otherwise (the GPU's default, here on the CPU)."""
    return _evaluate(dataclasses.replace(cfg, fold=True) if cfg.fold is None else cfg, **kwargs)

METRIC_COLS = ["kl", "top1_agree", "delta_loss"]
# stochastic rounding, a speculative per-sequence flush schedule, replay, bf16 and an exact format
VARIANTS = ["int8@conventional", "nvfp4:sr@replay4", "fp8_e4m3@spec8x2:p0.6", "bf16:sr", "fp32@replay8"]


def _metrics(result) -> np.ndarray:
    return result.positions.sort_values(["variant", "position"])[METRIC_COLS].to_numpy()


@pytest.fixture
def rowwise_linear(monkeypatch):
    """nn.Linear computed one row at a time (GEMMs of one row): CPU GEMMs pick their blocking by the number of
    rows, so a batch of 16 and a batch of 64 round differently in the last bits; row by row they cannot."""

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        return torch.cat([F.linear(r, self.weight, self.bias) for r in flat.split(1)]).reshape(*x.shape[:-1], -1)

    monkeypatch.setattr(torch.nn.Linear, "forward", forward)


@pytest.mark.parametrize("model", ["nemotron", "qwen"])
def test_folded_equals_unfolded_bitwise_with_batch_invariant_gemms(model, rowwise_linear, request):
    # batch 16 = CPU_ROW_MULTIPLE: the unfolded runs' batch needs no padding either, so that every elementwise
    # op sees the same rows; then the only batch-dependent arithmetic left is the GEMMs', made row-wise here.
    loaded = request.getfixturevalue(model)
    variants = VARIANTS[:3] + VARIANTS[4:]
    folded = evaluate(EvalConfig(loaded, variants, steps=10, batch=CPU_ROW_MULTIPLE, seed=1))
    unfolded = evaluate(EvalConfig(loaded, variants, steps=10, batch=CPU_ROW_MULTIPLE, seed=1, fold=False))
    a, b = _metrics(folded), _metrics(unfolded)
    assert (folded.positions.kl > 0).sum() > 10  # the variants drift: the comparison is not between zeros
    np.testing.assert_array_equal(a, b)
    assert folded.reference == unfolded.reference
    assert folded.timing["forward_batch"] == [4 * CPU_ROW_MULTIPLE] and unfolded.timing["forward_batch"] == 16


def test_folded_is_close_to_unfolded_with_the_real_gemms(nemotron):
    """With torch's own (batch-size-dependent) GEMMs the logits of the two differ in the last bits, and a
    rounding of the stored state that lands the other side of a grid midpoint turns that into a visible
    difference: observed up to 1.6e-3 of the largest per-position KL on these tiny models (3e-4 here)."""
    folded = evaluate(EvalConfig(nemotron, VARIANTS, steps=24, batch=2, seed=1))
    unfolded = evaluate(EvalConfig(nemotron, VARIANTS, steps=24, batch=2, seed=1, fold=False))
    a, b = _metrics(folded), _metrics(unfolded)
    assert np.abs(a[:, 0] - b[:, 0]).max() <= 1e-2 * np.abs(b[:, 0]).max()
    fs, us = folded.summary.set_index("variant"), unfolded.summary.set_index("variant")
    np.testing.assert_allclose(fs.kl_mean, us.kl_mean, rtol=1e-2)
    assert fs.loc["fp32@replay8", "kl_mean"] == 0.0 and us.loc["fp32@replay8", "kl_mean"] == 0.0
    assert folded.reference["loss_mean"] == pytest.approx(unfolded.reference["loss_mean"], rel=1e-6)


def test_folded_differs_from_unfolded_as_much_as_another_gemm_kernel_does(qwen, monkeypatch):
    """Why folded and unfolded results may differ, and by how much: the unfolded run's bits are themselves those of
    one GEMM blocking. Computing its linear layers row by row (another kernel, the same function) moves the
    metrics by the same order as folding does (measured on this model: per-position KL 6.6e-6 vs 2.5e-5, of a
    largest KL of 1.5e-2; the row-wise kernel also flips one top-1 of 48), and the summaries agree as closely."""
    variants = ["int8@conventional", "nvfp4:sr@replay4", "bf16:sr"]
    folded = evaluate(EvalConfig(qwen, variants, steps=24, batch=2, seed=1))
    unfolded = evaluate(EvalConfig(qwen, variants, steps=24, batch=2, seed=1, fold=False))
    linear = torch.nn.Linear.forward

    def rowwise(self, x):
        return torch.cat([linear(self, r) for r in x.reshape(-1, x.shape[-1]).split(1)]).reshape(*x.shape[:-1], -1)

    monkeypatch.setattr(torch.nn.Linear, "forward", rowwise)
    other_kernel = evaluate(EvalConfig(qwen, variants, steps=24, batch=2, seed=1, fold=False))
    a, b, c = _metrics(folded), _metrics(unfolded), _metrics(other_kernel)
    fold_diff, kernel_diff = np.abs(a - b)[:, 0].max(), np.abs(c - b)[:, 0].max()
    assert 0 < kernel_diff and 0 < fold_diff <= 10 * kernel_diff
    assert fold_diff <= 1e-2 * b[:, 0].max()
    for r in (folded, other_kernel):
        np.testing.assert_allclose(r.summary.kl_mean, unfolded.summary.kl_mean, rtol=2e-2)
        # the row-wise kernel alone flips one argmax of the 48 positions x sequences here: allow two
        np.testing.assert_allclose(r.summary.top1_agree_mean, unfolded.summary.top1_agree_mean, atol=2 / 48 + 1e-12)


def test_default_folds_on_a_gpu_only(nemotron):
    r = _evaluate(EvalConfig(nemotron, ["int8"], steps=4, batch=2))
    assert r.config.fold is False and r.timing["forward_batch"] == 2  # the CPU: one forward per run
    assert evaluate(EvalConfig(nemotron, ["int8"], steps=4, batch=2)).timing["forward_batch"] == [4]


def test_passes_of_fewer_variants_give_the_same_bits(nemotron):
    # on the CPU both folded batches are padded to 16 rows: the same GEMM shapes, so the same bits
    full = evaluate(EvalConfig(nemotron, VARIANTS, steps=20, batch=2, seed=1))
    split = evaluate(EvalConfig(nemotron, VARIANTS, steps=20, batch=2, seed=1, fold_width=1))
    np.testing.assert_array_equal(_metrics(full), _metrics(split))
    assert split.timing["passes"] == 4 and full.timing["passes"] == 1  # fp32 is not decoded: an alias
    assert any("1 of 4 variants folded per pass" in n for n in split.notes)


@pytest.mark.parametrize("row_multiple", [CPU_ROW_MULTIPLE, 1])
def test_slices_of_one_batch_are_bit_identical_until_the_first_flush(qwen, monkeypatch, row_multiple):
    # 5 slices x 3 sequences = 15 rows: unpadded, the last rows of small elementwise ops take torch's scalar
    # tail loop on the CPU and differ in the last bits (KL ~1e-15 before any rounding); padded to 16 they do not
    monkeypatch.setattr(run_module, "CPU_ROW_MULTIPLE", row_multiple)
    r = evaluate(EvalConfig(qwen, ["int8@replay8", "nvfp4@replay16", "fp8_e4m3@replay12", "int8:sr@replay10"], steps=20, batch=3))
    before_flush = []
    for name, first in zip(r.config.variants, (8, 16, 12, 10)):
        kl = r.positions[r.positions.variant == name].sort_values("position").kl.to_numpy()
        assert kl[first] > 0, name
        before_flush.append((kl[:first] == 0).all())
    assert all(before_flush) == (row_multiple == CPU_ROW_MULTIPLE), before_flush


def test_plan_passes():
    assert plan_passes(3, fold=False) == [Pass(((REFERENCE,), (0,), (1,), (2,)))]
    assert plan_passes(3, fold=True) == [Pass(((REFERENCE, 0, 1, 2),))]
    p = plan_passes(5, fold=True, per_pass=2, exact=frozenset({1}), row_multiple=16)
    assert [q.runs for q in p] == [((REFERENCE, 0, 2),), ((REFERENCE, 3, 4),)]
    assert p[0].aliases == (1,) and p[1].aliases == () and p[0].variants == [0, 2, 1] and p[0].slices == 4
    only_exact = plan_passes(2, fold=True, exact=frozenset({0, 1}))
    assert only_exact == [Pass(((REFERENCE,),), (0, 1))]


def test_memory_plan_folds_what_fits_and_refuses_what_cannot(nemotron, monkeypatch):
    need = {}
    real = run_module._memory

    def spy(*args, **kwargs):
        est = real(*args, **kwargs)
        need[args[4]] = est.total("host")
        return est

    monkeypatch.setattr(run_module, "_memory", spy)
    evaluate(EvalConfig(nemotron, VARIANTS[:4], steps=8, batch=2))
    assert set(need) == {4} and need[4] > 0
    # room for the reference and 2 variants, not 3: two passes of 2
    monkeypatch.setattr(run_module, "_memory", real)
    sizes = {k: real(nemotron.model, run_module.ssm_layout(nemotron.model.config), 2, 8, k, torch.device("cpu"),
                     step_batch=(k + 1) * 2).total("host") for k in (1, 2, 3)}  # fmt: skip
    monkeypatch.setattr(run_module, "free_bytes", lambda dev: (sizes[2] + sizes[3]) // 2)
    r = evaluate(EvalConfig(nemotron, VARIANTS[:4], steps=8, batch=2))
    assert r.timing["passes"] == 2 and r.config.variants_per_pass == 2
    monkeypatch.setattr(run_module, "free_bytes", lambda dev: sizes[1] // 2)
    with pytest.raises(EvalError, match=r"needs about .* of host memory .* lower --steps or --batch"):
        evaluate(EvalConfig(nemotron, VARIANTS[:4], steps=8, batch=2))


def test_progress_and_estimate(nemotron):
    calls, lines = [], []
    r = evaluate(EvalConfig(nemotron, ["int8", "nvfp4@replay4", "fp32"], steps=20, batch=2), progress=lambda d, t: calls.append((d, t)), notify=lines.append)  # fmt: skip
    assert calls[-1] == (4 * 20, 4 * 20) and len(calls) == 20  # one call per decode step, 4 slices each
    assert any(line.startswith("estimate: about") and "steps/s" in line for line in lines)
    assert r.timing["decode_steps_per_s"] > 0 and r.timing["forward_batch"] == [6]


def test_non_finite_reference_logits_stop_the_run_naming_the_step(nemotron):
    calls = []

    def poison(mod, inp, out):
        calls.append(1)
        return out.fill_(float("nan")) if len(calls) == 4 else out

    handle = nemotron.model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(EvalError, match="logits are not finite at decode step 3"):
            evaluate(EvalConfig(nemotron, ["int8"], steps=20, batch=2))
    finally:
        handle.remove()
