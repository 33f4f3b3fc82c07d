"""Export: files an engine takes as is at a given version and GPU, what is dropped with its measured cost, and
refusals that quote the engine's constraint and name the nearest runnable setting."""

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
from ssmquant.engines.facts import VLLM_PR_BUILD
from ssmquant.export import ExportError, export

from ..calibrate.helpers import GROUPS, HEADS, tiny_calibration

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")

# tiny-nemotron's layer sizes: what FlashInfer's 8-bit kernel takes (head_dim 64, d_state 128)
NEMOTRON_DIMS = {"heads": HEADS, "rows": 64, "state_dim": 128, "groups": GROUPS}


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


def _doc(recipe_dir):
    return json.loads((recipe_dir / CONFIG_NAME).read_text())


ERROR_KEYS = ("out_rel_err", "state_rel_err", "out_rel_err_max", "state_rel_err_max", "max_error", "worst_head_error")


def scale_errors(doc, factor):
    """Multiply every measured error of a recipe by `factor` and make every budget flag (and the global
    status) say what the new errors say against the unchanged budget: a consistent recipe that misses it."""
    metric, budget = doc["budget"]["metric"], doc["budget"]["value"]

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and (k in ERROR_KEYS or k.isdigit()):
                    node[k] = v * factor
                else:
                    walk(v)
            if "meets_budget" in node:
                err = node.get("max_error", node.get(metric, (node.get("calibration_error") or {}).get(metric)))
                if err is not None:
                    node["meets_budget"] = err <= budget
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    g = doc["global"]
    if g.get("status") == "meets_budget" and not g.get("meets_budget", True):
        g["status"] = "closest"
    v = doc.get("verification")
    if v is not None:
        v["passed"] = all(r["meets_budget"] for r in v["per_layer"])
        if v.get("global") is not None:
            v["global_passed"] = v["global"]["meets_budget"]


