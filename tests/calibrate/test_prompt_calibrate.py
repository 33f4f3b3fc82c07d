"""`calibrate` with a prompt: the sources give prompt + horizon tokens, the horizon counts decode steps after the
prompt, and the recipe records the prompt (recipes written before prompts read as no prompt)."""

import json

import pytest

from ssmquant.calibrate import CONFIG_NAME, CalibrateConfig, CalibrateError, calibrate, write_recipe

from .helpers import ROWS, STATE, tiny_source

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")


def _run(prompt: int, horizon: int = 24):
    cfg = CalibrateConfig(
        model="tiny-mamba2", horizon=horizon, prompt=prompt, batch=2, device="cpu", backend="torch", budget=0.5,
        candidates=["int8", "fp8_e4m3"], schemes=["replay"], buffer_lens=[8], engine_fallbacks=["fp16"],
        choose_among="research",
    )  # fmt: skip
    steps = prompt + horizon
    return calibrate(
        cfg,
        source=tiny_source("mamba2", batch=2, steps=steps, seed=0, rows=ROWS, state=STATE),
        heldout_source=tiny_source("mamba2", batch=2, steps=steps, seed=1, rows=ROWS, state=STATE),
    )


def test_the_recipe_records_the_prompt_and_its_errors_are_the_decode_steps_after_it(tmp_path):
    with_prompt, without = _run(16), _run(0)
    doc = json.loads((write_recipe(with_prompt, tmp_path / "r") / CONFIG_NAME).read_text())
    assert doc["budget"]["prompt"] == 16 and doc["budget"]["horizon"] == 24
    # the same candidates, measured after the prompt's stored state rather than from an empty one
    a, b = with_prompt.evaluations, without.evaluations
    assert list(a.setting) == list(b.setting)
    assert (a.out_rel_err != b.out_rel_err).any()


def test_a_negative_prompt_is_refused():
    with pytest.raises(CalibrateError, match="--prompt must be a whole number"):
        CalibrateConfig(budget=0.1, prompt=-1).validate()
