"""The ceilings job: bring the current environment to the newest release each ceilinged range of pyproject.toml admits.

For torch, Triton, transformers and nvidia-modelopt (the packages whose internals ssmquant touches, each with an upper
bound in pyproject.toml), ask the package index for its releases (`pip index versions`), pick the newest the declared
range admits (no pre-releases), install it where the environment holds another, and check that it is what is
installed. The README's test command runs this before the test suite, so the suite runs at the ceilings; the floors
job (.ci/floors.sh) runs the other end. `--pick SPEC V...` prints the version the job would pick from V... (tests).
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
CEILINGED = ("torch", "triton", "transformers", "nvidia-modelopt")


def pick(spec: str, versions: list[str]) -> str | None:
    """The newest of ``versions`` that ``spec`` admits, pre-releases left out (a local build such as 2.13.0+cpu
    counts as its release)."""
    admitted = []
    for v in versions:
        try:
            parsed = Version(v)
        except InvalidVersion:
            continue
        if not parsed.is_prerelease and SpecifierSet(spec).contains(parsed):
            admitted.append(parsed)
    return str(max(admitted)) if admitted else None


def declared() -> dict[str, str]:
    """name -> the range pyproject.toml declares for each ceilinged package."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    found = {Requirement(r).name: str(Requirement(r).specifier) for r in reqs}
    return {name: found[name] for name in CEILINGED}


def index_versions(name: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True, check=True
    ).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("Available versions:")), None)
    if line is None:
        raise SystemExit(f"ceilings: the package index lists no versions of {name}:\n{out}")
    return [v.strip() for v in line.split(":", 1)[1].split(",")]


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def same_release(a: str | None, b: str) -> bool:
    return a is not None and Version(a).public == Version(b).public


def main() -> None:
    targets = {}
    for name, spec in declared().items():
        newest = pick(spec, index_versions(name))
        if newest is None:
            raise SystemExit(f"ceilings: no release of {name} satisfies {spec}")
        targets[name] = (spec, newest)
    missing = [f"{n}=={v}" for n, (_, v) in targets.items() if not same_release(installed(n), v)]
    if missing:
        print("ceilings: installing " + " ".join(missing), flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)
    wrong = []
    for name, (spec, newest) in targets.items():
        have = installed(name)
        print(f"ceilings: {name} {have} (newest release of {spec}: {re.sub(r'[+].*', '', newest)})")
        if not same_release(have, newest):
            wrong.append(f"{name} {have} != {newest}")
    if wrong:
        raise SystemExit("ceilings: the environment does not hold the ceilings: " + "; ".join(wrong))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--pick":
        print(pick(sys.argv[2], sys.argv[3:]))
    else:
        main()
