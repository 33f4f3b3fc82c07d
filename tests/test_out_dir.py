"""`--out` and `--force` never delete what the user did not ask to replace (issue 27): the current directory, a
parent of it, the home directory or a filesystem root are refused in every spelling, with or without --force, and
--force replaces only a previous output of the same command that holds nothing else."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
from click.testing import CliRunner

from ssmquant.cli import main
from ssmquant.report.outdir import OUTPUT_MARKER, OutputError, check_out_dir, write_atomically

# the smallest analyze run: one layer of a synthetic preset, one variant, no plots
ANALYZE = ["analyze", "--model", "nemotron-3-nano", "--synthetic", "--steps", "4", "--batch", "1", "--layers", "0",
           "--formats", "int8", "--schemes", "conventional", "--no-plots", "-q", "--device", "cpu"]  # fmt: skip


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A working directory holding the user's own files, made the current directory."""
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "thesis.tex").write_text("years of work")
    (work / "sub" / "data.csv").write_text("1,2")
    monkeypatch.chdir(work / "sub")
    return work


def _untouched(work: pathlib.Path) -> bool:
    return (work / "thesis.tex").read_text() == "years of work" and (work / "sub" / "data.csv").read_text() == "1,2"


@pytest.mark.parametrize("spelling", [".", "./", "", "  ", "..", "../sub", "a/..", "./a/../.", "link", "link/."])
@pytest.mark.parametrize("force", [False, True])
def test_current_directory_and_its_parents_are_never_replaced(user_dir, spelling, force):
    (user_dir / "sub" / "a").mkdir()
    (user_dir / "sub" / "link").symlink_to(user_dir / "sub")
    res = CliRunner().invoke(main, [*ANALYZE, "--out", spelling, *(["--force"] if force else [])])
    assert res.exit_code == 1, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert any(why in lines[0] for why in ("is empty", "current directory", "not empty")), lines[0]
    assert _untouched(user_dir) and (user_dir / "sub" / "a").is_dir()


def test_home_and_root_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)  # the home directory is then neither the current directory nor above it
    with pytest.raises(OutputError, match="home directory"):
        check_out_dir("~", True)
    with pytest.raises(OutputError, match="(filesystem root|contains the current directory)"):
        check_out_dir("/", True)


def test_force_replaces_only_a_previous_output_of_the_same_command(tmp_path):
    out = tmp_path / "o"

    def fill(tmp):
        (tmp / "report.json").write_text(json.dumps({"files": ["report.json", "summary.csv"]}))
        (tmp / "summary.csv").write_text("a\n")

    write_atomically(out, False, fill, "analyze")
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker["command"] == "analyze" and marker["files"] == ["report.json", "summary.csv"]
    write_atomically(out, True, fill, "analyze")  # replaced: a previous analyze output
    with pytest.raises(OutputError, match="not a previous `ssmquant eval` output"):
        check_out_dir(out, True, "eval")
    (out / "notes.md").write_text("mine")
    with pytest.raises(OutputError, match=r"did not write \(notes.md\)"):
        write_atomically(out, True, fill, "analyze")
    assert (out / "notes.md").read_text() == "mine"


def test_an_output_written_before_the_marker_is_recognised_by_its_report(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"files": ["summary.csv", "report.json"]}))
    (out / "summary.csv").write_text("a\n")
    assert check_out_dir(out, True, "analyze") == out
    (out / "extra.txt").write_text("x")
    with pytest.raises(OutputError, match="did not write"):
        check_out_dir(out, True, "analyze")


def test_a_directory_of_other_files_is_refused_even_with_force(tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "a.jpg").write_bytes(b"\xff\xd8")
    res = CliRunner().invoke(main, [*ANALYZE, "--out", str(out), "--force"])
    assert res.exit_code == 1 and "not a previous `ssmquant analyze` output" in res.output
    assert os.listdir(out) == ["a.jpg"]