def _edit(src, dst, change):
    """A copy of recipe `src` at `dst` whose JSON document `change(doc)` edited in place."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("export-*"))
    doc = _doc(dst)
    change(doc)
    (dst / CONFIG_NAME).write_text(json.dumps(doc))
    return dst


@pytest.fixture(scope="module")
def nano_recipe(tmp_path_factory):
    """mamba_recipe's search on layers of tiny-nemotron's head sizes (head_dim 64, d_state 128): what the rules
    and files that depend on head_dim and d_state need."""
    r = tiny_calibration(
        budget=0.02, candidates=["int8", "fp8_e4m3"], schemes=["conventional", "replay"], buffer_lens=[4, 16],
        calibration=["max"], engine_fallbacks=["fp16", "bf16"], rows=NEMOTRON_DIMS["rows"],
        state=NEMOTRON_DIMS["state_dim"],
    )  # fmt: skip
    return write_recipe(r, tmp_path_factory.mktemp("nano") / "recipe")


def test_vllm_release_runs_a_float_fallback_and_names_the_unreleased_build(mamba_recipe):
    """vllm.state_dtype: vLLM 0.33.0 has no int8 / fp8 state, so the measured fp16/bf16 fallback runs."""
    res = export(mamba_recipe, "vllm", gpu="sm90")
    s = res.plan.setting
    assert s.encoding in ("fp16", "bf16") and res.plan.deployment.label == "vLLM 0.33.0 on sm90"
    assert any(f"--engine-version {VLLM_PR_BUILD}" in n for n in res.plan.notes)
    dropped = " ".join(d.reason for d in res.plan.dropped)
    assert "invalid choice: 'int8' (choose from 'auto', 'bfloat16', 'float16', 'float32')" in dropped
    md = (res.out_dir / "EXPORT.md").read_text()
    assert "Checked for **vLLM 0.33.0 on sm90** with 0 draft tokens per step." in md
    assert "## Bytes per sequence in vLLM's buffers" in md and "## Engine facts relied on" in md
    args = json.loads((res.out_dir / "vllm_engine_args.json").read_text())
    assert args["mamba_ssm_cache_dtype"] == {"fp16": "float16", "bf16": "bfloat16"}[s.encoding]
    assert "checked for vLLM 0.33.0 on sm90" in (res.out_dir / "vllm_serve.sh").read_text()


def test_vllm_pr_build_files(nano_recipe):
    """vllm.pr_8bit + vllm.fi_replay_no_prefix: int8 only under FlashInfer ReplaySSM, prefix caching off."""
    g = _doc(nano_recipe)["global"]["setting"]
    res = export(nano_recipe, "vllm", engine_version=VLLM_PR_BUILD, gpu="sm90")
    out = res.out_dir
    assert res.plan.from_global and res.plan.setting.name == g["name"]
    args = json.loads((out / "vllm_engine_args.json").read_text())
    assert args == {
        "mamba_ssm_cache_dtype": g["encoding"],
        "use_replayssm": True,
        "replayssm_buffer_len": g["buffer_len"],
        "mamba_backend": "flashinfer",
        "enable_prefix_caching": False,
        "enable_mamba_cache_stochastic_rounding": False,
        "env": {},
    }
    flags = (out / "vllm_flags.txt").read_text().split()
    assert flags == ["--mamba-ssm-cache-dtype", g["encoding"], "--use-replayssm", "--replayssm-buffer-len",
                     str(g["buffer_len"]), "--mamba-backend", "flashinfer", "--no-enable-prefix-caching"]  # fmt: skip
    sh = (out / "vllm_serve.sh").read_text()
    assert "UNRELEASED vLLM code: 0.33.0 plus vllm-project/vllm#52962" in sh and os.access(out / "vllm_serve.sh", os.X_OK)
    assert json.loads((out / "hf_config_patch.json").read_text()) == {"mamba_ssm_cache_dtype": g["encoding"]}
    report = json.loads((out / "export_report.json").read_text())
    assert report["engine"]["version"] == VLLM_PR_BUILD and "#52962" in report["engine"]["unreleased"]
    assert report["runtime"]["ring_rows"] == g["buffer_len"] + 1 and "vllm.fi_replay_no_prefix" in report["facts"]


def test_partially_consumable_recipe_reports_each_dropped_setting_with_its_cost(nano_recipe):
    doc = _doc(nano_recipe)
    assert all(e["setting"]["name"].endswith("@conventional") for e in doc["layers"])  # cheapest per layer
    res = CliRunner().invoke(main, ["export", str(nano_recipe), "--target", "vllm", "--engine-version", VLLM_PR_BUILD,
                                    "--gpu", "sm100", "--force"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"vLLM {VLLM_PR_BUILD} on sm100: ")
    assert "dropped conventional decoding (-> replay" in res.output
    assert "exists only under FlashInfer ReplaySSM" in res.output
    assert "measured cost of the export at these layers: bytes/sequence" in res.output
    assert "(calibration)" in res.output and "(held-out)" in res.output


def test_trtllm_files_fall_back_to_a_measured_float_state(mamba_recipe, tmp_path):
    """trtllm.state_dtype, trtllm.hf_key and trtllm.replay_gates (only "0" turns replay off)."""
    res = export(mamba_recipe, "trtllm", gpu="sm90")
    out = res.out_dir
    text = (out / "trtllm_llm_api_options.yaml").read_text()
    kv = yaml.safe_load(text)["kv_cache_config"]
    assert kv["mamba_ssm_cache_dtype"] in ("float16", "bfloat16") and kv["mamba_ssm_stochastic_rounding"] is False
    assert 'Literal["auto", "float16", "bfloat16", "float32"]' in text
    assert res.plan.setting.scheme_kind == "conventional"  # no drafts: TensorRT-LLM does not replay
    env = (out / "trtllm_env.sh").read_text()
    assert "export TRTLLM_USE_MAMBA_REPLAY" not in env and "replay needs speculative decoding" in env
    assert json.loads((out / "hf_config_patch.json").read_text()) == {"mamba_ssm_cache_dtype": kv["mamba_ssm_cache_dtype"]}
    assert any("is an engine fallback" in n for n in res.plan.notes)
    # with draft tokens replay is on by default, so the conventional setting turns it off
    res = export(mamba_recipe, "trtllm", tmp_path / "spec", num_speculative_tokens=3, gpu="sm90")
    assert "export TRTLLM_USE_MAMBA_REPLAY=0" in (res.out_dir / "trtllm_env.sh").read_text()
    assert "3 draft tokens per step (max_draft_len)" in (res.out_dir / "trtllm_llm_api_options.yaml").read_text()


def test_fix1_trtllm_refuses_replay_without_drafts_quoting_the_engine(sr_recipe):
    """trtllm.replay_spec_only: bad input exits non-zero with TensorRT-LLM's own log line."""
    res = CliRunner().invoke(main, ["export", str(sr_recipe), "--target", "trtllm", "--gpu", "sm100"])
    assert res.exit_code != 0
    assert "TensorRT-LLM main@2829508 on sm100 cannot run this recipe" in res.output
    assert '"Replay kernel requires speculative decoding; using non-replay path"' in res.output
    assert "cache_manager.py @ main 2829508" in res.output
    assert not (sr_recipe / "export-trtllm").exists()


