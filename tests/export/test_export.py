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
from ssmquant.engines.facts import FACTS, VLLM_PR_BUILD
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
    """vllm.state_dtype: vLLM releases (0.34.0 by default) have no int8 / fp8 state, so the measured fp16/bf16
    fallback runs."""
    res = export(mamba_recipe, "vllm", gpu="sm90")
    s = res.plan.setting
    assert s.encoding in ("fp16", "bf16") and res.plan.deployment.label == "vLLM 0.34.0 on sm90"
    assert any(f"--engine-version {VLLM_PR_BUILD}" in n for n in res.plan.notes)
    dropped = " ".join(d.reason for d in res.plan.dropped)
    assert "invalid choice: 'int8' (choose from 'auto', 'bfloat16', 'float16', 'float32')" in dropped
    md = (res.out_dir / "EXPORT.md").read_text()
    assert "Checked for **vLLM 0.34.0 on sm90** with 0 draft tokens per step." in md
    assert "## Bytes per sequence in vLLM's buffers" in md and "## Engine facts relied on" in md
    args = json.loads((res.out_dir / "vllm_engine_args.json").read_text())
    assert args["mamba_ssm_cache_dtype"] == {"fp16": "float16", "bf16": "bfloat16"}[s.encoding]
    assert "checked for vLLM 0.34.0 on sm90" in (res.out_dir / "vllm_serve.sh").read_text()


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
    }
    flags = (out / "vllm_flags.txt").read_text().split()
    assert flags == ["--mamba-ssm-cache-dtype", g["encoding"], "--use-replayssm", "--replayssm-buffer-len",
                     str(g["buffer_len"]), "--mamba-backend", "flashinfer", "--no-enable-prefix-caching"]  # fmt: skip
    sh = (out / "vllm_serve.sh").read_text()
    assert "UNRELEASED vLLM code: 0.33.0 plus vllm-project/vllm#52962" in sh and os.access(out / "vllm_serve.sh", os.X_OK)
    # issue 26.5: released vLLM reads the HF key unchecked at --mamba-ssm-cache-dtype auto
    # (vllm 0.33.0, vllm/model_executor/models/config.py: `getattr(hf_config, "mamba_ssm_cache_dtype", ...)`), so an
    # 8-bit dtype never goes into hf_config_patch.json; the flags carry it, and releases refuse those loudly
    assert not (out / "hf_config_patch.json").exists() and not (out / "vllm_env.sh").exists()
    assert "would allocate a int8 state without scales" in (out / "EXPORT.md").read_text().replace("an int8", "a int8")
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
    assert "dropped conventional decoding (-> replay" in res.output and "bytes/sequence" in res.output
    # issue 27: a short terminal report (no quoted facts); the engine's words and the per-layer costs are in EXPORT.md
    lines = res.output.splitlines()
    assert len(lines) <= 12 and "exists only under FlashInfer ReplaySSM" not in res.output, res.output
    md = (nano_recipe / "export-vllm" / "EXPORT.md").read_text()
    assert "exists only under FlashInfer ReplaySSM" in md and "(calibration)" in md and "(held-out)" in md
    for name in ("vllm_serve.sh", "vllm_flags.txt"):  # generated headers wrap at 100 characters
        assert max(map(len, (nano_recipe / "export-vllm" / name).read_text().splitlines()[:-1] or [""])) <= 100


