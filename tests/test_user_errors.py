"""What a user hits (issue 27): each mistake is one `Error:` line (usage errors: status 2, everything else: 1), no
traceback, refused before the expensive work where the information is there; `--out` is optional, held from the
start of a run, and proven writable before the work."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
from click.testing import CliRunner

from ssmquant.cli import MODELOPT_VERSION_WARNING, USAGE_ERROR, _quiet_modelopt, main
from ssmquant.models import SHIPPED_MODELS, ModelLoadError, available_shipped_models, load_model
from tests.test_cli import ROOT, TINY, assert_nothing_written, assert_user_error, cli

# the fastest analyze run: one synthetic layer, one variant, a few steps, no plots
SYNTH = ["--model", "nemotron-3-nano", "--synthetic", "--layers", "0", "--formats", "int8", "--schemes",
         "conventional", "--steps", 4, "--batch", 1, "--device", "cpu", "--no-plots", "-q"]  # fmt: skip


@pytest.fixture()
def no_weights_load(monkeypatch):
    """Fail loudly if transformers starts loading weights: the check under test must come first."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the bad checkpoint was refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture()
def no_inputs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the run started its work before the refusal")

    monkeypatch.setattr("ssmquant.analysis.sources.synthetic_layers", refuse)
    monkeypatch.setattr("ssmquant.analysis.sources.load_model", refuse)


def checkpoint_copy(tmp_path, *, weights_bytes: int | None = None, drop: tuple[str, ...] = (), model="tiny-nemotron"):
    """A shipped model's checkpoint in tmp_path/ckpt: its weights truncated to ``weights_bytes``, or linked whole;
    config.json without the fields ``drop``."""
    src = available_shipped_models()[model]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = json.loads((src / "config.json").read_text())
    for key in drop:
        del config[key]
    (ckpt / "config.json").write_text(json.dumps(config))
    if weights_bytes is None:
        os.symlink(src / "model.safetensors", ckpt / "model.safetensors")
    else:
        with open(src / "model.safetensors", "rb") as f:
            (ckpt / "model.safetensors").write_bytes(f.read(weights_bytes))
    return ckpt


# -- --layers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["analyze", "calibrate"])
def test_empty_layers_is_a_one_line_usage_error(tmp_path, command, no_inputs):
    extra = ["--budget", 1] if command == "calibrate" else []
    res = cli([command, "--model", "tiny-nemotron", "--layers", "", *extra, "--out", tmp_path / "o"])
    assert_user_error(res, "--layers", "give at least one layer", code=USAGE_ERROR)
    assert_nothing_written(tmp_path / "o")


def test_empty_layer_selection_is_refused_by_the_library():
    from ssmquant.analysis import SourceError
    from ssmquant.analysis.sources import select_layers

    with pytest.raises(SourceError, match=r"--layers is empty; .*mamba2 layers are \[0, 2\]"):
        select_layers([], (0, 2), "m", "mamba2")


def test_layers_outside_the_config_are_refused_before_the_weights_load(tmp_path, no_inputs):
    for model in ("tiny-nemotron", checkpoint_copy(tmp_path)):
        res = cli(["analyze", "--model", model, "--layers", "0,99", "--out", tmp_path / "o"])
        assert_user_error(res, "layers [99] are not SSM layers", "its mamba2 layers are [0, 2, 4, 6, 8]")
        assert_nothing_written(tmp_path / "o")


def test_calibrate_refuses_layers_outside_the_config_before_the_weights_load(tmp_path, no_weights_load):
    res = cli(["calibrate", "--model", checkpoint_copy(tmp_path), "--layers", "0,99", "--budget", 0.02,
               "--out", tmp_path / "r"])  # fmt: skip
    assert_user_error(res, "--layers: layers [99] are not SSM layers", "its mamba2 layers are [0, 2, 4, 6, 8]")
    assert_nothing_written(tmp_path / "r")


# -- a broken checkpoint: one line, before its weights load -------------------------------------------------


def test_truncated_weights_are_refused_before_loading(tmp_path, no_weights_load):
    ckpt = checkpoint_copy(tmp_path, weights_bytes=4_000_000)
    with pytest.raises(ModelLoadError, match=r"model.safetensors is truncated or corrupt: .* has 4000000 bytes"):
        load_model(ckpt, device="cpu")
    res = cli(["analyze", "--model", ckpt, "--layers", "0", "--out", tmp_path / "o"])
    assert_user_error(res, "is truncated or corrupt", "copy or download the checkpoint again")
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelLoadError, match="is truncated or corrupt"):
        load_model(ckpt, device="cpu")


