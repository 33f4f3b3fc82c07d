"""What calibrate chooses among (issue 27): by default what the engines checked run, the research settings beside."""

import json

import pytest

from ssmquant.calibrate import CONFIG_NAME, CalibrateError, load_recipe, write_recipe
from ssmquant.calibrate.summary import summary_text

from .helpers import tiny_calibration

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")

# head_dim 64, d_state 128: FlashInfer's 8-bit replay kernel takes the layer (tiny-nemotron's sizes); one layer
FI = dict(rows=64, state=128, layers=[0], steps=16, batch=1)
SEARCH = dict(candidates=["int8", "nvfp4"], schemes=["conventional", "replay"], buffer_lens=[4], calibration=["max"],
              engine_fallbacks=["fp16"], budget=0.05)  # fmt: skip


@pytest.fixture(scope="module")
def engines():
    return tiny_calibration(choose_among="engines", **FI, **SEARCH)


@pytest.fixture(scope="module")
def research():
    return tiny_calibration(choose_among="research", **FI, **SEARCH)


def test_default_chooses_what_an_engine_runs_and_shows_the_research_setting_beside(engines, tmp_path):
    (layer, setting), = engines.decisions.items()  # fmt: skip
    # FlashInfer 0.7.4 runs int8 under replay (dynamic scales) at these sizes; no engine runs nvfp4 or static scales
    assert engines.runs_on[setting.name] and setting.encoding != "nvfp4" and not setting.is_static
    assert engines.runs_on["nvfp4@conventional"] == [] and engines.runs_on["int8:static[max]@replay4"] == []
    alt = engines.alternatives[layer]
    assert alt is not None and engines.runs_on[alt["setting"]] == []  # the best research setting
    assert alt["bytes"] < engines.decision_rows[layer]["bytes"]
    text = summary_text(engines)
    assert "choosing among: what vLLM 0.34.0, TensorRT-LLM main@2829508, FlashInfer 0.7.4, SGLang 0.5.23 on sm90" in text
    assert "research settings (no checked engine runs them yet)" in text and alt["setting"] in text
    doc = load_recipe(write_recipe(engines, tmp_path / "r")).config
    assert doc["search"]["choose_among"] == "engines"
    entry = doc["layers"][0]
    assert entry["runs_on"] == engines.runs_on[setting.name]
    assert entry["alternative"]["pool"] == "research" and entry["alternative"]["setting"] == alt["setting"]


def test_research_mode_chooses_among_every_candidate_and_shows_what_engines_run(research, engines, tmp_path):
    (layer, setting), = research.decisions.items()  # fmt: skip
    assert research.runs_on[setting.name] == []  # the cheapest within the budget is a research setting here
    assert research.decision_rows[layer]["bytes"] < engines.decision_rows[layer]["bytes"]
    alt = research.alternatives[layer]
    assert alt["setting"] == engines.decisions[layer].name  # beside it: what the engines mode chose
    assert "what the checked engines run, the cheapest within the budget per layer" in summary_text(research)
    doc = json.loads((write_recipe(research, tmp_path / "r") / CONFIG_NAME).read_text())
    assert doc["search"]["choose_among"] == "research" and doc["layers"][0]["alternative"]["pool"] == "engines"


def test_nothing_an_engine_runs_is_refused_before_the_work():
    with pytest.raises(CalibrateError, match=r"--choose-among engines: none of the 2 settings runs on .*--choose-among research"):
        tiny_calibration(choose_among="engines", candidates=["nvfp4"], schemes=["conventional", "replay4"],
                         calibration=["none"], engine_fallbacks=[], budget=1.0, calibrate_kw={"progress": _never})  # fmt: skip


def _never(*args):
    raise AssertionError("the work started")


def test_a_recipe_chosen_among_engines_names_an_engine_for_every_layer(engines, tmp_path):
    path = write_recipe(engines, tmp_path / "r")
    doc = json.loads((path / CONFIG_NAME).read_text())
    doc["layers"][0]["runs_on"] = []
    (path / CONFIG_NAME).write_text(json.dumps(doc))
    with pytest.raises(Exception, match=r"layers\[0\].runs_on is empty but search.choose_among is 'engines'"):
        load_recipe(path)
