"""The hypothesis fit (`lab.engines.fit`) on a dump whose kernel is ssmquant's re-computation."""

from __future__ import annotations

import torch

from lab.engines import dump, fit
from lab.engines.oracle import CkptCase

from . import fake_flashinfer


def test_fit_finds_the_recomputation_exact_and_the_source_flush_rule(monkeypatch, tmp_path):
    fake_flashinfer.install(monkeypatch)
    s = dump.DumpSettings(calls=9, heads_saved=8)
    path = tmp_path / "d.safetensors"
    cases = [CkptCase("int8", 4), CkptCase("fp8_e4m3", 4, sr=True), CkptCase("int8", 12, npred=4), CkptCase("fp32", 4)]
    dump.run(path, s, torch.device("cpu"), cases=cases, ssu_cases=[])
    loaded, meta = dump.load(path)
    meta["heads"] = dump.HEADS
    other_h = fit.Hypothesis("exact_rz", "fma", "rcp", "ex2")
    rows = fit.measure(loaded, meta, [fit.PROFILE, other_h])
    by = {(r["case"], r["name"]): r for r in rows}
    for key in ("ckpt_int8_L4", "ckpt_fp8_e4m3_sr_L4", "ckpt_int8_L12_T4"):
        ref = by[(key, fit.PROFILE.name)]
        assert ref["flushes"] > 0 and ref["scales_identical"] == 1.0 and ref["codes_identical"] == 1.0
        assert by[(key, other_h.name)]["scales_identical"] < 1.0  # the fit can tell models apart
    ref = by[("ckpt_fp32_L4", fit.PROFILE.name)]
    assert ref["flushes"] > 0 and ref["state_identical"] == 1.0
    assert by[("ckpt_fp32_L4", other_h.name)]["state_identical"] < 1.0
    for r in fit.flush_rule(loaded, meta):
        assert r["pnat + T > max_window (kernel source)"] == 1.0


def test_mma_sum_models_agree_on_exactly_representable_sums():
    a = torch.tensor([[1.0, 2.0, 0.5, 0.0]])  # [P=1, k=4]
    b = torch.tensor([[1.0], [4.0], [2.0], [3.0]])  # [k=4, N=1]
    for mode in ("seq", "exact_rn", "exact_rz", "align_rz0", "align_rz3", "hmma"):
        assert fit.mma_sum(a, b, mode).item() == 10.0
    # 1 + 2^-24 * 3 terms: sequential FP32 loses every small term, an exact sum keeps them (then rounds)
    a = torch.tensor([[1.0, 2.0**-24, 2.0**-24, 2.0**-24]])
    b = torch.ones(4, 1)
    assert fit.mma_sum(a, b, "seq").item() == 1.0
    assert fit.mma_sum(a, b, "exact_rn").item() == 1.0 + 2.0**-22  # 1.5 ulp, to nearest even
    assert fit.mma_sum(a, b, "exact_rz").item() == 1.0 + 2.0**-23
    assert fit.mma_sum(a, b, "align_rz0").item() == 1.0  # 2^-24 is below a 24-bit aligned window
    assert fit.mma_sum(a, b, "align_rz1").item() == 1.0 + 2.0**-23  # kept by a 25-bit window, then truncated
