"""No file of the user's is removed or changed by a run, whatever the timing (issue 42): a file written into an output
being replaced while the run works, a file of the user's named like the run's lock, a run ended by SIGTERM or SIGHUP
in its write phase (nothing left), and what a SIGKILLed run left (cleaned by the next run into the same DIR, and only
that). Real file systems and real processes with real signals."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import warnings

import pytest

from ssmquant.report.outdir import OutputWarning, lock_path, write_atomically

ROOT = pathlib.Path(__file__).resolve().parents[1]
ANALYZE = ["analyze", "--model", "nemotron-3-nano", "--synthetic", "--steps", "4", "--batch", "1", "--layers", "0",
           "--formats", "int8", "--schemes", "conventional", "--no-plots", "-q", "--device", "cpu"]  # fmt: skip

# Runs the CLI with the write phase held open: after the first table is written, it says "writing" and waits for
# a line on stdin.
SLOW_WRITE = """
import sys
import ssmquant.report.files as files
real = files.write_table
def slow(df, directory, stem):
    name = real(df, directory, stem)
    print("writing", flush=True)
    sys.stdin.readline()
    return name
files.write_table = slow
from ssmquant.cli import main
sys.argv = ["ssmquant", *sys.argv[1:]]
main()
"""


def _default_signals() -> None:
    """The child's SIGINT, SIGTERM and SIGHUP at their default dispositions: a test run under `nohup` (SIGHUP
    ignored, which the child inherits and ssmquant rightly keeps) or a shell that ignores SIGINT in background jobs
    must not change what the child does."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _start(args, cwd, code=SLOW_WRITE) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, preexec_fn=_default_signals,
    )  # fmt: skip


def _wait_for(proc: subprocess.Popen, word: str) -> None:
    line = proc.stdout.readline()
    assert line.strip() == word, line + proc.stderr.read()


def _tree(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_force_keeps_a_file_the_user_writes_into_the_old_output_while_the_run_works(tmp_path):
    out = tmp_path / "old"
    write_atomically(out, False, lambda d: (d / "report.json").write_text("{}"), command="analyze")

    def fill(d):
        (out / "notes.txt").write_text("mine")  # the user, meanwhile
        (out / "more").mkdir()
        (out / "more" / "x.csv").write_text("1")
        (d / "report.json").write_text('{"new": 1}')

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        write_atomically(out, True, fill, command="analyze")
    assert (out / "notes.txt").read_text() == "mine" and (out / "more" / "x.csv").read_text() == "1"
    assert (out / "report.json").read_text() == '{"new": 1}'
    assert [str(w.message) for w in seen if w.category is OutputWarning] == [
        f"--out {out}: kept more/x.csv, notes.txt, written into it while this run worked (not ssmquant's)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_a_user_file_of_an_output_files_name_is_kept_beside_it(tmp_path):
    out = tmp_path / "old"
    write_atomically(out, False, lambda d: (d / "report.json").write_text("{}"), command="analyze")

    def fill(d):
        (out / "summary.csv").write_text("mine")  # a name the new output also writes
        (d / "report.json").write_text("{}")
        (d / "summary.csv").write_text("new")

    with pytest.warns(OutputWarning, match=r"so they are kept in .*old\.kept"):
        write_atomically(out, True, fill, command="analyze")
    assert (out / "summary.csv").read_text() == "new"
    assert (tmp_path / "old.kept" / "summary.csv").read_text() == "mine"


@pytest.mark.slow
def test_force_run_keeps_a_file_written_during_its_write_phase(tmp_path):
    first = subprocess.run([sys.executable, "-m", "ssmquant", *ANALYZE, "--out", "run"], cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)  # fmt: skip
    assert first.returncode == 0, first.stderr
    proc = _start([*ANALYZE, "--out", "run", "--force"], tmp_path)
    _wait_for(proc, "writing")
    (tmp_path / "run" / "mine.txt").write_text("keep me")
    _, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, err
    assert (tmp_path / "run" / "mine.txt").read_text() == "keep me"
    assert "Warning: --out" in err and "mine.txt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_users_file_named_like_the_lock_is_never_touched(tmp_path):
    from click.testing import CliRunner

    from ssmquant.cli import main

    lock = lock_path(tmp_path / "mydata")
    lock.write_text("my notes\n")
    res = CliRunner().invoke(main, [*ANALYZE, "--out", str(tmp_path / "mydata")])
    assert res.exit_code == 1 and "is not ssmquant's" in res.output and str(lock) in res.output, res.output
    assert lock.read_text() == "my notes\n" and not (tmp_path / "mydata").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mydata.lock"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_termination_in_the_write_phase_leaves_nothing(tmp_path, sig):
    (tmp_path / "mine.txt").write_text("keep")
    proc = _start([*ANALYZE, "--out", "run"], tmp_path)
    _wait_for(proc, "writing")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"Terminated ({signal.Signals(sig).name})." in err and "Traceback" not in err
    assert _tree(tmp_path) == {"mine.txt": b"keep"} and sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


@pytest.mark.slow
def test_the_next_run_cleans_what_a_killed_run_left_and_only_that(tmp_path):
    proc = _start([*ANALYZE, "--out", "run"], tmp_path)
    _wait_for(proc, "writing")
    proc.kill()  # SIGKILL: nothing of the run's own can clean up
    proc.wait()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert ".run.lock" in left and any(n.startswith(".run.tmp-") for n in left), left
    (tmp_path / ".run.tmp-mine").mkdir()  # the user's, by an unlucky name: not ssmquant's, stays
    (tmp_path / ".run.tmp-mine" / "a.txt").write_text("a")
    res = subprocess.run([sys.executable, "-m", "ssmquant", *ANALYZE, "--out", "run"], cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.tmp-mine", "run"]
    assert (tmp_path / ".run.tmp-mine" / "a.txt").read_text() == "a"


def test_a_stale_lock_of_an_earlier_version_is_taken_over(tmp_path):
    """Earlier versions wrote a bare pid into the lock file: still ssmquant's, taken over when its run is gone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = lock_path(tmp_path / "run")
    lock.write_text(f"{dead.pid}\n")
    write_atomically(tmp_path / "run", False, lambda d: (d / "report.json").write_text("{}"), command="analyze")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_calibrate_force_replaces_a_recipe_with_the_exports_made_from_it(tmp_path):
    """The README's workflow writes exports into the recipe directory: a later `calibrate --force` refused them as
    files calibrate did not write. They are ssmquant's, made from the recipe being replaced: they go with it; a
    file of the user's among them still stops the run."""
    from ssmquant.report.outdir import OutputError, check_out_dir

    recipe = tmp_path / "recipe"
    write_atomically(recipe, False, lambda d: (d / "ssm_quant_config.json").write_text("{}"), command="calibrate")
    write_atomically(recipe / "export-vllm", False, lambda d: (d / "vllm_serve.sh").write_text("#"), command="export")
    check_out_dir(recipe, True, "calibrate")
    (recipe / "export-vllm" / "mine.txt").write_text("x")
    with pytest.raises(OutputError, match=r"did not write \(export-vllm/mine.txt\)"):
        check_out_dir(recipe, True, "calibrate")
    (recipe / "export-vllm" / "mine.txt").unlink()
    write_atomically(
        recipe, True, lambda d: (d / "ssm_quant_config.json").write_text('{"new": 1}'), command="calibrate"
    )
    assert sorted(p.name for p in recipe.iterdir()) == [".ssmquant-output.json", "ssm_quant_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe"]