def test_trtllm_files_fall_back_to_a_measured_float_state(mamba_recipe, tmp_path):
    """trtllm.state_dtype, trtllm.hf_key and trtllm.replay_gates (only "0" turns replay off)."""
    res = export(mamba_recipe, "trtllm", gpu="sm90")
    out = res.out_dir
    text = (out / "trtllm_llm_api_options.yaml").read_text()
    kv = yaml.safe_load(text)["kv_cache_config"]
    assert kv["mamba_ssm_cache_dtype"] in ("float16", "bfloat16") and kv["mamba_ssm_stochastic_rounding"] is False
    assert 'Literal["auto", "float16", "bfloat16", "float32"]' in (out / "EXPORT.md").read_text()
    assert res.plan.setting.scheme_kind == "conventional"  # no drafts: TensorRT-LLM does not replay
    assert not (out / "trtllm_env.sh").exists()  # issue 27: no env file that holds only comments
    assert "replay needs speculative decoding" in text
    assert json.loads((out / "hf_config_patch.json").read_text()) == {"mamba_ssm_cache_dtype": kv["mamba_ssm_cache_dtype"]}
    assert any("is an engine fallback" in n for n in res.plan.notes)
    # with draft tokens replay is on by default, so the conventional setting turns it off
    res = export(mamba_recipe, "trtllm", tmp_path / "spec", num_speculative_tokens=3, gpu="sm90", speculative_method="mtp")
    assert "export TRTLLM_USE_MAMBA_REPLAY=0" in (res.out_dir / "trtllm_env.sh").read_text()
    opts = yaml.safe_load((res.out_dir / "trtllm_llm_api_options.yaml").read_text())
    # trtllm.spec_config: num_nextn_predict_layers is deprecated (remapped to max_draft_len): not written
    assert opts["speculative_config"] == {"decoding_type": "MTP", "max_draft_len": 3}


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
    # vllm.fi_replay_align: from 0.34.0 FlashInfer ReplaySSM keeps prefix caching (bfloat16 rings, as measured)
    assert args["mamba_backend"] == "flashinfer" and "enable_prefix_caching" not in args
    old = export(sr_recipe, "vllm", tmp_path / "v033", gpu="sm90", engine_version="0.33.0")
    args = json.loads((old.out_dir / "vllm_engine_args.json").read_text())
    assert args["mamba_backend"] == "flashinfer" and args["enable_prefix_caching"] is False  # vllm.fi_replay_no_prefix
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
    assert "invalid choice: 'int8'" in msg and "The recipe measured no setting that vLLM 0.34.0 on sm90 can run" in msg
    assert f"Or export for the unreleased build: --engine-version {VLLM_PR_BUILD}." in msg


def test_speculative_tokens_are_checked_against_the_buffer(nano_recipe, tmp_path):
    res = export(nano_recipe, "vllm", num_speculative_tokens=8, engine_version=VLLM_PR_BUILD, gpu="sm90", force=True,
                 speculative_method="ngram")  # fmt: skip
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
    enc = export(rec, "vllm", gpu="sm90")  # no architecture recorded: where Qwen3.5 reads the key is unknown
    assert not (enc.out_dir / "hf_config_patch.json").exists()
    assert "no hf_config_patch.json: vLLM reads no HF config key" in (enc.out_dir / "EXPORT.md").read_text()
    trt = export(rec, "trtllm", gpu="sm90")
    dtype = {"fp16": "float16", "bf16": "bfloat16"}[trt.plan.setting.encoding]
    assert json.loads((trt.out_dir / "hf_config_patch.json").read_text()) == {"mamba_ssm_cache_dtype": dtype}
    # issue 26.7: vLLM's fused GDN decode takes float32 / bfloat16 state only
    # (vllm 0.28.0-0.33.0 qwen_gdn_linear_attn.py: `FUSED_GDN_STATE_DTYPES = (torch.float32, torch.bfloat16)`)
    fp16 = export(rec, "vllm", tmp_path / "fp16", gpu="sm90")
    if fp16.plan.setting.encoding == "fp16":
        note = next(n for n in fp16.plan.notes if "FUSED_GDN_STATE_DTYPES" in n)
        assert "bf16 is the same size and stays on the fused kernel; bf16 measured worst-layer" in note
        assert "FUSED_GDN_STATE_DTYPES" in (fp16.out_dir / "EXPORT.md").read_text()
    # issue 26.6: TensorRT-LLM's GDN replay is opt-in (unset means off): with drafts, a conventional GDN export sets
    # no variable, so no trtllm_env.sh, and its YAML carries a real speculative_config
    spec = export(rec, "trtllm", tmp_path / "trt", gpu="sm90", num_speculative_tokens=2, speculative_method="mtp")
    assert not (spec.out_dir / "trtllm_env.sh").exists()
    assert "leave TRTLLM_USE_GDN_REPLAY unset" in (spec.out_dir / "EXPORT.md").read_text()
    opts = yaml.safe_load((spec.out_dir / "trtllm_llm_api_options.yaml").read_text())
    assert opts["speculative_config"]["decoding_type"] == "MTP" and opts["speculative_config"]["max_draft_len"] == 2


