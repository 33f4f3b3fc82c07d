"""--devices on the CLI (analyze, calibrate) and calibrate's layers spread over several emulation devices.

Several devices are simulated on the CPU as the analysis tests do: distinct ``torch.device("cpu", i)``
objects, each with its own worker thread (``analysis.devices.run_on_devices``)."""

import pytest
import torch
from click.testing import CliRunner

from ssmquant.analysis import sources
from ssmquant.cli import _devices, main

from .helpers import tiny_calibration

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")

OPTS = dict(candidates=["int8"], schemes=["replay"], buffer_lens=[4], calibration=["max"], engine_fallbacks=["fp16"])


@pytest.mark.parametrize("command", ["analyze", "calibrate"])
@pytest.mark.parametrize(
    "value, message",
    [
        ("xpu", "unknown device 'xpu'; accepted: cpu, cuda:N"),
        ("cuda:3", r"cuda:3 does not exist here: 0 GPU\(s\) visible; accepted: cuda:N"),
        ("2", r"cuda:0 does not exist here: 0 GPU\(s\) visible; accepted: .*a count of GPUs"),
        ("0", "a count of GPUs must be >= 1, got 0"),
        ("all", "none is visible"),
    ],
)
def test_cli_refuses_bad_devices_in_one_line(tmp_path, monkeypatch, command, value, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    extra = ["--budget", "0.1"] if command == "calibrate" else []
    res = CliRunner().invoke(main, [command, "--synthetic", "--model", "nemotron-3-nano", "--devices", value,
                                    "--out", str(tmp_path / "o"), "-q", *extra])  # fmt: skip
    assert res.exit_code == 2, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("Error:"))
    assert "--devices" in line
    import re

    assert re.search(message, line), line
    assert not (tmp_path / "o").exists()


def test_cli_devices_count_and_names(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _devices("2") == "cuda:0,cuda:1"
    assert _devices(" cuda:1 ") == "cuda:1" and _devices("all") == "all" and _devices(None) is None


def test_cli_passes_devices_to_calibrate(tmp_path):
    out = tmp_path / "recipe"
    args = [
        "calibrate", "--model", "nemotron-3-nano", "--synthetic", "--layers", "0", "--horizon", "8", "--batch", "1",
        "--budget", "0.05", "--candidates", "int8", "--schemes", "replay", "--buffer-lens", "4", "--calibration",
        "max", "--engine-fallbacks", "none", "--device", "cpu", "--devices", "cpu", "--out", str(out), "-q",
    ]  # fmt: skip
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    from ssmquant.calibrate import load_recipe

    doc = load_recipe(out).config
    assert doc["producer"]["stages"]["calibrate_wall_s"] > 0 and "emulation_devices" not in doc["producer"]["stages"]


def test_calibrate_over_two_devices_matches_one(monkeypatch):
    one = tiny_calibration(budget=0.05, **OPTS)
    two_devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
    monkeypatch.setattr(sources, "parse_emulation_devices", lambda spec, default: two_devices)
    two = tiny_calibration(budget=0.05, devices="cpu:0,cpu:1", **OPTS)
    assert two.stages["emulation_devices"] == {"cpu:0": [0], "cpu:1": [1]}  # round-robin, one worker per device
    assert set(two.stages["busy_s_per_device"]) == {"cpu:0", "cpu:1"}
    assert {k: v.name for k, v in two.decisions.items()} == {k: v.name for k, v in one.decisions.items()}
    cols = ["layer", "setting", "out_rel_err", "state_rel_err"]
    assert two.evaluations[cols].equals(one.evaluations[cols])  # the same numbers, bit for bit
    assert two.verification["per_layer"] == one.verification["per_layer"]
