"""The oracle driver end to end on the CPU, with the engine's re-computation standing in for the kernel.

With kernel == re-computation every teacher-forced and free-running comparison is bit-identical and the
engine curves coincide with the real ones; the ideal emulation stays within a few percent of them.
"""

import json

import pytest
import torch

from lab.engines import oracle
from ssmquant.models.synthetic import synthetic_inputs

from . import fake_flashinfer


def _small_nano(steps):
    """Nemotron-3-Nano's per-head shape (head_dim 64, d_state 128, the 8-bit kernel's only shape), 4 heads."""
    inp = oracle.bf16_inputs(synthetic_inputs("nemotron-3-nano", 0, batch=1, steps=steps))
    return oracle.Mamba2Inputs(
        x=inp.x[:, :, :4], dt=inp.dt[:, :, :4], B=inp.B[:, :, :1], C=inp.C[:, :, :1], A=inp.A[:4], D=inp.D[:4]
    ).validate()


@pytest.mark.parametrize(
    "case",
    [
        oracle.CkptCase("int8", 8, steps=40),
        oracle.CkptCase("fp8_e4m3", 4, sr=True, steps=40),
        oracle.CkptCase("int8", 12, npred=4, steps=40),
        oracle.CkptCase("bf16", 16, steps=40),
    ],
    ids=lambda c: c.name,
)
def test_checkpointing_driver_with_a_kernel_equal_to_its_recomputation(monkeypatch, case):
    fake_flashinfer.install(monkeypatch)
    r = oracle.run_checkpointing(_small_nano(40), case)
    tf = r["teacher_forced"]
    assert r["writes"] >= 2
    assert tf["codes_identical_min"] == 1.0 and tf["out_identical_mean"] == 1.0
    assert r["free_running_at_write"][1]["codes"] == 1.0
    assert r["out_curves"]["max_rel_gap_vs_real"]["engine_ref"] == 0.0
    assert r["state_curves"]["max_rel_gap_vs_real"]["engine_ref"] == 0.0
    if case.state in ("int8", "fp8_e4m3"):
        # the same format and flush schedule in the ideal emulation: curves of the same size
        assert r["out_curves"]["max_rel_gap_vs_real"]["ideal"] < 0.5


@pytest.mark.parametrize("case", [oracle.SsuCase("bf16", steps=20), oracle.SsuCase("fp16", True, 20), oracle.SsuCase("int16", steps=20)], ids=lambda c: c.name)
def test_ssu_driver_with_a_kernel_equal_to_its_recomputation(monkeypatch, case):
    fake_flashinfer.install(monkeypatch)
    r = oracle.run_ssu(_small_nano(20), case)
    assert r["teacher_forced"]["codes_identical_min"] == 1.0
    assert r["free_running_at_write"][16]["codes"] == 1.0
    if not case.sr:  # same arithmetic as the ideal emulation up to summation order
        assert r["state_curves"]["max_rel_gap_vs_real"]["ideal"] < 1e-3


def test_curve_windows_and_gap():
    a, b = oracle.Curve(), oracle.Curve()
    for s in range(1, 9):
        a.add(s, torch.tensor([1.0 + 0.1]), torch.tensor([1.0]))
        b.add(s, torch.tensor([1.0 + 0.2]), torch.tensor([1.0]))
    assert [w for w, _ in a.windows(4)] == [4, 8]
    assert oracle.curve_gap(a, b, 4) == pytest.approx(0.5, rel=1e-5)


def test_engine_status_is_one_line_naming_what_is_missing_and_how_to_get_it(monkeypatch):
    import sys

    from lab.engines import env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    st = env.engine_status("flashinfer")
    assert not st.ok and "CUDA GPU" in st.reason and "\n" not in st.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "compute capability >= 8.0" in env.engine_status("fla").reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # import fails
    st = env.engine_status("fla")
    assert not st.ok and "flash-linear-attention==0.6.0" in st.reason
    assert "python -m lab.engines.bundle OUTDIR" in st.reason and "\n" not in st.reason
    with pytest.raises(ValueError, match="accepted: flashinfer, fla"):
        env.engine_status("vllm")


def test_main_runs_each_fla_op_on_its_synthetic_and_captured_layers(monkeypatch, tmp_path):
    """`--only fla` with fla present: GDN cases on the qwen3.5-9b layer and on captured GDN layers, then KDA cases on
    the glm-5.3-flash layer and on captured KDA layers (the kernels replaced by a recorder)."""
    import ssmquant.models.synthetic as synthetic
    from lab.engines.env import EngineStatus

    def ok(name):
        return EngineStatus(name, name == "fla", "" if name == "fla" else "not here", "0")

    small = {p: synthetic_inputs(p, 0, batch=1, steps=2) for p in ("qwen3.5-9b", "glm-5.3-flash")}
    calls = []

    def recorder(op):
        def run(inp, case):
            assert case.op == op
            calls.append(case.name)
            gaps = {"max_rel_gap_vs_real": {"ideal": 0.0}}
            return {"case": case.name, "teacher_forced": {}, "out_curves": gaps, "state_curves": gaps, "seconds": 0.0}

        return run

    monkeypatch.setattr(oracle, "engine_status", ok)
    monkeypatch.setattr(oracle, "run_fla_gdn", recorder("gdn"))
    monkeypatch.setattr(oracle, "run_fla_kda", recorder("kda"))
    monkeypatch.setattr(synthetic, "synthetic_inputs", lambda preset, layer, **kw: small[preset])
    captured = {"cap-gdn": synthetic_inputs("qwen3.5-9b", 1, batch=1, steps=2),
                "cap-kda": synthetic_inputs("glm-5.3-flash", 1, batch=1, steps=2)}  # fmt: skip
    monkeypatch.setattr(oracle, "load_captured", lambda path, dev: captured)
    assert oracle.main(["--only", "fla", "--out", str(tmp_path), "--captured", "x", "--steps", "2"]) == 0
    gdn, kda = oracle.FLA_OPS["gdn"], oracle.FLA_OPS["kda"]
    names = [f"fla {op} {st}" for op in (gdn, gdn, kda, kda) for st in ("fp32", "bf16")]
    sources = ["synthetic qwen3.5-9b layer 0"] * 2 + ["cap-gdn"] * 2 + ["synthetic glm-5.3-flash layer 0"] * 2
    sources += ["cap-kda"] * 2
    assert calls == names
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["case"], r["source"]) for r in results["cases"]] == list(zip(names, sources)) and not results["skipped"]