def test_bad_targets_versions_and_gpus(mamba_recipe, tmp_path):
    res = CliRunner().invoke(main, ["export", str(mamba_recipe), "--target", "tgi"])
    assert res.exit_code != 0 and "known targets: vllm, trtllm, flashinfer, sglang" in res.output
    res = CliRunner().invoke(main, ["export", str(mamba_recipe), "--target", "vllm", "--engine-version", "0.35.0"])
    assert res.exit_code != 0 and "vLLM version '0.35.0' is not covered by the engine facts; accepted: 0.25.0" in res.output
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
    assert checked == {"engines": {"vllm": "0.34.0", "trtllm": "main@2829508", "flashinfer": "0.7.4", "sglang": "0.5.23"}, "gpu": "sm75",
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


def test_a_synthetic_recipe_says_so_in_every_exported_file(kda_recipe, mamba_recipe, tmp_path):
    """A recipe calibrated with --synthetic measured a preset's shapes, not a model: the terminal report, EXPORT.md,
    export_report.json and every file's header say SYNTHETIC, and the held-out note says on what it was verified."""
    res = export(kda_recipe, "vllm", tmp_path / "v", gpu="sm100")
    assert res.report_lines()[0].startswith("SYNTHETIC recipe: its errors were measured on synthetic inputs")
    assert (res.out_dir / "EXPORT.md").read_text().split("\n")[2].startswith("**SYNTHETIC recipe")
    assert json.loads((res.out_dir / "export_report.json").read_text())["synthetic"].startswith("SYNTHETIC")
    for name in res.files:
        if name.endswith((".sh", ".yaml", ".py")):
            assert "SYNTHETIC recipe" in (res.out_dir / name).read_text(), name
    real = export(mamba_recipe, "vllm", tmp_path / "real", gpu="sm90")
    assert not any("SYNTHETIC" in line for line in real.report_lines())
    assert json.loads((real.out_dir / "export_report.json").read_text())["synthetic"] is None


def test_flashinfer_kda_export_names_the_kernel_that_keeps_its_bf16_state(kda_recipe, tmp_path, monkeypatch):
    """flashinfer.fused_kda_decode (flashinfer/kda_decode.py, 0.7.4): "Paged recurrent state with shape
    ``[num_slots, H, 128, 128]`` and dtype float32 or bfloat16.", SM 100 / 103, 64 heads from 0.7.4: GLM-5.3-Flash's
    bf16 state runs there on sm100. flashinfer.kda_decode: before 0.7.4 (no 64-head fused kernel) it is
    flashinfer.recurrent_kda on a bf16 [N, HV, V, K] state. On sm90 neither runs: both kernels' words."""
    res = export(kda_recipe, "flashinfer", tmp_path / "fi", gpu="sm100")
    kw = json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())
    assert kw["function"] == "flashinfer.fused_kda_decode"
    assert kw["state"] == {"dtype": "torch.bfloat16", "shape": ["cache + 1", 64, 128, 128]}
    assert "selective_state_update" not in (res.out_dir / "flashinfer_alloc.py").read_text()
    assert "flashinfer.fused_kda_decode" in json.loads((res.out_dir / "export_report.json").read_text())["facts"]
    monkeypatch.setenv("SSMQUANT_DEVICE", "cpu")
    monkeypatch.setenv("SSMQUANT_CACHE", "2")
    ns = runpy.run_path(str(res.out_dir / "flashinfer_alloc.py"))
    assert ns["state"].dtype == torch.bfloat16 and tuple(ns["state"].shape) == (3, 64, 128, 128)  # slot 0: null slot
    assert json.loads((res.out_dir / "export_report.json").read_text())["engine_bytes_per_sequence"]["per_layer"][
        "state"] == 64 * 128 * 128 * 2  # fmt: skip
    res = export(kda_recipe, "flashinfer", tmp_path / "fi072", gpu="sm100", engine_version="0.7.2.post1")
    kw = json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())
    assert kw["function"] == "flashinfer.recurrent_kda"
    assert kw["initial_state"] == {"dtype": "torch.bfloat16", "shape": ["cache", 64, 128, 128]}
    ns = runpy.run_path(str(res.out_dir / "flashinfer_alloc.py"))
    assert ns["state"].dtype == torch.bfloat16 and tuple(ns["state"].shape) == (2, 64, 128, 128)
    with pytest.raises(ExportError, match=r"(?s)fused_kda_decode \(bfloat16 KDA state\) runs on SM 100 / 103 only, "
                                          r"not sm90.*Requires SM100 \(Blackwell\) architecture"):  # fmt: skip
        export(kda_recipe, "flashinfer", tmp_path / "fi90", gpu="sm90")


