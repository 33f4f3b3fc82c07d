"""One runner for the benchmarks of ssmquant.

    python benchmarks/run.py list                      the registered benchmarks and a CPU check of each
    python benchmarks/run.py NAME [--update-results] [NAME's options]      (NAME --help for them)
    python benchmarks/run.py file RAW.json [--results-file FILE]     file a finished run's raw JSON into RESULTS.md

A run prints its tables (markdown) and writes everything it measured to benchmarks/results/NAME-<UTC time>.json
(git-ignored; rewritten as the run goes, so a run cut short keeps what it measured). --update-results replaces the
run's sections of benchmarks/RESULTS.md (between `<!-- results:KEY -->` and `<!-- /results:KEY -->`; a section not
there yet is appended; nothing else in the file changes) with its tables, the exact command, the GPU, the versions
and the date. A check of a script on the CPU (tiny shapes, Triton's interpreter) is no measurement: its sections are
printed, never filed. History lives in git, not in files. `file` files a run made elsewhere (a GPU machine whose
copy of the repository is thrown away) from its raw JSON: the same sections, command, GPU, versions and date.

A benchmark is a module of this folder with `add_arguments(parser)` and `run(args) -> common.Result`, registered in
REGISTRY below with a one-line summary and the arguments of its CPU check.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

RESULTS_FILE = ROOT / "benchmarks" / "RESULTS.md"
RAW_DIR = ROOT / "benchmarks" / "results"
RESULTS_HEAD = "# Benchmark results\n\nThe current table of each benchmark (`python benchmarks/run.py list`).\n"


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """name: what `run.py NAME` runs; module: its module; summary: one line; check: the arguments of a tiny CPU
    check of it (`--device cpu` ones run the Triton kernels in the interpreter, which the runner turns on)."""

    name: str
    module: str
    summary: str
    check: tuple[str, ...]


REGISTRY: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark(
            "emulation",
            "benchmarks.emulation",
            "fused kernels vs the eager and torch.compile per-step peers, per kind x format x scheme (GPU)",
            ("--device", "cpu", "--kinds", "mamba2", "--formats", "fp8_e4m3", "--steps", "4", "--batch", "1",
             "--peer-steps", "2", "--reps", "3", "--no-compile"),  # fmt: skip
        ),
        Benchmark(
            "analyze",
            "benchmarks.analyze",
            "`ssmquant analyze` of synthetic Nemotron-3-Nano end to end, fresh processes, by stage (GPU or CPU)",
            ("cpu", "--steps", "8", "--batch", "1", "--layers", "0", "--runs", "warm"),
        ),
        Benchmark(
            "nvfp4",
            "benchmarks.nvfp4",
            "the Mamba-2 kernel for nvfp4 beside fp8 at Nemotron-3-Nano shapes, planned and forced tilings (GPU)",
            ("--device", "cpu", "--steps", "4", "--batch", "1", "--reps", "3", "--cases", "fp8_conv,nvfp4_conv"),
        ),
        Benchmark(
            "eval",
            "benchmarks.eval",
            "`ssmquant eval` --mode layer beside --mode decode, decode-step equivalents per second (CPU or GPU)",
            ("--models", "tiny-qwen", "--steps", "16", "--batch", "1", "--reps", "1"),
        ),
        Benchmark(
            "sass",
            "benchmarks.sass",
            "instructions per element-step of the Triton kernels and the KDA CUDA kernel, sm_90 machine code (no GPU)",
            ("--quick",),
        ),
        Benchmark(
            "registers",
            "benchmarks.registers",
            "registers and spills of the Triton kernels at the planned tilings and one size up, sm_90a (no GPU)",
            ("--kinds", "mamba2", "--variants", "1"),
        ),
    ]
}


def list_benchmarks() -> str:
    width = max(map(len, REGISTRY))
    lines = []
    for b in REGISTRY.values():
        lines.append(f"{b.name:<{width}}  {b.summary}")
        lines.append(f"{'':<{width}}  CPU check: python benchmarks/run.py {b.name} {' '.join(b.check)}")
    return "\n".join(lines)


def _json_ready(value):
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, pathlib.Path):
        return str(value)
    return repr(value)


RUNNER_FLAGS = ("--update-results",)
RUNNER_OPTIONS = ("--results-file", "--raw-dir")  # where results go: not part of the recorded command


def measured_argv(argv: list[str]) -> list[str]:
    """argv without the runner's own options, which change where results go, not what is measured."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in RUNNER_FLAGS or ("=" in a and a.split("=", 1)[0] in RUNNER_OPTIONS):
            continue
        elif a in RUNNER_OPTIONS:
            skip = True
        else:
            out.append(a)
    return out