def test_stochastic_rounding_exports(sr_recipe, tmp_path):
    """vllm.sr_triton_sm10x: off SM 10.x the FlashInfer backend rounds; flashinfer.cssu_sr: fp16 SR in replay."""
    args = json.loads((export(sr_recipe, "vllm", gpu="sm90").out_dir / "vllm_engine_args.json").read_text())
    assert args["enable_mamba_cache_stochastic_rounding"] is True and args["mamba_cache_philox_rounds"] == 10
    assert args["mamba_backend"] == "flashinfer" and args["enable_prefix_caching"] is False
    kw = json.loads((export(sr_recipe, "flashinfer", gpu="sm90").out_dir / "flashinfer_kwargs.json").read_text())
    assert kw["rand_seed"] == {"dtype": "torch.int64", "shape": [1], "device": "cuda"} and kw["philox_rounds"] == 10


def test_flashinfer_kwargs_and_snippet(nano_recipe, monkeypatch):
    """flashinfer.cssu_8bit_shape, flashinfer.tie_hdim, flashinfer.scale: the snippet builds what the kernel checks."""
    res = export(nano_recipe, "flashinfer", gpu="sm90")
    s = res.plan.setting
    P, N = NEMOTRON_DIMS["rows"], NEMOTRON_DIMS["state_dim"]
    kw = json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())
    assert kw["function"] == "flashinfer.mamba.checkpointing_ssu" and s.encoding in ("int8", "fp8_e4m3")
    assert kw["state"]["shape"] == ["cache", HEADS, P, N]
    assert kw["state_scale"]["shape"] == ["cache", HEADS, P] and kw["state_scale"]["strides"] == [HEADS * P, P, 1]
    assert kw["per_call"]["A"]["strides"] == [1, 0, 0] and kw["per_call"]["dt"]["strides_last_two"] == [1, 0]
    ring = s.buffer_len + 1
    assert kw["replay"]["x_cache"]["shape"] == ["cache", HEADS, ring, P]
    assert kw["replay"]["B_cache"]["shape"] == ["cache", GROUPS, ring, N]
    assert any("head_dim 64" in c for c in kw["constraints"])
    monkeypatch.setenv("SSMQUANT_DEVICE", "cpu")
    monkeypatch.setenv("SSMQUANT_CACHE", "3")
    ns = runpy.run_path(str(res.out_dir / "flashinfer_alloc.py"))
    dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[s.encoding]
    assert ns["state"].shape == (3, HEADS, P, N) and ns["state"].dtype == dtype
    assert ns["kwargs"]["state_scale"].shape == (3, HEADS, P) and ns["kwargs"]["state_scale"].stride() == (HEADS * P, P, 1)
    assert ns["x_cache"].shape == (3, HEADS, ring, P) and ns["dt_cache"].dtype == torch.float32
    b, T = 2, ns["TOKENS_PER_CALL"]
    args = ns["kernel_args"](
        torch.zeros(b, T, HEADS, P, dtype=torch.bfloat16), torch.zeros(b, T, HEADS), torch.zeros(HEADS),
        torch.zeros(b, T, GROUPS, N, dtype=torch.bfloat16), torch.zeros(b, T, GROUPS, N, dtype=torch.bfloat16),
        torch.zeros(b, T, HEADS, P, dtype=torch.bfloat16), torch.ones(HEADS), torch.zeros(HEADS),
        torch.arange(b, dtype=torch.int32),
    )  # fmt: skip
    assert args["dt"].shape == (b, T, HEADS, P) and args["dt"].stride()[2:] == (1, 0)
    assert args["A"].stride() == (1, 0, 0) and args["D"].stride() == (1, 0) and args["dt_bias"].stride() == (1, 0)
    assert args["x_cache"] is ns["x_cache"] and args["state_scale"] is ns["kwargs"]["state_scale"]


