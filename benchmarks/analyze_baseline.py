"""`ssmquant` with the start-up and pipeline changes of branch nanostart undone, for before/after runs in one call.

    python benchmarks/analyze_baseline.py analyze --model nemotron-3-nano --synthetic ... --out DIR -q

Runs the command line exactly as `python -m ssmquant` does (``cli.entry``) after ``revert()``, which puts back
the behaviour of main at 32340f4 for each change, one line each. bench_analyze.py's ``base`` runs use it, so
that the previous code path and this one alternate on one machine (start-up alone varied by 1.4 s between
runs of the same code there) and their output files can be compared byte for byte.
"""

from __future__ import annotations

import sys


def revert() -> list[str]:
    """Undo this branch's changes in the imported modules; returns what was undone."""
    from ssmquant import cli
    from ssmquant.replay import naive, reference, simulate

    never = lambda inputs: False  # noqa: E731
    simulate.is_validated = naive.is_validated = reference.is_validated = never  # every consumer validates again
    cli._warm_up_triton = lambda: None  # Triton's installation hash computed by the first launch
    return ["validated inputs not validated again", "Triton warm-up"]


if __name__ == "__main__":
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    revert()
    from ssmquant.cli import entry

    sys.argv[0] = "ssmquant"
    entry()
