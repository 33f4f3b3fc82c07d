"""A layer failing on held-out data ends `ssmquant calibrate` with a non-zero status and one line (issue 27); the
recipe is still written, marked, so that it can be inspected."""

import pytest
from click.testing import CliRunner

import ssmquant.calibrate as calibrate_pkg
from ssmquant.calibrate import load_recipe
from ssmquant.cli import main

from .helpers import tiny_calibration

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")

# static scales calibrated on quiet data saturate on held-out data with a 30x spike: the held-out error exceeds
# the budget that the calibration data met
LOUD = dict(candidates=["int8:static"], schemes=["conventional"], calibration=["max"], engine_fallbacks=[],
            budget=0.05, layers=[0], steps=16, batch=1, heldout_spike=30.0)  # fmt: skip


def _run(monkeypatch, tmp_path, quiet):
    monkeypatch.setattr(calibrate_pkg, "calibrate", lambda cfg, **kw: tiny_calibration(**LOUD))
    out = tmp_path / "recipe"
    args = ["calibrate", "--model", "tiny-nemotron", "--budget", "0.05", "--out", str(out)] + (["-q"] if quiet else [])
    return CliRunner().invoke(main, args), out


@pytest.mark.parametrize("quiet", [False, True])
def test_failed_verification_exits_non_zero_with_one_line_and_keeps_the_recipe(monkeypatch, tmp_path, quiet):
    res, out = _run(monkeypatch, tmp_path, quiet)
    assert res.exit_code == 4, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, res.output
    line = errors[0]
    assert "verification failed: on held-out data the decisions of layer(s) [0] exceed the budget out_rel_err <= 0.05" in line
    assert f"the recipe was still written to {out}" in line and "verification.passed = false" in line
    assert "WARNING" not in res.output
    recipe = load_recipe(out)  # written and valid, marked as failing
    assert recipe.config["verification"]["passed"] is False


def test_passing_verification_exits_zero(monkeypatch, tmp_path):
    # dynamic per-step scales follow the held-out data: the same layer passes
    ok = {**LOUD, "heldout_spike": None, "candidates": ["int8"]}
    monkeypatch.setattr(calibrate_pkg, "calibrate", lambda cfg, **kw: tiny_calibration(**ok))
    res = CliRunner().invoke(main, ["calibrate", "--model", "tiny-nemotron", "--budget", "0.05", "--out",
                                    str(tmp_path / "r"), "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert load_recipe(tmp_path / "r").config["verification"]["passed"] is True
