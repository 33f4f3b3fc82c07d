"""Writing an analysis to a directory and reading it back.

Files: traces.parquet (or .csv without pyarrow), heads.parquet (or .csv), summary.csv, memory.csv, report.json and
the plots, written through `outdir.write_atomically` (a temporary sibling directory renamed into place only when
complete, so an interrupted run never leaves a half-written DIR).
"""

from __future__ import annotations

import json
import pathlib
import time

import pandas as pd

from .outdir import OutputError, write_atomically
from .rendering import can_fork, fork_plots, ready_plots


def has_parquet() -> bool:
    try:
        import pyarrow  # noqa: F401

        return True
    except ImportError:
        return False


def write_table(df: pd.DataFrame, directory: pathlib.Path, stem: str) -> str:
    if has_parquet():
        name = f"{stem}.parquet"
        df.to_parquet(directory / name, index=False)
    else:
        name = f"{stem}.csv"
        df.to_csv(directory / name, index=False)
    return name


def read_table(directory: pathlib.Path, stem: str, columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """``stem``.parquet (or .csv) of ``directory``; a file that cannot be read or lacks ``columns`` is an
    OutputError naming it."""
    for name, reader in ((f"{stem}.parquet", pd.read_parquet), (f"{stem}.csv", pd.read_csv)):
        if (directory / name).is_file():
            return _read(directory / name, reader, columns)
    raise OutputError(f"{directory} has no {stem}.parquet or {stem}.csv; is it an `ssmquant analyze` output?")


def _read(path: pathlib.Path, reader, columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """``reader(path)``, with a file that cannot be read (truncated, not a table: pyarrow's and pandas' errors
    have no common base) or that lacks ``columns`` refused as an OutputError naming it."""
    try:
        df = reader(path)
    except Exception as err:  # noqa: BLE001 - pyarrow.ArrowInvalid, OSError, pandas' ParserError, ...
        raise OutputError(
            f"{path} cannot be read ({type(err).__name__}: {err}); it is damaged: run the command that wrote it again"
        ) from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise OutputError(
            f"{path} lacks the columns {missing}; it is damaged or not ssmquant's: run the command that wrote it again"
        )
    return df


def write_analysis(result, out_dir, *, force: bool = False, plots: bool = True) -> pathlib.Path:
    """Write an AnalysisResult to out_dir (atomically); returns the directory."""

    def fill(tmp: pathlib.Path):
        t0 = time.perf_counter()
        report = result.report()
        # forked children render while this process writes the tables
        waiting = None
        if plots and can_fork():
            waiting = fork_plots(result.traces, result.heads, result.summary, report, tmp)
        try:
            files = [
                write_table(result.traces, tmp, "traces"),
                write_table(result.heads, tmp, "heads"),
            ]
            result.summary.to_csv(tmp / "summary.csv", index=False)
            result.memory.to_csv(tmp / "memory.csv", index=False)
        except BaseException:
            if waiting is not None:
                waiting(render=False)  # no forked child outlives the run
            raise
        files += ["summary.csv", "memory.csv"]
        t_tables = time.perf_counter()
        if waiting is not None:
            files += waiting()
        elif plots:
            # matplotlib and seaborn are imported only when plotting (or by prefetch_plotting, meanwhile)
            files += ready_plots().render_all(result.traces, result.heads, result.summary, report, tmp)
        # the time of this write, beside analyze()'s stages (report.json itself is not counted); with
        # forked children plots_s is the last plot and the wait for them after the tables are written
        report["stages"] = {
            **report.get("stages", {}),
            "write_tables_s": round(t_tables - t0, 3),
            "plots_s": round(time.perf_counter() - t_tables, 3) if plots else None,
        }
        report["files"] = files + ["report.json"]
        (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    return write_atomically(out_dir, force, fill)


def load_analysis(out_dir) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict]:
    """(traces, heads, summary, report) of an analysis directory."""
    d = pathlib.Path(out_dir)
    if not d.is_dir():
        raise OutputError(f"{d} is not a directory")
    if not (d / "report.json").is_file():
        raise OutputError(f"{d} has no report.json; is it an `ssmquant analyze` output?")
    report = _read(d / "report.json", lambda p: json.loads(p.read_text()))
    if not isinstance(report, dict):
        raise OutputError(
            f"{d / 'report.json'} is not a JSON object; it is damaged: run the command that wrote it again"
        )
    if not (d / "summary.csv").is_file():
        raise OutputError(f"{d} has no summary.csv; is it an `ssmquant analyze` output?")
    summary = _read(d / "summary.csv", pd.read_csv, ("layer", "variant", "out_rel_err", "horizon"))
    traces = read_table(d, "traces", ("layer", "variant", "step", "out_rel_err", "state_rel_err"))
    return traces, read_table(d, "heads", ("layer", "variant", "step", "head", "out_rel_err")), summary, report


def replot(out_dir) -> list[str]:
    """Re-render the plots of an analysis directory from its saved tables (`ssmquant plot DIR`)."""
    traces, heads, summary, report = load_analysis(out_dir)
    return ready_plots().render_all(traces, heads, summary, report, out_dir)