def test_an_index_naming_a_missing_shard_is_refused(tmp_path, no_weights_load):
    ckpt = checkpoint_copy(tmp_path)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"is incomplete: .* model-00001-of-00002.safetensors is missing"):
        load_model(ckpt, device="cpu")


def test_a_config_missing_fields_is_refused_naming_them(tmp_path, no_weights_load):
    """transformers fills a missing field with its default, then loads every weight, prints a report of each
    tensor and raises RuntimeError; the check compares the sizes from config.json with the weights' headers."""
    ckpt = checkpoint_copy(tmp_path, drop=("hidden_size", "linear_num_value_heads"), model="tiny-qwen")
    res = cli(["analyze", "--model", ckpt, "--layers", "0", "--out", tmp_path / "o"])
    line = assert_user_error(res, "config.json does not match the weights beside it", "tensor(s) differ in size")
    assert "lacks hidden_size (transformers' default 4096 was taken)" in line, line
    assert "linear_num_value_heads (transformers' default 32 was taken)" in line, line
    assert len(res.output.splitlines()) < 4, res.output  # no loading report
    assert_nothing_written(tmp_path / "o")


# -- --text that is not a regular file ---------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_text_that_is_a_device_says_so(tmp_path, no_inputs):
    for cmd in (["analyze", *TINY], ["eval", *TINY[:2], "--device", "cpu"]):
        line = assert_user_error(cli([*cmd, "--text", "/dev/zero", "--out", tmp_path / "o"]))
        assert "'/dev/zero' is not a regular file (it is a character device)" in line and "does not exist" not in line
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    line = assert_user_error(cli(["analyze", *TINY, "--text", fifo, "--out", tmp_path / "o"]))
    assert "is not a regular file (it is a named pipe)" in line
    assert_nothing_written(tmp_path / "o")


# -- `ssmquant plot` on damaged tables ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("plot") / "run"
    res = cli(["analyze", *SYNTH, "--out", out])
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize(
    "damage, needles",
    [
        (lambda d: (d / "traces.parquet").write_bytes((d / "traces.parquet").read_bytes()[:300]), ["traces.parquet cannot be read"]),
        (lambda d: (d / "heads.parquet").write_text("garbage\n"), ["heads.parquet cannot be read"]),
        (lambda d: (d / "summary.csv").write_text("a,b\n1,2\n"), ["summary.csv lacks the columns"]),
        (lambda d: (d / "report.json").write_text("{not json"), ["report.json cannot be read"]),
    ],
)
def test_plot_of_damaged_tables_is_one_line(synthetic_run, tmp_path, damage, needles):
    run = tmp_path / "run"
    shutil.copytree(synthetic_run, run)
    damage(run)
    assert_user_error(cli(["plot", run]), *needles, "damaged")


# -- --out: writable up front, held from the start, optional ---------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_out_where_nothing_can_be_created_is_refused_before_the_work(no_inputs):
    """os.access says /proc is writable to root; creating a directory there is what fails."""
    assert_user_error(cli(["analyze", *SYNTH, "--out", "/proc/ssmquant-x"]), "cannot be created", "/proc")


