"""The command line as a new user meets it (issue 16): user errors are one `Error:` line with exit status 1
(usage errors: 2, tests/test_user_errors.py), no traceback and nothing written; sizes follow the device; plots, headers, permissions, exports, recipes
and Ctrl-C behave. In-process runs use click's CliRunner; what depends on the process (imports, signals,
environment variables read at import) runs `python -m ssmquant` in a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from ssmquant.cli import INTERRUPTED, main
from ssmquant.models.text import CORPUS_PATH

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
# the smallest real run: one layer of the shipped trained model, one variant
TINY = [
    "--model",
    "tiny-nemotron",
    "--layers",
    "0",
    "--formats",
    "int8",
    "--schemes",
    "conventional",
    "--device",
    "cpu",
]
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="checks the CPU defaults and CPU-only failure modes")


def cli(args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def run_cli(args, *, env=None, cwd=None, timeout=300, prefix=()):
    """`python -m ssmquant ARGS` in a fresh process (prefix: python arguments before -m, e.g. -c code)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    e.update(env or {})
    cmd = [sys.executable, *prefix] if prefix else [sys.executable, "-m", "ssmquant"]
    return subprocess.run(
        [*cmd, *map(str, args)], capture_output=True, text=True, env=e, cwd=cwd or ROOT, timeout=timeout
    )


def assert_user_error(res, *needles, code=1):
    """Exit status `code`, exactly one line with `Error:` and it starts the line, no traceback."""
    out = res.output if hasattr(res, "output") else res.stdout + res.stderr
    status = res.exit_code if hasattr(res, "exit_code") else res.returncode
    assert status == code, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "Error:" in line]
    assert len(errors) == 1 and errors[0].startswith("Error: "), out
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def assert_nothing_written(out: pathlib.Path):
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*")), list(out.parent.iterdir())


