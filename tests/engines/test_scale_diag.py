"""The CUDA-vs-CPU diagnostic of FlashInfer's re-computation (`lab.engines.scale_diag`), on the CPU.

Without a GPU the "device" is the CPU again, so every device-vs-cpu comparison must be bit-identical; a
perturbed op stands in for a device-dependent one (the bisection must name it), and a stand-in kernel that
moves one decode scale stands in for a kernel the model misses (the per-head count and amax offset must show it).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from lab.engines import dump, scale_diag
from ssmquant.engines import flashinfer as fi
from ssmquant.engines import mufu

from . import fake_flashinfer

SLICE = Path(__file__).parent / "data" / "fi_dump_slice.safetensors"


def test_pow2_f64_is_exact_where_ldexp_is_and_clamps_below():
    e = torch.arange(-1022, 1024)
    assert torch.equal(fi.pow2_f64(e), torch.ldexp(torch.ones((), dtype=torch.float64), e.double()))
    assert float(fi.pow2_f64(torch.tensor(-1025))) == 2.0**-1022  # all-zero products: any quantum sums to 0
    a = torch.zeros(1, 2, 3)
    assert torch.equal(fi.hmma(a, torch.zeros(1, 3, 4)), torch.zeros(1, 2, 4))


def test_legacy_quantum_is_the_same_on_the_cpu():
    g = torch.Generator().manual_seed(3)
    a = scale_diag._bf16_values(g, (4, 16, 16), -30, 4)
    b = scale_diag._bf16_values(g, (4, 16, 8), -4, 2)
    c = torch.randn(4, 16, 8, generator=g)
    want = fi.hmma(a, b, c)
    with scale_diag.legacy_ldexp_quantum():
        got = fi.hmma(a, b, c)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert fi.pow2_f64.__name__ == "pow2_f64"


def _flush_case():
    cases, meta = dump.load(SLICE)
    t = cases["ckpt_int8_L16"]
    c = next(k for k in range(t["call/changed"].shape[0]) if f"snap{k}/state" in t)
    return t, c


def test_bisection_names_the_first_op_that_differs(monkeypatch):
    t, c = _flush_case()
    state, scale = t["init/state"], t["init/scale"]
    with scale_diag.OpTrace() as ta:
        fi.checkpointing_ssu_reference(*scale_diag._ref_args(t, c, state, scale, "cpu"))
    with scale_diag.OpTrace() as tb:
        fi.checkpointing_ssu_reference(*scale_diag._ref_args(t, c, state, scale, "cpu"))
    assert len(ta.records) > 50 and scale_diag.first_divergence(ta.records, tb.records) is None
    names = [r.name for r in ta.records]
    assert {"flashinfer.hmma", "flashinfer.pow2_f64", "mufu.rcp_sm90", "flashinfer.encode_rows_fast"} <= set(names)
    # inner ops complete (and are recorded) before the op that calls them
    assert names.index("flashinfer.pow2_f64") < names.index("flashinfer.hmma") < names.index("flashinfer.encode_rows_fast")

    rcp = mufu.ieee_rcp  # a "device" whose IEEE reciprocal is one ulp off on one significand
    monkeypatch.setattr(mufu, "ieee_rcp", lambda m: torch.where(m == m.flatten()[0], torch.nextafter(rcp(m), m.new_zeros(())), rcp(m)))
    with scale_diag.OpTrace() as tc:
        fi.checkpointing_ssu_reference(*scale_diag._ref_args(t, c, state, scale, "cpu"))
    d = scale_diag.first_divergence(ta.records, tc.records)
    assert d["op"] == "mufu.ieee_rcp" and d["inputs_identical"] and d["differing"] >= 1, d
    ex = d["examples"][0]
    assert ex["a"] != ex["b"] and len(ex["a"].split()[0]) == 8  # FP32 bits in hex


def test_first_divergence_flags_an_untraced_op():
    t, c = _flush_case()
    state, scale = t["init/state"], t["init/scale"]
    args = scale_diag._ref_args(t, c, state, scale, "cpu")
    with scale_diag.OpTrace() as ta:
        fi.checkpointing_ssu_reference(*args)
    args = list(scale_diag._ref_args(t, c, state, scale, "cpu"))
    args[9] = torch.nextafter(args[9], torch.zeros_like(args[9]))  # A one ulp smaller: as if an untraced op differed
    with scale_diag.OpTrace() as tb:
        fi.checkpointing_ssu_reference(*args)
    d = scale_diag.first_divergence(ta.records, tb.records)
    assert d["inputs_identical"] is False, d  # the first traced op to differ was fed by the untraced product A dt


def test_implied_amax_offset_recovers_a_moved_amax():
    amax = torch.tensor([0.37, 1.5e-3, 12.25, 3.0e5])
    moved = (amax.view(torch.int32) + torch.tensor([3, -5, 0, 9], dtype=torch.int32)).view(torch.float32)
    scale = fi.rcp_approx(fi.rcp_approx(moved) * 127.0)
    k = scale_diag.implied_amax_offsets(amax, scale, 127.0)
    assert k[2] == 0 and bool((k.abs() <= torch.tensor([3, 5, 0, 9])).all()), k
    again = (amax.view(torch.int32) + k.int()).view(torch.float32)
    assert torch.equal(fi.rcp_approx(fi.rcp_approx(again) * 127.0), scale)
    far = scale_diag.implied_amax_offsets(amax, scale * 2, 127.0, reach=4)
    assert bool((far == 5).all())


def test_primitives_and_dump_replay_are_identical_on_one_device():
    rows = scale_diag.audit_primitives(torch.device("cpu"), size=12)
    assert len(rows) >= 10 and all(r["identical"] == 1.0 for r in rows), rows
    r = scale_diag.replay_dump(SLICE, [torch.device("cpu")])
    assert {x["case"] for x in r} == {"ckpt_int8_L16", "ckpt_fp8_e4m3_L4", "ckpt_int8_L12_T4", "ckpt_fp32_L16"}
    assert all(x.get("scales_identical", 1.0) == 1.0 and x.get("codes_identical", x.get("state_identical")) == 1.0 for x in r)


def _install(monkeypatch, kernel):
    pkg, mod = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mamba")
    mod.checkpointing_ssu = kernel
    pkg.mamba = mod
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mamba", mod)


def _small_layer(monkeypatch):
    """The oracle's layer cut to 8 heads (one group) and 24 steps; dump_checkpointing's HEADS / GROUPS follow."""
    from lab.engines import oracle

    inp = oracle.nano_layer(2, 24, "cpu")
    small = oracle.Mamba2Inputs(
        x=inp.x[:, :, :8], dt=inp.dt[:, :, :8], B=inp.B[:, :, :1], C=inp.C[:, :, :1], A=inp.A[:8], D=inp.D[:8]
    ).validate()
    monkeypatch.setattr(dump, "HEADS", 8)
    monkeypatch.setattr(dump, "GROUPS", 1)
    return small


@pytest.mark.parametrize("state", ["int8", "fp8_e4m3"])
def test_oracle_part_with_a_kernel_equal_to_the_reference(monkeypatch, tmp_path, state):
    _install(monkeypatch, fake_flashinfer.checkpointing_ssu)
    inp = _small_layer(monkeypatch)
    r, t = scale_diag.run_oracle_case(fi_case(state, 4), 12, inp, torch.device("cpu"), tmp_path)
    assert r["flushes"] == 2
    for p in ("real_vs_device", "real_vs_cpu", "device_vs_cpu"):
        assert r[p] == {"codes_identical": 1.0, "scales_identical": 1.0, "scales_within_ulp": 1.0}, (p, r[p])
    assert r["real_vs_cpu_mismatches_per_head"] == [0] * 8 and r["first_mismatch"] == {}
    assert not bool(t["init/state"].float().any()) and bool(t["snap4/state"].float().any())  # the oracle's zero cache
    # the saved calls are a dump: fit replays them bit for bit
    from lab.engines import fit

    key = f"ckpt_{state}_L4"
    cases, meta = dump.load(tmp_path / f"oracle_{key}.safetensors")
    rr = fit.replay_calls(cases[key], meta["cases"][key]["case"])
    assert rr["scales_identical"] == 1.0 and rr["codes_identical"] == 1.0 and rr["flush_decisions"] == 1.0


def fi_case(state, window):
    return scale_diag.oracle_cases([f"{state}:{window}"])[0][0]


def test_oracle_part_shows_a_kernel_that_moves_one_scale(monkeypatch, tmp_path):
    def kernel(state, x_cache, B_cache, dt_cache, ring_start, pnat, x, dt, A, B, C, out, D=None, state_scale=None, **kw):
        flush = int(pnat[0]) + x.shape[1] > x_cache.shape[2] - x.shape[1]
        fake_flashinfer.checkpointing_ssu(state, x_cache, B_cache, dt_cache, ring_start, pnat, x, dt, A, B, C, out, D=D, state_scale=state_scale)
        if flush:  # head 5, d-row 7 of batch row 1: the scale one ulp up, as a kernel the model misses would
            state_scale[1, 5, 7] = torch.nextafter(state_scale[1, 5, 7], torch.tensor(1.0))
        return out

    _install(monkeypatch, kernel)
    inp = _small_layer(monkeypatch)
    r, t = scale_diag.run_oracle_case(fi_case("int8", 4), 12, inp, torch.device("cpu"), None)
    n = 2 * 8 * 64 * r["flushes"]
    assert r["device_vs_cpu"]["scales_identical"] == 1.0 and r["real_vs_device"]["codes_identical"] == 1.0
    assert r["real_vs_cpu"]["scales_identical"] == pytest.approx(1 - r["flushes"] / n)
    assert r["real_vs_cpu"]["scales_within_ulp"] == 1.0
    assert r["real_vs_cpu_mismatches_per_head"] == [0] * 5 + [r["flushes"]] + [0] * 2
    assert sum(r["real_vs_cpu_implied_amax_offset_ulps"].values()) == r["flushes"]
    assert r["first_mismatch"]["real_vs_cpu"]["head"] == 5 and r["first_mismatch"]["real_vs_cpu"]["d_row"] == 7
    b = scale_diag.bisect_call(t, r["first_mismatch"]["real_vs_cpu"]["call"], 1, 5, torch.device("cpu"))
    assert b["first_divergence"] is None and b["scales_real_vs_cpu_differing"] == 1
    assert b["scale_examples"][0]["head"] == 5 and b["scale_examples"][0]["ulps"] == 1
    json.dumps(r)


def test_bad_case_specs_are_refused():
    assert scale_diag.oracle_cases(["fp32:16:40", "int8:4"], 64) == [(fi_case("fp32", 16), 40), (fi_case("int8", 4), 64)]
    with pytest.raises(ValueError, match="STATE:MAX_WINDOW"):
        scale_diag.oracle_cases(["int8"])
    with pytest.raises(ValueError, match="int8, fp8_e4m3, fp32, bf16"):
        scale_diag.oracle_cases(["int4:16"])
