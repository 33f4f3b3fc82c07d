"""A plotting process of `ssmquant analyze` (``report.files.PlotWorkers``): it imports the plotting stack and
loads the fonts at once, then waits for one JSON line on stdin, {"input": pickle path, "plot": file name,
"out_dir": directory}, renders that plot from the pickled (traces, heads, summary, report) and prints
{"plot": file name, "seconds": render time}. An empty stdin (the run ended without plots) exits quietly.

    python -m ssmquant.report.plot_worker
"""

from __future__ import annotations

import json
import pickle
import sys
import time


def main() -> int:
    from .plots import render_one, warm_up

    warm_up()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    request = json.loads(line)
    with open(request["input"], "rb") as f:
        traces, heads, summary, report = pickle.load(f)
    t0 = time.perf_counter()
    name = render_one(request["plot"], traces, heads, summary, report, request["out_dir"])
    print(json.dumps({"plot": name, "seconds": round(time.perf_counter() - t0, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
