"""The per-layer choice under a budget, the global setting, held-out verification, and the CLI."""

import pytest
from click.testing import CliRunner

from ssmquant.calibrate import BudgetError, load_recipe
from ssmquant.cli import main
from ssmquant.export import takeable_by_any

from .helpers import tiny_calibration

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")

OPTS = dict(
    candidates=["int8", "fp8_e4m3"],
    schemes=["conventional", "replay"],
    buffer_lens=[4, 16],
    calibration=["max", "mse"],
    engine_fallbacks=["fp16"],
)
BUDGET = 0.02


@pytest.fixture(scope="module")
def result():
    return tiny_calibration(budget=BUDGET, **OPTS)


def test_each_layer_takes_the_cheapest_candidate_within_budget(result):
    ev = result.evaluations
    assert set(result.decisions) == {0, 1}
    for layer, setting in result.decisions.items():
        rows = ev[(ev["layer"] == layer) & (ev["role"] == "candidate")]
        ok = rows[rows["out_rel_err"] <= BUDGET]
        chosen = rows[rows["setting"] == setting.name].iloc[0]
        assert chosen["bytes"] == ok["bytes"].min()
        assert chosen["out_rel_err"] == ok[ok["bytes"] == ok["bytes"].min()]["out_rel_err"].min()
    # fallbacks are measured but never chosen per layer
    assert set(ev[ev["role"] == "fallback"]["setting"]) == {"fp16@conventional", "fp16@replay4", "fp16@replay16"}
    assert not any(s.encoding == "fp16" for s in result.decisions.values())


def test_budget_is_met_on_heldout_data(result):
    v = result.verification
    assert v["passed"] and v["data"]["split"] == "heldout"
    assert all(r["out_rel_err"] <= BUDGET for r in v["per_layer"])
    g = result.global_setting
    assert result.global_status == "meets_budget" and takeable_by_any(g, "mamba2")
    assert v["global"]["setting"] == g.name and v["global"]["meets_budget"]
    # what each engine would take is verified too (the global setting and TensorRT-LLM's float fallback)
    assert g.name in v["uniform"] and any(n.startswith("fp16") for n in v["uniform"])


def test_global_setting_is_cheapest_uniform_within_budget(result):
    u = result.uniform
    ok = u[u["meets_budget"] & (u["role"] == "candidate") & u["setting"].map(result.takeable)]
    assert result.global_setting.name == ok.sort_values(["bytes", "max_error"]).iloc[0]["setting"]


def test_forced_global_setting_applies_to_every_layer():
    r = tiny_calibration(budget=BUDGET, force_global=True, **OPTS)
    assert {s.name for s in r.decisions.values()} == {r.global_setting.name}
    assert not r.scales


def test_global_cost_is_recorded(result, tmp_path):
    from ssmquant.calibrate import write_recipe

    doc = load_recipe(write_recipe(result, tmp_path / "r")).config
    g = doc["global"]
    assert g["setting"]["name"] == result.global_setting.name and g["status"] == "meets_budget"
    cost = g["cost_vs_per_layer"]
    assert cost["bytes_per_sequence_per_layer_choice"] == doc["per_layer_total"]["bytes_per_sequence"]
    assert cost["bytes_per_sequence_global"] >= cost["bytes_per_sequence_per_layer_choice"]
    assert cost["max_error_global"] <= 0.02


def test_unmeetable_budget_reports_best_per_layer_and_writes_nothing(tmp_path):
    with pytest.raises(BudgetError) as info:
        tiny_calibration(
            budget=1e-9, candidates=["nvfp4"], schemes=["conventional"], calibration=["none"], verify=False
        )
    table = info.value.table
    assert list(table["layer"]) == [0, 1]
    assert (table["best_out_rel_err"] > 1e-9).all() and not table["meets_budget"].any()
    assert "no recipe written" in str(info.value) and "Best achievable per layer" in str(info.value)


