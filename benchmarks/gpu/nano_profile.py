"""Where the wall time of `ssmquant analyze --model nemotron-3-nano --synthetic ...` goes, span by span.

Runs the CLI command in this process with timed spans wrapped around the stages (imports, CUDA init, each
layer's input generation, each kernel launch, the window statistics and their host copy, the per-layer
tables, the final tables, each plot, the write) and writes them as a JSON timeline. With ``--sync`` every
span ends with ``torch.cuda.synchronize()``, so a span holds the GPU work it queued (the per-stage cost);
without it the spans are the host's view (where the host blocks). ``--torch-profile FILE`` wraps the run in
torch.profiler and writes a gzipped Chrome trace plus the top ops (keep the layer count small).

``--events`` (no extra syncs but one before the first layer) records CUDA events on the emulation's stream
around each layer's queued work and each kernel launch, and prints a per-layer table: when the host queued
the layer and reduced it, when the GPU started and finished its work, the kernels' share, the GPU's idle gap
before it, and totals (the GPU's busy and idle time over the layers: which of host and device sets the pace).
``--cprofile-first-launch N`` prints the N costliest functions (cumulative) of the first kernel launch, the
Triton call that loads the kernels (about 0.5 s in a warm cache on the H200). ``--baseline`` runs the
previous code path (`benchmarks/analyze_baseline.py`). Every run prints a stage breakdown of the wall clock.

    T0=$(date +%s.%N) python benchmarks/gpu/nano_profile.py --json t.json --sync -- --steps 4096 --batch 8
    python benchmarks/gpu/nano_profile.py --json t.json --events --cprofile-first-launch 30

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


class LayerEvents:
    """--events: CUDA events on the current stream at the start and end of each layer's queued work
    (``start_simulation``) and around each kernel launch, with the host's times of queueing and reducing the
    layer; ``table()`` turns them into seconds on the host's clock (one device sync before the first layer
    anchors the device's clock to it)."""

    def __init__(self):
        self.base = None  # (event, host time) recorded after a device sync
        self.layers: list[dict] = []
        self.current: dict | None = None

    def _event(self):
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def wrap_queue(self, module, attr: str):
        import torch

        fn = getattr(module, attr)

        @functools.wraps(fn)
        def queued(inputs, *a, **kw):
            if not torch.cuda.is_available() or inputs.device.type != "cuda":
                return fn(inputs, *a, **kw)
            if self.base is None:
                torch.cuda.synchronize()
                self.base = (self._event(), _now())
            rec = {"layer": inputs.meta.get("layer"), "host_queue0": _now(), "start": self._event(), "launches": []}
            self.current = rec
            try:
                pending = fn(inputs, *a, **kw)
            finally:
                self.current = None
            rec["end"] = self._event()
            rec["host_queue1"] = _now()
            self.layers.append(rec)
            pending._profile_rec = rec
            return pending

        setattr(module, attr, queued)

    def wrap_launch(self, module, attr: str):
        fn = getattr(module, attr)

        @functools.wraps(fn)
        def launched(*a, **kw):
            rec = self.current
            if rec is None:
                return fn(*a, **kw)
            before = self._event()
            out = fn(*a, **kw)
            rec["launches"].append((before, self._event()))
            return out

        setattr(module, attr, launched)

    def wrap_result(self, cls):
        fn = cls.result

        @functools.wraps(fn)
        def result(pending):
            rec = getattr(pending, "_profile_rec", None)
            if rec is not None and "host_result0" not in rec:
                rec["host_result0"] = _now()
            out = fn(pending)
            if rec is not None and "host_result1" not in rec:
                rec["host_result1"] = _now()
            return out

        cls.result = result

    def table(self) -> dict:
        import torch

        if self.base is None:
            return {}
        torch.cuda.synchronize()
        base, t_base = self.base
        at = lambda ev: t_base + base.elapsed_time(ev) / 1e3  # noqa: E731
        rows, prev_end = [], None
        for rec in self.layers:
            g0, g1 = at(rec["start"]), at(rec["end"])
            kernels = sum(b.elapsed_time(e) for b, e in rec["launches"]) / 1e3
            row = {
                "layer": rec["layer"],
                "host_queue0": round(rec["host_queue0"], 4),
                "host_queue_s": round(rec["host_queue1"] - rec["host_queue0"], 4),
                "host_result0": round(rec.get("host_result0", float("nan")), 4),
                "host_result_s": round(rec.get("host_result1", float("nan")) - rec.get("host_result0", float("nan")), 4),
                "gpu_start": round(g0, 4),
                "gpu_end": round(g1, 4),
                "gpu_span_s": round(g1 - g0, 4),
                "kernels_s": round(kernels, 4),
                "launches": len(rec["launches"]),
                # the stream's idle time before this layer's work: its start event completed after the previous
                # layer's work by this much (the host had not queued it yet)
                "gpu_idle_before_s": round(g0 - prev_end, 4) if prev_end is not None else None,
            }
            rows.append(row)
            prev_end = g1
        first, last = rows[0], rows[-1]
        totals = {
            "layers": len(rows),
            "gpu_first_start": first["gpu_start"],
            "gpu_last_end": last["gpu_end"],
            "gpu_window_s": round(last["gpu_end"] - first["gpu_start"], 4),
            "gpu_span_s": round(sum(r["gpu_span_s"] for r in rows), 4),
            "kernels_s": round(sum(r["kernels_s"] for r in rows), 4),
            "gpu_idle_between_layers_s": round(sum(r["gpu_idle_before_s"] or 0.0 for r in rows), 4),
            "host_queue_s": round(sum(r["host_queue_s"] for r in rows), 4),
            "host_result_s": round(sum(r["host_result_s"] for r in rows if r["host_result_s"] == r["host_result_s"]), 4),
        }
        totals["gpu_non_kernel_s"] = round(totals["gpu_span_s"] - totals["kernels_s"], 4)
        return {"rows": rows, "totals": totals}