@pytest.fixture()
def no_model_load(monkeypatch):
    """Fail loudly if the run gets as far as loading a model: the check under test must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr("ssmquant.analysis.sources.load_model", refuse)


# -- 1. user errors in analyze: one line, before the work ------------------------------------------------


def test_analyze_empty_text_is_one_error_line(tmp_path, no_model_load):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    assert_user_error(cli(["analyze", *TINY, "--text", empty, "--out", out]), "empty.txt", "is empty")
    assert_nothing_written(out)


def test_analyze_text_too_short_is_refused_before_loading(tmp_path, no_model_load):
    out = tmp_path / "out"
    line = assert_user_error(cli(["analyze", *TINY, "--steps", 131072, "--batch", 4, "--out", out]))
    assert "4 sequences of 131072 tokens" in line and "shipped corpus" in line and "lower --steps" in line
    short = tmp_path / "short.txt"
    short.write_text("a few words of text\n" * 20)
    line = assert_user_error(cli(["analyze", *TINY, "--text", short, "--steps", 512, "--batch", 4, "--out", out]))
    assert "short.txt" in line and "needs at least" not in line and "2048 bytes" in line
    assert_nothing_written(out)


def test_analyze_refuses_a_run_that_will_not_fit_with_the_estimate(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("inputs were drawn before the memory check")

    monkeypatch.setattr("ssmquant.analysis.sources.synthetic_layers", never)
    out = tmp_path / "out"
    args = ["analyze", "--model", "nemotron-3-nano", "--synthetic", "--steps", 10_000_000, "--batch", 8, "--out", out]
    line = assert_user_error(cli(args))
    assert "needs about" in line and "TiB" in line and "(estimate;" in line and "is free" in line
    assert "lower --steps or --batch" in line and "steps fit at batch 8" in line
    assert_nothing_written(out)


def test_calibrate_refuses_a_run_that_will_not_fit_naming_its_own_option(tmp_path):
    """calibrate's steps are --horizon: the refusal names that option (not analyze's --steps) and a horizon
    that fits."""
    out = tmp_path / "recipe"
    args = ["calibrate", "--model", "nemotron-3-nano", "--synthetic", "--horizon", 100_000_000, "--batch", 8,
            "--budget", 0.1, "--out", out]  # fmt: skip
    line = assert_user_error(cli(args))
    assert "needs about" in line and "lower --horizon or --batch" in line and "--steps" not in line
    # --batch 8 plus 8 held-out sequences (synthetic data draws both): the batch of the estimate is named as such
    assert re.search(r"at most ~\d+ steps fit at batch 16, the calibration and held-out sequences together\)$", line)
    assert_nothing_written(out)


@cpu_only
def test_triton_backend_without_gpu_names_the_cli_fix(tmp_path, monkeypatch, no_model_load):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the test suite sets it for the kernel tests
    out = tmp_path / "out"
    line = assert_user_error(cli(["analyze", *TINY, "--backend", "triton", "--out", out]))
    assert "--backend triton needs a CUDA GPU" in line and "--backend auto or torch" in line
    assert "inputs.to(" not in line
    assert_nothing_written(out)


def test_out_that_cannot_be_created_is_refused_before_computing(tmp_path, no_model_load):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    line = assert_user_error(cli(["analyze", *TINY, "--out", blocker / "run"]))
    assert "cannot be created" in line and "not a directory" in line


def test_failed_write_is_one_error_line_and_leaves_nothing(tmp_path, monkeypatch):
    def disk_full(root):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ssmquant.report.outdir.follow_umask", disk_full)
    out = tmp_path / "out"
    res = cli(["analyze", *TINY, "--steps", 8, "--batch", 1, "--no-plots", "--out", out])
    assert_user_error(res, "cannot write --out", "No space left on device")
    assert_nothing_written(out)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_location_is_refused_before_computing(tmp_path, no_model_load):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        line = assert_user_error(cli(["analyze", *TINY, "--out", ro / "run"]))
        assert "is not writable" in line
    finally:
        ro.chmod(0o755)


# -- 2. sizes follow the device, with the choice and a time estimate printed ----------------------------


@cpu_only
def test_cpu_defaults_and_time_estimate_are_printed(tmp_path):
    out = tmp_path / "out"
    res = cli(["analyze", *TINY, "--out", out])
    assert res.exit_code == 0, res.output
    assert "defaults for the CPU (no GPU in use): --steps 512 --batch 4 (on a GPU: --steps 4096 --batch 8" in res.stderr
    assert "estimate: about" in res.stderr and "measured on this machine" in res.stderr
    settings = json.loads((out / "report.json").read_text())["settings"]
    assert (settings["steps"], settings["batch"]) == (512, 4)
    explicit = cli(["analyze", *TINY, "--steps", 16, "--batch", 1, "--out", tmp_path / "b", "-q"])
    assert explicit.exit_code == 0 and "defaults" not in explicit.output


@cpu_only
def test_calibrate_cpu_defaults(tmp_path):
    out = tmp_path / "recipe"
    args = ["calibrate", *TINY[:4], "--device", "cpu", "--candidates", "int8", "--schemes", "conventional",
            "--calibration", "none", "--engine-fallbacks", "none", "--choose-among", "research", "--budget", 1,
            "--no-verify", "--out", out]  # fmt: skip
    res = cli(args)
    assert res.exit_code == 0, res.output
    assert "--horizon 512 --batch 2 (on a GPU: --horizon 4096 --batch 4" in res.stderr
    assert "estimate: about" in res.stderr
    assert json.loads((out / "ssm_quant_config.json").read_text())["budget"]["horizon"] == 512


@cpu_only
@pytest.mark.slow
def test_eval_cpu_defaults_and_estimate(tmp_path):
    res = cli(["eval", *TINY[:2], "--formats", "int8", "--schemes", "conventional", "--out", tmp_path / "e"])
    assert res.exit_code == 0, res.output
    assert "--steps 256 --batch 4 (on a GPU: --steps 512 --batch 4" in res.stderr
    assert "estimate: about" in res.stderr and "decode steps" in res.stderr
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["settings"]["steps"] == 256


def test_sizing_defaults_and_memory_check():
    from ssmquant.sizing import SizingError, analyze_memory, check_memory, default_sizes, layer_dims

    assert default_sizes("analyze", "cuda:1") == {"steps": 4096, "batch": 8}
    assert default_sizes("calibrate", "cpu") == {"horizon": 512, "batch": 2}
    dims = layer_dims("mamba2", 64, 64, 128, 8)
    est = analyze_memory(dims, batch=8, steps=4096, variants=6, recorded=1024, device="cpu", backend="torch")
    need = est.total("host")
    assert 10 * 2**30 < need < 16 * 2**30  # torch emulation of Nemotron-3-Nano shapes: ~12.7 GiB
    check_memory(est, batch=8, steps=4096, free=lambda d: need)  # fits exactly: no error
    with pytest.raises(SizingError, match=r"at most ~(\d+) steps fit at batch 8") as err:
        check_memory(est, batch=8, steps=4096, free=lambda d: need // 2)
    fit = int(str(err.value).split("at most ~")[1].split()[0])
    assert 1500 < fit < 2048  # per-token parts halve, the fixed parts stay


# -- 3. parquet tables --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Two layers, rne and sr, conventional and replay: what the plots and tables must keep apart."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    args = [
        "analyze",
        "--model",
        "tiny-nemotron",
        "--layers",
        "0,2",
        "--formats",
        "fp8_e4m3,int8",
        "--rounding",
        "rne,sr",
        "--schemes",
        "conventional,replay16",
        "--steps",
        40,
        "--batch",
        1,
        "--device",
        "cpu",
        "--record-every",
        1,
        "--out",
        out,
    ]  # fmt: skip  (windows of one step: the conventional output error at step 1 is 0)
    res = cli(args)
    assert res.exit_code == 0, res.output
    return out, res


def test_plots_read_the_first_writes_from_the_report_and_need_no_torch(tiny_run, tmp_path):
    """report.json names each scheme's first rounded step; drawing from it imports no torch (a plotting process
    of its own needs nothing else of it), and the PNGs are those drawn with the steps computed from the schemes."""
    from ssmquant.report import files, plots, rendering

    out, _ = tiny_run
    traces, heads, summary, report = files.load_analysis(out)
    assert report["first_write_steps"] == {"conventional": 1, "replay16": 16}
    code = (
        "import sys; from ssmquant.report.files import load_analysis; from ssmquant.report.rendering import ready_plots; "
        f"t, h, s, r = load_analysis({str(out)!r}); ready_plots().render_all(t, h, s, r, {str(tmp_path)!r}); "
        "print('torch' in sys.modules)"
    )
    res = run_cli([], prefix=["-c", code])
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr
    without = dict(report)
    del without["first_write_steps"]
    b = tmp_path / "b"
    b.mkdir()
    rendering.ready_plots().render_all(traces, heads, summary, without, b)
    for name in plots.PLOT_FILES:
        assert (tmp_path / name).read_bytes() == (b / name).read_bytes(), name


def test_forked_plots_are_the_pngs_the_process_itself_draws(tiny_run, tmp_path, monkeypatch):
    """With spare cores `write_analysis` renders the plots in forked children: the same bytes, the same files."""
    import types

    import pandas as pd

    from ssmquant.report import files, plots, rendering

    out, _ = tiny_run
    traces, heads, summary, report = files.load_analysis(out)
    result = types.SimpleNamespace(traces=traces, heads=heads, summary=summary,
                                   memory=pd.read_csv(out / "memory.csv"), report=lambda: dict(report))  # fmt: skip
    monkeypatch.setattr(rendering, "PLOT_FORK_MIN_CPUS", 1)
    assert rendering.can_fork()
    children = []
    fork = rendering.os.fork
    monkeypatch.setattr(rendering.os, "fork", lambda: children.append(1) or fork())
    a = files.write_analysis(result, tmp_path / "a")
    written = json.loads((a / "report.json").read_text())
    assert written["files"][-4:] == [*plots.PLOT_FILES, "report.json"]
    b = tmp_path / "b"
    b.mkdir()
    rendering.ready_plots().render_all(traces, heads, summary, dict(report), b)
    for name in plots.PLOT_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert len(children) == len(plots.PLOT_FILES) - 1  # this process drew the last plot itself


def test_a_forked_plot_that_fails_names_its_plot(tiny_run, tmp_path, monkeypatch, capfd):
    import types

    from ssmquant.report import files, rendering

    out, _ = tiny_run
    traces, heads, summary, report = files.load_analysis(out)
    result = types.SimpleNamespace(traces=traces, heads=heads, summary=summary, memory=summary,
                                   report=lambda: dict(report))  # fmt: skip
    plots = rendering.ready_plots()
    render_one = plots.render_one

    def broken(name, *args):
        if name == "heatmap.png":
            raise ValueError("no heatmap today")
        return render_one(name, *args)

    monkeypatch.setattr(rendering, "PLOT_FORK_MIN_CPUS", 1)
    monkeypatch.setattr(plots, "render_one", broken)
    with pytest.raises(RuntimeError, match=r"the process plotting heatmap.png \(status 1\) failed"):
        files.write_analysis(result, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    assert "no heatmap today" in capfd.readouterr().err  # the child's traceback


def test_triton_warm_up_fills_the_cache_of_the_installation_hash():
    """What the CUDA start-up thread computes ahead is what Triton's first kernel call would: its cached
    installation hash (so the first launch finds it)."""
    pytest.importorskip("triton")
    from triton.runtime.cache import triton_key

    from ssmquant import startup as cli_mod

    key = triton_key()
    triton_key.cache_clear()
    cli_mod._warm_up_triton()
    assert triton_key.cache_info().currsize == 1 and triton_key() == key


def test_triton_warm_up_starts_before_torch_where_a_gpu_is_likely(monkeypatch):
    """With an NVIDIA device node present (judged without torch) the warm-up thread starts at once, before
    torch's import; without one it waits for torch to see a GPU (none here: not started); never for cpu."""
    import threading

    from ssmquant import startup as cli_mod

    calls = []
    done = threading.Event()
    monkeypatch.setattr(cli_mod, "_warm_up_triton", lambda: calls.append(1) or done.set())
    monkeypatch.setattr(cli_mod, "_likely_nvidia_gpu", lambda: True)
    cli_mod.start_devices("cpu")
    assert not done.wait(0.2) and calls == []
    cli_mod.start_devices("cuda")
    assert done.wait(10) and calls == [1]
    if not torch.cuda.is_available():
        monkeypatch.setattr(cli_mod, "_likely_nvidia_gpu", lambda: False)
        done.clear()
        cli_mod.start_devices("cuda")
        assert not done.wait(0.5) and calls == [1]


