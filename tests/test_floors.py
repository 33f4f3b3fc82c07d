"""The floors CI job (.ci/floors.sh) installs exactly the lower bounds pyproject.toml declares, so every floor is a
version the suite has passed with; in that job, the installed versions are those floors."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# pyproject's torch floor is the GPU machine's; the CPU job installs the lowest CPU build reachable (floors.txt)
CPU_BUILD_ABOVE_FLOOR = {"torch"}


def _floors() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def _lower_bounds() -> dict[str, str]:
    """The lower bounds of the dependencies and of the dev extra's packages the library's code runs (triton: the
    kernels in the CPU tests; the test tools themselves are not floors)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("dependencies = [") : text.index("]", text.index("dependencies = ["))]
    dev = text[text.index("dev = [") : text.index("]", text.index("dev = ["))]
    bound = r'"([A-Za-z0-9_.-]+)>=([^",]+)"'
    found = {m.group(1).lower().replace("_", "-"): m.group(2) for m in re.finditer(bound, block)}
    found.update({m.group(1): m.group(2) for m in re.finditer(bound, dev) if m.group(1) == "triton"})
    return found


def test_every_floor_is_installed_by_the_floors_job():
    floors, bounds = _floors(), _lower_bounds()
    assert set(bounds) == set(floors), set(bounds) ^ set(floors)
    for name, bound in bounds.items():
        if name in CPU_BUILD_ABOVE_FLOOR:
            continue
        assert floors[name] == bound or floors[name].startswith(bound + "."), (name, bound, floors[name])


@pytest.mark.skipif(os.environ.get("VIRTUAL_ENV", "").rsplit("/", 1)[-1] != ".venv-floors", reason="the floors job only")
def test_the_floors_job_runs_the_floors():
    for name, version in _floors().items():
        assert importlib.metadata.version(name).split("+")[0] == version, name
