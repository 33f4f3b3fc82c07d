"""The transformers releases ssmquant is tested with, and what a run says outside them.

``TESTED_TRANSFORMERS`` is the range pyproject.toml declares (tests/models/test_compat.py keeps the two equal): its
floor is what the floors job installs, its ceiling the newest release the ceilings job found passing. Capture reads
the mixers through their public submodules and verifies every layer it hands on (``capture``), so an untested
release is a warning while capture verifies, and an ``Error:`` naming the layer and the version where it does not.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import Version

TESTED_TRANSFORMERS = SpecifierSet(">=5.24.0,<5.26")


class UntestedVersionWarning(UserWarning):
    """A dependency outside the range ssmquant was tested with; the message names both and what to do."""


def transformers_version() -> str:
    """The installed transformers release ("5.25.0"), or "not installed"."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def tested_range() -> str:
    """The tested range for messages: "5.24.0 <= transformers < 5.26"."""
    lo = next(s.version for s in TESTED_TRANSFORMERS if s.operator == ">=")
    hi = next(s.version for s in TESTED_TRANSFORMERS if s.operator == "<")
    return f"{lo} <= transformers < {hi}"


def is_tested(version: str) -> bool:
    """Whether ``version`` lies in ``TESTED_TRANSFORMERS`` (a dev or pre-release of a tested one counts as untested)."""
    try:
        return TESTED_TRANSFORMERS.contains(Version(version), prereleases=True) and not Version(version).is_prerelease
    except ValueError:
        return False


def untested_transformers_note(version: str | None = None) -> str | None:
    """One line saying that the installed transformers is outside the tested range and what to do, or None."""
    version = version or transformers_version()
    if is_tested(version):
        return None
    return (
        f"transformers {version} is outside the range ssmquant is tested with ({tested_range()}); every captured "
        f"layer is verified against the layer's own output, so results stand where capture passes; to use a tested "
        f"release: pip install 'transformers{TESTED_TRANSFORMERS}'"
    )


_WARNED: set[str] = set()


def warn_if_untested_transformers() -> None:
    """Emit ``UntestedVersionWarning`` once per process when the installed transformers is untested."""
    note = untested_transformers_note()
    if note is not None and note not in _WARNED:
        _WARNED.add(note)
        warnings.warn(note, UntestedVersionWarning, stacklevel=3)


__all__ = [
    "TESTED_TRANSFORMERS",
    "UntestedVersionWarning",
    "is_tested",
    "tested_range",
    "transformers_version",
    "untested_transformers_note",
    "warn_if_untested_transformers",
]