def test_likely_nvidia_gpu_honours_hidden_devices(monkeypatch):
    from ssmquant import startup as cli_mod

    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert cli_mod._likely_nvidia_gpu() is False
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr("os.path.exists", lambda p: p == "/dev/nvidiactl")
    assert cli_mod._likely_nvidia_gpu() is (importlib.util.find_spec("triton") is not None)


def test_first_layer_time_is_reported(tiny_run):
    _, res = tiny_run
    assert "the first layer took" in res.stderr and "more" in res.stderr


def test_tables_are_parquet_and_pyarrow_is_a_dependency(tiny_run):
    out, _ = tiny_run
    assert {"traces.parquet", "heads.parquet"} <= {p.name for p in out.iterdir()}
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python >= 3.11)
    deps = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert '"pyarrow>=' in deps


# -- 4. plots and forecasts ----------------------------------------------------------------------------


ORDER = [
    "fp8_e4m3@conventional", "fp8_e4m3@replay16", "fp8_e4m3:sr@conventional", "fp8_e4m3:sr@replay16",
    "int8@conventional", "int8@replay16", "int8:sr@conventional", "int8:sr@replay16",
]  # fmt: skip


def test_plots_share_the_run_order_and_one_legend(tiny_run):
    import matplotlib.pyplot as plt
    from matplotlib.collections import PathCollection

    from ssmquant.report.files import load_analysis
    from ssmquant.report.plots import drift_figure, heatmap_figure, variant_order

    traces, _, summary, report = load_analysis(tiny_run[0])
    assert variant_order(summary) == ORDER  # format, rounding, scheme: not sorted as strings
    fig = heatmap_figure(summary, report)
    ax = fig.axes[0]
    assert [t.get_text().replace("\n", "") for t in ax.get_xticklabels()] == ORDER
    fig.canvas.draw()
    renderer, frame = fig.canvas.get_renderer(), fig.bbox
    cbar = fig.axes[1]
    label = cbar.yaxis.label.get_window_extent(renderer)
    assert label.x1 <= frame.x1 and label.x0 >= frame.x0  # the colour bar's label is not clipped
    ticks = ax.get_xaxis().get_tightbbox(renderer)
    assert ticks.height < 0.25 * frame.height  # labels do not take half the figure
    plt.close(fig)

    fig = drift_figure(traces, summary, report)
    panels = [a for a in fig.axes if a.get_title()]
    assert len(fig.legends) == 1 and all(a.get_legend() is None for a in panels)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:2] == ["fp8_e4m3", "fp8_e4m3:sr"] and "replay16: 1st flush, step 16" in legend
    assert "error exactly 0" in legend  # conventional output error at step 1 is 0: drawn on the floor
    out_axes = [a for a in panels if "output error" in a.get_title()]
    assert all(any(isinstance(c, PathCollection) for c in a.collections) for a in out_axes)
    assert all(any(tuple(line.get_xdata()) == (16, 16) for line in a.get_lines()) for a in panels)
    from ssmquant.report import plots

    # one width for every format (issue 27: widths that varied by format read as emphasis); coinciding curves are
    # told apart by colour and dash instead
    widths = {
        line.get_linewidth() for line in panels[0].get_lines() if len(line.get_xdata()) > 2 and line.get_alpha() is None
    }
    assert widths == {plots.LINE_WIDTH}
    plt.close(fig)