def test_fix6_flashinfer_refuses_8bit_at_sizes_its_kernel_does_not_take(mamba_recipe):
    """flashinfer.cssu_8bit_shape: the tiny layers (head_dim 8, d_state 32) get a measured float fallback."""
    res = export(mamba_recipe, "flashinfer", gpu="sm90")
    assert res.plan.setting.encoding in ("fp16", "bf16")
    assert any("head_dim 64 and d_state 128 only" in d.reason for d in res.plan.dropped)


def test_unsatisfiable_recipe_names_the_nearest_runnable_setting_with_its_cost(mamba_recipe, tmp_path):
    def no_budget(doc):  # every measured error 1000x larger: every setting misses the budget
        scale_errors(doc, 1000.0)

    rec = _edit(mamba_recipe, tmp_path / "recipe", no_budget)
    res = CliRunner().invoke(main, ["export", str(rec), "--target", "trtllm", "--gpu", "sm90"])
    assert res.exit_code != 0
    assert "TensorRT-LLM main@2829508 on sm90 cannot run this recipe within the budget out_rel_err <= 0.02" in res.output
    assert 'Literal["auto", "float16", "bfloat16", "float32"]' in res.output
    assert "Nearest runnable setting: " in res.output and "(budget 0.02, not met)" in res.output
    assert "bytes per sequence over the calibrated layers" in res.output
    assert not (rec / "export-trtllm").exists()

    def candidates_only(doc):
        doc["uniform_settings"] = [u for u in doc["uniform_settings"] if u["role"] == "candidate"]

    rec = _edit(mamba_recipe, tmp_path / "recipe2", candidates_only)
    with pytest.raises(ExportError) as info:
        export(rec, "vllm", gpu="sm90")
    msg = str(info.value)
    assert "invalid choice: 'int8'" in msg and "The recipe measured no setting that vLLM 0.33.0 on sm90 can run" in msg
    assert f"Or export for the unreleased build: --engine-version {VLLM_PR_BUILD}." in msg


def test_speculative_tokens_are_checked_against_the_buffer(nano_recipe, tmp_path):
    res = export(nano_recipe, "vllm", num_speculative_tokens=8, engine_version=VLLM_PR_BUILD, gpu="sm90", force=True)
    s = res.plan.setting
    assert s.scheme_kind == "conventional" or s.buffer_len >= 9
    glob = _doc(nano_recipe)["global"]["setting"]
    assert glob["buffer_len"] < 9  # the recipe's global replay buffer has no room for 8 drafts
    assert any(f"L={glob['buffer_len']}, T=8" in d.reason for d in res.plan.dropped)

    def replay_only(doc):
        doc["uniform_settings"] = [u for u in doc["uniform_settings"] if u["setting"]["scheme_kind"] == "replay"]

    rec = _edit(nano_recipe, tmp_path / "recipe", replay_only)
    with pytest.raises(ExportError, match=r"needs buffer length >= 1 \+ draft tokens: L=\d+, T=20"):
        export(rec, "flashinfer", num_speculative_tokens=20, gpu="sm90")