def print_layer_table(ev: dict) -> None:
    if not ev:
        print("events: no CUDA layer was queued")
        return
    print("per layer (seconds on the host's clock since launch; gpu = the emulation stream's work for the layer):")
    print(f"  {'layer':>5} {'queued at':>9} {'queue':>7} {'gpu start':>9} {'gpu end':>8} {'span':>7} {'kernels':>7} "
          f"{'idle before':>11} {'reduced at':>10} {'reduce':>7}")  # fmt: skip
    for r in ev["rows"]:
        idle = "" if r["gpu_idle_before_s"] is None else f"{r['gpu_idle_before_s']:.4f}"
        print(f"  {r['layer']:>5} {r['host_queue0']:9.3f} {r['host_queue_s']:7.4f} {r['gpu_start']:9.3f} "
              f"{r['gpu_end']:8.3f} {r['gpu_span_s']:7.4f} {r['kernels_s']:7.4f} {idle:>11} "
              f"{r['host_result0']:10.3f} {r['host_result_s']:7.4f}")  # fmt: skip
    t = ev["totals"]
    print(f"  totals: {t['layers']} layers; GPU from {t['gpu_first_start']:.3f} to {t['gpu_last_end']:.3f} s "
          f"({t['gpu_window_s']:.3f} s): layer work {t['gpu_span_s']:.3f} s, of it kernels {t['kernels_s']:.3f} s and "
          f"other GPU work / waits {t['gpu_non_kernel_s']:.3f} s; idle between layers {t['gpu_idle_between_layers_s']:.3f} s; "
          f"host queueing {t['host_queue_s']:.3f} s, host reduce (wait included) {t['host_result_s']:.3f} s")  # fmt: skip


