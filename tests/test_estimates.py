"""Time-left estimates: a first unit slowed by compiles is not extrapolated over the whole run."""

from __future__ import annotations

import torch

from ssmquant.evaluate import loop
from ssmquant.sizing import LayerEstimate


def test_layer_estimate_revises_once_when_the_second_layer_is_much_faster():
    lines: list[str] = []
    est = LayerEstimate(24, 1, lines.append, ", then the verification")
    for seconds in (31.0, 6.0, 6.2, 5.9):
        est.done(seconds)
    assert lines[0] == "the first layer took 31 s: about 11.9 min more for the other 23 layers, then the verification"
    assert lines[1].startswith("revised: the second layer took 6 s (the first 31 s, kernel compiles included)")
    assert "about 2.2 min more for the other 22 layers, then the verification" in lines[1]
    assert len(lines) == 2


def test_layer_estimate_keeps_quiet_when_the_layers_agree_and_counts_parallel_devices():
    lines: list[str] = []
    est = LayerEstimate(9, 2, lines.append)
    for seconds in (10.0, 8.0, 9.0):
        est.done(seconds)
    assert lines == ["the first layer took 10 s: about 40 s more for the other 8 layers"]
    silent = LayerEstimate(1, 1, lines.append)
    silent.done(5.0)
    LayerEstimate(5, 1, None).done(5.0)
    assert len(lines) == 1


def _clock_lines(monkeypatch, total: int, step_seconds) -> list[str]:
    """The lines eval's Clock prints over ``total`` decode steps taking ``step_seconds(t)`` each, with a check
    every 16 steps (the loop's windows)."""
    now = [0.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: now[0])
    lines: list[str] = []
    clock = loop.Clock(total, torch.device("cpu"), lines.append)
    for t in range(total):
        now[0] += step_seconds(t)
        clock.step(0, 1, t, total, check=(t + 1) % 16 == 0)
    return lines


def test_eval_clock_revises_an_estimate_made_on_slow_first_steps(monkeypatch):
    # step 0 starts the clock; steps 1-2 take 4 s each (compiles); then 0.1 s per step
    lines = _clock_lines(monkeypatch, 256, lambda t: 4.0 if t in (1, 2) else 0.1)
    first, revised = lines[0], lines[1]
    assert first.startswith("estimate: about 16.9 min for the 253 decode steps left (0.25 steps/s")
    assert revised.startswith("revised estimate: about 24 s for the 240 decode steps left (10 steps/s over the last 13")
    assert sum(line.startswith("revised") for line in lines) == 1


def test_eval_clock_does_not_revise_a_steady_rate(monkeypatch):
    lines = _clock_lines(monkeypatch, 64, lambda t: 0.1)
    assert [line for line in lines if line.startswith("revised")] == []
    assert lines[0].startswith("estimate: about 6 s for the 61 decode steps left")
