"""The real FlashInfer kernel as a CPU oracle: calls of a dump of `checkpointing_ssu` on an H200, replayed.

The slice (`data/fi_dump_slice.safetensors`, provenance in `data/README.md`) holds every input, the kernel's
stored caches before and after each flush and its outputs. `fit.replay_calls` re-runs each call through
`flashinfer.checkpointing_ssu_reference` (the arithmetic of the `flashinfer` profile) teacher-forced. The
profile computes MUFU.EX2 / MUFU.RCP with the H200's own tables (`mufu.ex2_sm90` / `rcp_sm90`), so every
code, decode scale, FP32 state word and output of the slice is bit-identical (2026-12-01); the models before
the tables (2^x toward zero, RN(1/x)) are measurably worse, which the last tests check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.engines import dump, fit
from ssmquant.engines import flashinfer as fi

SLICE = Path(__file__).parent / "data" / "fi_dump_slice.safetensors"

# case: (codes or FP32 state words identical, scales identical, scales within one ulp), measured on the slice
FLOORS = {
    "ckpt_int8_L16": (1.0, 1.0, 1.0),
    "ckpt_fp8_e4m3_L4": (1.0, 1.0, 1.0),
    "ckpt_int8_L12_T4": (1.0, 1.0, 1.0),
    "ckpt_fp32_L16": (1.0, None, None),
}


@pytest.fixture(scope="module")
def sliced():
    return dump.load(SLICE)


@pytest.mark.parametrize("key", sorted(FLOORS))
def test_profile_reproduces_the_real_kernel_calls(sliced, key):
    cases, meta = sliced
    r = fit.replay_calls(cases[key], meta["cases"][key]["case"])
    assert r["flush_rows"] >= 2
    assert r["flush_decisions"] == 1.0 and r["rings_identical"] == 1.0
    assert r["outputs_identical"] == 1.0, r
    elements, scales, ulp = FLOORS[key]
    assert r.get("codes_identical", r.get("state_identical")) >= elements, r
    if scales is not None:
        assert r["scales_identical"] >= scales and r["scales_within_ulp"] >= ulp, r


def test_the_oracle_tells_tensor_core_models_apart(sliced, monkeypatch):
    cases, meta = sliced
    key = "ckpt_fp32_L16"
    good = fit.replay_calls(cases[key], meta["cases"][key]["case"])["state_identical"]
    monkeypatch.setattr(fi, "HMMA_EXTRA_BITS", 0)  # a 24-bit alignment window: measurably worse
    bad = fit.replay_calls(cases[key], meta["cases"][key]["case"])["state_identical"]
    assert bad < good - 0.1, (bad, good)


@pytest.mark.parametrize(
    ("key", "patch", "field", "worst"),
    [
        ("ckpt_int8_L16", ("rcp_approx", "rcp_rn"), "scales_identical", 0.9),  # RN(1/x): 0.74 on the slice
        ("ckpt_fp8_e4m3_L4", ("ex2_approx", "ex2_rz"), "scales_identical", 0.9),  # 2^x toward zero: 0.82
        ("ckpt_fp32_L16", ("ex2_approx", "ex2_rz"), "state_identical", 0.9),  # 0.61
    ],
)
def test_the_oracle_tells_mufu_models_apart(sliced, monkeypatch, key, patch, field, worst):
    cases, meta = sliced
    monkeypatch.setattr(fi, patch[0], getattr(fi, patch[1]))  # the model before the H200's tables
    r = fit.replay_calls(cases[key], meta["cases"][key]["case"])
    assert r[field] < worst, r


def test_slice_of_a_slice_keeps_calls_heads_and_groups(tmp_path):
    out = tmp_path / "s.safetensors"
    meta = dump.slice_dump(SLICE, out, {"ckpt_int8_L16": 17}, heads=1)
    cases, m = dump.load(out)
    t = cases["ckpt_int8_L16"]
    assert m["slice"]["heads"] == 1 and meta["settings"]["heads_saved"] == 1
    assert t["init/state"].shape == (2, 1, 64, 128) and t["init/B_cache"].shape[1] == 1
    assert t["in/x"].shape[:4] == (17, 2, 1, 1) and t["out"].shape[0] == 17 and "snap16/state" in t
    assert not any(k.startswith("snap32") for k in t)
    r = fit.replay_calls(t, m["cases"]["ckpt_int8_L16"]["case"])
    assert r["flush_decisions"] == 1.0 and r["codes_identical"] == 1.0
    with pytest.raises(ValueError, match="not checkpointing cases"):
        dump.slice_dump(SLICE, out, {"ssu_fp32": 3}, heads=1)
    with pytest.raises(ValueError, match="heads must be in 1..2"):
        dump.slice_dump(SLICE, out, {"ckpt_int8_L16": 3}, heads=4)


def _kernel_writes(t, b: int) -> tuple[list[int], int]:
    """Committed-token positions after which the real kernel's flushes took effect (row b), and the
    position of the last call's decision (flushes due later were not observed)."""
    acc = t["call/accept"][:, b]
    before = (acc.cumsum(0) - acc).tolist()  # committed tokens before each call
    return [before[c] - 1 for c in range(len(before)) if t["call/changed"][c, b]], before[-1]


@pytest.mark.parametrize("key", ["ckpt_int8_L12_T4", "ckpt_int8_L16", "ckpt_fp8_e4m3_L4"])
def test_spec_scheme_is_the_kernel_flush_schedule(sliced, key):
    """spec(max_window, tokens per call - 1) with the dump's accepted counts flushes where the kernel did."""
    from ssmquant.replay.schemes import Scheme

    cases, meta = sliced
    t, case = cases[key], meta["cases"][key]["case"]
    for b in range(t["call/accept"].shape[1]):
        kernel, last = _kernel_writes(t, b)
        assert kernel, "no flush in the slice"
        drafts = tuple(int(a) - 1 for a in t["call/accept"][:, b])
        mask = Scheme.spec(case["window"], case["npred"] - 1, drafts).write_mask(1, int(t["call/accept"][:, b].sum()))[0]
        assert mask[:last].nonzero().flatten().tolist() == kernel
