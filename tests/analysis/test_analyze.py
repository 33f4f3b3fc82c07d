"""`ssmquant analyze` end to end (CLI and library), its invariants on real runs, and its bad inputs."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from ssmquant.analysis import AnalyzeConfig, AnalyzeError, SourceError, analyze, fit_power_law
from ssmquant.cli import main
from ssmquant.report.files import load_analysis
from ssmquant.report.outdir import OutputError, write_atomically

SYNTH = ["--model", "nemotron-3-nano", "--synthetic", "--layers", "0,2", "--steps", "24", "--batch", "1"]


def run(args):
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    return res


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("an") / "run"
    res = run(
        [
            "analyze",
            *SYNTH,
            "--formats",
            "fp32,bf16,fp8_e4m3,int8",
            "--schemes",
            "conventional,replay1,replay4",
            "--out",
            str(out),
            "-q",
        ]
    )
    assert res.exit_code == 0, res.output
    return out


def test_files_columns_and_data_source(synthetic_run):
    names = {p.name for p in synthetic_run.iterdir()}
    assert {"summary.csv", "memory.csv", "report.json", "drift.png", "heatmap.png", "heads.png"} <= names
    assert ("traces.parquet" in names or "traces.csv" in names) and ("heads.parquet" in names or "heads.csv" in names)
    traces, heads, summary, report = load_analysis(synthetic_run)
    assert list(traces.columns) == [
        "layer",
        "variant",
        "step",
        "window_start",
        "state_rel_err",
        "state_rel_err_max",
        "state_rel_err_last",
        "out_rel_err",
        "out_rel_err_max",
        "out_rel_err_last",
        "state_snr_db",
        "out_snr_db",
    ]
    assert set(traces.layer) == {0, 2} and traces.step.max() == 24
    # default windows hold whole flush cycles of every variant (lcm(1, 1, 4) = 4), covering every step
    assert report["settings"]["record_every"] == 4
    assert traces.window_start.min() == 1 and (traces.step - traces.window_start + 1).eq(4).all()
    assert {"layer", "variant", "step", "head", "state_rel_err", "out_rel_err", "out_rel_err_max"} <= set(heads.columns)
    assert len(summary) == 2 * 12
    assert (summary.out_rel_err_max >= summary.out_rel_err).all()
    for col in ("out_rel_err", "worst_head", "growth_b_out", "forecast_out_32k", "forecast_out_128k"):
        assert col in summary.columns
    assert report["data_source"]["kind"] == "synthetic" and report["model"] == "nemotron-3-nano"
    assert report["settings"]["steps"] == 24 and "torch" in report["environment"]
    mem = {m["format"]: m for m in report["memory"]}
    assert mem["fp32"]["bytes_per_sequence"] == 23 * 2 * 2**20  # 23 layers x 2 MiB (ARCHITECTURE.md, reference shapes)
    assert abs(mem["int8"]["capacity_vs_fp32"] - 3.8788) < 1e-3


def test_invariants_on_a_real_run(synthetic_run):
    summary = pd.read_csv(synthetic_run / "summary.csv").set_index(["layer", "variant"])
    traces = (
        pd.read_csv(synthetic_run / "traces.csv")
        if (synthetic_run / "traces.csv").exists()
        else pd.read_parquet(synthetic_run / "traces.parquet")
    )
    for layer in (0, 2):
        s = summary.loc[layer]
        assert s.loc["fp32@conventional", "out_rel_err"] == 0 and s.loc["fp32@replay4", "state_rel_err"] == 0
        assert 0 < s.loc["bf16@conventional", "out_rel_err"] < s.loc["fp8_e4m3@conventional", "out_rel_err"]
        # replay with L=1 equals conventional (bf16 inputs are stored losslessly in the bf16 buffer)
        t = traces[traces.layer == layer].set_index(["variant", "step"])
        for fmt in ("bf16", "fp8_e4m3", "int8"):
            a = t.loc[f"{fmt}@conventional"][["state_rel_err", "out_rel_err"]].to_numpy()
            b = t.loc[f"{fmt}@replay1"][["state_rel_err", "out_rel_err"]].to_numpy()
            assert np.array_equal(a, b)


def test_plot_command_rerenders(synthetic_run):
    (synthetic_run / "drift.png").unlink()
    res = run(["plot", str(synthetic_run)])
    assert res.exit_code == 0 and (synthetic_run / "drift.png").stat().st_size > 10_000


def test_checkpoint_end_to_end(byte_nemotron_dir, tmp_path):
    out = tmp_path / "ckpt"
    res = run(
        [
            "analyze",
            "--model",
            str(byte_nemotron_dir),
            "--steps",
            "32",
            "--batch",
            "2",
            "--formats",
            "fp8_e4m3,nvfp4:head",
            "--schemes",
            "conventional,replay8",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["data_source"]["kind"] == "checkpoint"
    assert report["data_source"]["text"]["origin"].startswith("shipped:")
    assert report["data_source"]["layers"] == [0, 2, 4]
    assert "fp8_e4m3@conventional" in res.output and "forecast" in res.output


def test_library_call_and_progress():
    seen = []
    r = analyze(
        AnalyzeConfig(
            model="qwen3.5-0.8b", synthetic=True, layers=[0], steps=12, batch=1, formats=["int8"], schemes=["replay4"]
        ),
        progress=lambda d, t, layer: seen.append((d, t, layer)),
    )
    assert seen[0] == (0, 1, None) and seen[-1] == (1, 1, 0)
    assert r.summary.loc[0, "variant"] == "int8@replay4" and r.source["layer_kind"] == "gdn"


def test_library_call_on_a_kda_preset():
    r = analyze(
        AnalyzeConfig(
            model="kimi-linear-48b-a3b",
            synthetic=True,
            layers=[1],
            steps=8,
            batch=1,
            formats=["int8"],
            schemes=["conventional", "replay4"],
        )
    )
    assert r.source["layer_kind"] == "kda" and r.source["state_shape"] == [32, 128, 128]
    assert "fused_kernels" not in r.environment  # the torch backend: no fused kernel ran
    s = r.summary.set_index("variant")
    assert (s.kind == "kda").all()
    assert 0 < s.loc["int8@replay4", "out_rel_err"] < s.loc["int8@conventional", "out_rel_err"]


def test_kda_layers_measure_a_bf16_state_by_default():
    """KDA's engines keep a bf16 or fp32 state, never an 8-bit one (engines/facts.py: vllm.kda_state_dtype,
    flashinfer.fused_kda_decode): analyze measures bf16@conventional on KDA layers beside the default formats, so
    its table and verdict say whether a bf16 KDA state is good enough. Other kinds and an explicit --formats keep
    their grid."""
    kw = dict(steps=4, batch=1, layers=[0], schemes=["conventional"])
    r = analyze(AnalyzeConfig(model="tiny-kda", **kw))
    assert list(r.summary["variant"]) == ["fp8_e4m3@conventional", "int8@conventional", "nvfp4@conventional",
                                          "bf16@conventional"]  # fmt: skip
    assert "bf16" in list(r.memory["format"])
    assert list(analyze(AnalyzeConfig(model="tiny-kda", formats=["int8"], **kw)).summary["variant"]) == [
        "int8@conventional"]  # fmt: skip
    assert "bf16@conventional" in list(
        analyze(AnalyzeConfig(model="tiny-kda", formats=["int8"], kind_baselines=True, **kw)).summary["variant"]
    )
    assert "bf16@conventional" not in list(analyze(AnalyzeConfig(model="tiny-nemotron", **kw)).summary["variant"])


def test_cli_kda_default_verdict_answers_bf16_and_formats_turns_it_off(tmp_path):
    base = ["analyze", "--model", "tiny-kda", "--layers", "0", "--steps", "4", "--batch", "1", "--schemes",
            "conventional", "--no-plots"]  # fmt: skip
    res = run([*base, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert "bf16@conventional:" in res.output  # a verdict line of its own
    res = run([*base, "--formats", "int8", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    assert "bf16@conventional" not in res.output.split("SSM state per sequence")[0]


def test_fused_kernels_are_recorded():
    """Which fused kernel ran each variant is part of the record (the CUDA kernel only on a GPU, for the 8-bit
    per-row variants of KDA heads of 128 key channels; tiny-kda's are smaller, so Triton everywhere)."""
    r = analyze(
        AnalyzeConfig(model="tiny-kda", steps=4, batch=1, formats=["int8"], schemes=["conventional"], backend="triton")
    )
    assert r.environment["backend"] == "triton"
    assert r.environment["fused_kernels"] == {"int8@conventional": "triton"}


@pytest.mark.parametrize(
    "args,message",
    [
        (["--formats", "int4"], "unknown format 'int4'.*accepted encodings: fp32, bf16, fp16, fp8_e4m3, int8, nvfp4"),
        (["--schemes", "lookahead"], "unknown scheme 'lookahead'.*accepted: conventional"),
        (["--rounding", "up"], "unknown rounding 'up'; accepted: rne, sr"),
        (["--layers", "1"], r"layers \[1\] are not SSM layers of nemotron-3-nano; its mamba2 layers are \[0, 2, 4, 7"),
        (
            ["--synthetic-profile", "nope"],
            "unknown synthetic profile 'nope'; accepted: init, slow-decay, low-rank-keys",
        ),
    ],
)
def test_bad_inputs(args, message, tmp_path):
    argv = [
        "analyze",
        "--model",
        "nemotron-3-nano",
        "--synthetic",
        "--steps",
        "16",
        "--batch",
        "1",
        "--layers",
        "0",
        *args,
        "--out",
        str(tmp_path / "o"),
    ]
    res = CliRunner().invoke(main, argv)
    assert res.exit_code != 0
    assert pytest.importorskip("re").search(message, res.output), res.output
    assert not (tmp_path / "o").exists()


def test_synthetic_profile_is_labelled_in_the_report(tmp_path):
    out = tmp_path / "p"
    argv = ["analyze", "--model", "qwen3.5-0.8b", "--synthetic", "--synthetic-profile", "persistent", "--layers", "0"]
    argv += ["--steps", "16", "--batch", "1", "--formats", "fp8_e4m3", "--schemes", "replay4", "--no-plots", "-q"]
    assert run([*argv, "--out", str(out)]).exit_code == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["settings"]["synthetic_profile"] == "persistent"
    assert rep["data_source"]["synthetic_profile"] == "persistent"
    assert "'persistent' stress profile" in rep["data_source"]["note"]


def test_synthetic_profile_needs_synthetic_inputs(tmp_path):
    res = CliRunner().invoke(
        main, ["analyze", "--model", "tiny-nemotron", "--synthetic-profile", "slow-decay", "--out", str(tmp_path / "o")]
    )
    assert res.exit_code != 0
    assert "--synthetic-profile slow-decay applies to synthetic inputs only: add --synthetic" in res.output


def test_unknown_preset_lists_presets(tmp_path):
    res = CliRunner().invoke(main, ["analyze", "--model", "llama-3", "--synthetic", "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and "presets: nemotron-3-nano" in res.output


def test_non_empty_out_is_refused_unless_force(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    base = [
        "analyze",
        "--model",
        "nemotron-3-nano",
        "--synthetic",
        "--steps",
        "4",
        "--batch",
        "1",
        "--layers",
        "0",
        "--formats",
        "int8",
        "--schemes",
        "conventional",
        "--no-plots",
        "-q",
        "--out",
        str(out),
    ]
    res = CliRunner().invoke(main, base)
    assert res.exit_code != 0 and "exists and is not empty; pass --force" in res.output
    # --force replaces only a previous output of the same command: the user's own file is never deleted
    res = CliRunner().invoke(main, base + ["--force"])
    assert res.exit_code != 0 and "is not a previous `ssmquant analyze` output" in res.output
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    assert CliRunner().invoke(main, base).exit_code == 0 and (out / "report.json").exists()
    first = (out / "report.json").stat().st_mtime_ns
    assert CliRunner().invoke(main, base + ["--force"]).exit_code == 0
    assert (out / "report.json").stat().st_mtime_ns != first


def test_interrupted_write_leaves_no_directory(tmp_path):
    out = tmp_path / "o"

    def fill(tmp):
        (tmp / "half.csv").write_text("a")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(out, False, fill)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_nan_in_captured_inputs_names_layer_and_step(monkeypatch):
    import ssmquant.analysis.sources as sources

    original = sources.synthetic_layers

    def poisoned(*a, **k):
        for layer, inp in original(*a, **k):
            inp.x = inp.x.clone()
            inp.x[0, 3, 0, 0] = float("nan")
            yield layer, inp

    monkeypatch.setattr(sources, "synthetic_layers", poisoned)
    with pytest.raises(AnalyzeError, match=r"layer 2: x contains NaN/Inf \(first at batch 0, step 3\)"):
        analyze(AnalyzeConfig(model="nemotron-3-nano", synthetic=True, layers=[2], steps=16, batch=1, formats=["int8"]))


@pytest.mark.gpu
def test_synthetic_needs_a_preset_and_cuda_request_without_gpu():
    with pytest.raises(SourceError, match="--synthetic needs a preset name"):
        analyze(AnalyzeConfig(model="./nowhere", synthetic=True, steps=4, batch=1, schemes=["conventional"]))
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SourceError, match="no CUDA GPU is available"):
            analyze(AnalyzeConfig(model="nemotron-3-nano", synthetic=True, steps=4, batch=1, device="cuda",
                                  schemes=["conventional"]))  # fmt: skip


def test_power_law_fit_recovers_exponent():
    steps = np.arange(1, 1025)
    fit = fit_power_law(steps, 3e-4 * steps**0.5, first_write=16)
    assert abs(fit.b - 0.5) < 1e-9 and abs(fit.a - 3e-4) < 1e-12 and fit.t_first == 16
    assert abs(fit.predict(32768) - 3e-4 * 32768**0.5) < 1e-9
    assert np.isnan(fit_power_law(steps, np.zeros(1024), 1).b)


def test_output_error_on_file_out(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        write_atomically(f, True, lambda tmp: None)


def test_a_replay_buffer_longer_than_the_run_is_refused_before_the_work(tmp_path):
    """replay(L) with L > --steps never rewrites its checkpoint: its error would read 0 (issue 27)."""
    res = CliRunner().invoke(main, ["analyze", "--model", "nemotron-3-nano", "--synthetic", "--steps", "8", "--batch",
                                    "1", "--layers", "0", "--buffer-len", "16", "--out", str(tmp_path / "o")])  # fmt: skip
    assert res.exit_code == 1 and not (tmp_path / "o").exists()
    assert "replay16 never rewrites its checkpoint within --steps 8" in res.output and "Traceback" not in res.output


def test_an_engine_that_cannot_run_a_variant_is_refused_before_the_work(tmp_path):
    """A format named with --formats that the engine cannot store (without --formats, such defaults are left out)."""
    res = CliRunner().invoke(main, ["analyze", "--model", "nemotron-3-nano", "--synthetic", "--steps", "16", "--batch",
                                    "1", "--layers", "0", "--engine", "vllm", "--formats", "fp8_e4m3",
                                    "--out", str(tmp_path / "o")])  # fmt: skip
    assert res.exit_code == 1 and "{value}" not in res.output and "invalid choice: 'fp8_e4m3'" in res.output


# -- the budget verdict (issue 27) ----------------------------------------------------------------------------------


def _verdict_rows(budget, series, ends, starts, first_write=1, variant="fp8_e4m3@replay16", horizon=None):
    """Summary rows of the budget verdict for constructed per-layer window maxima {layer: [R]}."""
    from ssmquant.analysis.run import budget_columns

    rows = []
    for layer, maxima in series.items():
        cols = budget_columns(np.asarray(maxima, dtype=float), starts, ends, first_write, budget)
        rows.append({"layer": layer, "variant": variant, "horizon": int(horizon or ends[-1]), **cols})
    return pd.DataFrame(rows)


def test_budget_verdict_from_constructed_window_maxima():
    """Per layer: the worst step of every window against the budget, over the run and up to 32K / 128K (measured
    worst step and the power-law forecast of the window maxima); a broken-down layer is 'diverged', not 'over'."""
    from ssmquant.analysis.run import verdicts

    ends = np.arange(16, 4097, 16)
    starts = ends - 15
    rng = np.random.default_rng(0)
    series = {
        0: 1e-4 * ends**0.25,  # 8e-4 at 4096 -> 1.3e-3 at 32K, 1.9e-3 at 128K: under throughout
        2: 1e-3 * ends**0.5,  # 0.064 at 4096: over within the run
        4: 1e-4 * ends**0.47,  # 5.0e-3 at 4096, 0.013 at 32K, 0.025 at 128K: over only at 128K
        6: np.where(ends > 2000, np.nan, 1e-3),  # NaN within the run: diverged
        8: np.where(ends > 2000, 5.0, 1e-3),  # an error 5x the signal: diverged, not over
        10: 2e-3 * np.exp(rng.normal(0, 0.5, len(ends))),  # flat noise: no power law (r2 < 0.5) -> unknown
    }
    # the mean of window maxima can sit under the budget while one window's worst step is over it: the peak decides
    spike = np.full(len(ends), 1e-3)
    spike[100] = 0.03
    series[12] = spike
    df = _verdict_rows(0.02, series, ends, starts).set_index("layer")
    assert (
        df.loc[0, "verdict_horizon"] == "under" and df.loc[0, ["verdict_32k", "verdict_128k"]].tolist() == ["under"] * 2
    )
    assert df.loc[2, ["verdict_horizon", "verdict_32k", "verdict_128k"]].tolist() == ["over"] * 3
    assert df.loc[4, ["verdict_horizon", "verdict_32k", "verdict_128k"]].tolist() == ["under", "under", "over"]
    assert df.loc[4, "forecast_out_max_128k"] == pytest.approx(1e-4 * 131072**0.47, rel=1e-6)
    for layer in (6, 8):
        assert df.loc[layer, ["verdict_horizon", "verdict_32k", "verdict_128k"]].tolist() == ["diverged"] * 3
    assert df.loc[10, "fit_r2_out_max"] < 0.5 and df.loc[10, "verdict_horizon"] == "under"
    assert df.loc[10, ["verdict_32k", "verdict_128k"]].tolist() == ["unknown"] * 2
    assert df.loc[12, "out_rel_err_peak"] == 0.03 and df.loc[12, "out_rel_err_peak_step"] == ends[100]
    assert df.loc[12, "verdict_horizon"] == "over"
    (v,) = verdicts(df.reset_index())
    assert v["horizon"] == {"answer": "no", "layers_over": [2, 12], "layers_diverged": [6, 8], "layers_unknown": []}
    assert v["128k"]["layers_over"] == [2, 4, 12] and v["32k"]["layers_unknown"] == [10]
    assert v["text"].startswith("fp8_e4m3@replay16: layers 2, 12 over 0.02 within 4096 steps (worst 6.40e-02, layer 2)")
    assert "layers 6, 8 diverged within 4096 steps" in v["text"]
    assert "; 128K: layers 2, 4, 12 over, layers 6, 8 diverged, layer 10 unknown (fit r2 < 0.5)" in v["text"]
    # every layer under: the short form; a run that reaches 32K measures it instead of forecasting it
    ok = _verdict_rows(0.02, {0: series[0], 4: series[4]}, ends, starts)
    assert verdicts(ok)[0]["text"] == (
        "fp8_e4m3@replay16: every layer under 0.02 to 4096 steps; 32K: yes; 128K: layer 4 over"
    )
    long_ends = np.arange(1024, 40961, 1024)
    measured = _verdict_rows(0.02, {0: np.where(long_ends > 32768, 0.05, 1e-3)}, long_ends, long_ends - 1023)
    assert measured.loc[0, "forecast_out_max_32k_status"] == "measured"
    assert measured.loc[0, ["verdict_horizon", "verdict_32k"]].tolist() == ["over", "under"]


def test_verdict_labels_follow_one_order():
    """'diverged' is a measurement: a reliable forecast reaching 1 is 'over' (the best variant read 'diverged' while
    worse ones read 'over'); a fit too noisy to forecast is 'unknown' even where it would cross 1 (a 16-step run with
    r2 0.23 read 'diverged'); a run with no fit says so, not 'fit r2 < 0.5'."""
    from ssmquant.analysis.run import verdicts

    ends = np.arange(16, 4097, 16)
    starts = ends - 15
    series = {0: 1e-5 * ends**1.2, 2: 1e-4 * ends**0.4}  # 0.2 at 4096 (under 0.5) -> >= 1 at 32K; 2.8e-3 at 4096
    df = _verdict_rows(0.5, series, ends, starts).set_index("layer")
    assert df.loc[0, "forecast_out_max_32k_status"] == ">=1"
    assert df.loc[0, ["verdict_horizon", "verdict_32k", "verdict_128k"]].tolist() == ["under", "over", "over"]
    (v,) = verdicts(df.reset_index())
    assert "32K: layer 0 over" in v["text"] and "diverged" not in v["text"]
    short_ends = np.array([8, 16])
    short = _verdict_rows(0.02, {0: np.array([1e-3, 2e-3])}, short_ends, short_ends - 7).set_index("layer")
    assert short.loc[0, "forecast_out_max_32k_status"] == "no fit"
    assert short.loc[0, ["verdict_horizon", "verdict_32k"]].tolist() == ["under", "unknown"]
    (v,) = verdicts(short.reset_index())
    assert "32K: layer 0 unknown (no fit)" in v["text"] and "r2" not in v["text"]


def test_budget_verdict_of_a_run_in_summary_report_and_terminal(tmp_path):
    """analyze --budget: summary.csv's verdict columns come from the run's window maxima (the worst step of every
    window, not one sampled step), report.json records the budget and the verdict, the terminal prints it."""
    from ssmquant.report.tables import summary_table

    out = tmp_path / "v"
    argv = [
        "analyze",
        "--model",
        "nemotron-3-nano",
        "--synthetic",
        "--layers",
        "0",
        "--steps",
        "8",
        "--batch",
        "1",
        "--formats",
        "bf16,fp8_e4m3",
        "--schemes",
        "conventional",
        "--budget",
        "1e-3",
        "--no-plots",
        "-q",
        "--out",
        str(out),
    ]  # fmt: skip  (-q: no time estimate, which runs a measurement)
    res = run(argv)
    assert res.exit_code == 0, res.output
    traces, _, summary, report = load_analysis(out)
    assert report["settings"]["budget"] == 1e-3 and report["budget"]["value"] == 1e-3
    assert "worst step" in report["budget"]["note"]
    peaks = traces.groupby(["layer", "variant"])["out_rel_err_max"].max()
    s = summary.set_index(["layer", "variant"])
    assert np.allclose(s["out_rel_err_peak"], peaks.loc[s.index])
    assert (s["out_rel_err_peak"] >= s["out_rel_err_max"]).all() and (s["budget"] == 1e-3).all()
    expect = np.where(s["out_rel_err_peak"] <= 1e-3, "under", "over")
    assert s["verdict_horizon"].tolist() == expect.tolist()
    # bf16 stays far under 1e-3 and fp8 conventional far over it on these inputs: both answers are exercised
    assert s.loc[(0, "bf16@conventional"), "verdict_horizon"] == "under"
    assert s.loc[(0, "fp8_e4m3@conventional"), "verdict_horizon"] == "over"
    assert {"verdict_32k", "verdict_128k", "forecast_out_max_32k_status"} <= set(summary.columns)
    assert [v["variant"] for v in report["verdict"]] == list(dict.fromkeys(summary.variant))
    printed = summary_table(summary)  # what the command prints after the run (without -q)
    for v in report["verdict"]:
        assert v["text"] in printed
    assert "  fp8_e4m3@conventional: layer 0 over 0.001 within 8 steps" in printed
    assert "  bf16@conventional: every layer under 0.001 to 8 steps" in printed


@pytest.mark.parametrize("budget", ["0", "-0.1", "1", "nan"])
def test_a_budget_outside_0_1_is_refused(budget, tmp_path):
    res = CliRunner().invoke(main, ["analyze", *SYNTH, "--budget", budget, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "Invalid value for '--budget'" in res.output and "0<x<1" in res.output
    assert not (tmp_path / "o").exists()


def test_the_cli_default_budget_is_the_library_default():
    from ssmquant.analysis.fit import DEFAULT_BUDGET

    option = next(p for p in main.commands["analyze"].params if p.name == "budget")
    assert option.default == DEFAULT_BUDGET == AnalyzeConfig().budget


def test_the_cpu_emulation_and_its_time_probe_run_on_one_thread(monkeypatch):
    """analyze's CPU emulation ran on torch's default thread pool beside the capture thread's own pool: with more
    OpenMP threads than cores, libgomp stops spinning between the many small ops of a step and the first layers
    ran 4-5x slower than the probe that estimates them (issue 42 case 12). It now runs on one thread, as calibrate's
    and eval's do, and the probe measures it so."""
    import ssmquant.analysis.run as run_mod
    import ssmquant.analysis.sources as sources_mod

    seen = []
    start, probe = run_mod.start_simulation, sources_mod.probe_step_seconds
    monkeypatch.setattr(
        run_mod, "start_simulation", lambda *a, **k: (seen.append(torch.get_num_threads()), start(*a, **k))[1]
    )
    monkeypatch.setattr(
        sources_mod, "probe_step_seconds", lambda *a, **k: (seen.append(torch.get_num_threads()), probe(*a, **k))[1]
    )
    before = torch.get_num_threads()
    analyze(AnalyzeConfig(model="tiny-nemotron", steps=32, batch=1, layers=[0, 2], formats=["int8"]),
            notify=lambda line: None)  # fmt: skip
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before


def test_fp8_e5m2_and_plain_casts_run_through_analyze_and_calibrate(tmp_path):
    """fp8_e5m2 and the unscaled fp8 casts (issue 43) run through analyze, calibrate and the formats table from their
    specs alone; no engine's facts cover them, so the verdict says no engine runs them."""
    from ssmquant.report.tables import formats_frame

    names = ["fp8_e5m2", "fp8_e4m3_cast", "fp8_e5m2_cast"]
    frame = formats_frame((64, 64, 128), names).set_index("format")
    assert frame.loc["fp8_e5m2", "scales"] == "FP32 per row, amax/57344"
    assert frame.loc["fp8_e4m3_cast", "scales"] == "none (saturating cast)"
    r = analyze(AnalyzeConfig(model="tiny-qwen", steps=32, batch=1, layers=[0], formats=names, schemes=["conventional"]))
    assert set(r.summary.variant) == {f"{n}@conventional" for n in names}
    assert (r.summary.out_rel_err > 0).all() and (r.summary.out_rel_err < 0.5).all()
    assert r.summary.engines.str.startswith("engines: none").all()
    out = tmp_path / "recipe"
    res = CliRunner().invoke(main, ["calibrate", "--model", "tiny-qwen", "--horizon", "32", "--batch", "1",
                                    "--heldout-batch", "1", "--layers", "0", "--budget", "0.5", "--candidates",
                                    ",".join(names), "--schemes", "conventional", "--choose-among", "research",
                                    "--device", "cpu", "-q", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    cands = pd.read_csv(out / "candidates.csv")
    assert {"fp8_e5m2", "fp8_e5m2:static", "fp8_e4m3_cast", "fp8_e5m2_cast"} <= set(cands["format"])


def test_a_prompt_store_measures_each_float_format_after_a_prefix_cache_hit():
    """--prompt-store int8col: each float variant again, its start the prompt's state restored from SGLang's int8
    prefix cache (formats.prompt_store); only SGLang runs it; the memory table counts the cached copy; refused
    without a prompt or without a float format."""
    kw = dict(steps=8, batch=1, device="cpu", schemes=["conventional"], layers=[0], prompt=16)
    r = analyze(AnalyzeConfig(model="tiny-qwen", formats=["bf16"], prompt_stores=["int8col"], **kw))
    s = r.summary.set_index("variant")
    assert list(s.index) == ["bf16@conventional", "bf16@conventional+int8col"]
    first = r.traces[r.traces["step"] == r.traces["step"].min()].set_index("variant")["state_rel_err"]
    assert first["bf16@conventional+int8col"] > first["bf16@conventional"] > 0
    assert "SGLang" in s.loc["bf16@conventional+int8col", "engines"] and "vLLM" not in s.loc["bf16@conventional+int8col", "engines"]
    cached = r.memory.set_index("format").loc["int8col (prompt cache, bf16 scales)", "bytes_per_sequence"]
    assert cached < r.memory.set_index("format").loc["bf16", "bytes_per_sequence"]
    with pytest.raises(AnalyzeError, match="give the prompt's length with --prompt N"):
        analyze(AnalyzeConfig(model="tiny-qwen", formats=["bf16"], prompt_stores=["int8col"], **{**kw, "prompt": 0}))
    with pytest.raises(AnalyzeError, match="add one of fp32, bf16, fp16 to --formats"):
        analyze(AnalyzeConfig(model="tiny-qwen", formats=["int8"], prompt_stores=["int8col"], **kw))
    with pytest.raises(AnalyzeError, match="unknown prompt store 'int4'"):
        analyze(AnalyzeConfig(model="tiny-qwen", formats=["bf16"], prompt_stores=["int4"], **kw))


def test_memory_table_counts_what_each_engine_reserves_per_sequence():
    """engines.state_copies in memory.csv: vLLM keeps 2 + 1 state pages per sequence for a Mamba-2 layer with prefix
    caching on (its default for hybrids), the others one state; a format an engine does not store is empty."""
    r = analyze(AnalyzeConfig(model="tiny-nemotron", steps=4, batch=1, layers=[0], schemes=["conventional"],
                              formats=["int8"], device="cpu"))  # fmt: skip
    m = r.memory.set_index("format")
    assert m.loc["bf16", "vllm_state_copies"] == 3
    assert m.loc["bf16", "vllm_bytes_per_sequence"] == 3 * m.loc["bf16", "bytes_per_sequence"]
    assert m.loc["bf16", "sglang_bytes_per_sequence"] == m.loc["bf16", "bytes_per_sequence"]
    assert pd.isna(m.loc["int8", "vllm_bytes_per_sequence"]) and pd.isna(m.loc["int8", "sglang_state_copies"])
    assert "prefix caching on" in r.report()["memory_note"]