def _cli(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_cli_calibrates_a_preset_layer_and_verifies_on_heldout(tmp_path):
    out = tmp_path / "recipe"
    args = [
        "calibrate", "--model", "nemotron-3-nano", "--synthetic", "--layers", "0", "--horizon", "12",
        "--batch", "1", "--budget", "0.01", "--candidates", "int8", "--schemes", "conventional,replay",
        "--buffer-lens", "4", "--calibration", "max", "--engine-fallbacks", "fp16", "--device", "cpu",
        "--out", str(out), "-q",
    ]  # fmt: skip
    res = _cli(args)
    assert res.exit_code == 0, res.output
    recipe = load_recipe(out)
    v = recipe.config["verification"]
    assert v["passed"] and all(r["out_rel_err"] <= 0.01 for r in v["per_layer"])
    assert recipe.config["data"]["heldout"]["split"] == "heldout"
    assert recipe.config["model"]["dims"] == {"kind": "mamba2", "heads": 64, "rows": 64, "state_dim": 128, "groups": 8}
    # a non-empty --out without --force is refused
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0 and "--force" in res.output


def test_cli_unmeetable_budget_exits_3_without_a_recipe(tmp_path):
    out = tmp_path / "recipe"
    res = CliRunner().invoke(
        main,
        [
            "calibrate", "--model", "nemotron-3-nano", "--synthetic", "--layers", "0,2", "--horizon", "4",
            "--batch", "1", "--budget", "1e-9", "--candidates", "nvfp4", "--schemes", "conventional",
            "--calibration", "none", "--engine-fallbacks", "none", "--choose-among", "research", "--device", "cpu",
            "--out", str(out), "-q",
        ],
    )  # fmt: skip
    assert res.exit_code == 3, res.output
    assert "best_out_rel_err" in res.output and "no recipe written" in res.output
    assert not out.exists()


def test_cli_bad_option_names_accepted_values(tmp_path):
    res = CliRunner().invoke(
        main,
        ["calibrate", "--model", "nemotron-3-nano", "--synthetic", "--budget", "0.02", "--rounding", "up",
         "--out", str(tmp_path / "r"), "-q"],
    )  # fmt: skip
    assert res.exit_code != 0 and "accepted: rne, sr" in res.output
    assert not (tmp_path / "r").exists()


def _shipped():
    from ssmquant.models import available_shipped_models

    return sorted(available_shipped_models())


@pytest.mark.skipif(not _shipped(), reason="no shipped tiny model installed")
def test_trained_tiny_model_meets_the_budget_on_heldout_text():
    from ssmquant.calibrate import CalibrateConfig, calibrate

    model = "tiny-nemotron" if "tiny-nemotron" in _shipped() else _shipped()[0]
    cfg = CalibrateConfig(
        model=model,
        budget=0.02,
        horizon=32,
        batch=1,
        candidates=["int8"],
        schemes=["conventional", "replay"],
        buffer_lens=[4],
        calibration=["max"],
        engine_fallbacks=["fp16"],
        layers=[0],
        device="cpu",
    )  # layer 0 is an SSM layer of both shipped models
    r = calibrate(cfg)
    assert r.source["text"]["split"] == "calibration" and r.verification["data"]["text"]["split"] == "heldout"
    assert r.verification["passed"] and all(x["out_rel_err"] <= 0.02 for x in r.verification["per_layer"])


def test_synthetic_heldout_is_new_sequences_of_the_same_layer():
    import torch

    from ssmquant.calibrate import synthetic_heldout_source
    from ssmquant.models import synthetic_inputs

    cal = synthetic_inputs("qwen3.5-0.8b", 0, batch=2, steps=4, seed=0)
    src = synthetic_heldout_source("qwen3.5-0.8b", calibration_batch=2, batch=1, steps=4, seed=0, device="cpu")
    ((layer, held),) = list(src.iter_layers([0]))
    assert layer == 0 and held.batch == 1 and held.meta["sequences"] == [2, 3]
    for k in ("A_log", "dt_bias"):  # the same layer parameters
        torch.testing.assert_close(held.meta["params"][k], cal.meta["params"][k], atol=0, rtol=0)
    assert not any(torch.equal(held.v[0], cal.v[i]) for i in range(2))  # new sequences