def test_fix7_gdn_exports(tmp_path):
    """flashinfer.gdn_decode (GDN decode kernels exist), vllm.hf_dtype and trtllm.hf_key (the key each reads)."""
    r = tiny_calibration("gdn", budget=0.05, candidates=["fp16", "bf16"], schemes=["conventional"],
                         calibration=["none"], engine_fallbacks=[])  # fmt: skip
    rec = write_recipe(r, tmp_path / "gdn")
    with pytest.raises(ExportError, match=r"K = V = 128, not K=32, V=8"):  # tiny sizes: a shape refusal, not a kind one
        export(rec, "flashinfer", gpu="sm90")
    r = tiny_calibration("gdn", budget=0.05, candidates=["fp16", "bf16"], schemes=["conventional"],
                         calibration=["none"], engine_fallbacks=[], rows=128, state=128)  # fmt: skip
    qwen = write_recipe(r, tmp_path / "qwen")  # Qwen3.5's head sizes (K = V = 128)
    res = export(qwen, "flashinfer", gpu="sm90")
    kw = json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())
    assert res.plan.setting.encoding == "bf16" and kw["function"].endswith("gated_delta_rule_decode_pretranspose")
    assert any("fp16 GDN" in d.reason or "not fp16" in d.reason for d in res.plan.dropped) or res.plan.from_global
    enc = export(rec, "vllm", gpu="sm90")
    dtype = {"fp16": "float16", "bf16": "bfloat16"}[enc.plan.setting.encoding]
    assert json.loads((enc.out_dir / "hf_config_patch.json").read_text()) == {"mamba_ssm_dtype": dtype}
    trt = export(rec, "trtllm", gpu="sm90")
    dtype = {"fp16": "float16", "bf16": "bfloat16"}[trt.plan.setting.encoding]
    assert json.loads((trt.out_dir / "hf_config_patch.json").read_text()) == {"mamba_ssm_cache_dtype": dtype}


def test_bad_targets_versions_and_gpus(mamba_recipe, tmp_path):
    res = CliRunner().invoke(main, ["export", str(mamba_recipe), "--target", "sglang"])
    assert res.exit_code != 0 and "known targets: vllm, trtllm, flashinfer" in res.output
    res = CliRunner().invoke(main, ["export", str(mamba_recipe), "--target", "vllm", "--engine-version", "0.34.0"])
    assert res.exit_code != 0 and "vLLM version '0.34.0' is not covered by the engine facts; accepted: 0.25.0" in res.output
    res = CliRunner().invoke(main, ["export", str(mamba_recipe), "--target", "vllm", "--gpu", "hopper"])
    assert res.exit_code != 0 and "unknown GPU 'hopper'; give its compute capability as smXY" in res.output
    rec = _edit(mamba_recipe, tmp_path / "recipe", lambda d: d.update(schema_version=99))
    with pytest.raises(ExportError, match=r"schema_version 99; .* reads schema_version 1 only"):
        export(rec, "vllm")
    other = tmp_path / "other"  # an explicit non-empty --out needs --force
    other.mkdir()
    (other / "x").write_text("keep")
    with pytest.raises(ExportError, match="--force"):
        export(mamba_recipe, "vllm", other)
    with pytest.raises(ExportError, match="not a previous `ssmquant export` output"):  # --force keeps the user's file
        export(mamba_recipe, "vllm", other, force=True)
    (other / "x").unlink()
    assert export(mamba_recipe, "vllm", other).out_dir == other.resolve()
    assert export(mamba_recipe, "vllm", other, force=True).out_dir == other.resolve()


