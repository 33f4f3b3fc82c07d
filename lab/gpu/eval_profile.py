"""Per-step timeline of `evaluate`'s decode loop, folded and unfolded, and a dump of the first non-finite state.

Runs ``loop.decode_pass`` (the loop `evaluate` runs) on a model built in memory (a preset: random weights, as
``models.build.build_random_model``) or loaded (a shipped model or checkpoint), with:

- spans per decode step (host perf_counter and CUDA events, no extra host synchronisation): ``forward`` (the
  model's one-token forward of a run), ``write`` (a variant's state write), ``probe`` (this script's own state
  statistics), ``metrics`` (reference_step / compare_step), ``check`` (the loop's finiteness check, which
  synchronises every CHECK_EVERY steps);
- state probes: for the reference slice and every variant's slice, per step and SSM layer, before the write:
  max |state|, the smallest row amax (a row = one (sequence, head, head_dim) channel, the fp8/int8 scale
  group), how many rows have amax < TINY_ROW_AMAX, finiteness; after the write: finiteness of the stored state.
  A stored state that is non-finite while its input was finite means the quantizer made the NaN;
- torch.profiler over a few folded steps: kernel launches per step and summed GPU kernel time vs wall time
  (launch-bound or GPU-bound).

On an EvalError (non-finite state or logits) the run's probes are dumped: first non-finite (step, layer) of
every slice before and after its write, and the history of the offending layer's statistics up to that step.

    python3 lab/gpu/eval_profile.py nemotron-h-8b OUT_DIR --device cuda --steps 150 --batch 8
    python3 lab/gpu/eval_profile.py tiny-nemotron /tmp/o --device cpu --steps 20 --batch 2   # CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import sys
import time

import torch

from ssmquant.evaluate import loop
from ssmquant.evaluate.graphs import SegmentGraphs
from ssmquant.evaluate.loop import Clock, decode_pass, plan_passes
from ssmquant.evaluate.run import CPU_ROW_MULTIPLE, parse_eval_variants
from ssmquant.evaluate.states import EvalError, StateWriter, get_state, ssm_layers, to_rows
from ssmquant.models import load_model, ssm_layout
from ssmquant.models.text import calibration_batch, load_text

# fp8_e4m3's encode multiplier 448 / amax overflows FP32 below this row amax (448 / FLT_MAX = 1.3e-36); int8's
# (127 / amax) below 3.7e-37. Rows under 1e-30 are counted to see how close a run comes.
TINY_ROW_AMAX = 1e-30
FLT_MAX = torch.finfo(torch.float32).max
FP8_EDGE = 448.0 / FLT_MAX


@contextlib.contextmanager
def _old_codec():
    """The dynamic scales before the vanishing-amax fix (max_code / amax, infinite below max_code / FLT_MAX), on the
    torch write path, to reproduce the first H200 run's folded NaN."""
    from ssmquant.formats import codec

    def old(fmt, amax):
        zero = amax == 0
        mult = torch.where(zero, 1.0, codec.ieee_div(fmt.encoding.max_code, torch.where(zero, 1.0, amax)))
        return mult, codec.ieee_div(1.0, mult)

    saved = codec.scales_from_amax
    codec.scales_from_amax = old
    try:
        yield
    finally:
        codec.scales_from_amax = saved


def _first(flags: torch.Tensor, layers) -> dict | None:
    """The first (step, layer) where flags [T, L] is set, or None."""
    if not flags.any():
        return None
    step, i = (int(v) for v in flags.nonzero()[0])
    return {"step": step, "layer": layers[i].index}


