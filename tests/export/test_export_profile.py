"""Export checks the engine profile a recipe was measured with against the profile of the target's kernel."""

import json

import pytest
from click.testing import CliRunner

from ssmquant.calibrate import CONFIG_NAME, write_recipe
from ssmquant.cli import main
from ssmquant.export import export
from ssmquant.export.run import REPORT_NAME, SUMMARY_NAME

from ..calibrate.helpers import tiny_calibration

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")

KW = dict(budget=0.5, candidates=["fp16"], schemes=["conventional"], calibration=["none"], engine_fallbacks=[],
          layers=[0], verify=False)  # fmt: skip


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """fp16@conventional measured with the ideal and with the vllm profile."""
    root = tmp_path_factory.mktemp("profiles")
    return {e: write_recipe(tiny_calibration(**KW, engine=e), root / e) for e in ("ideal", "vllm")}


def _report(result):
    return json.loads((result.out_dir / REPORT_NAME).read_text())


def test_mismatch_is_one_line_naming_the_remeasuring_command(recipes, tmp_path):
    res = export(recipes["ideal"], "vllm", tmp_path / "v")
    prof = _report(res)["engine_profile"]
    assert prof["measured"] == "ideal" and prof["recorded"] and prof["target"] == "vllm"
    assert not prof["matches"] and not prof["same_arithmetic"]
    assert prof["remeasure"].startswith("ssmquant calibrate --engine vllm --model tiny-mamba2 --budget 0.5 ")
    lines = [x for x in res.report_lines() if "engine profile" in x]
    assert len(lines) == 1 and lines[0].startswith("engine profile MISMATCH: measured with `ideal`")
    assert "fp16@conventional on vLLM" in lines[0] and "`ssmquant calibrate --engine vllm" in lines[0]
    assert "**Engine profile MISMATCH**" in (res.out_dir / SUMMARY_NAME).read_text()


def test_matching_profile_and_same_arithmetic(recipes, tmp_path):
    prof = _report(export(recipes["vllm"], "vllm", tmp_path / "v"))["engine_profile"]
    assert prof["matches"] and prof["remeasure"] is None
    assert prof["line"].startswith("engine profile: measured with `vllm`, the profile of fp16@conventional on vLLM")
    # TensorRT-LLM's Triton selective_state_update computes as vLLM's: other name, same arithmetic
    prof = _report(export(recipes["vllm"], "trtllm", tmp_path / "t"))["engine_profile"]
    assert prof["target"] == "trtllm" and not prof["matches"] and prof["same_arithmetic"]
    assert "same arithmetic" in prof["line"]
    # FlashInfer's selective_state_update is its own profile
    prof = _report(export(recipes["vllm"], "flashinfer", tmp_path / "f"))["engine_profile"]
    assert prof["target"] == "flashinfer" and "--engine flashinfer" in prof["remeasure"]


def test_recipe_without_the_field_is_treated_as_ideal_and_says_so(recipes, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for f in recipes["vllm"].iterdir():
        if f.is_file():
            (old / f.name).write_bytes(f.read_bytes())
    doc = json.loads((old / CONFIG_NAME).read_text())
    del doc["engine_profile"]
    (old / CONFIG_NAME).write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["export", str(old), "--target", "vllm", "--out", str(tmp_path / "e")])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if "engine profile" in x)
    assert "measured with `ideal` (the recipe records no engine_profile" in line and "treated as ideal" in line
    assert "--engine vllm" in line
    assert json.loads((tmp_path / "e" / REPORT_NAME).read_text())["engine_profile"]["recorded"] is False


def test_bad_engine_profile_in_recipe_is_refused(recipes, tmp_path):
    from ssmquant.export import ExportError

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in recipes["ideal"].iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    doc = json.loads((bad / CONFIG_NAME).read_text())
    doc["engine_profile"]["name"] = "lmdeploy"
    (bad / CONFIG_NAME).write_text(json.dumps(doc))
    with pytest.raises(ExportError, match="engine_profile.name must be one of ideal, flashinfer, vllm, trtllm, sglang"):
        export(bad, "vllm", tmp_path / "e")


def test_the_remeasuring_command_keeps_the_recipes_prompt(recipes, tmp_path):
    """A recipe calibrated after a prompt (budget.prompt) is re-measured after the same prompt."""
    src = tmp_path / "prompted"
    src.mkdir()
    for f in recipes["ideal"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    doc = json.loads((src / CONFIG_NAME).read_text())
    doc["budget"]["prompt"] = 2048
    (src / CONFIG_NAME).write_text(json.dumps(doc))
    prof = _report(export(src, "vllm", tmp_path / "v"))["engine_profile"]
    assert " --prompt 2048 --candidates " in prof["remeasure"]
    assert " --prompt" not in _report(export(recipes["ideal"], "vllm", tmp_path / "w"))["engine_profile"]["remeasure"]
