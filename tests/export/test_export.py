"""Export: files an engine takes as is, what is dropped with its measured cost, and refusals with reasons."""

import json
import os
import runpy
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner

from ssmquant.calibrate import CONFIG_NAME, write_recipe
from ssmquant.cli import main
from ssmquant.export import ExportError, export

from ..calibrate.helpers import GROUPS, HEADS, ROWS, STATE, tiny_calibration

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")


@pytest.fixture(scope="module")
def mamba_recipe(tmp_path_factory):
    """Per-layer int8 decisions (conventional is cheapest), an int8 replay global, fp16/bf16 fallbacks."""
    r = tiny_calibration(
        budget=0.02, candidates=["int8", "fp8_e4m3"], schemes=["conventional", "replay"], buffer_lens=[4, 16],
        calibration=["max"], engine_fallbacks=["fp16", "bf16"],
    )  # fmt: skip
    return write_recipe(r, tmp_path_factory.mktemp("mamba") / "recipe")


@pytest.fixture(scope="module")
def sr_recipe(tmp_path_factory):
    r = tiny_calibration(budget=0.02, candidates=["fp16:sr"], schemes=["replay16"], calibration=["none"],
                         engine_fallbacks=[])  # fmt: skip
    return write_recipe(r, tmp_path_factory.mktemp("sr") / "recipe")


@pytest.fixture()
def copy(tmp_path):
    def make(src):
        dst = tmp_path / "recipe"
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("export-*"))
        return dst

    return make


def _doc(recipe_dir):
    return json.loads((recipe_dir / CONFIG_NAME).read_text())


def test_vllm_files(mamba_recipe):
    doc = _doc(mamba_recipe)
    g = doc["global"]["setting"]
    assert g["encoding"] in ("int8", "fp8_e4m3") and g["scheme_kind"] == "replay"
    res = export(mamba_recipe, "vllm", force=True)
    out = res.out_dir
    assert out == mamba_recipe / "export-vllm"
    args = json.loads((out / "vllm_engine_args.json").read_text())
    assert args == {
        "mamba_ssm_cache_dtype": g["encoding"],
        "use_replayssm": True,
        "replayssm_buffer_len": g["buffer_len"],
        "mamba_backend": "flashinfer",
        "enable_mamba_cache_stochastic_rounding": False,
    }
    flags = (out / "vllm_flags.txt").read_text().split()
    assert flags == ["--mamba-ssm-cache-dtype", g["encoding"], "--use-replayssm", "--replayssm-buffer-len",
                     str(g["buffer_len"]), "--mamba-backend", "flashinfer"]  # fmt: skip
    sh = (out / "vllm_serve.sh").read_text()
    assert "vllm serve" in sh and "--use-replayssm" in sh and "# NOT consumed by the engine" in sh
    assert os.access(out / "vllm_serve.sh", os.X_OK)
    assert json.loads((out / "hf_config_patch.json").read_text()) == {"mamba_ssm_cache_dtype": g["encoding"]}
    report = json.loads((out / "export_report.json").read_text())
    assert report["setting"]["name"] == g["name"] and report["from_global"]
    assert report["measured"]["heldout"]["meets_budget"] is True


def test_partially_consumable_recipe_reports_each_dropped_setting_with_its_cost(mamba_recipe):
    doc = _doc(mamba_recipe)
    decisions = {e["setting"]["name"] for e in doc["layers"]}
    assert all(n.endswith("@conventional") for n in decisions)  # the cheapest per layer: no replay ring
    res = CliRunner().invoke(main, ["export", str(mamba_recipe), "--target", "vllm", "--force"])
    assert res.exit_code == 0, res.output
    assert "dropped conventional decoding (-> replay" in res.output
    assert "int8 state exists only in FlashInfer's ReplaySSM kernel" in res.output
    assert "measured cost of the export at these layers: bytes/sequence" in res.output
    assert "(calibration)" in res.output and "(held-out)" in res.output
    md = (mamba_recipe / "export-vllm" / "EXPORT.md").read_text()
    assert "## Not consumed by the engine" in md and "dropped conventional decoding" in md


def test_trtllm_files_fall_back_to_a_measured_float_state(mamba_recipe):
    res = export(mamba_recipe, "trtllm")
    out = res.out_dir
    text = (out / "trtllm_llm_api_options.yaml").read_text()
    opts = yaml.safe_load(text)
    kv = opts["kv_cache_config"]
    assert kv["mamba_ssm_cache_dtype"] in ("float16", "bfloat16") and kv["mamba_ssm_stochastic_rounding"] is False
    assert "no config knob" in text  # the comment says what is not consumed
    env = (out / "trtllm_env.sh").read_text()
    setting = res.plan.setting
    assert ("export TRTLLM_USE_MAMBA_REPLAY=1" in env) == (setting.scheme_kind == "replay")
    assert setting.buffer_len in (0, 16)
    dropped = [d.what for d in res.plan.dropped]
    assert any(w.startswith("int8 state") or w.startswith("fp8_e4m3 state") for w in dropped)
    assert any("global setting" in w for w in dropped)
    assert any("is an engine fallback" in n for n in res.plan.notes)


