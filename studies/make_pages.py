"""Build every study page (studies/<study>/README.md, tables as markdown + CSV, plots) from the committed
summary tables in studies/<study>/data/ -- on CPU, in seconds, no simulation.

    python studies/make_pages.py                          # reads and writes studies/
    python studies/make_pages.py --data DIR --out DIR     # e.g. after `SCALE=smoke python -m studies.run --data DIR`

The tables are written by `python -m studies.run` (see studies/README.md). Every number in a page is
computed here from them; the prose states only what the tables show, with its numbers filled in.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from studies.common.plots import theme  # noqa: E402
from studies.index import write_index  # noqa: E402
from studies.run import STUDIES, study_module  # noqa: E402


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "studies"), help="root of the study data (default: studies/)")
    ap.add_argument("--out", default=None, help="where the study folders go (default: the --data root)")
    ap.add_argument("--only", default=None, help=f"comma-separated studies (default: all): {', '.join(STUDIES)}")
    args = ap.parse_args(argv)
    data = pathlib.Path(args.data)
    out = pathlib.Path(args.out) if args.out else data
    only = STUDIES if args.only is None else tuple(s.strip() for s in args.only.split(",") if s.strip())
    bad = [s for s in only if s not in STUDIES]
    if bad:
        ap.error(f"unknown studies {bad}; accepted: {', '.join(STUDIES)}")
    missing = [s for s in only if not any((data / d / "data").is_dir() for d in getattr(study_module(s), "SOURCES", (s,)))]
    if missing:
        ap.error(f"no data for {', '.join(missing)} under {data}: run `python -m studies.run` first")
    out.mkdir(parents=True, exist_ok=True)
    theme()
    answers = []
    for name in only:
        print(f"{name} ...", flush=True)
        answers.append(study_module(name).page(data, out))
    if args.only is None:
        write_index(data, out, answers)
    for a in answers:
        print(f"- {a['title']}: {a['answer']}")
    return answers


if __name__ == "__main__":
    main()
