"""Wall-clock time of `ssmquant analyze`, start-up included, by stage.

    python benchmarks/run.py analyze gpu                      # nemotron-3-nano synthetic, 4096 steps, batch 8
    python benchmarks/run.py analyze gpu --runs cold,warm,warm,pyc,pyc
    python benchmarks/run.py analyze cpu                      # the same at 512 steps, batch 1 (2 CPU cores)
    python benchmarks/run.py analyze cpu --steps 8 --batch 1 --layers 0 --runs warm   # a check: not a measurement

Each run is a fresh `python -X importtime -m ssmquant analyze ... -q` process (interpreter, imports, input
synthesis, kernel compilation or cache loads, all 23 layers x 6 variants, tables, JSON and plots). Stages:

- start-up + exit: the wall clock less analyze() and the writing of DIR (interpreter, the command's imports,
  click, CUDA and process teardown); split into start-up (up to analyze()) and exit (from report.json's
  modification time, the last file written, to the process' end);
- import torch: the cumulative time of `import torch` in the run's `-X importtime` log (most of start-up);
- imports (all): the sum of the process's top-level imports from `-X importtime`, wherever they ran (some
  run inside analyze(), e.g. Triton on the first launch, so this column overlaps the others);
- inputs, emulation, tables: report.json's stages of analyze() (`capture_wait_s`, `emulate_s`, `tables_s`;
  tables_s also holds what analyze() does besides, such as the memory check that creates the CUDA context);
- write, plots: report.json's `write_tables_s` (parquet, CSV) and `plots_s` (the three PNGs);
- Triton cache: entries added to the run's TRITON_CACHE_DIR (0 on a warm run: nothing was recompiled).

Run kinds (--runs): ``cold`` empties the Triton cache first; ``warm`` keeps what the runs before it compiled;
``pyc`` is a warm run with a warm Python bytecode cache. Some machines' Python compiles every module it imports from
source each time (a GPU image whose torch has no cached .pyc and writes none), which a usual installation (pip
compiles the .pyc files when it installs) does not; ``pyc`` runs and the ``cold`` run (which fills it) get
PYTHONPYCACHEPREFIX=<work dir>/pycache and no PYTHONDONTWRITEBYTECODE, every other run the environment as given.
Every run's output files but report.json (which records times) must be byte-identical to the first run's: the
run fails otherwise.

All runs of one invocation share one TRITON_CACHE_DIR (a fresh temporary one unless --cache-dir). The table gives
each run and the median (min-max) wall clock of each run kind; RESULTS.md keys `analyze` (gpu) and `analyze-cpu`.
--deadline stops starting runs that would end past it (judged by the longest run so far), so that a device call
keeps to its time; the runs left out are named. --steps, --batch or --layers make the run a quick check, not a
measurement.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.common import Result, Section

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = {"gpu": {"steps": 4096, "batch": 8, "device": "cuda"}, "cpu": {"steps": 512, "batch": 1, "device": "cpu"}}
TARGET = {"gpu": "< 10 s warm on one H200 (issue 15)", "cpu": "< 2 min on 2 CPU cores"}
RUN_KINDS = ("cold", "warm", "pyc")
COLUMNS = [
    ("run", "run"),
    ("wall_s", "wall clock"),
    ("startup_exit_s", "start-up + exit"),
    ("startup_s", "start-up"),
    ("exit_s", "exit"),
    ("torch_import_s", "import torch"),
    ("imports_s", "imports (all)"),
    ("analyze_s", "inside analyze()"),
    ("inputs_s", "inputs"),
    ("emulate_s", "emulation"),
    ("tables_s", "tables"),
    ("write_tables_s", "write"),
    ("plots_s", "plots"),
    ("triton_cache_new", "Triton cache entries added"),
]


def hardware(kind: str) -> str:
    """The machine and torch's version, without importing torch (seconds of a device call's time)."""
    from importlib.metadata import version

    torch_version = version("torch")
    if kind == "gpu":
        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=20, check=True).stdout.splitlines()[0].strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError, IndexError):
            import torch

            name = torch.cuda.get_device_name(0)
        return f"{name}, torch {torch_version}"
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch {torch_version}"


def import_seconds(importtime_log: str) -> float:
    """Sum of the top-level entries of a `python -X importtime` log (an import nested in another is
    indented under it and already counted in its parent's cumulative time)."""
    total = 0
    for line in importtime_log.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| ( *)\S", line)
        if m and not m.group(2):
            total += int(m.group(1))
    return total / 1e6


def module_import_seconds(importtime_log: str, module: str) -> float | None:
    """The cumulative import time of ``module`` in a `python -X importtime` log (its first import), or None."""
    m = re.search(rf"^import time:\s+\d+ \|\s+(\d+) \| *{re.escape(module)}$", importtime_log, re.M)
    return int(m.group(1)) / 1e6 if m else None


def median(values: list[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def kind_summary(rows: list[dict]) -> list[str]:
    """One line per run kind: the wall clock of each run, and their median (min-max)."""
    lines = []
    for kind in RUN_KINDS:
        walls = [r["wall_s"] for r in rows if r["run"] == kind]
        if walls:
            lines.append(f"{kind}: wall clock median {median(walls):.2f} s (min-max {min(walls):.2f}-{max(walls):.2f} s, "
                         f"{len(walls)} run{'s' if len(walls) > 1 else ''}: {', '.join(f'{w:.2f}' for w in walls)})")  # fmt: skip
    return lines


def cache_entries(cache: pathlib.Path) -> set[str]:
    """Triton's cache: one directory per compiled kernel (and per built launcher / driver helper)."""
    return {p.name for p in cache.iterdir()} if cache.is_dir() else set()


def output_digests(out: pathlib.Path) -> dict[str, str]:
    """sha256 of each output file but report.json (it records the run's times)."""
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir()) if p.name != "report.json"}


def one_run(label: str, cmd: list[str], env: dict, cache: pathlib.Path, out: pathlib.Path) -> dict:
    before = cache_entries(cache)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    t_end = time.time()
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
        raise SystemExit(f"{label} run failed with status {proc.returncode}:\n" + "\n".join(lines[-40:]))
    report = json.loads((out / "report.json").read_text())
    # report.json is the last file written before DIR is renamed into place: from then to the process' end
    # is the exit (the rename, the interpreter's teardown or os._exit)
    exit_s = t_end - (out / "report.json").stat().st_mtime
    st = report["stages"]
    write = (st.get("write_tables_s") or 0.0) + (st.get("plots_s") or 0.0)
    row = {
        "run": label,
        "wall_s": wall,
        "startup_exit_s": wall - report["elapsed_s"] - write,
        "startup_s": wall - report["elapsed_s"] - write - exit_s,
        "exit_s": exit_s,
        "torch_import_s": module_import_seconds(proc.stderr, "torch"),
        "imports_s": import_seconds(proc.stderr),
        "analyze_s": report["elapsed_s"],
        "inputs_s": st.get("capture_wait_s"),
        "emulate_s": st.get("emulate_s"),
        "tables_s": st.get("tables_s"),
        "write_tables_s": st.get("write_tables_s"),
        "plots_s": st.get("plots_s"),
        "triton_cache_new": len(cache_entries(cache) - before),
        "peak_gpu_memory_GiB": st.get("peak_gpu_memory_GiB"),
        "stages": st,
        "outputs": output_digests(out),
    }
    shutil.rmtree(out, ignore_errors=True)
    return row


def cell(v) -> str:
    if v is None:
        return "—"
    return f"{v:.2f} s" if isinstance(v, float) else str(v)


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(h for _, h in COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(r[k]) for k, _ in COLUMNS) + " |\n" for r in rows)


