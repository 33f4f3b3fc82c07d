"""What the benchmarks share: a benchmark's result, timing with its spread, markdown tables, the machine and
versions, and the sections of RESULTS.md.

Imports nothing heavy at module level: `python benchmarks/run.py list` and the results file work without torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version

MIN_REPS = 3  # a timing is a median over at least this many runs


@dataclasses.dataclass
class Section:
    """One table of a benchmark, as RESULTS.md holds it under the key it is filed by: a title and a markdown body
    (a paragraph saying what was run, the table, notes)."""

    title: str
    body: str


@dataclasses.dataclass
class Result:
    """What a benchmark's `run(args)` returns.

    sections: RESULTS.md key -> Section (a run may fill several, e.g. one per layer kind); raw: everything measured,
    JSON-ready (written to benchmarks/results/); measurement: False for a check of the script (CPU, tiny shapes),
    whose sections --update-results refuses; hardware: what the numbers were measured on when it is not this
    machine's GPU (e.g. code compiled offline for sm_90a), else None; failed: a message when the run failed (written
    and printed, then exit status 1)."""

    sections: dict[str, Section]
    raw: dict
    measurement: bool = True
    hardware: str | None = None
    failed: str | None = None


class Timing(tuple):
    """Seconds of reps runs, sorted: .median, .fastest, .slowest."""

    @property
    def median(self) -> float:
        return statistics.median(self)

    @property
    def fastest(self) -> float:
        return self[0]

    @property
    def slowest(self) -> float:
        return self[-1]


def cuda_times(fn, reps: int) -> Timing:
    """Seconds of each of reps runs of fn() (CUDA events around each run, after one warm-up run), sorted; without
    a GPU (a check of a script in Triton's interpreter) wall-clock times."""
    import torch

    fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return Timing(sorted(times))
    torch.cuda.synchronize()
    return Timing(sorted(cuda_seconds(fn) for _ in range(reps)))


def cuda_seconds(fn) -> float:
    """Seconds of one run of fn() between CUDA events (no warm-up: for A/B runs that alternate their arms)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def fmt_cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if v != 0 and abs(v) < 0.1:
            return f"{v:.2g}"
        return f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def spread(rate_of, timing: Timing) -> str:
    """The rates of a timing's slowest and fastest runs, "lo-hi" (rate_of: seconds -> rate)."""
    return f"{fmt_cell(rate_of(timing.slowest))}-{fmt_cell(rate_of(timing.fastest))}"


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A markdown table of dict rows (columns: the first row's keys unless given), cells by `fmt_cell`."""
    if not rows:
        return "(no rows)\n"
    cols = columns or list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def gpu_description() -> str | None:
    """The first GPU as nvidia-smi names it, with memory, driver and maximum SM clock; None without one (judged
    without importing torch, so that a benchmark of start-up is not slowed by it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    name, memory, driver, clock = (x.strip() for x in out.stdout.splitlines()[0].split(","))
    return f"{name} ({memory}, driver {driver}, max SM clock {clock})"


def environment() -> dict:
    """The machine and the versions a result was measured with. Imports no torch (a benchmark of start-up runs
    without it); where a benchmark has imported it, its full version (with the CUDA build: 2.11.0+cu130)."""
    torch = sys.modules.get("torch")
    return {
        "gpu": gpu_description(),
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else _package_version("torch"),
        "triton": _package_version("triton"),
        "transformers": _package_version("transformers"),
    }


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


# Environment variables that change what a benchmark runs; recorded in front of its command.
COMMAND_ENV = ("TRITON_INTERPRET", "SSMQUANT_KDA_CUDA", "CUDA_VISIBLE_DEVICES")


def command_line(argv: list[str]) -> str:
    """The command as run from the repository root, with the environment variables that change what runs."""
    import shlex

    env = [f"{k}={shlex.quote(os.environ[k])}" for k in COMMAND_ENV if os.environ.get(k)]
    return " ".join([*env, "python", "benchmarks/run.py", *map(shlex.quote, argv)])


def section_header(command: str, env: dict, hardware: str | None, when: datetime.datetime) -> str:
    """The provenance line of a RESULTS.md section: command, hardware, versions, date."""
    hw = hardware or env["gpu"] or f"No GPU ({env['cpus']} CPU cores, {env['cpu']})"
    return (
        f"`{command}`\n\n"
        f"{hw}; torch {env['torch']}, Triton {env['triton']}, Python {env['python']}; "
        f"{when.strftime('%Y-%m-%d %H:%M')} UTC.\n"
    )


def _markers(key: str) -> tuple[str, str]:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", key):
        raise ValueError(f"a results key is lower-case letters, digits, '-' and '_', got {key!r}")
    return f"<!-- results:{key} -->", f"<!-- /results:{key} -->"


def section_block(key: str, title: str, header: str, body: str) -> str:
    """A RESULTS.md section between its markers: heading, provenance, body."""
    start, end = _markers(key)
    return f"{start}\n## {title}\n\n{header}\n{body.strip()}\n{end}\n"


def replace_section(text: str, key: str, block: str) -> str:
    """`text` (RESULTS.md) with the section of `key` (between its markers, markers included) replaced by `block`;
    a section not yet there is appended. Everything outside those markers is kept as it is."""
    start, end = _markers(key)
    i = text.find(start)
    if i < 0:
        return text.rstrip("\n") + "\n\n" + block
    j = text.find(end, i)
    if j < 0:
        raise ValueError(f"RESULTS.md has {start} but no {end}")
    if text.find(start, i + len(start)) >= 0:
        raise ValueError(f"RESULTS.md has {start} twice")
    j += len(end)
    if text[j : j + 1] == "\n":
        j += 1
    return text[:i] + block + text[j:]


def section_keys(text: str) -> list[str]:
    """The keys of the marked sections of a results file, in order."""
    return re.findall(r"<!-- results:([a-z0-9_-]+) -->", text)


def repo_root():
    import pathlib

    return pathlib.Path(__file__).resolve().parents[1]


def python() -> str:
    """This interpreter (for benchmarks that time fresh processes)."""
    return sys.executable
