"""`ssmquant eval` end to end: parse, run, write, print; and its usage errors."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ssmquant.cli import main


def test_eval_command_writes_its_files(nemotron_byte_dir, tmp_path):
    out = tmp_path / "e2e"
    args = ["eval", "--model", str(nemotron_byte_dir), "--variants", "fp32@conventional,nvfp4@replay,int8:sr"]
    args += ["--buffer-len", "4", "--steps", "12", "--batch", "2", "--device", "cpu", "--seed", "1", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "nvfp4@replay4" in res.output and "bits/byte" in res.output and "wrote" in res.output
    files = {p.name for p in out.iterdir()}
    assert {"summary.csv", "eval.json", "kl.png"} <= files
    report = json.loads((out / "eval.json").read_text())
    assert report["settings"]["variants"] == ["fp32@conventional", "nvfp4@replay4", "int8:sr@conventional#seed1"]
    assert report["summary"][0]["kl_mean"] == 0.0 and report["summary"][1]["kl_mean"] > 0

    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "not empty" in again.output and "--force" in again.output


def test_eval_grid_options_and_errors(nemotron_byte_dir, tmp_path):
    base = ["eval", "--model", str(nemotron_byte_dir), "--steps", "8", "--batch", "1", "--device", "cpu", "-q"]
    res = CliRunner().invoke(
        main,
        base
        + ["--formats", "int8", "--schemes", "conventional,replay", "--buffer-len", "4", "--out", str(tmp_path / "a")],
    )
    assert res.exit_code == 0, res.output
    summary = (tmp_path / "a" / "summary.csv").read_text()
    assert "int8@conventional" in summary and "int8@replay4" in summary

    both = CliRunner().invoke(main, base + ["--variants", "int8", "--formats", "nvfp4", "--out", str(tmp_path / "b")])
    assert both.exit_code == 2 and "either --variants or --formats" in both.output
    bad = CliRunner().invoke(main, base + ["--variants", "int9@conventional", "--out", str(tmp_path / "c")])
    assert bad.exit_code == 1 and "unknown format 'int9'" in bad.output
    long = CliRunner().invoke(main, base + ["--variants", "int8", "--steps", "1000000", "--out", str(tmp_path / "d")])
    assert long.exit_code == 1 and "held-out" in long.output
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_eval_text_split_option(nemotron_byte_dir, tmp_path):
    """--text-split all reads the whole text (recorded in eval.json); an unknown split is a usage error naming the
    accepted ones."""
    text = tmp_path / "short.txt"
    text.write_text("abcdefghij" * 30)  # 300 bytes: 60 held out, too few for 3 sequences of 21 tokens; the whole holds 14
    base = ["eval", "--model", str(nemotron_byte_dir), "--variants", "int8", "--steps", "20", "--batch", "3"]
    base += ["--device", "cpu", "--text", str(text), "-q", "--no-plots"]
    held = CliRunner().invoke(main, base + ["--out", str(tmp_path / "a")])
    assert held.exit_code != 0 and "--text-split all" in held.output
    whole = CliRunner().invoke(main, base + ["--text-split", "all", "--out", str(tmp_path / "b")])
    assert whole.exit_code == 0, whole.output
    report = json.loads((tmp_path / "b" / "eval.json").read_text())
    assert report["data_source"]["text"]["split"] == "all" and report["settings"]["text_split"] == "all"
    bad = CliRunner().invoke(main, base + ["--text-split", "train", "--out", str(tmp_path / "c")])
    assert bad.exit_code == 2 and "'heldout', 'all'" in bad.output