def test_forecasts_show_r2_and_withhold_unreliable_and_diverged(tiny_run):
    import numpy as np

    from ssmquant.analysis.fit import PowerFit, fit_power_law, forecast
    from ssmquant.report.tables import summary_table

    steps = np.arange(1, 513)
    good = fit_power_law(steps, 1e-3 * steps**0.5, 1)
    assert forecast(good, 32768)[1] == "ok" and forecast(good, 32768)[0] == pytest.approx(1e-3 * 32768**0.5)
    flat = fit_power_law(steps, 1e-3 * (1 + 0.5 * np.sin(steps)), 16)
    assert flat.r2 < 0.5 and forecast(flat, 32768) == (pytest.approx(float("nan"), nan_ok=True), "unreliable")
    steep = PowerFit(a=1e-3, b=0.9, r2=0.95, t_first=8, t_last=512, points=100)
    assert steep.predict(131072) > 1 and np.isnan(forecast(steep, 131072)[0])
    assert forecast(steep, 131072)[1] == ">=1" and forecast(good, 32768, measured=1.2)[1] == "diverged"
    # divergence of a forecast is read only from a reliable fit: a noisy one that would cross 1 is unreliable
    noisy_steep = PowerFit(a=1e-3, b=0.9, r2=0.23, t_first=8, t_last=16, points=4)
    assert forecast(noisy_steep, 131072)[1] == "unreliable"
    assert forecast(PowerFit(float("nan"), float("nan"), float("nan"), 0, 0, 0), 32768)[1] == "no fit"

    out, res = tiny_run
    import pandas as pd

    summary = pd.read_csv(out / "summary.csv")
    for col in ("fit_r2_out", "forecast_out_32k_status", "forecast_out_128k_status"):
        assert col in summary.columns
    withheld = summary[summary.forecast_out_128k_status != "ok"]
    assert withheld.forecast_out_128k.isna().all()
    assert "fit r2" in res.stdout and "fit r2" in summary_table(summary)
    table = summary_table(summary.assign(forecast_out_128k_status=">=1"))
    assert ">=1 (forecast)" in table