class Spans:
    """Named spans per step: host time (perf_counter) and, on CUDA, device time between two events."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.rows: list[list] = []  # [mode, step, name, host_t0, host_s, ev0, ev1]
        self.mode = ""
        self.step = 0

    def span(self, name: str):
        spans = self

        class _Span:
            def __enter__(self):
                self.ev = None
                if spans.cuda:
                    self.ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    self.ev[0].record()
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                host = time.perf_counter() - self.t0
                if self.ev:
                    self.ev[1].record()
                spans.rows.append([spans.mode, spans.step, name, self.t0, host, *(self.ev or (None, None))])
                return False

        return _Span()

    def table(self) -> list[dict]:
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for mode, step, name, t0, host, e0, e1 in self.rows:
            gpu = e0.elapsed_time(e1) if e0 is not None else None
            out.append({"mode": mode, "step": step, "span": name, "host_t0_s": t0, "host_ms": 1e3 * host, "gpu_ms": gpu})
        return out


class Probe:
    """State statistics of one slice (rows offset .. offset + batch of a run's cache) per step and layer."""

    def __init__(self, name: str, layers, batch: int, steps: int, device):
        self.name, self.layers, self.batch = name, layers, batch
        # [T, L, 5]: max |x|, min row amax, rows with amax < TINY_ROW_AMAX, finite (before the write), nonzero
        # rows with amax below fp8_e4m3's overflow edge 448 / FLT_MAX (infinite multiplier before the codec fix)
        self.pre = torch.full((steps, len(layers), 5), float("nan"), dtype=torch.float64, device=device)
        self.post = torch.ones(steps, len(layers), dtype=torch.bool, device=device)  # stored state finite

    def before(self, cache, t: int, offset: int) -> None:
        stats = []
        for layer in self.layers:
            x = to_rows(get_state(cache, layer, t)[offset : offset + self.batch], layer.kind).float()
            row = x.abs().amax(-1)  # [B, H, rows]
            edge = ((row > 0) & (row < FP8_EDGE)).sum()
            stats.append(torch.stack([x.abs().max(), row.min(), (row < TINY_ROW_AMAX).sum(), torch.isfinite(x).all(), edge]))
        self.pre[t] = torch.stack(stats).double()

    def after(self, cache, t: int, offset: int) -> None:
        self.post[t] = torch.stack(
            [torch.isfinite(get_state(cache, layer, t)[offset : offset + self.batch]).all() for layer in self.layers]
        )

    def report(self, upto: int) -> dict:
        pre, post = self.pre[: upto + 1].cpu(), self.post[: upto + 1].cpu()
        seen = ~torch.isnan(pre[..., 3])  # probed (step, layer); the statistics of a NaN state are NaN
        ok = seen & (pre[..., 3] == 1)
        out = {
            "slice": self.name,
            "steps_probed": int(seen.any(1).sum()),
            "max_abs_finite_state": float(pre[..., 0][ok].max()) if ok.any() else None,
            "min_row_amax_finite_state": float(pre[..., 1][ok].min()) if ok.any() else None,
            "rows_below_tiny_total": int(pre[..., 2][ok].sum()) if ok.any() else 0,
            "nonzero_rows_below_fp8_edge_total": int(pre[..., 4][ok].sum()) if ok.any() else 0,
            "first_row_below_fp8_edge": _first(pre[..., 4] > 0, self.layers),
            "min_row_amax_per_layer": {
                layer.index: float(pre[:, i, 1][ok[:, i]].min()) if ok[:, i].any() else None
                for i, layer in enumerate(self.layers)
            },
        }
        for what, bad in (("pre_write", seen & (pre[..., 3] == 0)), ("post_write", ~post)):
            if bad.any():
                step, i = (int(v) for v in bad.nonzero()[0])
                layer = self.layers[i]
                h = pre[: step + 1, i]
                out[f"first_nonfinite_{what}"] = {
                    "step": step,
                    "layer": layer.index,
                    "layer_position": i,
                    "input_finite_at_that_write": bool(pre[step, i, 3] == 1),
                    "min_row_amax_at_that_step": float(pre[step, i, 1]),
                    "history_max_abs": h[:, 0].tolist(),
                    "history_min_row_amax": h[:, 1].tolist(),
                    "history_rows_below_tiny": h[:, 2].tolist(),
                }
        return out


class ProbedWriter:
    """A StateWriter wrapped with a span and its slice's probe (before and after the write)."""

    def __init__(self, writer: StateWriter, probe: Probe, spans: Spans, probes_on: bool):
        self.writer, self.probe, self.spans, self.probes_on = writer, probe, spans, probes_on

    inject_at: int | None = None  # --inject-tiny-row

    def __call__(self, cache, t: int, offset: int = 0) -> None:
        if t == self.inject_at:
            layer = self.probe.layers[0]
            row = to_rows(get_state(cache, layer, t)[offset], layer.kind)[0, 0]  # sequence 0, head 0, row 0
            row.zero_()
            row[0] = 1e-38
        if self.probes_on:
            with self.spans.span("probe"):
                self.probe.before(cache, t, offset)
        with self.spans.span("write"):
            self.writer(cache, t, offset)
        if self.probes_on:
            with self.spans.span("probe"):
                self.probe.after(cache, t, offset)

    def first_nonfinite(self):
        return self.writer.first_nonfinite()


def instrument(spans: Spans, ref_probe: Probe | None, batch: int):
    """Patch the loop's forward, metrics and check with spans; the first run of a pass probes the reference."""
    base = loop.TeacherForced
    created = []

    class TimedRun(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            created.append(self)

        def step(self, t):
            spans.step = t
            with spans.span("forward"):
                out = super().step(t)
            if ref_probe is not None and self is created[0] and t > 0:  # step 0: the cache is not folded yet
                with spans.span("probe"):
                    ref_probe.before(self.cache, t, 0)
            return out

    def timed(name, fn):
        def wrapper(*a, **k):
            with spans.span(name):
                return fn(*a, **k)

        return wrapper

    loop.TeacherForced = TimedRun
    loop.reference_step = timed("metrics", loop.reference_step)
    loop.compare_step = timed("metrics", loop.compare_step)
    loop._check = timed("check", loop._check)
    return created


def run_mode(
    args,
    net,
    ids,
    vlist,
    layers,
    state_shape,
    dev,
    fold: bool,
    probes_on: bool,
    prof=None,
    graphs: bool = False,
    old_codec: bool = False,
) -> dict:
    """One decode pass (folded or not, with CUDA graphs of the segments or not) over ids, instrumented; returns
    rates, spans and probe reports."""
    batch, steps = ids.shape[0], ids.shape[1] - 1
    spans = Spans(dev)
    spans.mode = ("folded" if fold else "unfolded") + ("+graphs" if graphs else "") + ("+oldcodec" if old_codec else "")
    saved = (loop.TeacherForced, loop.reference_step, loop.compare_step, loop._check)
    ref_probe = Probe("reference", layers, batch, steps, dev)
    writers = {
        i: ProbedWriter(
            StateWriter(v, layers, batch, steps, kernel=False if old_codec else None),
            Probe(v.name, layers, batch, steps, dev),
            spans,
            probes_on,
        )
        for i, v in enumerate(vlist)
    }
    writers[0].inject_at = args.inject_tiny_row
    rows = CPU_ROW_MULTIPLE if dev.type == "cpu" else 1
    exact = frozenset(i for i, v in enumerate(vlist) if v.format.is_exact)
    plan = plan_passes(len(vlist), fold, None, exact, rows)[0]
    values = torch.zeros(len(vlist), 3, batch, steps, dtype=torch.float64, device=dev)
    ref_nll = torch.zeros(batch, steps, dtype=torch.float64, device=dev)
    clock = Clock(steps, dev, lambda line: print(f"  [{spans.mode}] {line}", flush=True))
    marks = []

    def progress():
        marks.append(time.perf_counter())
        if prof is not None:
            prof.step()

    instrument(spans, ref_probe if probes_on else None, batch)
    error = None
    segment_graphs = SegmentGraphs(net) if graphs else contextlib.nullcontext()
    t0 = time.perf_counter()
    try:
        with torch.inference_mode(), segment_graphs, _old_codec() if old_codec else contextlib.nullcontext():
            decode_pass(net, ids, plan, writers, layers, state_shape, values, ref_nll, clock, progress=progress)
    except EvalError as err:
        error = str(err)
        print(f"  [{spans.mode}] stopped: {error}", flush=True)
    finally:
        loop.TeacherForced, loop.reference_step, loop.compare_step, loop._check = saved
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    done = len(marks)
    # steady rate: from the end of step 1 (step 0 allocates the cache and folds it) to the end
    rate = (done - 2) / (marks[-1] - marks[1]) if done > 3 else None
    table = spans.table()
    per_span: dict[str, dict] = {}
    for r in table:
        if r["step"] < 2:
            continue
        s = per_span.setdefault(r["span"], {"calls": 0, "host_ms": 0.0, "gpu_ms": 0.0})
        s["calls"] += 1
        s["host_ms"] += r["host_ms"]
        s["gpu_ms"] += r["gpu_ms"] or 0.0
    n = max(done - 2, 1)
    for s in per_span.values():
        host, gpu = s.pop("host_ms"), s.pop("gpu_ms")
        s["host_ms_per_step"] = round(host / n, 3)
        s["gpu_ms_per_step"] = round(gpu / n, 3) if dev.type == "cuda" else None
    upto = done  # the steps that ran (the failing step included)
    res = {
        "mode": spans.mode,
        "probes": probes_on,
        "forward_batch": (len(plan.runs[0]) * batch) if fold else batch,
        "steps_done": done,
        "wall_s": round(wall, 3),
        "steady_steps_per_s": round(rate, 3) if rate else None,
        "ms_per_step": round(1e3 / rate, 3) if rate else None,
        "per_span_per_step": per_span,
        "error": error,
    }
    if graphs:
        res["graphs"] = {**segment_graphs.stats, "broken": segment_graphs.broken}
    if probes_on:
        res["probe"] = [ref_probe.report(upto - 1)] + [w.probe.report(upto - 1) for w in writers.values()]
    return res, table


def profile_steps(args, net, ids, vlist, layers, state_shape, dev, fold: bool, graphs: bool = False) -> dict:
    """torch.profiler over a few decode steps (after 3 warm steps): kernel count and GPU time vs wall per step."""
    from torch.profiler import ProfilerActivity, profile, schedule

    active = args.profile_steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    short = ids[:, : 3 + active + 1 + 1]
    with profile(activities=acts, schedule=schedule(wait=2, warmup=1, active=active)) as prof:
        res, _ = run_mode(args, net, short, vlist, layers, state_shape, dev, fold, False, prof=prof, graphs=graphs)
    events = prof.key_averages()
    kernels = 0
    kernel_us = 0.0
    for e in events:
        dt = str(getattr(e, "device_type", ""))
        if "CUDA" in dt:
            kernels += e.count
            kernel_us += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    try:
        text = events.table(sort_by=sort, row_limit=45)
    except Exception as err:  # a sort key this torch does not know: the table unsorted
        text = f"(sort by {sort} failed: {err})\n" + events.table(row_limit=45)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    return {
        "mode": res["mode"],
        "active_steps": active,
        "gpu_kernels_per_step": kernels / active,
        "launch_calls_per_step": launches / active,
        "gpu_kernel_ms_per_step": kernel_us / 1e3 / active,
        "wall_ms_per_step_under_profiler": res["ms_per_step"],
        "table": text,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a preset (built in memory with random weights) or a shipped model / checkpoint")
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variants", default="fp8_e4m3@conventional,nvfp4@conventional,int8@replay16")
    ap.add_argument(
        "--runs",
        default="folded+probe+oldcodec,profile,profile+unfolded,folded+graphs,unfolded+graphs,profile+graphs,unfolded,"
        "folded+probe",
        help="in order: decode runs folded | unfolded, +probe for the state statistics (the dump on a NaN), +graphs "
        "for CUDA graphs of the segments, +oldcodec for the dynamic scales before the vanishing-amax fix (torch "
        "writes); profile[+unfolded][+graphs]: torch.profiler over --profile-steps steps",
    )
    ap.add_argument(
        "--inject-tiny-row",
        type=int,
        default=None,
        metavar="STEP",
        help="self-check of the dump: before the first variant's write at STEP, set one row of its first SSM "
        "layer's state to (1e-38, 0, 0, ...) (finite) and see what the write makes of it",
    )
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of a preset build (default: all)")
    args = ap.parse_args(argv)

    from pathlib import Path

    from ssmquant.models.presets import get_preset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    t = time.time()
    try:
        get_preset(args.model)
        is_preset = True
    except Exception:
        is_preset = False
    if is_preset:
        from ssmquant.models.build import build_random_model

        loaded = build_random_model(args.model, devices=args.device, num_layers=args.layers)
    else:
        loaded = load_model(args.model, device=dev)
    net = loaded.model.eval()
    print(f"model {args.model} ready in {time.time() - t:.1f} s ({'built in memory' if is_preset else 'loaded'})",
          flush=True)  # fmt: skip
    layout = ssm_layout(net.config)
    state_shape = tuple(layout["state_shape"])
    layers = ssm_layers(net)
    vlist = parse_eval_variants(args.variants)
    text = load_text(None)
    ids = calibration_batch(args.batch, args.steps + 1, tokenizer=loaded.tokenizer, text=text, seed=0, split="heldout")
    ids = ids.to(net.get_input_embeddings().weight.device)

    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
        "batch": args.batch,
        "variants": [v.name for v in vlist],
        "ssm_layers": [layer.index for layer in layers],
        "tiny_row_amax": TINY_ROW_AMAX,
        "fp8_mult_overflow_below": FP8_EDGE,
        "runs": [],
    }
    timeline = []
    # warm-up: CUDA context, cuBLAS handles, allocator
    run_mode(args, net, ids[:, :4], vlist, layers, state_shape, dev, True, probes_on=False)
    result["profiler"] = []
    for spec in args.runs.split(","):
        parts = spec.split("+")
        mode, extras = parts[0], set(parts[1:])
        if mode not in ("folded", "unfolded", "profile") or not extras <= {"probe", "graphs", "unfolded", "oldcodec"}:
            raise SystemExit(
                f"bad run {spec!r}; accepted: folded | unfolded, each optionally +probe and/or +graphs; "
                "profile (folded) or profile+unfolded, optionally +graphs"
            )
        graphs = "graphs" in extras
        if mode == "profile":
            if args.profile_steps <= 0:
                continue
            fold = "unfolded" not in extras
            p = profile_steps(args, net, ids, vlist, layers, state_shape, dev, fold, graphs)
            name = ("folded" if fold else "unfolded") + ("_graphs" if graphs else "")
            (out / f"profile_{name}.txt").write_text(p.pop("table"))
            print("profiler", json.dumps(p), flush=True)
            result["profiler"].append(p)
            (out / "eval_profile.json").write_text(json.dumps(result, indent=1, default=str))
            continue
        fold, probes_on = mode == "folded", "probe" in extras
        print(f"== {spec}: {args.steps} steps x batch {args.batch}", flush=True)
        res, table = run_mode(
            args, net, ids, vlist, layers, state_shape, dev, fold, probes_on, graphs=graphs, old_codec="oldcodec" in extras
        )
        print(json.dumps({k: v for k, v in res.items() if k != "probe"}, default=str), flush=True)
        for p in res.get("probe", []):
            print("  probe", json.dumps({k: v for k, v in p.items() if not k.startswith(("first", "min_row_amax_per"))}),
                  flush=True)  # fmt: skip
            for k in ("first_nonfinite_pre_write", "first_nonfinite_post_write"):
                if k in p:
                    d = p[k]
                    print(f"  {p['slice']}: {k} step {d['step']} layer {d['layer']} input finite "
                          f"{d['input_finite_at_that_write']} min row amax {d['min_row_amax_at_that_step']:.3g}",
                          flush=True)  # fmt: skip
        result["runs"].append(res)
        timeline += table if not probes_on else []
        (out / "eval_profile.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "eval_profile.json").write_text(json.dumps(result, indent=1, default=str))
    with open(out / "timeline.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["mode", "step", "span", "host_t0_s", "host_ms", "gpu_ms"])
        w.writeheader()
        w.writerows(timeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