def test_trtllm_stochastic_rounding(sr_recipe):
    res = export(sr_recipe, "trtllm")
    kv = yaml.safe_load((res.out_dir / "trtllm_llm_api_options.yaml").read_text())["kv_cache_config"]
    assert kv == {
        "mamba_ssm_cache_dtype": "float16",
        "mamba_ssm_stochastic_rounding": True,
        "mamba_ssm_philox_rounds": 10,
    }
    assert "export TRTLLM_USE_MAMBA_REPLAY=1" in (res.out_dir / "trtllm_env.sh").read_text()
    args = json.loads((export(sr_recipe, "vllm").out_dir / "vllm_engine_args.json").read_text())
    assert args["enable_mamba_cache_stochastic_rounding"] is True and args["mamba_cache_philox_rounds"] == 10
    assert args["mamba_backend"] == "triton"
    kw = json.loads((export(sr_recipe, "flashinfer").out_dir / "flashinfer_kwargs.json").read_text())
    assert kw["rand_seed"] == {"dtype": "torch.int64", "shape": [1], "device": "cuda"} and kw["philox_rounds"] == 10


def test_flashinfer_kwargs_and_snippet(mamba_recipe, monkeypatch):
    res = export(mamba_recipe, "flashinfer")
    s = res.plan.setting
    kw = json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())
    assert kw["function"] == "flashinfer.mamba.checkpointing_ssu"
    assert kw["state"]["shape"] == ["cache", HEADS, ROWS, STATE]
    assert kw["state_scale"]["shape"] == ["cache", HEADS, ROWS] and kw["state_scale"]["dtype"] == "torch.float32"
    assert kw["rand_seed"] is None
    ring = s.buffer_len + 1
    assert kw["replay"]["x_cache"]["shape"] == ["cache", HEADS, ring, ROWS]
    assert kw["replay"]["B_cache"]["shape"] == ["cache", GROUPS, ring, STATE]
    monkeypatch.setenv("SSMQUANT_DEVICE", "cpu")
    monkeypatch.setenv("SSMQUANT_CACHE", "3")
    ns = runpy.run_path(str(res.out_dir / "flashinfer_alloc.py"))
    dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[s.encoding]
    assert ns["state"].shape == (3, HEADS, ROWS, STATE) and ns["state"].dtype == dtype
    assert ns["kwargs"]["state_scale"].shape == (3, HEADS, ROWS) and ns["kwargs"]["state_scale"].dtype == torch.float32
    assert ns["x_cache"].shape == (3, HEADS, ring, ROWS) and ns["dt_cache"].dtype == torch.float32


def test_unsatisfiable_recipe_exits_nonzero_with_the_reason(mamba_recipe, copy):
    rec = copy(mamba_recipe)
    doc = _doc(rec)
    doc["uniform_settings"] = [u for u in doc["uniform_settings"] if u["role"] == "candidate"]
    (rec / CONFIG_NAME).write_text(json.dumps(doc))
    with pytest.raises(ExportError) as info:
        export(rec, "trtllm")
    msg = str(info.value)
    assert msg.startswith("TensorRT-LLM cannot run this recipe within the budget out_rel_err <= 0.02")
    assert "no config knob" in msg and "the recipe measured no setting that TensorRT-LLM can take" in msg
    res = CliRunner().invoke(main, ["export", str(rec), "--target", "trtllm"])
    assert res.exit_code != 0 and "no config knob" in res.output
    assert not (rec / "export-trtllm").exists()


def test_speculative_tokens_are_checked_against_the_buffer(mamba_recipe, copy):
    res = export(mamba_recipe, "vllm", num_speculative_tokens=8, force=True)
    s = res.plan.setting
    assert s.scheme_kind == "conventional" or s.buffer_len >= 9
    glob = _doc(mamba_recipe)["global"]["setting"]
    assert glob["buffer_len"] < 9  # the recipe's global replay buffer has no room for 8 drafts
    assert any(f"L={glob['buffer_len']}, T=8" in d.reason for d in res.plan.dropped)
    args = json.loads((res.out_dir / "vllm_engine_args.json").read_text())
    assert not args["use_replayssm"] or args["replayssm_buffer_len"] >= 9
    rec = copy(mamba_recipe)  # keep the replay settings only: 20 drafts fit none of them
    doc = _doc(rec)
    doc["uniform_settings"] = [u for u in doc["uniform_settings"] if u["setting"]["scheme_kind"] == "replay"]
    (rec / CONFIG_NAME).write_text(json.dumps(doc))
    with pytest.raises(ExportError, match=r"needs buffer length >= 1 \+ draft tokens: L=\d+, T=20"):
        export(rec, "flashinfer", num_speculative_tokens=20)


def test_gdn_recipe_has_no_flashinfer_export(tmp_path):
    r = tiny_calibration("gdn", budget=0.05, candidates=["fp16", "bf16"], schemes=["conventional"],
                         calibration=["none"], engine_fallbacks=[])  # fmt: skip
    rec = write_recipe(r, tmp_path / "gdn")
    with pytest.raises(ExportError, match="Mamba-2 kernels"):
        export(rec, "flashinfer")
    res = export(rec, "vllm")
    assert json.loads((res.out_dir / "hf_config_patch.json").read_text()) == {
        "mamba_ssm_dtype": res.plan.setting.to_dict()["encoding"].replace("bf16", "bfloat16").replace("fp16", "float16")
    }


def test_bad_targets_and_versions(mamba_recipe, copy, tmp_path):
    res = CliRunner().invoke(main, ["export", str(mamba_recipe), "--target", "sglang"])
    assert res.exit_code != 0 and "known targets: vllm, trtllm, flashinfer" in res.output
    rec = copy(mamba_recipe)
    doc = _doc(rec)
    doc["schema_version"] = 99
    (rec / CONFIG_NAME).write_text(json.dumps(doc))
    with pytest.raises(ExportError, match=r"schema_version 99; .* reads schema_version 1 only"):
        export(rec, "vllm")
    # an explicit non-empty --out needs --force
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("keep")
    with pytest.raises(ExportError, match="--force"):
        export(mamba_recipe, "vllm", other)
    assert export(mamba_recipe, "vllm", other, force=True).out_dir == other.resolve()