def stage_breakdown(spans: list[dict], marks: dict, report: dict) -> list[tuple[str, float]]:
    """The wall clock cut into consecutive stages: start-up (up to analyze()), analyze() (before the first layer,
    the layers, the tables after them), the write (tables, then the plots' wait, the rename), the rest."""
    first = {}
    for sp in spans:
        first.setdefault(sp["name"], sp)
    an, wr = first.get("analyze()"), first.get("write_analysis (tables + plots + rename)")
    if an is None or wr is None:
        return []
    st = report.get("stages", {})
    layers = st.get("layers_wall_s") or 0.0
    before = max(0.0, an["dt"] - layers - (st.get("tables_s") or 0.0))
    out = [
        ("start-up (to analyze())", an["t0"]),
        ("analyze(): before the first layer", before),
        ("analyze(): layers (first queued to last reduced)", layers),
        ("analyze(): tables after the layers", st.get("tables_s") or 0.0),
        ("between analyze() and the write", wr["t0"] - an["t1"]),
        ("write: tables", st.get("write_tables_s") or 0.0),
        ("write: plots (wait after the tables)", st.get("plots_s") or 0.0),
        ("write: report.json, modes, rename", wr["dt"] - (st.get("write_tables_s") or 0.0) - (st.get("plots_s") or 0.0)),
        ("after the write (to main done)", marks["main_done"] - wr["t1"]),
    ]
    return [(k, round(v, 4)) for k, v in out]


def main():
    global SYNC
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True, type=pathlib.Path)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--events", action="store_true", help="per-layer CUDA events (see the module docstring)")
    ap.add_argument("--cprofile-first-launch", type=int, default=0, metavar="N",
                    help="print the N costliest functions of the first kernel launch")  # fmt: skip
    ap.add_argument("--baseline", action="store_true", help="the previous code path (benchmarks/analyze_baseline.py)")
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

    if args.baseline:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        from analyze_baseline import revert

        print("baseline: undone:", ", ".join(revert()))
    first_launch: dict = {}
    if args.cprofile_first_launch:
        import cProfile
        import io
        import pstats

        def profile_first(module, attr):
            fn = getattr(module, attr)

            @functools.wraps(fn)
            def profiled(*a, **kw):
                if first_launch:
                    return fn(*a, **kw)
                first_launch["started"] = _now()
                prof = cProfile.Profile()
                prof.enable()
                try:
                    return fn(*a, **kw)
                finally:
                    prof.disable()
                    first_launch["host_s"] = round(_now() - first_launch["started"], 4)
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.cprofile_first_launch)
                    first_launch["top"] = text.getvalue()

            setattr(module, attr, profiled)

        profile_first(kernels, "mamba2_launch")
        profile_first(kernels, "delta_rule_launch")
    events = LayerEvents() if args.events else None
    wrap_gen(sources, "synthetic_layers", "inputs: next layer")
    wrap(run, "start_simulation", "simulate (queue)", lambda inputs, *a, **k: {"layer": inputs.meta.get("layer")})
    wrap(sim_mod.PendingTrace, "result", "simulate (wait, host copy)")
    wrap(kernels, "mamba2_launch", "kernel launch", launch_info)
    wrap(kernels, "delta_rule_launch", "kernel launch", launch_info)
    if events is not None:  # outermost: their events bracket the spans' work too
        events.wrap_queue(run, "start_simulation")
        events.wrap_result(sim_mod.PendingTrace)
        events.wrap_launch(kernels, "mamba2_launch")
        events.wrap_launch(kernels, "delta_rule_launch")
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
    layer_events = events.table() if events is not None else None
    stages = stage_breakdown(SPANS, marks, report)
    args.json.write_text(json.dumps({"sync": SYNC, "baseline": args.baseline, "argv": cmd, "marks": marks,
                                     "report_stages": report["stages"], "elapsed_s": report["elapsed_s"],
                                     "stages": stages, "layer_events": layer_events, "first_launch": first_launch,
                                     "totals": totals, "spans": SPANS}, indent=1) + "\n")  # fmt: skip
    width = max(len(k) for k in totals)
    print(f"spans (sync={SYNC}, baseline={args.baseline}), seconds since launch; main done at {marks['main_done']:.3f} s")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]["total_s"]):
        print(f"  {k:<{width}}  x{v['count']:<4} {v['total_s']:8.3f} s")
    print("stages of the wall clock (consecutive):")
    for k, v in stages:
        print(f"  {k:<50} {v:8.3f} s")
    if layer_events is not None:
        print_layer_table(layer_events)
    if first_launch:
        print(f"first kernel launch: {first_launch['host_s']:.3f} s on the host (cProfile on); costliest functions:")
        print(first_launch["top"])
    print(f"EXIT_MARK {time.time():.6f}", flush=True)


if __name__ == "__main__":
    main()
