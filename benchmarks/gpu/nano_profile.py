"""Where the wall time of `ssmquant analyze --model nemotron-3-nano --synthetic ...` goes, span by span.

Runs the CLI command in this process with timed spans wrapped around the stages (imports, CUDA init, each
layer's input generation, each kernel launch, the window statistics and their host copy, the per-layer
tables, the final tables, each plot, the write) and writes them as a JSON timeline. With ``--sync`` every
span ends with ``torch.cuda.synchronize()``, so a span holds the GPU work it queued (the per-stage cost);
without it the spans are the host's view (where the host blocks). ``--torch-profile FILE`` wraps the run in
torch.profiler and writes a gzipped Chrome trace plus the top ops (keep the layer count small).

    T0=$(date +%s.%N) python benchmarks/gpu/nano_profile.py --json t.json --sync -- --steps 4096 --batch 8

Arguments after ``--`` are appended to the analyze command (they override the defaults below).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import functools  # noqa: E402
import gzip  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

T0 = float(os.environ.get("T0", T_START))  # the shell's launch time, when given
SPANS: list[dict] = []
_LOCK = threading.Lock()
SYNC = False


def _now() -> float:
    return time.time() - T0


def _sync():
    if SYNC and "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.synchronize()


class span:
    """A timed span (seconds since T0), recorded with its thread and any extra fields."""

    def __init__(self, name: str, **extra):
        self.name, self.extra = name, extra

    def __enter__(self):
        self.t = _now()
        return self

    def __exit__(self, *exc):
        _sync()
        rec = {"name": self.name, "t0": round(self.t, 4), "t1": round(_now(), 4), "thread": threading.current_thread().name}
        rec["dt"] = round(rec["t1"] - rec["t0"], 4)
        rec.update(self.extra)
        with _LOCK:
            SPANS.append(rec)


def wrap(module, attr: str, name: str | None = None, describe=None):
    """Replace module.attr by a timed wrapper (describe(*args, **kw) -> extra fields)."""
    fn = getattr(module, attr)

    @functools.wraps(fn)
    def timed(*args, **kw):
        with span(name or attr, **(describe(*args, **kw) if describe else {})):
            return fn(*args, **kw)

    setattr(module, attr, timed)


def wrap_gen(module, attr: str, name: str):
    """Time each item of a generator function (the time to produce it, not the consumer's)."""
    fn = getattr(module, attr)

    @functools.wraps(fn)
    def timed(*args, **kw):
        it = fn(*args, **kw)
        k = 0
        while True:
            with span(name, item=k):
                try:
                    item = next(it)
                except StopIteration:
                    return
            k += 1
            yield item

    setattr(module, attr, timed)


def main():
    global SYNC
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True, type=pathlib.Path)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--torch-profile", type=pathlib.Path, help="gzipped Chrome trace here (+ .txt top ops)")
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    SYNC = args.sync
    marks = {"python_started": round(T_START - T0, 4)}

    with span("import torch"):
        import torch
    if torch.cuda.is_available():  # (a CPU check of this script skips these)
        with span("cuda init"):
            torch.cuda.init()
        with span("first kernel"):
            torch.ones(1, device="cuda").add_(1).item()
    with span("import triton"):
        import triton  # noqa: F401
    with span("import pandas"):
        import pandas  # noqa: F401
    with span("import ssmquant.cli"):
        from ssmquant import cli
    with span("import ssmquant.analysis"):
        import ssmquant.analysis  # noqa: F401
    with span("import ssmquant.kernels"):
        import ssmquant.kernels as kernels
    from ssmquant.analysis import run, sources
    sim_mod = importlib.import_module("ssmquant.replay.simulate")
    from ssmquant.replay import inputs as inputs_mod
    from ssmquant.replay import trace as trace_mod
    from ssmquant.report import files

    def launch_info(*a, **kw):
        return {"x": list(a[0].shape), "nv": len(kw["specs"]), "block_p": kw["block_p"], "num_warps": kw["num_warps"],
                "b0": kw.get("batch_offset", 0)}  # fmt: skip

    wrap_gen(sources, "synthetic_layers", "inputs: next layer")
    wrap(run, "start_simulation", "simulate (queue)", lambda inputs, *a, **k: {"layer": inputs.meta.get("layer")})
    wrap(sim_mod.PendingTrace, "result", "simulate (wait, host copy)")
    wrap(kernels, "mamba2_launch", "kernel launch", launch_info)
    wrap(kernels, "delta_rule_launch", "kernel launch", launch_info)
    wrap(trace_mod.WindowAccumulator, "add", "window stats add")
    wrap(trace_mod.WindowAccumulator, "finish_tensors", "window stats finish")
    wrap(trace_mod.WindowAccumulator, "_window_sums", "window stats: window sums")
    wrap(trace_mod.WindowAccumulator, "_window_max", "window stats: window max")
    wrap(inputs_mod.Mamba2Inputs, "validate", "inputs validate")
    wrap(kernels, "mamba2_decays", "decays")
    wrap(kernels, "_to_device", "host -> device (masks, seeds)")
    wrap(sim_mod, "WindowAccumulator", "window accumulator init")
    wrap(trace_mod.Trace, "to_frame", "trace.to_frame")
    wrap(run, "head_table", "head_table")
    wrap(run, "summarize_layer", "summarize_layer")
    wrap(run, "memory_table", "memory_table")
    wrap(run, "environment", "environment()")
    wrap(run, "plan_layers", "plan_layers (memory check)")
    wrap(run, "open_source", "open_source")
    wrap(run.pd, "concat", "pd.concat")
    wrap(ssmquant.analysis, "analyze", "analyze()")  # the CLI imports it from the package
    wrap(files, "write_table", "write_table", lambda df, d, stem: {"stem": stem, "rows": len(df)})
    wrap(files, "write_analysis", "write_analysis (tables + plots + rename)")
    wrap(files, "prefetch_plotting", "prefetch_plotting (start)")
    orig_plots = files._plots

    def plots_module():
        with span("wait for plot prefetch"):
            mod = orig_plots()
        for fn in ("drift_plot", "heatmap_plot", "heads_plot", "_save", "drift_figure", "heatmap_figure"):
            if not hasattr(getattr(mod, fn), "__wrapped__"):
                wrap(mod, fn, f"plot: {fn}")
        return mod

    files._plots = plots_module

    out = pathlib.Path(tempfile.mkdtemp(prefix="nano-profile-")) / "run"
    cmd = ["analyze", "--model", "nemotron-3-nano", "--synthetic", "--formats", "fp8_e4m3,int8,nvfp4",
           "--schemes", "conventional,replay", "--steps", "4096", "--batch", "8", "--device", "cuda",
           "--out", str(out), "-q", *args.rest]  # fmt: skip
    prof = None
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False)
        prof.__enter__()
    with span("cli main"):
        cli.main(cmd, prog_name="ssmquant", standalone_mode=False)
    if prof is not None:
        prof.__exit__(None, None, None)
        raw = args.torch_profile.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(args.torch_profile, "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
        table += "\n\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        args.torch_profile.with_name(args.torch_profile.name.replace(".json.gz", "") + "_ops.txt").write_text(table)
    report = json.loads((out / "report.json").read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    marks["main_done"] = round(_now(), 4)
    # totals per span name
    totals: dict[str, dict] = {}
    for s in SPANS:
        t = totals.setdefault(s["name"], {"count": 0, "total_s": 0.0})
        t["count"] += 1
        t["total_s"] = round(t["total_s"] + s["dt"], 4)
    args.json.write_text(json.dumps({"sync": SYNC, "argv": cmd, "marks": marks, "report_stages": report["stages"],
                                     "elapsed_s": report["elapsed_s"], "totals": totals, "spans": SPANS},
                                    indent=1) + "\n")  # fmt: skip
    width = max(len(k) for k in totals)
    print(f"spans (sync={SYNC}), seconds since launch; main done at {marks['main_done']:.3f} s")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]["total_s"]):
        print(f"  {k:<{width}}  x{v['count']:<4} {v['total_s']:8.3f} s")
    print(f"EXIT_MARK {time.time():.6f}", flush=True)


if __name__ == "__main__":
    main()
