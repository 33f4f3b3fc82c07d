"""The version ranges pyproject.toml declares, and the CI jobs at their two ends.

Floors: .ci/floors.sh installs exactly the lower bounds pyproject.toml declares, so every floor is a version the suite
has passed with; in that job, the installed versions are those floors. Ceilings: every package whose internals the
code touches (torch, Triton, transformers, nvidia-modelopt) declares an upper bound, and .ci/ceilings.sh installs the
newest release each range admits before the main test run, so the suite runs at the ceilings."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
# pyproject's torch floor is the GPU machine's; the CPU job installs the lowest CPU build reachable (floors.txt)
CPU_BUILD_ABOVE_FLOOR = {"torch"}
# the packages whose internals the code touches: each must have a ceiling, tested by .ci/ceilings.sh
CEILINGED = {"torch", "triton", "transformers", "nvidia-modelopt"}


def _name(name: str) -> str:
    return name.lower().replace("_", "-")


def _floors() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[_name(name)] = version
    return pins


def _requirements() -> dict[str, Requirement]:
    """The dependencies, and the dev extra's packages the library's code runs (triton: the kernels in the CPU
    tests; the test tools themselves are neither floors nor ceilings)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {_name(r.name): r for r in map(Requirement, project["dependencies"])}
    reqs["triton"] = next(r for r in map(Requirement, project["optional-dependencies"]["dev"]) if r.name == "triton")
    return reqs


def _bound(req: Requirement, op: str) -> str | None:
    return next((s.version for s in req.specifier if s.operator == op), None)


def test_every_floor_is_installed_by_the_floors_job():
    floors, reqs = _floors(), _requirements()
    bounds = {name: _bound(r, ">=") for name, r in reqs.items()}
    assert all(bounds.values()), [n for n, b in bounds.items() if not b]
    assert set(bounds) == set(floors), set(bounds) ^ set(floors)
    for name, bound in bounds.items():
        if name in CPU_BUILD_ABOVE_FLOOR:
            continue
        assert floors[name] == bound or floors[name].startswith(bound + "."), (name, bound, floors[name])


def test_the_packages_whose_internals_the_code_touches_have_ceilings():
    reqs = _requirements()
    for name in CEILINGED:
        ceiling = _bound(reqs[name], "<")
        assert ceiling is not None, f"{name} has no upper bound"
        assert Version(_bound(reqs[name], ">=")) < Version(ceiling), name
    others = {n for n, r in reqs.items() if _bound(r, "<")} - CEILINGED
    assert not others, f"ceilings on packages .ci/ceilings.sh does not test: {others}"


def test_the_gpu_extra_admits_the_same_triton_as_the_dev_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    spec = {str(Requirement(r).specifier) for key in ("dev", "gpu") for r in extras[key] if r.startswith("triton")}
    assert len(spec) == 1, spec


def test_the_library_names_the_transformers_range_pyproject_declares():
    from ssmquant.models.compat import TESTED_TRANSFORMERS

    assert _requirements()["transformers"].specifier == TESTED_TRANSFORMERS


def test_ceilings_script_picks_the_newest_admitted_release():
    """The selection .ci/ceilings.sh makes from an index's version list: the newest release the range admits,
    pre-releases and local builds of a newer release left out."""
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "ceilings.py"), "--pick", ">=5.24.0,<5.26",
         "5.26.0", "5.25.1rc1", "5.25.0", "5.24.0", "5.23.0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "5.25.0"
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "ceilings.py"), "--pick", ">=2.11,<2.14", "2.15.0", "2.14.1", "2.13.0+cpu",
         "2.13.0", "2.12.1"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "2.13.0+cpu"


@pytest.mark.skipif(
    os.environ.get("VIRTUAL_ENV", "").rsplit("/", 1)[-1] != ".venv-floors", reason="the floors job only"
)
def test_the_floors_job_runs_the_floors():
    for name, version in _floors().items():
        assert importlib.metadata.version(name).split("+")[0] == version, name