HOLD = """
import sys, time
from ssmquant.report.outdir import claim_out_dir
with claim_out_dir(sys.argv[1], False, "analyze"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_run_into_one_out_is_refused_at_its_start_and_a_dead_runs_lock_is_taken_over(tmp_path, monkeypatch):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        import ssmquant.analysis.sources as sources

        real = sources.synthetic_layers
        monkeypatch.setattr(sources, "synthetic_layers", lambda *a, **k: pytest.fail("the loser did its work first"))
        line = assert_user_error(cli(["analyze", *SYNTH, "--out", out]), "is being written by another ssmquant run")
        assert f"(pid {holder.pid})" in line
    finally:
        holder.kill()  # SIGKILL: its lock file stays behind, with its pid
        holder.wait()
    lock = tmp_path / ".run.lock"
    assert lock.read_text() == f"ssmquant output lock, pid {holder.pid}\n"
    monkeypatch.setattr(sources, "synthetic_layers", real)
    res = cli(["analyze", *SYNTH, "--out", out])
    assert res.exit_code == 0, res.output
    assert (out / "report.json").is_file() and not lock.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_out_is_optional_and_never_replaces(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ["analyze-nemotron-3-nano-synthetic", "analyze-nemotron-3-nano-synthetic-2"]:
        res = cli(["analyze", *SYNTH])
        assert res.exit_code == 0, res.output
        assert f"output: {os.path.join('ssmquant-out', name)} (no --out given)" in res.stderr
        assert (tmp_path / "ssmquant-out" / name / "report.json").is_file()
    # a shipped model as typed, without --out (the real `ssmquant analyze --model nemotron-3-nano` downloads)
    res = cli(["analyze", *TINY, "--steps", 8, "--batch", 1, "--no-plots", "-q"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "ssmquant-out" / "analyze-tiny-nemotron" / "report.json").is_file()
    res = cli(["eval", *TINY[:2], "--formats", "int8", "--schemes", "conventional", "--steps", 4, "--batch", 1,
               "--device", "cpu", "--no-plots", "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (tmp_path / "ssmquant-out" / "eval-tiny-nemotron" / "eval.json").is_file()
    # a run that fails leaves nothing, not even the ssmquant-out/ it would have created
    shutil.rmtree(tmp_path / "ssmquant-out")
    res = cli(["calibrate", *TINY[:2], "--layers", 99, "--budget", 1])
    assert "output: " + os.path.join("ssmquant-out", "calibrate-tiny-nemotron") in res.stderr
    assert_user_error(res, "layers [99] are not SSM layers")
    assert not (tmp_path / "ssmquant-out").exists()


def test_default_out_names_the_command_and_the_model(tmp_path, monkeypatch):
    from ssmquant.report.outdir import default_out_dir, lock_path

    monkeypatch.chdir(tmp_path)
    assert str(default_out_dir("eval", "./ckpt/my-model/")) == os.path.join("ssmquant-out", "eval-my-model")
    assert str(default_out_dir("calibrate", "nvidia/Some Model")) == os.path.join("ssmquant-out", "calibrate-Some-Model")
    (tmp_path / "ssmquant-out" / "eval-m").mkdir(parents=True)
    lock_path(tmp_path / "ssmquant-out" / "eval-m-2").write_text("1\n")  # being written by another run
    assert str(default_out_dir("eval", "m")) == os.path.join("ssmquant-out", "eval-m-3")


def test_out_option_is_optional_for_eval_and_calibrate():
    for command in ("analyze", "eval", "calibrate"):
        res = CliRunner().invoke(main, [command, "--help"])
        assert res.exit_code == 0
        assert "ssmquant-out/" in re.sub(r"\s+", "", res.output), res.output


# -- usage errors: one line, status 2 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["analyze", "--bogus"], "No such option '--bogus'"),
        (["analyze", "--steps", "many"], "'many' is not a valid integer"),
        (["build"], "Missing argument 'PRESET'"),
        (["nosuch"], "No such command 'nosuch'"),
        (["--bogus"], "No such option '--bogus'"),
        (["export", "/nonexistent-recipe", "--target", "vllm"], "does not exist"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(args, needle):
    res = cli(args)
    line = assert_user_error(res, needle, "--help'", code=USAGE_ERROR)
    assert "Usage:" not in res.output and "Try " not in res.output, res.output
    assert line.startswith("Error: ")


def test_readme_states_the_exit_statuses():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert f"exit status {USAGE_ERROR} for a usage error" in text and "1 for anything else" in text


# -- the shipped models are listed ------------------------------------------------------------------------


def test_presets_and_help_list_every_shipped_model():
    res = cli(["presets"])
    assert res.exit_code == 0, res.output
    shipped = res.output.split("shipped models")[1]
    for name in available_shipped_models():
        assert re.search(rf"^\s*{name}\s+\w+\s+\d+/\d+", shipped, re.M), res.output
    for command in ("analyze", "eval", "calibrate"):
        help_text = re.sub(r"\s+", "", CliRunner().invoke(main, [command, "--help"]).output)
        for name in SHIPPED_MODELS:
            assert name in help_text, (command, name)


# -- modelopt's transformers-version warning ------------------------------------------------------------


def test_modelopt_version_warning_is_silenced_and_nothing_else():
    """The filter matches the warning modelopt emits (its own source's words) and no other one."""
    import importlib.util

    spec = importlib.util.find_spec("modelopt")
    source = open(os.path.join(os.path.dirname(spec.origin), "torch", "__init__.py")).read()
    assert "is not tested with current version of modelopt" in source  # the words the filter matches
    message = "transformers 5.24.0 is not tested with current version of modelopt and may cause issues. Please install"
    assert re.match(MODELOPT_VERSION_WARNING, message)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _quiet_modelopt()
        warnings.warn(message, UserWarning, stacklevel=1)
        warnings.warn("modelopt: some other warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["modelopt: some other warning"]


def test_calibrate_installs_the_modelopt_filter(tmp_path, monkeypatch):
    monkeypatch.setattr(warnings, "filters", [])
    cli(["calibrate", "--model", "tiny-nemotron", "--layers", "", "--budget", 1, "--out", tmp_path / "r"])
    assert any(f[1] is not None and f[1].pattern == MODELOPT_VERSION_WARNING for f in warnings.filters)


@pytest.mark.parametrize(
    "option",
    [["--schemes", "replay99999"], ["--schemes", "replay", "--buffer-len", "99999"], ["--schemes", "replay65537"]],
)
def test_a_buffer_longer_than_any_mask_is_one_error_line(option):
    """A replay buffer above 65536 steps raised an IndexError (the first-write search looked at 65536 steps only)."""
    res = cli(["analyze", *SYNTH, *option])
    assert_user_error(res, "never rewrites its checkpoint within --steps", "raise --steps or lower --buffer-len")


def test_eval_refuses_a_variant_that_never_stores_its_state():
    """eval reported KL 0, 100% top-1 and a zero loss change for replay buffers longer than --steps."""
    res = cli(["eval", *TINY[:2], "--formats", "int8", "--schemes", "replay32", "--steps", 16, "--batch", 1,
               "--device", "cpu", "--no-plots", "-q"])  # fmt: skip
    assert_user_error(res, "replay32 never stores its state within --steps 16", "give a --prompt")


@pytest.mark.parametrize("engine", ["flashinfer", "vllm", "trtllm"])
def test_an_engine_profile_with_the_default_formats_runs_what_the_engine_runs(engine, tmp_path):
    """`--engine X` without --formats aborted at the first default variant the engine cannot run; now those are
    left out (one line, and report.json), the engine's 16-bit states measured beside; a format the user names that
    the engine cannot run is still refused."""
    args = ["analyze", *TINY[:2], "--engine", engine, "--steps", 16, "--batch", 1, "--layers", 0, "--device", "cpu",
            "--no-plots", "--out", tmp_path / "a"]  # fmt: skip
    res = cli(args)
    assert res.exit_code == 0, res.output
    assert f"{engine}: left out " in res.stderr and "default variant" in res.stderr
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    ran = {row["variant"] for row in report["summary"]}
    assert ran and all(v.endswith(f"~{engine}") for v in ran) and report["skipped_variants"]
    assert not ran & {x["variant"] for x in report["skipped_variants"]}
    if engine != "flashinfer":
        assert_user_error(cli([*args[:-2], "--formats", "int8", "--out", tmp_path / "b"]), "int8@")


def test_the_verdict_names_the_engines_that_serve_each_variant(tmp_path):
    """analyze said `fp8_e4m3@conventional: every layer under 0.02` of a setting no engine runs: each verdict line
    (and report.json) now names the engines, at the versions the facts were read at, that serve it, or none."""
    res = cli(["analyze", *SYNTH[:5], "--formats", "fp8_e4m3", "--schemes", "conventional,replay16", "--steps", 32,
               "--batch", 1, "--device", "cpu", "--no-plots", "--out", tmp_path / "a"])  # fmt: skip
    assert res.exit_code == 0, res.output
    lines = {ln.split(":")[0].strip(): ln for ln in res.stdout.splitlines() if ln.startswith("  fp8_e4m3@")}
    assert "engines: none (vLLM " in lines["fp8_e4m3@conventional"] and "checked)" in lines["fp8_e4m3@conventional"]
    assert "engines: FlashInfer " in lines["fp8_e4m3@replay16"]
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert {v["variant"]: v["engines"].split(":")[1].split()[0] for v in report["verdict"]} == {
        "fp8_e4m3@conventional": "none", "fp8_e4m3@replay16": "FlashInfer"}  # fmt: skip


@pytest.mark.slow
def test_the_readmes_python_snippet_prints_its_results_as_a_script(tmp_path):
    """Run as a script, the snippet printed nothing (its results were bare expressions)."""
    text = (ROOT / "README.md").read_text()
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    res = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "fp8_e4m3@conventional" in res.stdout and "int8:sr@replay16" in res.stdout
    assert res.stdout.strip().splitlines()[-1].strip().isdigit()  # the bytes of an nvfp4 state
