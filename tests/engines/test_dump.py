"""The FlashInfer dump driver (`lab.engines.dump`) on the CPU, its kernels replaced by ssmquant's re-computations."""

from __future__ import annotations

import pytest
import torch

from lab.engines import dump
from lab.engines.oracle import CkptCase, SsuCase
from ssmquant.engines import flashinfer as fi

from . import fake_flashinfer


def _replay(case, t, s):
    """Re-run the dumped calls of heads 0..heads_saved-1 from the dumped initial cache with the re-computation."""
    st = t["init/state"].clone()
    sc = t["init/scale"].clone() if "init/scale" in t else None
    xc, bc, dc = t["init/x_cache"].clone(), t["init/B_cache"].clone(), t["init/dt_cache"].clone()
    start, pnat = t["init/start"].clone(), t["init/pnat"].clone()
    ring = case.window + case.npred
    # SR words count from the start of the whole cache (64 heads per slot): with a subset of heads saved the
    # re-computation of slot 1 draws other words (`fit.py` passes the full head count); check slot 0 only
    rows = slice(0, 1) if case.sr else slice(None)
    for c in range(s.calls):
        assert torch.equal(start, t["call/start_before"][c].int()) and torch.equal(pnat, t["call/pnat_before"][c].int())
        if f"snap{c}/x_cache" in t:
            assert torch.equal(xc, t[f"snap{c}/x_cache"]) and torch.equal(dc, t[f"snap{c}/dt_cache"])
        seed = int(t["call/seed"][c])
        y = fi.checkpointing_ssu_reference(
            st, sc, xc, bc, dc, start, pnat, t["in/x"][c], t["in/dt"][c], t["A"], t["in/B"][c], t["in/C"][c], t["D"],
            rand_seed=None if seed < 0 else seed,
        )  # fmt: skip
        assert torch.equal(y[rows], t["out"][c][rows])
        if f"snap{c}/state" in t:
            assert torch.equal(fi_bits(st[rows]), fi_bits(t[f"snap{c}/state"][rows]))
        for b in range(st.shape[0]):
            k, a = int(pnat[b]), int(t["call/accept"][c, b])
            if t["call/changed"][c, b]:
                start[b], pnat[b] = (int(start[b]) + k) % ring, a
            else:
                pnat[b] = k + a


def fi_bits(x):
    return dump.fi_bits(x)


@pytest.mark.parametrize(
    "case", [CkptCase("int8", 4), CkptCase("fp8_e4m3", 4, sr=True), CkptCase("int8", 12, npred=4)], ids=str
)
def test_checkpointing_dump_replays_from_its_own_contents(monkeypatch, tmp_path, case):
    fake_flashinfer.install(monkeypatch)
    s = dump.DumpSettings(calls=9, ssu_calls=2, heads_saved=8)
    path = tmp_path / "d.safetensors"
    meta = dump.run(path, s, torch.device("cpu"), cases=[case], ssu_cases=[])
    assert not meta["failed"]
    cases, meta2 = dump.load(path)
    key = dump.case_key(case)
    assert meta2["cases"][key]["flushes"] == meta["cases"][key]["flushes"] > 0
    t = cases[key]
    assert t["out"].shape == (9, 2, case.npred, 8, 64) and t["in/B"].shape == (9, 2, case.npred, 1, 128)
    if case.npred == 1:  # without drafts the ring is full every `window` calls, in every row
        flushes = t["call/changed"].nonzero()[:, 0].unique().tolist()
        assert flushes == list(range(case.window, 9, case.window))
    _replay(case, t, s)


def test_ssu_dump_has_every_call(monkeypatch, tmp_path):
    fake_flashinfer.install(monkeypatch)
    s = dump.DumpSettings(calls=2, ssu_calls=3, ssu_heads_saved=64)  # fp16 SR words depend on the head count
    path = tmp_path / "d.safetensors"
    dump.run(path, s, torch.device("cpu"), cases=[], ssu_cases=[SsuCase("fp16", sr=True), SsuCase("int16")])
    cases, _ = dump.load(path)
    t = cases["ssu_fp16_sr"]
    st = t["init/state"].clone()
    for c in range(3):
        y = fi.selective_state_update_reference(
            st, None, t["in/x"][c], t["in/dt"][c], t["A"], t["in/B"][c], t["in/C"][c], t["D"], rand_seed=int(t["call/seed"][c])
        )
        assert torch.equal(y, t["out"][c]) and torch.equal(st, t["state"][c])
    assert cases["ssu_int16"]["scale"].shape == (3, 2, 64, 64)


def test_dump_cases_use_prebuilt_modules():
    """Every dumped configuration is one the ahead-of-time build (`aot.py`) compiles: no nvcc on the GPU machine."""
    from lab.engines import oracle

    ckpt, long, ssu, _ = oracle.default_cases(8, 8)
    built = {(c.state, c.window, c.npred, c.sr) for c in ckpt + long}
    assert {(c.state, c.window, c.npred, c.sr) for c in dump.CKPT_CASES} <= built
    assert {(c.state, c.sr) for c in dump.SSU_CASES} <= {(c.state, c.sr) for c in ssu}


def test_without_flashinfer_the_dump_says_what_is_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(SystemExit, match="flashinfer"):
        dump.main(["--out", "/tmp/never.safetensors"])
