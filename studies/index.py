"""studies/README.md: one line per study (its answer, computed from the data) and every run's provenance."""

from __future__ import annotations

import pathlib

import pandas as pd

from studies.common.context import load_runs
from studies.common.page import NONE_USED, SCALE_MACHINES, SUPERSEDED
from studies.common.tables import env_text, markdown, short_source


def write_index(data: pathlib.Path, out: pathlib.Path, answers: list[dict]) -> None:
    rows, scales = [], set()
    for a in answers:
        for name, prov in load_runs(data / a["folder"] / "data").items():
            s = prov.get("settings", {})
            scales.add(prov.get("scale"))
            rows.append(
                {
                    "study / run": f"{a['folder']} / {name}",
                    "data": short_source(prov.get("data_source")),
                    "steps x sequences": f"{s.get('steps')} x {s.get('batch', 1) * len(s.get('seeds', [0]))}",
                    "hardware / versions": env_text(prov.get("environment", {})),
                    "scale": prov.get("scale"),
                    "wall-clock s": prov.get("elapsed_s"),
                }
            )
    runs = pd.DataFrame(rows)
    total = runs["wall-clock s"].sum() if len(runs) else 0
    by_scale = runs.groupby("scale")["wall-clock s"].sum() if len(runs) else pd.Series(dtype=float)
    times = "; ".join(
        f"{scale}: {seconds:.0f} s on {SCALE_MACHINES.get(scale, 'see each run').split(',')[0]}"
        for scale, seconds in by_scale.items()
    )
    page = [
        "# Studies",
        "",
        "Reproducible studies of quantized SSM state (issues 8 and 12). Each folder holds a page (question, "
        "method, tables with bootstrap intervals, plots, commands), its tables as markdown and CSV, its plots, "
        "and `data/`: the compact summary tables the page is built from (committed). `python studies/make_pages.py` "
        "rebuilds every page from them on CPU in seconds; `python -m studies.run` re-runs the simulations.",
        "",
        f"Scale of the committed data: `{', '.join(sorted(x for x in scales if x))}` "
        f"({total:.0f} s of wall-clock time in all; {times}; the CPU machine was shared with other jobs, so the "
        "times below are not speed measurements). " + SUPERSEDED + NONE_USED + ", except the biased ratios kept, labelled, in "
        "the closing-note table of study 1.",
        "",
        "| study | answer (computed from the data) |",
        "|---|---|",
        *[f"| [{a['title']}]({a['folder']}/README.md) | {a['answer']} |" for a in answers],
        "",
        "## Runs: data, size, hardware and versions",
        "",
        markdown(runs) if len(runs) else "(no data)",
        "",
        "`synthetic` runs use the presets' exact shapes with inputs from the family's initialisation "
        "distributions (profile `init`), or a labelled stress profile (`synthetic, <profile> profile`; "
        "`ssmquant.models.synthetic.PROFILES`); `shipped` runs use the tiny models trained for ssmquant "
        "(`studies/tiny_models/`) on the shipped public-domain text (e2e_horizon: on the tiny models' whole held-out "
        "documents, `studies/tiny_models/CORPUS.md`).",
        "",
        "## Commands",
        "",
        "```bash",
        "python -m studies.run --scale cpu       # every simulation -> studies/<study>/data/ (about 30 CPU-minutes)",
        "python studies/make_pages.py            # every page, table and plot from studies/<study>/data/ (seconds)",
        "SCALE=smoke python -m studies.run --data /tmp/smoke && python studies/make_pages.py --data /tmp/smoke",
        "python -m studies.run --scale gpu --device cuda   # the long horizons on a GPU (e2e_horizon's data ran so)",
        "python -m studies.run --scale gpu --device cuda --only e2e_horizon --dtype float32 --data /tmp/fp32",
        "                                        # the end-to-end study with float32 weights (not run yet)",
        "pytest -q tests/studies                 # statistics helpers + the smoke pipeline (< 60 s)",
        "```",
        "",
        "Layout: `studies/<study>/study.py` (one module per study: `collect` runs the library and writes "
        "`data/`, `page` builds the page), `studies/common/` (statistics: bootstrap and permutation tests; "
        "tables; plots; measurement), `studies/run.py`, `studies/make_pages.py`. Raw traces are never written; "
        "`studies/data/` (the earlier raw-data folder) stays git-ignored. `studies/tiny_models/` documents how "
        "the shipped tiny models were trained. Speed: `benchmarks/RESULTS.md`.",
        "",
    ]
    (out / "README.md").write_text("\n".join(page))