@pytest.fixture(scope="module")
def kimi_linear_recipe(tmp_path_factory):
    """A bf16 conventional recipe on layer 0 of a synthetic Kimi-Linear-48B-A3B (KimiLinearForCausalLM)."""
    from ssmquant.calibrate import CalibrateConfig, calibrate

    cfg = CalibrateConfig(
        model="kimi-linear-48b-a3b", synthetic=True, budget=1.0, horizon=8, batch=1, candidates=["bf16"],
        schemes=["conventional"], calibration=["none"], engine_fallbacks=[], layers=[0], device="cpu",
        backend="torch", verify=False, gpu="sm100", choose_among="research",
    )  # fmt: skip
    return write_recipe(calibrate(cfg), tmp_path_factory.mktemp("kimi_linear") / "recipe")


def test_issue26_bf16_kda_recipe_is_refused_for_kimi_linear_on_vllm_in_the_engines_words(kimi_linear_recipe, tmp_path):
    """vllm.kda_linear_fp32 (vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py, vLLM 0.25.0 to 0.33.0):
    Kimi-Linear's layer calls `return MambaStateDtypeCalculator.kda_state_dtype(self.model_config.dtype,
    self.cache_config.mamba_cache_dtype)`, without the SSM cache dtype: its state stays float32, so vLLM would accept
    --mamba-ssm-cache-dtype bfloat16 and run float32. The export refuses the bf16 recipe quoting that line; FlashInfer
    on sm100 runs it (fused_kda_decode takes Kimi-Linear's 32 heads)."""
    f = FACTS["vllm.kda_linear_fp32"]
    assert f.sources[0].path == "vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py" and f.since is None
    for version in ("0.30.0", "0.32.0", "0.33.0"):
        with pytest.raises(ExportError) as err:
            export(kimi_linear_recipe, "vllm", tmp_path / f"v{version}", engine_version=version, gpu="sm100")
        msg = str(err.value)
        assert "Kimi-Linear's KDA layer keeps a float32 state and ignores the flag" in msg
        assert f'"{f.quote}"' in msg and "kimi_gdn_linear_attn.py" in msg
        assert f"The recipe measured no setting that vLLM {version} on sm100 can run" in msg
    res = export(kimi_linear_recipe, "flashinfer", tmp_path / "fi", gpu="sm100")
    assert json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())["function"] == "flashinfer.fused_kda_decode"


# -- issue 26 / 27 ----------------------------------------------------------------------------------------------
def test_issue26_1_vllm_exports_kda_recipes_by_architecture(kda_recipe, tmp_path):
    """Was `KeyError: 'kda'`. GLM-5.3-Flash's KDA state follows --mamba-ssm-cache-dtype from vLLM 0.32.0
    (vllm/models/glm5next/common/kda.py passes `self.cache_config.mamba_ssm_cache_dtype,`); vLLM reads no HF key
    for it, so no hf_config_patch.json is written."""
    res = export(kda_recipe, "vllm", tmp_path / "v", gpu="sm90")
    args = json.loads((res.out_dir / "vllm_engine_args.json").read_text())
    assert args["mamba_ssm_cache_dtype"] == "bfloat16" and args["use_replayssm"] is False and "env" not in args
    assert not (res.out_dir / "hf_config_patch.json").exists()
    assert res.plan.architecture == "Glm5NextForConditionalGeneration"
    assert "vllm.kda_glm_follows" in json.loads((res.out_dir / "export_report.json").read_text())["facts"]
    # 0.31.0 keeps GLM's KDA state in float32 whatever the flag: the bf16 recipe is refused, not exported
    res = CliRunner().invoke(main, ["export", str(kda_recipe), "--target", "vllm", "--engine-version", "0.31.0",
                                    "--gpu", "sm90", "--out", str(tmp_path / "old")])  # fmt: skip
    assert res.exit_code != 0 and "follows the flag only from vLLM 0.32.0" in res.output
    assert "The recipe measured no setting that vLLM 0.31.0 on sm90 can run" in res.output


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_issue26_bf16_kda_state_exports_to_vllm_for_glm_from_0_32_0(kda_recipe, tmp_path, version):
    """vllm.kda_glm_follows (vllm/models/glm5next/common/kda.py, vLLM 0.32.0 and 0.33.0): GLM-5.3-Flash's layer passes
    `self.cache_config.mamba_ssm_cache_dtype,` to kda_state_dtype, which maps bfloat16 to a bfloat16 state
    (vllm.kda_state_dtype, vllm/model_executor/layers/mamba/mamba_utils.py): the flag is the whole export."""
    f = FACTS["vllm.kda_glm_follows"]
    assert f.since == "0.32.0" and f.sources[0].path == "vllm/models/glm5next/common/kda.py"
    res = export(kda_recipe, "vllm", tmp_path / "v", engine_version=version, gpu="sm100")
    assert res.plan.setting.name == "bf16@conventional"
    flags = (res.out_dir / "vllm_flags.txt").read_text()
    assert "--mamba-ssm-cache-dtype bfloat16" in flags and "--use-replayssm" not in flags
    assert "--mamba-ssm-cache-dtype bfloat16" in (res.out_dir / "vllm_serve.sh").read_text()
    facts = json.loads((res.out_dir / "export_report.json").read_text())["facts"]
    assert "vllm.kda_state_dtype" in facts and "vllm.kda_glm_follows" in facts