# -- 5. console: errors on their own line, quiet means quiet, the hub fails fast ---------------------------


def test_error_after_the_progress_bar_starts_on_its_own_line(tmp_path, monkeypatch):
    import ssmquant.analysis.run as run

    calls = []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("emulation failed")
        return real(*args, **kwargs)

    real = run.start_simulation
    monkeypatch.setattr(run, "start_simulation", fail_second)
    out = tmp_path / "out"
    res = cli(["analyze", *TINY[:2], "--layers", "0,2", "--formats", "int8", "--schemes", "conventional",
               "--steps", 8, "--batch", 1, "--device", "cpu", "--out", out])  # fmt: skip
    assert "analyze:" in res.stderr  # the bar was drawn
    assert_user_error(res, "layer 2: emulation failed")
    assert_nothing_written(out)


@pytest.mark.slow
def test_quiet_runs_are_silent_and_cpu_runs_have_no_kernel_fallback_noise(tmp_path):
    quiet = run_cli(["eval", *TINY[:2], "--formats", "int8", "--schemes", "conventional", "--steps", 4, "--batch", 1,
                     "--device", "cpu", "--out", tmp_path / "e", "-q"])  # fmt: skip
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == "", quiet.stderr
    cal = run_cli(["calibrate", *TINY[:4], "--candidates", "int8", "--schemes", "conventional", "--horizon", 8, "--batch", 1, "--calibration", "none", "--engine-fallbacks",
                   "none", "--choose-among", "research", "--budget", 1, "--no-verify", "--out", tmp_path / "r", "-q"])  # fmt: skip
    assert cal.returncode == 0 and cal.stdout == "" and cal.stderr == "", cal.stderr
    loud = run_cli(["eval", *TINY[:2], "--formats", "int8", "--schemes", "conventional", "--steps", 4, "--batch", 1,
                    "--device", "cpu", "--out", tmp_path / "e2"])  # fmt: skip
    assert loud.returncode == 0 and "wrote" in loud.stdout
    assert "falling back" not in loud.stderr and "causal_conv1d" not in loud.stderr