def update_results(path: pathlib.Path, result: common.Result, header: str) -> list[str]:
    """Replace (or append) each section of `result` in the results file at `path`; returns the keys written."""
    text = path.read_text() if path.exists() else RESULTS_HEAD
    for key, sec in result.sections.items():
        text = common.replace_section(text, key, common.section_block(key, sec.title, header, sec.body))
    path.write_text(text)
    return list(result.sections)


def file_raw(argv: list[str]) -> int:
    """`file RAW.json [--results-file FILE]`: the sections of a complete measured run's raw JSON into RESULTS.md."""
    ap = argparse.ArgumentParser(prog="python benchmarks/run.py file")
    ap.add_argument("raw", type=pathlib.Path, help="a run's JSON (benchmarks/results/NAME-<UTC time>.json)")
    ap.add_argument("--results-file", type=pathlib.Path, default=RESULTS_FILE, help="[default: benchmarks/RESULTS.md]")
    args = ap.parse_args(argv)
    doc = json.loads(args.raw.read_text())
    if not doc.get("complete") or not doc.get("measurement") or doc.get("failed"):
        why = "failed" if doc.get("failed") else "a check of the script" if doc.get("complete") else "cut short"
        print(f"{args.raw}: not filed, the run was {why}", file=sys.stderr)
        return 1
    when = datetime.datetime.fromisoformat(doc["utc"])
    header = common.section_header(doc["command"], doc["environment"], doc.get("hardware"), when)
    result = common.Result(sections={k: common.Section(**v) for k, v in doc["sections"].items()}, raw=doc["raw"])
    keys = update_results(args.results_file, result, header)
    print(f"updated {args.results_file}: {', '.join(keys)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nBenchmarks:\n" + list_benchmarks())
        return 0 if argv else 2
    if argv[0] == "list":
        print(list_benchmarks())
        return 0
    if argv[0] == "file":
        return file_raw(argv[1:])
    bench = REGISTRY.get(argv[0])
    if bench is None:
        print(f"unknown benchmark {argv[0]!r}; registered: {', '.join(REGISTRY)} (python benchmarks/run.py list)",
              file=sys.stderr)  # fmt: skip
        return 2
    rest = argv[1:]
    if ("--device", "cpu") in zip(rest, rest[1:]) or "--device=cpu" in rest:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton or the kernels are imported
    module = importlib.import_module(bench.module)
    ap = argparse.ArgumentParser(
        prog=f"python benchmarks/run.py {bench.name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--update-results", action="store_true", help="replace this benchmark's sections of RESULTS.md")
    ap.add_argument("--results-file", type=pathlib.Path, default=RESULTS_FILE, help="[default: benchmarks/RESULTS.md]")
    ap.add_argument("--raw-dir", default=str(RAW_DIR), help="where the raw JSON goes ('-': nowhere) "
                    "[default: benchmarks/results]")  # fmt: skip
    module.add_arguments(ap)
    args = ap.parse_args(rest)

    when = common.utc_now()
    command = common.command_line(measured_argv(argv))
    env = common.environment()
    raw_path = None
    if args.raw_dir != "-":
        raw_path = pathlib.Path(args.raw_dir) / f"{bench.name}-{when.strftime('%Y%m%dT%H%M%SZ')}.json"
        raw_path.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("save_partial",) and not callable(v)}

    def save(raw, result: common.Result | None = None) -> None:
        if raw_path is None:
            return
        doc = {
            "benchmark": bench.name,
            "command": command,
            "utc": when.isoformat(timespec="seconds"),
            "environment": env,
            "arguments": settings,
            "complete": result is not None,
        }
        if result is not None:
            doc.update(
                measurement=result.measurement,
                hardware=result.hardware,
                failed=result.failed,
                sections={k: dataclasses.asdict(s) for k, s in result.sections.items()},
            )
        doc["raw"] = raw
        raw_path.write_text(json.dumps(_json_ready(doc), indent=1) + "\n")

    args.save_partial = save
    result = module.run(args)
    env.update(common.environment())  # torch's full version, once a benchmark has imported it
    save(result.raw, result)
    header = common.section_header(command, env, result.hardware, when)
    for key, sec in result.sections.items():
        print(f"\n<!-- {key} -->\n## {sec.title}\n\n{header}\n{sec.body.strip()}\n")
    if raw_path is not None:
        print(f"raw results: {raw_path.relative_to(ROOT) if raw_path.is_relative_to(ROOT) else raw_path}")
    if result.failed:
        print(f"FAILED: {result.failed}", file=sys.stderr)
    if args.update_results:
        if not result.measurement:
            print("--update-results: this run checks the script (CPU, small shapes); it is not a measurement and "
                  "is not filed", file=sys.stderr)  # fmt: skip
            return 2
        if result.failed:
            print("--update-results: the run failed; RESULTS.md left as it was", file=sys.stderr)
            return 1
        keys = update_results(args.results_file, result, header)
        print(f"updated {args.results_file}: {', '.join(keys)}")
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