def test_issue26_3_vllm_speculative_config_carries_a_method(nano_recipe, tmp_path):
    """vllm/config/speculative.py (0.25.0-0.33.0): "num_speculative_tokens was provided but without speculative
    model." when the config has no method: every vLLM file now carries the method."""
    out = tmp_path / "spec"
    export(nano_recipe, "vllm", out, num_speculative_tokens=3, engine_version=VLLM_PR_BUILD, gpu="sm90",
           speculative_method="ngram")  # fmt: skip
    args = json.loads((out / "vllm_engine_args.json").read_text())
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    flags = (out / "vllm_flags.txt").read_text()
    assert """--speculative-config '{"method":"ngram","num_speculative_tokens":3}'""" in flags
    assert """--speculative-config '{"method":"ngram","num_speculative_tokens":3}'""" in (out / "vllm_serve.sh").read_text()
    res = CliRunner().invoke(main, ["export", str(nano_recipe), "--target", "vllm", "--engine-version", VLLM_PR_BUILD,
                                    "--num-speculative-tokens", "3", "--out", str(tmp_path / "x")])  # fmt: skip
    assert res.exit_code != 0 and "num_speculative_tokens was provided but without speculative model." in res.output
    assert "pass --speculative-method (mtp, ngram, eagle, eagle3, draft_model)" in res.output
    with pytest.raises(ExportError, match="unknown --speculative-method 'medusa' for vLLM; accepted: mtp, ngram"):
        export(nano_recipe, "vllm", tmp_path / "y", num_speculative_tokens=3, speculative_method="medusa")
    with pytest.raises(ExportError, match="eagle3 needs the drafter's checkpoint: pass --speculative-model PATH"):
        export(nano_recipe, "vllm", tmp_path / "y", num_speculative_tokens=3, speculative_method="eagle3")
    with pytest.raises(ExportError, match="the export drafts no tokens"):
        export(nano_recipe, "vllm", tmp_path / "y", engine_version=VLLM_PR_BUILD, speculative_method="mtp")


