"""The recipe files: round trip, schema validation, and the static scales in FlashInfer's layout."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ssmquant.calibrate import (
    CONFIG_NAME,
    SCALES_NAME,
    SCHEMA_VERSION,
    STATS_NAME,
    RecipeError,
    load_recipe,
    write_recipe,
)
from ssmquant.report.outdir import OUTPUT_MARKER

from .helpers import HEADS, ROWS, tiny_calibration

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")


@pytest.fixture(scope="module")
def static_result():
    """Static int8 only, so that every layer has calibrated scales."""
    return tiny_calibration(
        budget=0.5, candidates=["int8:static"], schemes=["conventional"], calibration=["max", "mse"],
        engine_fallbacks=["fp16"], choose_among="research",
    )  # fmt: skip


@pytest.fixture()
def recipe_dir(static_result, tmp_path):
    return write_recipe(static_result, tmp_path / "recipe")


def test_round_trip(static_result, recipe_dir):
    files = {CONFIG_NAME, SCALES_NAME, STATS_NAME, "candidates.csv"}
    assert {p.name for p in recipe_dir.iterdir()} == files | {OUTPUT_MARKER}
    assert json.loads((recipe_dir / OUTPUT_MARKER).read_text())["files"] == sorted(files)
    recipe = load_recipe(recipe_dir)
    doc = recipe.config
    assert doc["schema_version"] == SCHEMA_VERSION and doc["producer"]["name"] == "ssmquant"
    assert {"version", "torch", "transformers", "modelopt"} <= set(doc["producer"])
    assert doc["data"]["calibration"]["model"] == "tiny-mamba2" and doc["data"]["heldout"]["split"] == "heldout"
    assert doc["budget"] == {**doc["budget"], "metric": "out_rel_err", "value": 0.5, "horizon": 24}
    assert [d.layer for d in recipe.layers] == [0, 1]
    for d in recipe.layers:
        assert d.setting == static_result.decisions[d.layer]
        assert d.entry["state_scale"] == f"layers.{d.layer}.state_scale"
        s = recipe.static_scale(d.layer)
        assert s.dtype == torch.float32 and tuple(s.shape) == (HEADS, ROWS)  # (nheads, head_dim)
        torch.testing.assert_close(s, static_result.scales[d.layer], atol=0, rtol=0)
    # static scales are taken by no engine, and fallbacks are not candidates: no global setting, said so
    assert (
        recipe.global_setting is None and doc["global"]["status"] == "none" and "no candidate" in doc["global"]["note"]
    )
    assert all(u.setting.name in {x["setting"]["name"] for x in doc["uniform_settings"]} for u in recipe.uniform)
    raw = load_file(str(recipe_dir / SCALES_NAME))
    assert set(raw) == {"layers.0.state_scale", "layers.1.state_scale"}
    stats = load_file(str(recipe_dir / STATS_NAME))
    assert tuple(stats["layers.0.row_amax"].shape) == (HEADS, ROWS)


def _edit(recipe_dir, fn):
    path = recipe_dir / CONFIG_NAME
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_other_schema_version_is_refused_naming_both(recipe_dir):
    _edit(recipe_dir, lambda d: d.update(schema_version=2))
    with pytest.raises(RecipeError, match=r"schema_version 2; .* reads schema_version 1 only"):
        load_recipe(recipe_dir)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.pop("budget"), "the document is missing 'budget'"),
        (lambda d: d["budget"].update(metric="kl"), "budget.metric must be one of out_rel_err, state_rel_err, out_rel_err_max, state_rel_err_max"),
        (lambda d: d["model"].update(layer_kind="rwkv"), "model.layer_kind must be one of 'mamba2', 'gdn', 'kda'"),
        (lambda d: d["layers"][0]["setting"].update(format="int4"), r"layers\[0\].setting: invalid setting"),
        (lambda d: d["layers"][0].update(state_scale=None), r"layers\[0\] is static but state_scale is None"),
        (lambda d: d["layers"].append(d["layers"][0]), "layer 0 appears twice"),
        (lambda d: d.update(kind="something"), "kind must be 'ssmquant.ssm_state_recipe'"),
    ],
)
def test_malformed_documents_name_the_problem(recipe_dir, edit, match):
    _edit(recipe_dir, edit)
    with pytest.raises(RecipeError, match=match):
        load_recipe(recipe_dir)


@pytest.mark.parametrize(
    "edit, where, literal",
    [
        (lambda d: d["global"].update(max_error=float("nan")), "global.max_error", "NaN"),
        (lambda d: d["layers"][1]["calibration_error"].update(out_rel_err=float("inf")),
         "layers[1].calibration_error.out_rel_err", "Infinity"),
        (lambda d: d["uniform_settings"][0]["errors"].update({"0": float("-inf")}), "uniform_settings[0].errors.0",
         "-Infinity"),
    ],
)  # fmt: skip
def test_non_finite_numbers_are_refused_in_one_line(recipe_dir, edit, where, literal):
    """Issue 27: NaN in global.max_error was accepted (Python's json reads NaN and Infinity; calibrate writes null)."""
    _edit(recipe_dir, edit)
    assert literal in (recipe_dir / CONFIG_NAME).read_text()
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe_dir)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{CONFIG_NAME}: {where} is {literal}: a recipe holds finite numbers only")


def test_global_max_error_must_agree_with_its_status(recipe_dir):
    def meets_but_misses(d):
        u = d["uniform_settings"][0]
        d["global"] = {**d["global"], "setting": u["setting"], "status": "meets_budget", "meets_budget": True,
                       "max_error": 2 * d["budget"]["value"]}  # fmt: skip

    _edit(recipe_dir, meets_but_misses)
    with pytest.raises(RecipeError, match=r"global.status is 'meets_budget' but its max_error 1.0 is not within the budget 0.5"):
        load_recipe(recipe_dir)


def test_scale_tensors_are_checked(recipe_dir):
    path = recipe_dir / SCALES_NAME
    save_file({"layers.0.state_scale": torch.ones(HEADS, ROWS + 1)}, str(path))
    with pytest.raises(RecipeError, match=r"layers.0.state_scale is torch.float32 \(2, 9\); expected float32 \(2, 8\)"):
        load_recipe(recipe_dir)
    save_file({"layers.0.state_scale": torch.ones(HEADS, ROWS)}, str(path))
    with pytest.raises(RecipeError, match="has no tensor 'layers.1.state_scale'"):
        load_recipe(recipe_dir)


def test_not_a_recipe(tmp_path):
    with pytest.raises(RecipeError, match="has no ssm_quant_config.json"):
        load_recipe(tmp_path)
