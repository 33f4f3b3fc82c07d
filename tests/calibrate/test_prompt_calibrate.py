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


# -- prompt stores (SGLang's int8 prefix cache) -------------------------------------------------------------------
def _run_store(stores, fallbacks=("fp16", "bf16")):
    cfg = CalibrateConfig(
        model="tiny-mamba2", horizon=24, prompt=16, batch=2, device="cpu", backend="torch", budget=0.5,
        candidates=["int8"], schemes=["conventional"], engine_fallbacks=list(fallbacks), choose_among="research",
        prompt_stores=list(stores),
    )  # fmt: skip
    return calibrate(
        cfg,
        source=tiny_source("mamba2", batch=2, steps=40, seed=0, rows=ROWS, state=STATE),
        heldout_source=tiny_source("mamba2", batch=2, steps=40, seed=1, rows=ROWS, state=STATE),
    )


def test_a_prompt_store_twins_every_float_setting_and_counts_the_cached_prompt(tmp_path):
    """--prompt-store int8col: each float setting measured again with the prompt's state kept as SGLang's int8
    prefix cache; the bytes count one cached prompt state (int8 codes + live-dtype column scales for the twin, the
    live state for the others), recorded with the objective, and the recipe reads back."""
    from ssmquant.calibrate import load_recipe
    from ssmquant.calibrate.settings import Setting, cached_prompt_bytes

    res = _run_store(["int8col"])
    names = list(res.evaluations.setting.unique())
    assert "fp16@conventional+int8col" in names and "bf16@conventional+int8col" in names
    assert not any(n.startswith("int8@") and n.endswith("+int8col") for n in names)
    first = res.evaluations[res.evaluations.layer == res.ssm_layers[0]].set_index("setting")
    row, plain = first.loc["fp16@conventional+int8col"], first.loc["fp16@conventional"]
    want = cached_prompt_bytes(Setting.parse("fp16@conventional+int8col"), res.dims)
    heads, rows, sdim = res.dims.state_shape
    assert want == heads * (rows * sdim + sdim * 2)  # int8 codes, one fp16 scale per key channel
    assert int(row["cached_prompt_bytes"]) == want and int(row["bytes"]) == int(row["state_bytes"]) + want
    assert int(plain["cached_prompt_bytes"]) == int(plain["state_bytes"])  # the live fp16 state, cached as is
    # decoding starts from the restored int8 prompt state, not the fp16 one
    assert row["out_rel_err"] != plain["out_rel_err"]
    out = write_recipe(res, tmp_path / "r")
    doc = json.loads((out / CONFIG_NAME).read_text())
    assert doc["search"]["objective"] == "bytes per sequence: state + replay ring + cached prompt state"
    assert doc["search"]["prompt_stores"] == ["int8col"]
    assert all("cached_prompt" in layer["bytes_per_sequence"] for layer in doc["layers"])
    load_recipe(out)  # validates every layer's bytes against the objective


def test_prompt_stores_need_a_prompt_and_a_float_setting():
    with pytest.raises(CalibrateError, match="give the prompt's length with --prompt N"):
        CalibrateConfig(model="tiny-mamba2", prompt=0, prompt_stores=["int8col"]).validate()
    with pytest.raises(CalibrateError, match="restores the prompt's state into a float state"):
        _run_store(["int8col"], fallbacks=())
    with pytest.raises(CalibrateError, match="unknown prompt store 'int4col'; accepted: int8col"):
        _run_store(["int4col"])


def test_a_setting_with_a_prompt_store_round_trips_and_old_settings_serialise_unchanged():
    from ssmquant.calibrate.settings import Setting

    s = Setting.parse("bf16@replay16+int8col")
    assert s.name == "bf16@replay16+int8col" and s.variant().prompt_store == "int8col"
    assert Setting.from_dict(s.to_dict()) == s
    assert "prompt_store" not in Setting.parse("bf16@replay16").to_dict()
    with pytest.raises(CalibrateError, match="restores into a float live state"):
        Setting.parse("int8@conventional+int8col")
