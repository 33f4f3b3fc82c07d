"""The tested transformers range at run time: an untested release is one `Warning:` line while capture verifies, a
capture that does not reproduce its layer one `Error:` line naming the layer and the version."""

from __future__ import annotations

import dataclasses

import pytest

from ssmquant.models import compat

TINY = ["--model", "tiny-nemotron", "--layers", "0", "--formats", "int8", "--schemes", "conventional", "--device",
        "cpu", "--steps", "8", "--batch", "1"]  # fmt: skip


@pytest.mark.parametrize(
    "version,tested",
    [("5.24.0", True), ("5.25.0", True), ("5.25.3", True), ("5.23.0", False), ("5.26.0", False),
     ("5.25.0.dev0", False), ("6.0.0", False), ("not installed", False)],
)  # fmt: skip
def test_tested_range(version, tested):
    assert compat.is_tested(version) is tested
    note = compat.untested_transformers_note(version)
    if tested:
        assert note is None
    else:
        assert f"transformers {version} is outside the range ssmquant is tested with" in note
        assert "5.24.0 <= transformers < 5.26" in note and "pip install 'transformers<5.26,>=5.24.0'" in note


def test_the_installed_transformers_is_a_tested_one():
    """CI installs the floor and the ceiling: both inside the range, so no run there warns."""
    assert compat.is_tested(compat.transformers_version()), compat.transformers_version()


def _run(code: str, args: list[str], tmp_path):
    """The CLI with ``code`` run first in its process (``tests.test_cli.run_cli``)."""
    from tests.test_cli import run_cli

    prog = f"import sys\n{code}\nfrom ssmquant.cli import main\nsys.argv = ['ssmquant', *sys.argv[1:]]\nmain()\n"
    return run_cli(args, cwd=tmp_path, prefix=["-c", prog])


@pytest.mark.slow
def test_an_untested_transformers_is_one_warning_line_and_the_run_goes_on(tmp_path):
    fake = "import ssmquant.models.compat as c\nc.transformers_version = lambda: '9.9.0'"
    res = _run(fake, ["analyze", *TINY, "--out", str(tmp_path / "a")], tmp_path)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "9.9.0" in ln]
    assert len(lines) == 1 and lines[0].startswith("Warning: transformers 9.9.0 is outside the range"), res.stderr
    assert "UntestedVersionWarning" not in res.stderr and (tmp_path / "a").is_dir()


PERTURB = """
import dataclasses
from ssmquant.models import taps
def _wrong(tap):
    def derive(mixer, recorded):
        raw = tap.derive(mixer, recorded)
        return dict(raw, dt=raw["dt"] * 1.05)
    return dataclasses.replace(tap, derive=derive)
taps.TAPS = tuple(_wrong(t) if t.family == "nemotron_h" else t for t in taps.TAPS)
"""


@pytest.mark.slow
def test_a_capture_that_fails_verification_is_one_error_line(tmp_path):
    import transformers

    res = _run(PERTURB, ["analyze", *TINY, "--out", str(tmp_path / "a")], tmp_path)
    assert res.returncode == 1, res.stderr
    errors = [ln for ln in (res.stdout + res.stderr).splitlines() if "Error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("Error: layer 0 (NemotronHMamba2Mixer): "), res.stderr
    assert f"transformers {transformers.__version__}" in errors[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "a").exists()


def test_one_tap_per_family():
    from ssmquant.models import taps

    families = [t.family for t in taps.TAPS]
    assert families == sorted(set(families), key=families.index)  # one tap per family
    assert all(dataclasses.is_dataclass(t) for t in taps.TAPS)