@pytest.mark.parametrize(
    "arch, kind, enc, patch",
    [
        ("Qwen3_5ForConditionalGeneration", "gdn", "bf16", {"text_config": {"mamba_ssm_dtype": "bfloat16"}}),
        ("Qwen3_5MoeForConditionalGeneration", "gdn", "fp32", {"text_config": {"mamba_ssm_dtype": "float32"}}),
        ("Qwen3_5ForCausalLM", "gdn", "bf16", {"mamba_ssm_dtype": "bfloat16"}),
        ("Qwen3NextForCausalLM", "gdn", "bf16", None),
        ("NemotronHForCausalLM", "mamba2", "fp16", {"mamba_ssm_cache_dtype": "float16"}),
        ("NemotronHForCausalLM", "mamba2", "int8", None),  # issue 26.5: read unchecked by released vLLM
        ("KimiLinearForCausalLM", "kda", "fp32", None),
    ],
)
def test_issue26_4_and_5_vllm_hf_patch_goes_where_the_architecture_reads_it(arch, kind, enc, patch):
    """vllm/model_executor/models/config.py (0.33.0): Qwen3.5 `mamba_ssm_dtype = getattr(hf_text_config,
    "mamba_ssm_dtype", None)` (text_config of the multimodal checkpoints); NemotronH `getattr(hf_config,
    "mamba_ssm_cache_dtype", cls.DEFAULT_MAMBA_SSM_CACHE_DTYPE)`, unchecked, so never an 8-bit dtype there."""
    from types import SimpleNamespace

    from ssmquant.calibrate import Setting
    from ssmquant.export.targets import vllm_hf_patch

    plan = SimpleNamespace(setting=Setting.parse(f"{enc}@conventional"), architecture=arch)
    got, why = vllm_hf_patch(plan, SimpleNamespace(layer_kind=kind))
    assert got == patch and why
    if enc == "int8":
        assert "would allocate a int8 state without scales" in why


def test_issue27_flashinfer_alloc_covers_every_ssm_layer_and_fails_in_one_line(nano_recipe, tmp_path, monkeypatch):
    """flashinfer_alloc.py allocates each SSM layer's tensors (LAYERS) and refuses a bad SSMQUANT_CACHE /
    SSMQUANT_DEVICE, or a CUDA device on a machine without one, with one line and exit status 1 (no traceback)."""
    res = export(nano_recipe, "flashinfer", tmp_path / "fi", gpu="sm90")
    path = str(res.out_dir / "flashinfer_alloc.py")
    layers = _doc(nano_recipe)["model"]["ssm_layers"]
    monkeypatch.setenv("SSMQUANT_DEVICE", "cpu")
    monkeypatch.setenv("SSMQUANT_CACHE", "2")
    ns = runpy.run_path(path)
    assert ns["SSM_LAYERS"] == layers and sorted(ns["LAYERS"]) == sorted(layers)
    assert all(t["state"].shape[0] == 2 for t in ns["LAYERS"].values()) and ns["state"] is ns["LAYERS"][layers[0]]["state"]
    assert json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())["layers"]["ssm_layers"] == layers
    for env, words in [({"SSMQUANT_CACHE": "eight"}, "SSMQUANT_CACHE='eight' is not a slot count"),
                       ({"SSMQUANT_CACHE": "0"}, "integer >= 1"),
                       ({"SSMQUANT_DEVICE": "gpu0"}, "SSMQUANT_DEVICE='gpu0' is not a torch device")]:  # fmt: skip
        monkeypatch.setenv("SSMQUANT_CACHE", "2")
        monkeypatch.setenv("SSMQUANT_DEVICE", "cpu")
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SystemExit) as info:
            runpy.run_path(path)
        assert isinstance(info.value.code, str) and "\n" not in info.value.code and words in info.value.code
    if not torch.cuda.is_available():
        monkeypatch.setenv("SSMQUANT_DEVICE", "cuda")
        with pytest.raises(SystemExit, match="no CUDA GPU here"):
            runpy.run_path(path)
    text = open(path).read()
    assert max(len(line) for line in text.split('"""')[1].splitlines()) <= 100  # the docstring header is wrapped


def test_flashinfer_exports_its_scaled_int16_state(tmp_path):
    """flashinfer.ssu_dtypes: selective_state_update stores int16 with a float32 state_scale (cache, nheads, dim);
    an int16 recipe exports with that scale, counted in the bytes, and the snippet allocates it."""
    r = tiny_calibration(budget=1.0, candidates=["int16"], schemes=["conventional"], calibration=["none"],
                         engine_fallbacks=[], rows=64, state=128)  # fmt: skip
    res = export(write_recipe(r, tmp_path / "recipe"), "flashinfer", tmp_path / "fi", gpu="sm90")
    kw = json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())
    assert kw["function"] == "flashinfer.mamba.selective_state_update" and kw["state"]["dtype"] == "torch.int16"
    assert kw["state_scale"]["shape"] == ["cache", HEADS, 64] and kw["state_scale"]["dtype"] == "torch.float32"
    assert res.plan.engine_bytes["scales"] == HEADS * 64 * 4
    assert "torch.int16" in (res.out_dir / "flashinfer_alloc.py").read_text()