def add_arguments(ap) -> None:
    ap.add_argument("kind", choices=sorted(SIZES), help="gpu: 4096 steps x batch 8 on CUDA; cpu: 512 x 1 on the CPU")
    ap.add_argument("--runs", default="cold,warm", help="comma-separated run labels, each cold, warm or pyc: a cold "
                    "run empties the Triton cache first, a warm one keeps what the runs before it compiled, a pyc "
                    "one is a warm run with Python's bytecode cache (filled by the cold run)")  # fmt: skip
    ap.add_argument("--cache-dir", type=pathlib.Path, help="TRITON_CACHE_DIR of the runs [default: a fresh temp dir]")
    ap.add_argument("--steps", type=int, help="override the kind's steps (a quick check)")
    ap.add_argument("--batch", type=int, help="override the kind's batch (a quick check)")
    ap.add_argument("--layers", help="only these layers (model layer indices of SSM layers, e.g. 0,2; a quick check)")
    ap.add_argument("--deadline", type=float, help="seconds from the start: no run is started that would end "
                    "later, by the longest run so far [default: none]")  # fmt: skip


def run(args) -> Result:
    labels = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in labels if r not in RUN_KINDS]
    if bad or not labels:
        sys.exit(f"--runs takes {', '.join(RUN_KINDS)} (comma-separated), got {args.runs!r}")
    sizes = dict(SIZES[args.kind])
    sizes["steps"] = args.steps or sizes["steps"]
    sizes["batch"] = args.batch or sizes["batch"]
    quick = bool(args.steps or args.batch or args.layers)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-analyze-"))
    cache = args.cache_dir or work / "triton-cache"
    out = work / "run"
    cli_args = [
        "analyze", "--model", "nemotron-3-nano", "--synthetic", "--formats", "fp8_e4m3,int8,nvfp4",
        "--schemes", "conventional,replay", "--steps", str(sizes["steps"]), "--batch", str(sizes["batch"]),
        "--device", sizes["device"], "--out", str(out), "-q",
    ]  # fmt: skip
    if args.layers:
        cli_args[-3:-3] = ["--layers", args.layers]
    cmd = [sys.executable, "-X", "importtime", "-m", "ssmquant", *cli_args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(cache))
    pyc_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    pyc_env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    shown = "ssmquant " + " ".join(cli_args).replace(str(out), "DIR")
    rows, skipped, t_start = [], [], time.perf_counter()
    raw = {"command": shown, "hardware": hardware(args.kind), "sizes": sizes, "runs": rows, "not_started": skipped}
    save = getattr(args, "save_partial", None) or (lambda raw: None)
    try:
        for i, label in enumerate(labels):
            # the longest warm run so far (the cold one while there is none) is what the next one may take
            walls = [r["wall_s"] for r in rows if r["run"] != "cold"] or [r["wall_s"] for r in rows]
            longest = max(walls, default=0.0)
            if args.deadline is not None and time.perf_counter() - t_start + longest > args.deadline:
                skipped += labels[i:]
                print(f"[analyze] deadline {args.deadline:.0f} s: not started: {', '.join(skipped)}", flush=True)
                break
            if label == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            print(f"[analyze] {label} run ...", flush=True)
            rows.append(one_run(label, cmd, pyc_env if label in ("cold", "pyc") else env, cache, out))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            save(raw)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not rows:
        sys.exit("no run fitted in --deadline")
    differ = [f"{r['run']} #{i}: {', '.join(k for k in sorted(set(r['outputs']) | set(rows[0]['outputs'])) if r['outputs'].get(k) != rows[0]['outputs'].get(k))}"
              for i, r in enumerate(rows) if r["outputs"] != rows[0]["outputs"]]  # fmt: skip
    identical = (f"output files ({len(rows[0]['outputs'])}, report.json aside) of all {len(rows)} runs byte-identical: "
                 + ("yes" if not differ else "NO, differing from run #0: " + "; ".join(differ)))  # fmt: skip
    body = (
        f"`{shown}` in fresh processes, target {TARGET[args.kind]}; cold: an empty Triton cache (kernels compiled in "
        "the run), warm: the cache the runs before it filled, pyc: a warm run with a warm bytecode cache for "
        "torch's own modules.\n\n"
        + table(rows)
        + "\n"
        + "".join(f"- {line}\n" for line in kind_summary(rows))
        + (f"- not started (--deadline {args.deadline:.0f} s): {', '.join(skipped)}\n" if skipped else "")
        + f"- {identical}\n"
    )
    key = "analyze" if args.kind == "gpu" else "analyze-cpu"
    title = "`ssmquant analyze` end to end, " + ("one GPU" if args.kind == "gpu" else "CPU")
    cpu = None if args.kind == "gpu" else hardware("cpu").rsplit(", torch", 1)[0]  # the runner names the GPU
    return Result({key: Section(title, body)}, raw, measurement=not quick, hardware=cpu,
                  failed="the runs' output files differ" if differ else None)  # fmt: skip
