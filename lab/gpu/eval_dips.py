"""Why `evaluate`'s decode rate dips: every decode step timed on the host and on the device, with what happened in
it, and an A/B of the cheap candidate fixes in one process. Part of lab/gpu/eval_dips.sh.

    python3 lab/gpu/eval_dips.py MODEL OUT_JSON --steps 256 --batch 8 --device cuda --budget 110

Per decode step (the loop's own code, wrapped from outside: ``TeacherForced.step``, ``StateWriter.__call__``, the
metrics, ``loop._check``, ``Clock.step``, transformers' ``DynamicLayer.update`` and torch's
``scaled_dot_product_attention``):

- host: wall time between step ends (``perf_counter``) and the host time spent in the forward, in attention
  (SDPA calls), in the KV-cache update, in the state writes, the metrics and the window check (a host sync);
- device: CUDA events at the step's start, after the forward, after the state writes and at its end, so the
  device time of each part; ``lag_ms``: how long after the host queued the step's end the device reached it
  (anchored by a synchronisation before the run): near 0 the device waited for the host (launch-bound), large
  the host ran ahead;
- Python's garbage collections in the step (``gc.callbacks``: generation, milliseconds);
- the CUDA caching allocator's counters after the step (cudaMalloc / cudaFree calls, retries, segments);
- whether the step read the window checks (every ``loop.CHECK_EVERY`` steps) or printed a progress line;
- the SDPA backend torch picks for the step's attention inputs (``torch._fused_sdp_choice``).

A step is *slow* when its device time (host time on the CPU) exceeds 1.5 x the run's median; the report gives, per
factor, how often slow steps have it against the others, the correlation with the step time, and the slowest steps.

Runs (each a fresh ``evaluate`` of ``--steps`` steps, the default loop otherwise; ``--runs`` picks and orders them):
``base`` (first: cold caches), ``again`` (the same: what a warm process gives), ``gcoff`` (``gc.freeze()`` +
``gc.disable()`` around the run), ``expandable`` (the allocator switched to ``expandable_segments:True`` after
``empty_cache``, for the segments allocated from then on), ``flash`` (cuDNN's SDPA disabled: torch falls back to
flash attention), ``flash_kvbuf`` (that and ``kv_buffer=True``), ``kvbuf`` (the preallocated KV cache with the
default backend). Checks: runs that must be bit-identical (base / again / gcoff / expandable; flash / flash_kvbuf;
base / kvbuf is reported, not required) and flash vs base within eval_speed's tolerances (another attention kernel).
Since 2026-12-01 ``evaluate`` decodes without cuDNN's attention by default (``decode.decode_attention``, the fix this
script's first GPU run, s1, led to): then base / again / gcoff / expandable / kvbuf run flash attention like the
flash runs; ``--cudnn-attention`` (CUDNN=1 in eval_dips.sh) gives them ``cudnn_attention=True``, torch's own choice,
as s1 ran them.

``--probe``: attention alone at the model's decode shapes (a batch the runs never used, so torch's per-shape caches
are cold): host time of the first and second call at each KV length, contiguous (``torch.cat``'s layout) vs a view
of a larger buffer, per backend, and whether the two layouts give the same bits.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback

import numpy as np
import torch
from eval_speed import AGREE, _agree, _exact, _load, run_environment
from transformers.cache_utils import DynamicLayer

from ssmquant.evaluate import EvalConfig, evaluate
from ssmquant.evaluate import decode as decode_mod
from ssmquant.evaluate import loop as loop_mod
from ssmquant.evaluate import states as states_mod

RUNS = ("base", "again", "gcoff", "expandable", "flash", "flash_kvbuf", "kvbuf")
DEFAULT_RUNS = "base,again,flash,flash_kvbuf,gcoff,expandable"
EXACT_PAIRS = [("base", "again"), ("again", "gcoff"), ("again", "expandable"), ("flash", "flash_kvbuf")]
REPORT_PAIRS = [("base", "kvbuf")]  # reported, not required (r7: the KV buffer changed bits with the default backend)
AGREE_PAIRS = [("again", "flash")]
SLOW = 1.5  # a step slower than SLOW x the run's median step time is slow
ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _backend_names() -> dict[int, str]:
    from torch.nn.attention import SDPBackend

    return {int(v.value): k.lower() for k, v in SDPBackend.__members__.items()}


class Tracer:
    """Wraps the decode loop's parts (see the module docstring) while ``active`` and records one dict per step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.steps: list[dict] = []
        self.cur: dict | None = None
        self.active = False
        self._gc_t0 = 0.0
        self._sdpa_choice_done = False
        self.backends = _backend_names()
        self.anchor = None
        self.h_anchor = 0.0
        self.alloc_before: dict | None = None
        self.sdpa_call: dict | None = None  # shapes and arguments of the first traced attention call

    # -- recording helpers
    def _event(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _alloc(self) -> dict:
        if not self.cuda:
            return {}
        s = torch.cuda.memory_stats_as_nested_dict(self.device)
        out = {k: int(s.get(k, 0)) for k in ALLOC_KEYS}
        out["segments"] = int(s.get("segment", {}).get("all", {}).get("current", 0))
        return out

    def begin_run(self) -> None:
        self.steps, self.cur = [], None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.anchor = self._event()
            torch.cuda.synchronize(self.device)
        self.h_anchor = time.perf_counter()
        self.alloc_before = self._alloc()
        self.h_last = self.h_anchor
        self.active = True

    def end_run(self) -> None:
        self.active = False
        if self.cur is not None:  # a run that raised inside a step
            self.cur = None

    def _step(self) -> dict:
        if self.cur is None:
            self.cur = {
                "h_start": time.perf_counter(),
                "e_start": self._event(),
                "fwd_host_ms": 0.0,
                "sdpa_host_ms": 0.0,
                "sdpa_calls": 0,
                "kv_update_host_ms": 0.0,
                "writes_host_ms": 0.0,
                "metrics_host_ms": 0.0,
                "check_host_ms": 0.0,
                "gc": [],
                "notify": False,
                "check": False,
                "sdpa_backend": None,
            }
            self._sdpa_choice_done = False
        return self.cur

    # -- wrapped pieces
    def wrap(self):
        """Install the wrappers; returns a function that removes them."""
        tr = self
        saved = []

        def patch(obj, name, make):
            orig = getattr(obj, name)
            saved.append((obj, name, orig))
            setattr(obj, name, make(orig))

        def timed(key, event_key=None):
            def make(orig):
                def run(*a, **k):
                    if not tr.active:
                        return orig(*a, **k)
                    cur = tr._step()
                    t = time.perf_counter()
                    out = orig(*a, **k)
                    cur[key] += 1e3 * (time.perf_counter() - t)
                    if event_key:
                        cur[event_key] = tr._event()
                    return out

                return run

            return make

        patch(decode_mod.TeacherForced, "step", timed("fwd_host_ms", "e_fwd"))
        patch(states_mod.StateWriter, "__call__", timed("writes_host_ms", "e_writes"))
        patch(loop_mod, "reference_step", timed("metrics_host_ms"))
        patch(loop_mod, "compare_step", timed("metrics_host_ms"))
        patch(DynamicLayer, "update", timed("kv_update_host_ms"))

        def make_check(orig):
            def run(*a, **k):
                if not tr.active:
                    return orig(*a, **k)
                cur = tr._step()
                cur["check"] = True
                t = time.perf_counter()
                out = orig(*a, **k)
                cur["check_host_ms"] += 1e3 * (time.perf_counter() - t)
                return out

            return run

        patch(loop_mod, "_check", make_check)

        def make_sdpa(orig):
            def run(q, k, v, *a, **kw):
                if not tr.active:
                    return orig(q, k, v, *a, **kw)
                cur = tr._step()
                if not tr._sdpa_choice_done:  # the backend for this step's shapes and strides (first layer)
                    tr._sdpa_choice_done = True
                    with contextlib.suppress(Exception):
                        choice = torch._fused_sdp_choice(
                            q, k, v, kw.get("attn_mask"), kw.get("dropout_p", 0.0), kw.get("is_causal", False),
                            scale=kw.get("scale"), enable_gqa=kw.get("enable_gqa", False),
                        )  # fmt: skip
                        cur["sdpa_backend"] = tr.backends.get(int(choice), str(choice))
                    cur["kv_len"] = int(k.shape[-2])
                    cur["kv_contiguous"] = bool(k.is_contiguous())
                    if tr.sdpa_call is None:  # what transformers passes (the probe mimics it)
                        mask = kw.get("attn_mask")
                        tr.sdpa_call = {
                            "q": list(q.shape), "k": list(k.shape), "k_stride": list(k.stride()),
                            "dtype": str(q.dtype), "enable_gqa": bool(kw.get("enable_gqa", False)),
                            "is_causal": bool(kw.get("is_causal", False)),
                            "attn_mask": None if mask is None else [list(mask.shape), str(mask.dtype)],
                        }  # fmt: skip
                t = time.perf_counter()
                out = orig(q, k, v, *a, **kw)
                cur["sdpa_host_ms"] += 1e3 * (time.perf_counter() - t)
                cur["sdpa_calls"] += 1
                return out

            return run

        patch(torch.nn.functional, "scaled_dot_product_attention", make_sdpa)

        def make_clock(orig):
            def run(clock, *a, **k):
                if not tr.active:
                    return orig(clock, *a, **k)
                cur = tr._step()
                n_marks = len(clock.marks)
                last = clock.last_report
                was_estimated = clock.estimated
                out = orig(clock, *a, **k)
                cur["notify"] = clock.last_report != last or clock.estimated != was_estimated
                cur["window_mark"] = len(clock.marks) != n_marks
                cur["e_end"] = tr._event()
                h = time.perf_counter()
                cur["h_end"] = h
                cur["host_step_ms"] = 1e3 * (h - tr.h_last)
                tr.h_last = h
                cur["alloc"] = tr._alloc()
                tr.steps.append(cur)
                tr.cur = None
                return out

            return run

        patch(loop_mod.Clock, "step", make_clock)

        def on_gc(phase, info):
            if not tr.active:
                return
            if phase == "start":
                tr._gc_t0 = time.perf_counter()
            else:
                ms = 1e3 * (time.perf_counter() - tr._gc_t0)
                tr._step()["gc"].append((int(info.get("generation", -1)), round(ms, 3)))

        gc.callbacks.append(on_gc)

        def undo():
            gc.callbacks.remove(on_gc)
            for obj, name, orig in reversed(saved):
                setattr(obj, name, orig)

        return undo

    # -- after the run (the device is idle: evaluate ends on a host read)
    def table(self) -> list[dict]:
        rows = []
        prev_alloc = self.alloc_before or {}
        prev_end = self.anchor
        for i, s in enumerate(self.steps):
            row = {
                "step": i,
                "host_step_ms": round(s["host_step_ms"], 3),
                **{k: round(s[k], 3) for k in ("fwd_host_ms", "sdpa_host_ms", "kv_update_host_ms", "writes_host_ms",
                                               "metrics_host_ms", "check_host_ms")},  # fmt: skip
                "sdpa_calls": s["sdpa_calls"],
                "sdpa_backend": s["sdpa_backend"],
                "kv_len": s.get("kv_len"),
                "kv_contiguous": s.get("kv_contiguous"),
                "gc": s["gc"],
                "gc_ms": round(sum(ms for _, ms in s["gc"]), 3),
                "gc_gen2": any(g == 2 for g, _ in s["gc"]),
                "check": s["check"],
                "notify": s["notify"],
            }
            a = s.get("alloc") or {}
            row["alloc_delta"] = {k: a[k] - prev_alloc.get(k, 0) for k in a}
            row["segments"] = a.get("segments")
            prev_alloc = a or prev_alloc
            if self.cuda:
                e_end, e_start = s["e_end"], s["e_start"]
                e_fwd = s["e_fwd"] if s.get("e_fwd") is not None else e_start
                e_wr = s["e_writes"] if s.get("e_writes") is not None else e_fwd  # exact variants write nothing
                row["gpu_step_ms"] = round(prev_end.elapsed_time(e_end), 3)
                row["gpu_fwd_ms"] = round(e_start.elapsed_time(e_fwd), 3)
                row["gpu_writes_ms"] = round(e_fwd.elapsed_time(e_wr), 3)
                row["gpu_rest_ms"] = round(e_wr.elapsed_time(e_end), 3)
                gpu_at_end = self.h_anchor + self.anchor.elapsed_time(e_end) / 1e3
                row["lag_ms"] = round(1e3 * (gpu_at_end - s["h_end"]), 3)
                prev_end = e_end
            rows.append(row)
        return rows


def correlate(rows: list[dict], key: str) -> dict:
    """Slow steps (``key`` > SLOW x median) against each recorded factor."""
    rows = rows[2:]  # steps 0-1: the caches' first allocation and the graphs' warm-up and recording
    if len(rows) < 4:
        return {}
    t = np.array([r[key] for r in rows])
    med = float(np.median(t))
    slow = t > SLOW * med
    out = {
        "time": key,
        "median_ms": round(med, 3),
        "mean_ms": round(float(t.mean()), 3),
        "slow_steps": int(slow.sum()),
        "excess_ms_in_slow_steps": round(float((t[slow] - med).sum()), 1),
        "excess_ms_all_steps": round(float(np.clip(t - med, 0, None).sum()), 1),
    }
    flags = {
        "gc_any": [bool(r["gc"]) for r in rows],
        "gc_gen2": [r["gc_gen2"] for r in rows],
        "cudaMalloc": [r["alloc_delta"].get("num_device_alloc", 0) > 0 for r in rows],
        "cudaFree": [r["alloc_delta"].get("num_device_free", 0) > 0 for r in rows],
        "alloc_retry": [r["alloc_delta"].get("num_alloc_retries", 0) > 0 for r in rows],
        "check": [r["check"] for r in rows],
        "notify": [r["notify"] for r in rows],
    }
    fl = {}
    for name, f in flags.items():
        f = np.array(f, dtype=bool)
        fl[name] = {
            "steps_with": int(f.sum()),
            "slow_with": int((f & slow).sum()),
            "p_slow_given": round(float(slow[f].mean()), 3) if f.any() else None,
            "p_slow_given_not": round(float(slow[~f].mean()), 3) if (~f).any() else None,
        }
    out["flags"] = fl
    cont = {}
    for name in ("sdpa_host_ms", "kv_update_host_ms", "fwd_host_ms", "writes_host_ms", "metrics_host_ms",
                 "check_host_ms", "gc_ms", "host_step_ms", "gpu_fwd_ms", "gpu_writes_ms", "gpu_rest_ms", "lag_ms"):  # fmt: skip
        if name == key or name not in rows[0]:
            continue
        x = np.array([r[name] for r in rows], dtype=float)
        r = float(np.corrcoef(x, t)[0, 1]) if x.std() > 0 and t.std() > 0 else None
        cont[name] = {
            "r": None if r is None else round(r, 3),
            "mean_slow": round(float(x[slow].mean()), 3) if slow.any() else None,
            "mean_other": round(float(x[~slow].mean()), 3) if (~slow).any() else None,
        }
    out["continuous"] = cont
    order = np.argsort(-t)[:8]
    keep = ("step", key, "host_step_ms", "gpu_step_ms", "fwd_host_ms", "sdpa_host_ms", "gpu_fwd_ms", "gpu_writes_ms",
            "lag_ms", "gc", "alloc_delta", "check", "notify", "kv_len", "sdpa_backend")  # fmt: skip
    out["slowest"] = [{k: rows[i][k] for k in keep if k in rows[i]} for i in order]
    return out


def windows(rows: list[dict], key: str, every: int) -> list[float]:
    """Steps/s per window of ``every`` steps, from the per-step times in ``key``."""
    t = [r[key] for r in rows]
    return [round(every / (sum(t[i : i + every]) / 1e3), 2) for i in range(0, len(t) - every + 1, every)]


@contextlib.contextmanager
def run_setting(name: str, device: torch.device):
    """The process-wide switch of a run: gc off, expandable segments, or cuDNN attention off."""
    if name == "gcoff":
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
            gc.unfreeze()
    elif name == "expandable":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        try:
            yield
        finally:
            torch.cuda.synchronize(device)
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
            torch.cuda.empty_cache()
    elif name.startswith("flash"):
        was = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            yield
        finally:
            torch.backends.cuda.enable_cudnn_sdp(was)
    else:
        yield


def sdpa_probe(call: dict, batch: int, device: torch.device, lengths: list[int], capacity: int) -> dict:
    """Attention alone as the decode loop calls it (``call``: the traced call's query shape, KV heads, dtype,
    ``enable_gqa``; no mask) at another batch: per backend and KV length, host ms of the first and the second call
    (synchronised), the backend torch picks, and whether a view of a [batch, kv_heads, capacity, d] buffer gives the
    bits of the contiguous tensor."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, heads, q_len, d = call["q"]
    kv_heads = call["k"][1]
    gqa = call["enable_gqa"]
    g = torch.Generator(device=device).manual_seed(1)
    dt = getattr(torch, call["dtype"].replace("torch.", ""))
    kb = torch.randn(batch, kv_heads, capacity, d, generator=g, device=device, dtype=dt)
    vb = torch.randn(batch, kv_heads, capacity, d, generator=g, device=device, dtype=dt)
    q = torch.randn(batch, heads, q_len, d, generator=g, device=device, dtype=dt)
    names = _backend_names()
    out = {"call": call, "batch": batch, "capacity": capacity}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    backends = {"default": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
                "efficient": [SDPBackend.EFFICIENT_ATTENTION]}  # fmt: skip
    for label, which in backends.items():
        res = {}
        for n in lengths:
            views = {"view": (kb[:, :, :n], vb[:, :, :n]), "contiguous": (kb[:, :, :n].contiguous(), vb[:, :, :n].contiguous())}
            row = {}
            outs = {}
            for lay, (k, v) in views.items():
                try:
                    with sdpa_kernel(which) if which else contextlib.nullcontext():
                        times = []
                        for _ in range(2):
                            sync()
                            t = time.perf_counter()
                            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
                            sync()
                            times.append(round(1e3 * (time.perf_counter() - t), 3))
                        choice = int(torch._fused_sdp_choice(q, k, v, enable_gqa=gqa))
                    row[lay] = {"first_ms": times[0], "second_ms": times[1], "picked": names.get(choice, choice)}
                    outs[lay] = o
                except Exception as err:  # a backend that cannot run these inputs
                    row[lay] = {"error": f"{type(err).__name__}: {str(err)[:120]}"}
            if len(outs) == 2:
                row["view_equals_contiguous"] = bool(torch.equal(outs["view"], outs["contiguous"]))
                row["max_abs_diff"] = float((outs["view"].float() - outs["contiguous"].float()).abs().max())
            res[n] = row
            if not outs:  # the backend cannot run these inputs (the same at every length)
                break
        out[label] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out_json")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="fp8_e4m3@conventional,nvfp4@conventional,int8@replay16")
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--warm-steps", type=int, default=20, help="steps of the warm-up (replay16 writes at step 15)")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds for the whole process; runs that would not "
                    "fit (estimated from the previous run) are skipped")  # fmt: skip
    ap.add_argument("--cudnn-attention", action="store_true", help="evaluate(cudnn_attention=True) in the runs other "
                    "than flash*: torch's own choice of attention kernel (the default before 2026-12-01)")  # fmt: skip
    ap.add_argument("--probe", action="store_true", help="the attention probe at the end (a few seconds)")
    args = ap.parse_args(argv)
    t_proc = time.time()
    names = args.runs.split(",")
    bad = [n for n in names if n not in RUNS]
    if bad:
        ap.error(f"unknown runs {bad}; accepted: {list(RUNS)}")
    cuda = args.device.startswith("cuda")
    if not cuda and any(n in ("expandable",) or n.startswith("flash") for n in names):
        ap.error("runs expandable / flash* need --device cuda")

    t = time.time()
    loaded, how = _load(args.model, args.device)
    print(f"{args.model}: {how} in {time.time() - t:.1f} s", flush=True)
    dev = loaded.device
    t = time.time()
    evaluate(EvalConfig(loaded, args.variants, steps=args.warm_steps, batch=args.batch), notify=None)
    print(f"warm-up ({args.warm_steps} steps, the default loop: kernels compiled or loaded) {time.time() - t:.1f} s",
          flush=True)  # fmt: skip

    tracer = Tracer(dev)
    undo = tracer.wrap()
    results, res, skipped = {}, {}, []
    env = {**run_environment(args, how, dev), "slow_factor": SLOW, "cudnn_attention": args.cudnn_attention}

    def dump(extra=None) -> dict:
        out = {**env, "runs": res, "skipped": skipped, **(extra or {})}
        with open(args.out_json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        return out

    last_wall = None
    key = "gpu_step_ms" if cuda else "host_step_ms"
    for name in names:
        left = args.budget - (time.time() - t_proc)
        need = 1.15 * last_wall if last_wall else 0.0
        if left < need + 3:
            print(f"== {name}: SKIPPED ({left:.0f} s of the budget left, the last run took {last_wall:.0f} s)", flush=True)
            skipped.append(name)
            continue
        print(f"== {name}", flush=True)
        kw = {
            "kv_buffer": name.endswith("kvbuf"),
            "cudnn_attention": args.cudnn_attention and not name.startswith("flash"),
        }
        t = time.time()
        try:
            with run_setting(name, dev):
                tracer.begin_run()
                try:
                    r = evaluate(EvalConfig(loaded, args.variants, steps=args.steps, batch=args.batch, **kw),
                                 notify=lambda line: print("  " + line, flush=True))  # fmt: skip
                finally:
                    tracer.end_run()
        except Exception as err:  # EvalError or a bug: keep the other runs
            traceback.print_exc()
            res[name] = {"error": f"{type(err).__name__}: {err}", "wall_s": round(time.time() - t, 2)}
            dump()
            continue
        last_wall = time.time() - t
        rows = tracer.table()
        results[name] = r
        corr = correlate(rows, key)
        res[name] = {
            **kw,
            "wall_s": round(last_wall, 2),
            "decode_steps_per_s": r.timing["decode_steps_per_s"],
            "window_steps_per_s": r.timing["window_steps_per_s"],
            "window_steps_per_s_from_" + key: windows(rows, key, loop_mod.CHECK_EVERY),
            "allocator": r.timing.get("allocator"),
            "cuda_graphs": r.timing.get("cuda_graphs"),
            "sdpa_backends": sorted({str(x["sdpa_backend"]) for x in rows}),
            "gc_collections": {g: sum(1 for x in rows for gg, _ in x["gc"] if gg == g) for g in (0, 1, 2)},
            "gc_ms_total": round(sum(x["gc_ms"] for x in rows), 1),
            "sum_ms": {k: round(sum(x.get(k, 0.0) for x in rows), 1) for k in (
                "host_step_ms", "gpu_step_ms", "fwd_host_ms", "sdpa_host_ms", "kv_update_host_ms", "writes_host_ms",
                "metrics_host_ms", "check_host_ms", "gpu_fwd_ms", "gpu_writes_ms", "gpu_rest_ms")},  # fmt: skip
            "median_lag_ms": round(statistics.median(x["lag_ms"] for x in rows), 3) if cuda else None,
            "slow": corr,
            "per_step": rows,
        }
        dump()
        c = corr
        print(f"  {name}: {r.timing['decode_steps_per_s']:.2f} steps/s ({last_wall:.1f} s); windows "
              f"{r.timing['window_steps_per_s']}; median step {c.get('median_ms')} ms, {c.get('slow_steps')} slow "
              f"(> {SLOW} x), excess {c.get('excess_ms_all_steps')} ms; sums {res[name]['sum_ms']}; gc "
              f"{res[name]['gc_collections']} {res[name]['gc_ms_total']} ms; sdpa {res[name]['sdpa_backends']}; "
              f"median lag {res[name]['median_lag_ms']} ms; allocator {r.timing.get('allocator')}", flush=True)  # fmt: skip
        for f, v in c.get("flags", {}).items():
            print(f"    slow vs {f}: {v}", flush=True)
        for f, v in c.get("continuous", {}).items():
            print(f"    slow vs {f}: {v}", flush=True)
        for s in c.get("slowest", [])[:5]:
            print(f"    slow step {s}", flush=True)
    undo()

    checks = {}
    for pairs, check in ((EXACT_PAIRS, _exact), (REPORT_PAIRS, _exact), (AGREE_PAIRS, _agree)):
        for a, b in pairs:
            if a in results and b in results:
                c = checks[f"{a}_vs_{b}"] = check(results[a], results[b])
                c["required"] = pairs is not REPORT_PAIRS
                print(f"{a} vs {b}: {'OK' if c['ok'] else 'DIFFERENT'} {json.dumps(c)}", flush=True)
    extra = {"checks": checks, "agree_tolerances": AGREE, "sdpa_call": tracer.sdpa_call}
    if args.probe:
        left = args.budget - (time.time() - t_proc)
        if left > 8:
            t = time.time()
            try:
                lengths = [2, 3, 64, 65, 127, 128, 129, 130, 200, 255, 256, 257]
                if tracer.sdpa_call is None:
                    raise RuntimeError("no attention call was traced (a model without attention layers?)")
                p = sdpa_probe(tracer.sdpa_call, 4 * args.batch + 1, dev, lengths, args.steps + 1)
            except Exception as err:
                traceback.print_exc()
                p = {"error": f"{type(err).__name__}: {err}"}
            extra["sdpa_probe"] = p
            print(f"attention probe ({time.time() - t:.1f} s): {p.get('call')}, batch {p.get('batch')}; per KV length: "
                  "view / contiguous first-call and second-call host ms, backend picked, view bits == contiguous",
                  flush=True)  # fmt: skip
            for label, v in p.items():
                if not isinstance(v, dict) or label == "call":
                    continue
                for n, row in v.items():
                    cells = [f"{lay} " + (f"{c['first_ms']}/{c['second_ms']} {c['picked']}" if "error" not in c
                                          else c["error"][:60]) for lay, c in row.items() if isinstance(c, dict)]  # fmt: skip
                    print(f"  {label} n={n}: {'; '.join(cells)}; equal {row.get('view_equals_contiguous')}", flush=True)
        else:
            print(f"attention probe SKIPPED ({left:.0f} s left)", flush=True)
    out = dump(extra)
    print("decode steps/s:", json.dumps({n: v.get("decode_steps_per_s") for n, v in out["runs"].items()}), flush=True)
    failed = [n for n, c in checks.items() if c["required"] and not c["ok"]] + [n for n in res if "error" in res[n]]
    if failed:
        print(f"FAILED: {failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