@pytest.mark.parametrize(
    "env, why",
    [({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"), ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "does not answer")],
)
def test_unreachable_hub_fails_fast(tmp_path, env, why):
    t0 = time.monotonic()
    res = run_cli(["analyze", "--model", "someone/some-model", "--out", tmp_path / "o"],
                  env={"HF_HOME": str(tmp_path / "hf"), **env})  # fmt: skip
    assert_user_error(res, "someone/some-model", why, "not in the local cache")
    assert "Retrying" not in res.stderr and time.monotonic() - t0 < 20  # huggingface_hub's retries take ~25 s
    assert_nothing_written(tmp_path / "o")


# -- 6, 7. the user's text: named in the header, refused when it is not text --------------------------------


def test_header_names_the_users_text(tmp_path):
    text = tmp_path / "my_notes.txt"
    text.write_text(CORPUS_PATH.read_text(encoding="utf-8")[:60000], encoding="utf-8")
    res = cli(["analyze", *TINY, "--text", text, "--steps", 16, "--batch", 1, "--out", tmp_path / "a"])
    assert res.exit_code == 0, res.output
    header = next(line for line in res.stdout.splitlines() if line.startswith("tiny-nemotron ("))
    assert "my_notes.txt" in header and "public-domain" not in header and "shipped corpus" not in header
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["data_source"]["text"]["origin"] == str(text)
    res = cli(["eval", *TINY[:2], "--text", text, "--formats", "int8", "--schemes", "conventional", "--steps", 8,
               "--batch", 1, "--device", "cpu", "--out", tmp_path / "e"])  # fmt: skip
    assert res.exit_code == 0, res.output
    header = next(line for line in res.stdout.splitlines() if line.startswith("tiny-nemotron ("))
    assert "held-out split of the text of my_notes.txt" in header and "public-domain" not in header


def test_binary_text_is_refused_naming_the_file(tmp_path, no_model_load):
    blob = tmp_path / "binary.txt"
    blob.write_bytes(bytes(torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0)).tolist()))
    for cmd in (["analyze", *TINY], ["eval", *TINY[:2], "--device", "cpu"]):
        out = tmp_path / cmd[0]
        line = assert_user_error(cli([*cmd, "--text", blob, "--steps", 16, "--batch", 1, "--out", out]))
        assert "binary.txt" in line and "does not look like text" in line and "UTF-8" in line
        assert_nothing_written(out)
    latin1 = tmp_path / "latin1.txt"  # a stray non-UTF-8 byte or two is still text
    latin1.write_bytes(("plain words " * 2000).encode() + "caf\xe9 na\xefve".encode("latin-1"))
    from ssmquant.models.text import load_text

    assert load_text(latin1).startswith("plain words")


# -- 8, 9, 10. permissions, export --force, recipe fields ------------------------------------------------


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    out = tmp_path_factory.mktemp("rec") / "recipe"
    args = ["calibrate", *TINY[:4], "--device", "cpu", "--candidates", "int8", "--schemes", "conventional,replay",
            "--buffer-lens", "4", "--calibration", "none", "--engine-fallbacks", "fp16", "--budget", 1,
            "--horizon", 16, "--batch", 1, "--out", out, "-q"]  # fmt: skip
    old = os.umask(0o022)
    try:
        res = cli(args)
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    return out


def _modes(root: pathlib.Path) -> dict[str, int]:
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_outputs_follow_the_umask(tmp_path, recipe):
    modes = _modes(recipe)
    assert modes["recipe"] == 0o755 and modes["recipe/ssm_state_scales.safetensors"] == 0o644
    assert set(modes.values()) == {0o755, 0o644}, modes
    old = os.umask(0o027)
    try:
        res = cli(["analyze", *TINY, "--steps", 8, "--batch", 1, "--no-plots", "--out", tmp_path / "a", "-q"])
        exp = cli(["export", recipe, "--target", "vllm", "--out", tmp_path / "x"])
    finally:
        os.umask(old)
    assert res.exit_code == 0 and exp.exit_code == 0, res.output + exp.output
    modes = _modes(tmp_path / "a")
    assert modes["a"] == 0o750 and set(modes.values()) == {0o750, 0o640}, modes
    assert {m & 0o007 for m in _modes(tmp_path / "x").values()} == {0}


def test_export_default_dir_needs_force_like_an_explicit_out(tmp_path, recipe):
    rec = tmp_path / "recipe"
    shutil.copytree(recipe, rec)
    first = cli(["export", rec, "--target", "vllm"])
    assert first.exit_code == 0, first.output
    (rec / "export-vllm" / "my_notes.md").write_text("hand-written, must not vanish silently")
    line = assert_user_error(cli(["export", rec, "--target", "vllm"]), "not empty", "--force")
    assert "export-vllm" in line and (rec / "export-vllm" / "my_notes.md").exists()
    explicit = tmp_path / "mine"
    assert cli(["export", rec, "--target", "vllm", "--out", explicit]).exit_code == 0
    assert_user_error(cli(["export", rec, "--target", "vllm", "--out", explicit]), "not empty", "--force")
    # --force replaces ssmquant's own files only: a hand-written file in the output is never deleted
    line = assert_user_error(cli(["export", rec, "--target", "vllm", "--force"]), "did not write", "my_notes.md")
    assert (rec / "export-vllm" / "my_notes.md").exists()
    (rec / "export-vllm" / "my_notes.md").unlink()
    forced = cli(["export", rec, "--target", "vllm", "--force"])
    assert forced.exit_code == 0, forced.output


def _edited(recipe: pathlib.Path, tmp_path: pathlib.Path, edit) -> pathlib.Path:
    rec = tmp_path / "edited"
    shutil.copytree(recipe, rec)
    path = rec / "ssm_quant_config.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return rec


@pytest.mark.parametrize(
    "edit, needles",
    [
        (lambda d: d["layers"][0]["setting"].update(buffer_len=-3), ["buffer_len is -3", "give"]),
        (lambda d: d["layers"][0]["setting"].update(scheme_kind="spec"), ["scheme_kind is 'spec'"]),
        (lambda d: d["layers"][0]["setting"].update(stray=1), ["unknown fields ['stray']"]),
        (lambda d: d["layers"][0]["bytes_per_sequence"].update(total=1), ["bytes_per_sequence.total is 1"]),
        (lambda d: d["layers"][0].update(meets_budget=False), ["meets_budget is False"]),
        (lambda d: d["global"].update(status="none"), ["global.status is 'none' but global.setting is set"]),
        (lambda d: d["model"].update(calibrated_layers=[0, 2]), ["layers hold decisions for [0]"]),
        (lambda d: d["budget"].update(horizon=0), ["budget.horizon must be >= 1"]),
    ],
)
def test_hand_edited_recipe_fields_are_validated(tmp_path, recipe, edit, needles):
    rec = _edited(recipe, tmp_path, edit)
    assert_user_error(cli(["export", rec, "--target", "vllm"]), *needles)
    assert_nothing_written(rec / "export-vllm")


# -- 11. flash-linear-attention installed on a machine without a GPU -------------------------------------


@cpu_only
@pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("fla") is None, reason="flash-linear-attention is not installed"
)
def test_gdn_model_runs_on_cpu_with_fla_installed(tmp_path):
    res = cli(["eval", "--model", "tiny-qwen", "--steps", 8, "--batch", 1, "--device", "cpu", "--out", tmp_path / "e"])
    assert res.exit_code == 0, res.output


