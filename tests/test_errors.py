"""One base error: every exception class the package defines for its user derives from SsmquantError, so the CLI
catches them once (and a caller of the library can too)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import ssmquant
from ssmquant.errors import SsmquantError


def _package_exceptions() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(ssmquant.__path__, "ssmquant."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name
                and not issubclass(obj, Warning) and not name.startswith("_")
            ):  # fmt: skip
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_public_error_derives_from_the_base():
    errors = _package_exceptions()
    assert len(errors) >= 25, sorted(errors)
    assert not [n for n, cls in errors.items() if not issubclass(cls, SsmquantError)]


def test_the_cli_catches_the_base_once(tmp_path):
    from click.testing import CliRunner

    from ssmquant.cli import main

    res = CliRunner().invoke(main, ["plot", str(tmp_path)])  # an existing directory, not an analysis: OutputError
    assert res.exit_code == 1 and res.output.startswith("Error: ") and len(res.output.strip().splitlines()) == 1
    source = (inspect.getsource(importlib.import_module("ssmquant.cli")))
    assert source.count("except SsmquantError") == 1 and "_errors()" not in source
