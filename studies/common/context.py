"""What a study's `collect` gets: the scale, where its data go, the device, and how each run is stored.

A run's tables are written as `<data>/<study>/data/<table>_<run>.csv` and its provenance as
`<data>/<study>/data/runs/<run>.json`, one file per run, so that runs can be redone one at a time and
the page reads whatever runs are there (`load`).
"""

from __future__ import annotations

import json
import pathlib
import time
from dataclasses import dataclass, field

import pandas as pd

from .measure import RunResult, RunSpec, run
from .tables import CSV_FLOAT

SCALES = ("smoke", "cpu", "gpu")
TABLES = ("sequences", "windows", "heads", "decays", "seqwindows")
# columns of the window table kept in the committed CSVs (4 significant digits are plenty for a curve)
WINDOW_COLUMNS = ["model", "layer", "variant", "step", "window_start", "out_rel_err", "out_rel_err_max", "state_rel_err"]


@dataclass
class Context:
    scale: str
    data: pathlib.Path
    device: str = "cpu"
    backend: str = "auto"
    only_runs: set[str] | None = None
    log: object = print
    timings: dict = field(default_factory=dict)
    # the weights' dtype of the studies that load a model for end-to-end evaluation (WEIGHT_DTYPE_STUDIES); None:
    # ``load_model``'s default (bfloat16 on CUDA, float32 on the CPU)
    dtype: str | None = None

    def folder(self, study: str) -> pathlib.Path:
        return self.data / study / "data"

    def wanted(self, run_name: str) -> bool:
        return self.only_runs is None or run_name in self.only_runs

    def run_and_store(self, study: str, spec: RunSpec) -> RunResult | None:
        """Run `spec` (unless filtered out) and write its tables and provenance into the study's data."""
        if not self.wanted(spec.name):
            return None
        self.log(f"[{study}] {spec.name} ...")
        t0 = time.time()
        res = run(spec, device=self.device, backend=self.backend, log=self.log)
        store(self.folder(study), spec.name, res, self.scale, spec.keep_windows)
        self.timings[f"{study}/{spec.name}"] = round(time.time() - t0, 1)
        return res


def store(folder: pathlib.Path, name: str, res: RunResult, scale: str, keep_windows: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "runs").mkdir(exist_ok=True)
    tables = {
        "sequences": res.sequences,
        "windows": res.windows[WINDOW_COLUMNS] if keep_windows else None,
        "heads": res.heads,
        "decays": res.decays,
        "seqwindows": res.sequence_windows,
    }
    for t, df in tables.items():
        path = folder / f"{t}_{name}.csv"
        if df is None or df.empty:
            path.unlink(missing_ok=True)
            continue
        df.to_csv(path, index=False, float_format="%.4g" if t in ("windows", "seqwindows") else CSV_FLOAT)
    write_provenance(folder, name, {**res.provenance, "scale": scale})


def write_provenance(folder: pathlib.Path, name: str, doc: dict) -> None:
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    (folder / "runs" / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")


def load(folder: pathlib.Path, table: str) -> pd.DataFrame:
    """All runs' rows of one table (empty frame when there are none)."""
    parts = [pd.read_csv(p) for p in sorted(folder.glob(f"{table}_*.csv"))]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def load_runs(folder: pathlib.Path) -> dict[str, dict]:
    """{run name: provenance} of the runs stored in `folder`."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((folder / "runs").glob("*.json"))}
