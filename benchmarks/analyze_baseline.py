"""`ssmquant` with the latest start-up change undone, for before/after runs in one call.

    python benchmarks/analyze_baseline.py analyze --model nemotron-3-nano --synthetic ... --out DIR -q

Runs the command line exactly as `python -m ssmquant` does (``cli.entry``) after ``revert()``, which puts back
the behaviour of main at c18ac03: Triton's warm-up thread started after torch's import, not before it. (Until
2026-12-01 the base undid branch nanostart's changes instead: main at 32340f4.) bench_analyze.py's ``base`` runs use it, so
that the previous code path and this one alternate on one machine (start-up alone varied by 1.4 s between
runs of the same code there) and their output files can be compared byte for byte.
"""

from __future__ import annotations

import sys


def revert() -> list[str]:
    """Undo the change in the imported modules; returns what was undone."""
    from ssmquant import cli

    cli._likely_nvidia_gpu = lambda: False  # Triton's warm-up started after torch's import, as at c18ac03
    return ["Triton warm-up started before torch's import"]


if __name__ == "__main__":
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    revert()
    from ssmquant.cli import entry

    sys.argv[0] = "ssmquant"
    entry()