def test_calibrate_checks_takeability_for_the_given_engine_versions_and_gpu(tmp_path):
    """Item 2 of #13's residuals: "engine-takeable" in a recipe is checked for the user's engine versions and GPU,
    and the recipe says which. fp16@replay8 on sm75: FlashInfer's Mamba kernels need SM 8.x (flashinfer.sm80),
    TensorRT-LLM replays only with drafts (trtllm.replay_spec_only), vLLM replays from 0.27.0 (vllm.replay_flags)."""
    kw = dict(budget=1.0, candidates=["fp16"], schemes=["replay8"], calibration=["none"], engine_fallbacks=[])
    old = tiny_calibration(engine_versions={"vllm": "0.26.0"}, gpu="sm75", verify=False, **kw)
    assert old.global_setting is None and old.global_status == "none"
    assert old.takeability["engines"]["vllm"] == "0.26.0" and old.takeability["gpu"] == "sm75"
    new = tiny_calibration(gpu="sm75", verify=False, **kw)
    assert new.global_setting.name == "fp16@replay8"
    doc = json.loads((write_recipe(new, tmp_path / "r") / CONFIG_NAME).read_text())
    checked = doc["global"]["engines_checked"]
    assert checked == {"engines": {"vllm": "0.33.0", "trtllm": "main@2829508", "flashinfer": "0.7.4"}, "gpu": "sm75",
                       "unreleased": [], "note": None}  # fmt: skip
    with pytest.raises(Exception, match="vLLM version '0.2' is not covered"):
        tiny_calibration(engine_versions={"vllm": "0.2"}, **kw)
    runner = CliRunner()
    res = runner.invoke(main, ["calibrate", "--model", "tiny-nemotron", "--budget", "1", "--engine-version", "vllm",
                               "--out", str(tmp_path / "x")])  # fmt: skip
    assert res.exit_code != 0 and "expected ENGINE=VERSION" in res.output


@pytest.fixture(scope="module")
def kda_recipe(tmp_path_factory):
    """A bf16 conventional recipe on layer 0 of a synthetic GLM-5.3-Flash (KDA, 64 heads, K = V = 128)."""
    from ssmquant.calibrate import CalibrateConfig, calibrate

    cfg = CalibrateConfig(
        model="glm-5.3-flash", synthetic=True, budget=1.0, horizon=8, batch=1, candidates=["bf16"],
        schemes=["conventional"], calibration=["none"], engine_fallbacks=[], layers=[0], device="cpu",
        backend="torch", verify=False, gpu="sm100",
    )  # fmt: skip
    return write_recipe(calibrate(cfg), tmp_path_factory.mktemp("kda") / "recipe")


def test_flashinfer_kda_export_names_recurrent_kda_and_its_bf16_state(kda_recipe, tmp_path, monkeypatch):
    """flashinfer.kda_decode: KDA decode is flashinfer.recurrent_kda on a bf16 [N, HV, V, K] state, SM 100 only."""
    res = export(kda_recipe, "flashinfer", tmp_path / "fi", gpu="sm100")
    kw = json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())
    assert kw["function"] == "flashinfer.recurrent_kda"
    assert kw["initial_state"] == {"dtype": "torch.bfloat16", "shape": ["cache", 64, 128, 128]}
    assert "selective_state_update" not in (res.out_dir / "flashinfer_alloc.py").read_text()
    monkeypatch.setenv("SSMQUANT_DEVICE", "cpu")
    monkeypatch.setenv("SSMQUANT_CACHE", "2")
    ns = runpy.run_path(str(res.out_dir / "flashinfer_alloc.py"))
    assert ns["state"].dtype == torch.bfloat16 and tuple(ns["state"].shape) == (2, 64, 128, 128)
    assert json.loads((res.out_dir / "export_report.json").read_text())["engine_bytes_per_sequence"]["per_layer"][
        "state"] == 64 * 128 * 128 * 2  # fmt: skip
    with pytest.raises(ExportError, match=r"Requires SM100 \(Blackwell\) architecture"):
        export(kda_recipe, "flashinfer", tmp_path / "fi90", gpu="sm90")
