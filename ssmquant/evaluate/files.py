"""Writing an evaluation to a directory (atomically, as `analyze` does) and reading it back.

Files: positions.parquet (or .csv without pyarrow; the long per-position table), summary.csv (one row
per variant), sequences.csv (one row per variant and sequence), eval.json (model, data source, versions, settings, reference loss, summary) and kl.png.
"""

from __future__ import annotations

import json
import pathlib

import pandas as pd

from ..report.files import read_table, write_table
from ..report.outdir import OutputError, write_atomically
from .plots import render_all

REPORT_NAME = "eval.json"


def write_eval(result, out_dir, force: bool = False, *, plots: bool = True) -> pathlib.Path:
    """Write an EvalResult to ``out_dir`` (created atomically; a non-empty one needs ``force``); returns it."""

    def fill(tmp: pathlib.Path):
        files = [write_table(result.positions, tmp, "positions")]
        result.summary.to_csv(tmp / "summary.csv", index=False)
        files.append("summary.csv")
        if result.sequences is not None:
            result.sequences.to_csv(tmp / "sequences.csv", index=False)
            files.append("sequences.csv")
        report = result.report()
        if plots:
            files += render_all(result.positions, result.summary, report, tmp)
        report["files"] = files + [REPORT_NAME]
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2, default=str) + "\n")

    return write_atomically(out_dir, force, fill, "eval")


def load_eval(out_dir) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(positions, summary, report) of an `ssmquant eval` output directory."""
    d = pathlib.Path(out_dir)
    if not (d / REPORT_NAME).is_file():
        raise OutputError(f"{d} has no {REPORT_NAME}; is it an `ssmquant eval` output?")
    report = json.loads((d / REPORT_NAME).read_text())
    return read_table(d, "positions"), pd.read_csv(d / "summary.csv"), report
