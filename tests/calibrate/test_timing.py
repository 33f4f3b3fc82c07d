"""How calibrate spends and reports its time (issue 27): one intra-op thread for the CPU emulation, progress that
moves within a layer and has a verification stage, and time estimates that include the verification, with a
range where the machine is busy."""

import pytest
import torch

from ssmquant.analysis.devices import emulation_threads
from ssmquant.calibrate import timing
from ssmquant.calibrate.stats import iter_reference_states
from ssmquant.calibrate.timing import Costs, LayerCost, RunClock, TimeLeft, mse_samples_at

from .helpers import tiny_calibration, tiny_mamba2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")

QUICK = dict(candidates=["int8"], schemes=["conventional", "replay"], buffer_lens=[4], calibration=["max"],
             engine_fallbacks=["fp16"], budget=1.0, steps=8, batch=1)  # fmt: skip


def test_cpu_emulation_runs_on_one_intra_op_thread_and_restores_the_count(monkeypatch):
    import ssmquant.calibrate.run as run

    seen = []
    for name in ("evaluate_layer", "verify_layer"):
        real = getattr(run, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, torch.get_num_threads()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(run, name, spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tiny_calibration(**QUICK)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert {n for n, _ in seen} == {"evaluate_layer", "verify_layer"}
    assert all(threads == 1 for _, threads in seen), seen
    with emulation_threads(["cuda:0"]):  # a GPU run keeps the process' threads
        assert torch.get_num_threads() == before


def test_progress_moves_within_a_layer_and_the_time_left_includes_the_verification():
    calls, lefts = [], []
    tiny_calibration(**QUICK, calibrate_kw={
        "progress": lambda stage, done, total, layer: calls.append((stage, done, total)),
        "time_left": lambda left: lefts.append((calls[-1][0] if calls else None, left)),
    })  # fmt: skip
    stages = [c[0] for c in calls]
    assert stages[0] == "calibrate" and stages[-1] == "verify" and stages.index("verify") > stages.index("calibrate")
    cal = [done for stage, done, _ in calls if stage == "calibrate"]
    assert any(0 < d < 1 for d in cal) and any(1 < d < 2 for d in cal)  # statistics, scales, simulate calls
    assert cal == sorted(cal) and cal[-1] == 2
    assert [d for s, d, _ in calls if s == "verify"][-1] == 2
    during = [left for stage, left in lefts if stage == "calibrate"]
    assert during and all(left.verify_s > 0 and left.seconds >= left.verify_s for left in during)


def test_mse_samples_at_counts_what_the_scale_search_quantizes():
    inputs = tiny_mamba2(0, batch=1, steps=40)
    for samples in (4, 64):
        first = int(40 * timing.MSE_FROM)
        every = max(1, (40 - first) // samples)
        n = sum(1 for t, _ in iter_reference_states(inputs, every=every) if t > first)
        assert mse_samples_at(40, samples) == n
    assert mse_samples_at(512) == 64


def _cost(**kw):
    base = dict(wall_s=10.0, cpu_s=10.0, stats_s=1.0, scales_s=2.0, eval_s=7.0, simulated=13, calls=1, steps=512, batch=2)
    return LayerCost(**{**base, **kw})


def test_probe_scales_to_the_horizon_with_the_mse_search_per_sample_and_the_verification():
    probe = LayerCost(wall_s=2.0, cpu_s=2.0, stats_s=0.1, scales_s=0.5, eval_s=1.7, simulated=16, calls=1, steps=32,
                      batch=2, decode_s=0.1, mse_samples=4)  # fmt: skip
    c = Costs.from_probe(probe, steps=512, settings=56, calls=4, mse_samples=64, verify_settings=3, heldout_ratio=2.0,
                         cpu=True)  # fmt: skip
    unit = 1.7 / 17 * 16  # one setting over 512 steps
    assert c.layer_s == pytest.approx(0.1 * 16 + (0.1 * 16 + 0.1 * 64) + unit * 60)
    assert c.verify_s == pytest.approx(unit * 4 * 2.0)
    assert c.share == 1.0


def test_time_left_counts_the_layers_left_and_the_verification():
    clock = RunClock(5, verify=True, heldout_ratio=1.0, cpu=True)
    assert clock.left() is None  # nothing measured, no probe
    clock.calibrated(0, _cost())
    left = clock.left()
    unit = 7.0 / 14 * 10.0 / 10.0
    assert left.calibrate_s == pytest.approx(4 * 10.0)
    assert left.verify_s == pytest.approx(5 * unit * (timing.VERIFY_SETTINGS_GUESS + 1))
    assert left.low is None and "machine" not in left.text()
    clock.advance(2, 0.5)  # half of the next layer done
    assert clock.left().calibrate_s == pytest.approx(3.5 * 10.0)
    clock.start_verification(2)
    assert clock.left().calibrate_s == 0 and clock.left().verify_s == pytest.approx(5 * unit * 3)
    clock.verified(0, 4.0, 4.0)  # measured verification layers replace the model
    assert clock.left().verify_s == pytest.approx(4 * 4.0)


def test_a_busy_machine_gives_a_range():
    clock = RunClock(3, verify=False, cpu=True)
    clock.calibrated(0, _cost(cpu_s=4.0))  # the emulation thread got 40% of a core
    left = clock.left()
    assert left.seconds == pytest.approx(20.0) and left.low == pytest.approx(8.0)
    assert "at this load (8 s if the machine frees up: the emulation got 40% of a core" in left.text()
    assert left.short() == "8-20 s left"
    gpu = RunClock(3, verify=False, cpu=False)  # a GPU run's thread waits for the GPU: no busy range
    gpu.calibrated(0, _cost(cpu_s=1.0))
    assert gpu.left().low is None


def test_estimate_lines_name_the_verification():
    lines = []
    tiny_calibration(**{**QUICK, "layers": [0, 1]}, calibrate_kw={"notify": lines.append})
    assert lines[0].startswith("estimate: about ") and "to verify on 1 held-out sequences" in lines[0]
    assert "trial of the pipeline" in lines[0]
    assert lines[1].startswith("the first layer took ") and "for the other 1 layers" in lines[1]
    assert "for the verification" in lines[1]
    assert isinstance(TimeLeft(1.0, None, 1.0, 0.0, None).short(), str)