FAKE_FLA = """
def _no_gpu(*args, **kwargs):  # what fla's Triton kernels do on a machine without a GPU
    raise RuntimeError("0 active drivers ([]). There should only be one.")

chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = _no_gpu
"""

CHECK_AND_RUN = """
import sys, torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as m
x = torch.zeros(1, 2, 1, 4)
import importlib.util
from packaging.version import Version
import transformers
assert importlib.util.find_spec("fla").origin.endswith("site/fla/__init__.py"), "the fake fla is not the one imported"
try:
    m.torch_recurrent_gated_delta_rule(x, x, x, g=torch.zeros(1, 2, 1), beta=torch.ones(1, 2, 1))
except RuntimeError as err:
    assert "0 active drivers" in str(err)  # transformers < 5.25 binds fla for every device
else:
    # transformers >= 5.25 routes CPU inputs to its torch path itself, fla installed or not
    if Version(transformers.__version__) < Version("5.25"):
        raise SystemExit("transformers did not bind the fake fla: the test would prove nothing")
from ssmquant.cli import main
sys.argv = ["ssmquant", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_gdn_model_runs_on_cpu_with_a_simulated_fla(tmp_path):
    pkg = tmp_path / "site" / "fla" / "ops" / "gated_delta_rule"
    pkg.mkdir(parents=True)
    (tmp_path / "site" / "fla" / "__init__.py").write_text("__version__ = '0.6.0'\n")
    (tmp_path / "site" / "fla" / "ops" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(FAKE_FLA)
    args = ["eval", "--model", "tiny-qwen", "--formats", "int8", "--schemes", "conventional", "--steps", 8,
            "--batch", 1, "--device", "cpu", "--out", tmp_path / "e", "-q"]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    res = run_cli(args, env=env, prefix=["-c", CHECK_AND_RUN])
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "e" / "eval.json").is_file()


# -- 12. Ctrl-C, --record-every, git-ignored outputs -------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_exits_130_and_leaves_no_output(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssmquant", "analyze", *TINY, "--steps", "4096", "--batch", "8", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        # as from a terminal: a shell without job control starts background jobs (a CI script run with `&` or
        # nohup) with SIGINT ignored, children inherit that, and Python then installs no KeyboardInterrupt
        # handler, so the child would rightly run to the end
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    seen = ""
    while "estimate:" not in seen:  # the emulation is about to start
        ch = proc.stderr.read(1)
        assert ch, seen
        seen += ch
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == INTERRUPTED == 130, seen + err
    assert "Interrupted." in err and "Traceback" not in err and "Aborted" not in err
    assert_nothing_written(out)


def test_record_every_zero_is_refused(tmp_path, no_model_load):
    out = tmp_path / "out"
    assert_user_error(cli(["analyze", *TINY, "--record-every", 0, "--out", out]), "--record-every must be >= 1")
    assert_nothing_written(out)


def test_readme_outputs_are_git_ignored():
    if shutil.which("git") is None or subprocess.run(["git", "-C", ROOT, "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    import re

    readme = (ROOT / "README.md").read_text()
    outs = set(re.findall(r"--out (\S+)", readme)) - {"DIR"}
    assert {"runs/demo", "recipe/"} <= outs
    for path in outs:
        probe = str(pathlib.PurePosixPath(path) / "report.json")
        res = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", probe])
        assert res.returncode == 0, f"{path} (written by a README command) is not git-ignored"


# -- start-up (issue 15): what a command imports ----------------------------------------------------------


def test_help_imports_neither_torch_nor_pandas():
    code = "import sys; from ssmquant.cli import main; print(sorted({'torch', 'pandas', 'transformers'} & set(sys.modules)))"
    res = run_cli([], prefix=["-c", code])
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    assert run_cli(["--help"]).returncode == 0


def test_quiet_synthetic_run_skips_transformers_and_times_the_write(tmp_path):
    """-q silences transformers through its environment variables, so a run that loads no checkpoint never
    imports it; report.json's stages time the tables' and plots' writing beside analyze()'s stages."""
    out = tmp_path / "run"
    args = ["analyze", "--model", "nemotron-3-nano", "--synthetic", "--layers", "0", "--formats", "int8",
            "--schemes", "conventional", "--steps", 4, "--batch", 1, "--device", "cpu", "--out", out, "-q"]  # fmt: skip
    code = (
        "import sys; from ssmquant.cli import main\n"
        f"sys.argv = ['ssmquant', *{[str(a) for a in args]!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('transformers' in sys.modules)"
    )
    res = run_cli([], prefix=["-c", code])
    assert res.returncode == 0 and res.stdout.strip() == "False" and res.stderr == "", res.stdout + res.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["environment"]["transformers"]  # the version, read from the installed metadata
    stages = report["stages"]
    assert {"emulate_s", "tables_s", "write_tables_s", "plots_s"} <= set(stages)
    assert stages["plots_s"] > 0 and {"drift.png", "heatmap.png", "heads.png"} <= {p.name for p in out.iterdir()}


def test_the_remeasure_command_an_export_advises_runs(recipe, tmp_path):
    """export's `engine profile MISMATCH ... re-measure: ssmquant calibrate --engine vllm ...` failed with `the profile
    runs none of the 48 candidates`: it now names the exported setting as the candidate, and runs."""
    import json
    import shlex

    res = cli(["export", recipe, "--target", "vllm", "--engine-version", "0.33.0", "--gpu", "sm90",
               "--out", tmp_path / "x"])  # fmt: skip
    assert res.exit_code == 0, res.output
    advice = json.loads((tmp_path / "x" / "export_report.json").read_text())["engine_profile"]["remeasure"]
    assert advice and advice.startswith("ssmquant calibrate --engine vllm")
    argv = shlex.split(advice.replace("RECIPE_DIR", str(tmp_path / "again")))[1:]
    res = cli([*argv, "--batch", 1, "--device", "cpu", "-q"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "again" / "ssm_quant_config.json").is_file()


@pytest.fixture(scope="module")
def qwen_recipe(tmp_path_factory):
    out = tmp_path_factory.mktemp("recq") / "recipe"
    res = cli(["calibrate", "--model", "tiny-qwen", "--device", "cpu", "--candidates", "int8", "--schemes",
               "conventional", "--calibration", "none", "--engine-fallbacks", "fp16,bf16", "--budget", 0.5, "--horizon",
               16, "--batch", 1, "--out", out, "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


def test_flashinfer_refusal_of_small_gdn_layers_quotes_the_rule_and_advises_no_rerun(qwen_recipe, tmp_path):
    """tiny-qwen's K = V = 64: FlashInfer's GDN decode runs no setting on it; the refusal quoted "Requires SM90+" and
    advised re-running calibrate with settings measured and refused."""
    res = cli(["export", qwen_recipe, "--target", "flashinfer", "--out", tmp_path / "fi"])
    line = assert_user_error(res)
    out = res.output
    assert 'K must be at least 128, got K={K}' in out and "Requires SM90+" not in out, out
    assert "runs none of fp32@conventional" in out and "export for another target" in out
    assert "Re-run `ssmquant calibrate`" not in out and line


def test_vllm_export_prefers_bf16_over_fp16_for_gdn_at_the_same_bytes(qwen_recipe, tmp_path):
    """fp16 and bf16 state are the same size; vLLM's fused GDN decode takes bf16 only (fp16 falls back to Triton)."""
    import json

    res = cli(["export", qwen_recipe, "--target", "vllm", "--engine-version", "0.33.0", "--out", tmp_path / "v"])
    assert res.exit_code == 0, res.output
    args = json.loads((tmp_path / "v" / "vllm_engine_args.json").read_text())
    assert args["mamba_ssm_cache_dtype"] == "bfloat16", args
