"""`evaluate` speed on one model: decode steps/s of the new default loop (folded) and the old one (one forward per
run), over short and long runs, per window of steps, and how far their metrics differ. Part of
lab/gpu/eval_speed.sh.

    python3 lab/gpu/eval_speed.py MODEL OUT_JSON --long 256 --short 64 --batch 8 --device cuda

MODEL: a preset (built in memory with random weights: ``models.build.build_random_model``) or anything
``load_model`` takes (a checkpoint directory, a shipped model). Runs, each a fresh ``evaluate`` on the same model
(names: ``new`` = the default on a GPU, ``fold=True``, the preallocated KV cache and the in-place state writes
(``kernels.store_state_triton``); ``old`` = the default before: ``fold=False``, transformers' KV cache growing by
concatenation, ``fake_quant_triton`` + copy + two finiteness checks per state write; ``short`` / ``long``:
``--short`` / ``--long`` steps, 64 / 256 by default):

- ``new_short``, ``new_long``, ``old_short``, ``old_long``: CUDA graphs where allowed (the default), timing per window of
  ``loop.CHECK_EVERY`` steps (``timing.window_steps_per_s``: a rate that falls window after window is a per-step
  cost growing with the position) and the CUDA allocator's cudaMalloc / cudaFree counts during the loop;
- ``new_short_again``: ``new_short`` once more at the end (an order / warm-up effect rather than the run length);
- ``new_eager_short``, ``old_eager_short``: without CUDA graphs;
- ``new_..._kvcat``: the attention layers' KV cache growing by concatenation (``kv_buffer=False``, transformers'
  DynamicLayer) instead of the preallocated ``decode.KVBuffer``; ``old_..._kvbuf``: the old loop with the buffer;
  ``old_..._kvbuf_inplace``: and the in-place writes (the new loop unfolded).

Checks (the process exits with status 1 when one fails, after writing the JSON):

- exact: graphed vs eager (the same kernels on the same addresses), KV buffer vs concatenation (the same values,
  other strides) and a run vs its repeat: metrics equal bit for bit;
- agree: new (folded) vs old (unfolded) on the same sequences. torch's GEMMs choose their kernel by the number
  of rows (32 folded, 8 unfolded), so the logits differ in the last bits and a stored state that rounds across a
  grid midpoint makes that visible per position; averaged over the run the summaries must agree within
  ``AGREE`` (from the 2026-12-01 H200 run: kl_mean within 0.12%, top-1 within 0.2 points).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
import traceback

import numpy as np
import torch

from ssmquant.evaluate import EvalConfig, EvalError, evaluate
from ssmquant.evaluate import run as run_module
from ssmquant.evaluate.states import StateWriter
from ssmquant.models import load_model

METRICS = ["kl", "top1_agree", "delta_loss"]
# new vs old summaries: relative for kl_mean, absolute for the agreement fraction and the loss change (bits)
AGREE = {"kl_mean": ("rel", 2e-2), "top1_agree_mean": ("abs", 1e-2), "delta_loss_mean": ("abs", 1e-2)}


DEFAULT_RUNS = "old_short,new_short,new_long,old_long,new_long_kvcat,old_short_kvbuf_inplace,new_short_again,new_eager_short"
KNOWN_RUNS = {
    f"{a}_{e}{n}{k}"
    for a, kv in (("new", "_kvcat"), ("old", "_kvbuf"), ("old", "_kvbuf_inplace"))
    for e in ("", "eager_")
    for n in ("short", "long")
    for k in ("", kv)
} | {"new_short_again"}


@contextlib.contextmanager
def _writes(in_place: bool):
    """``evaluate``'s state writers built with ``in_place`` (False: the earlier GPU writes, fake_quant_triton + a
    copy + two finiteness checks per state; the same bits)."""
    saved = run_module.StateWriter
    run_module.StateWriter = functools.partial(StateWriter, in_place=in_place)
    try:
        yield
    finally:
        run_module.StateWriter = saved


def _load(spec: str, device: str):
    from ssmquant.models.presets import get_preset

    try:
        get_preset(spec)
    except Exception:
        return load_model(spec, device=torch.device(device)), "loaded"
    from ssmquant.models.build import build_random_model

    return build_random_model(spec, devices=device), "built in memory (random weights)"


def run_environment(args, how: str, device: torch.device) -> dict:
    """What a timed eval ran on: model and how it was made, device, torch / cuDNN / Python versions, steps, batch,
    variants (args: the scripts' --steps, --batch, --variants)."""
    cuda = device.type == "cuda"
    return {
        "model": args.model,
        "how": how,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": sys.version.split()[0],
        "steps": args.steps,
        "batch": args.batch,
        "variants": args.variants.split(","),
    }


def _positions(r, steps: int) -> np.ndarray:
    p = r.positions[r.positions.position <= steps].sort_values(["variant", "position"])
    return p[METRICS].to_numpy()


def _exact(a, b) -> dict:
    n = min(a.config.steps, b.config.steps)
    x, y = _positions(a, n), _positions(b, n)
    diff = np.abs(x - y).max(0)
    same_ref = a.reference["loss_mean"] == b.reference["loss_mean"] if a.config.steps == b.config.steps else None
    return {
        "kind": "exact",
        "positions": n,
        "max_abs_diff": dict(zip(METRICS, diff.tolist())),
        "reference_equal": same_ref,
        "ok": bool((diff == 0).all()) and same_ref is not False,
    }


def _agree(a, b) -> dict:
    sa, sb = a.summary.set_index("variant"), b.summary.set_index("variant")
    out, ok = {}, True
    for col, (kind, tol) in AGREE.items():
        x, y = sa[col].to_numpy(), sb[col].to_numpy()
        d = np.abs(x - y) / np.maximum(np.abs(y), 1e-30) if kind == "rel" else np.abs(x - y)
        out[col] = {"max_" + kind + "_diff": float(d.max()), "tolerance": tol}
        ok &= bool((d <= tol).all())
    ref = abs(a.reference["loss_mean"] - b.reference["loss_mean"]) / abs(b.reference["loss_mean"])
    out["reference_loss_rel_diff"] = ref
    ok &= ref <= 1e-3
    n = min(a.config.steps, b.config.steps)
    per_pos = np.abs(_positions(a, n) - _positions(b, n)).max(0)
    return {"kind": "agree", "summary": out, "per_position_max_abs_diff": dict(zip(METRICS, per_pos.tolist())), "ok": ok}


class _Cache:
    """The one method of a transformers cache that StateWriter reads."""

    def __init__(self, states: dict[int, torch.Tensor]):
        self.states = states

    def get_recurrent_state(self, index: int) -> torch.Tensor:
        return self.states[index]


def _writer_check(variants: str, shape: tuple[int, ...], device: str, layers: int = 3) -> dict:
    """The GPU write path (in place, one Triton kernel per layer: kernels.store_state_triton) against the torch
    path (formats.codec) on states of ``shape`` [B, H, P, N] with row amaxes over 8 decades, one a vanishing row:
    every stored value and finiteness flag equal bit for bit, at steps 0-16 (replay16 writes at step 15)."""
    from ssmquant.evaluate import parse_eval_variants
    from ssmquant.evaluate.states import SSMLayer, StateWriter

    g = torch.Generator(device=device).manual_seed(0)
    base = {}
    for i in range(layers):
        x = torch.randn(shape, generator=g, device=device)
        x *= torch.exp(4 * torch.randn(*shape[:-1], 1, generator=g, device=device))  # row amaxes over decades
        x[0, 0, 0] = 0.0
        x[0, 0, 0, 0] = 1e-37  # below fp8's max_code / FLT_MAX
        base[i] = x
    out = {}
    for v in parse_eval_variants(variants):
        ls = [SSMLayer(i, "mamba2") for i in base]
        writers = {k: StateWriter(v, ls, batch=shape[0], steps=17, kernel=k) for k in (False, True)}
        caches = {k: _Cache({i: x.clone() for i, x in base.items()}) for k in writers}
        equal = True
        for t in range(17):
            for k in writers:
                writers[k](caches[k], t)
            equal &= all(torch.equal(caches[True].states[i], caches[False].states[i]) for i in base)
            f1, f0 = writers[True].finite, writers[False].finite
            equal &= (f1 is None and f0 is None) or torch.equal(f1, f0)
        out[v.name] = bool(equal)
    return {"kind": "exact", "shape": list(shape), "per_variant": out, "ok": all(out.values())}


def _sync_probe(loaded, variants: str, batch: int, steps: int) -> dict:
    """Host synchronisations of the default loop: ``torch.cuda.set_sync_debug_mode("warn")`` makes every op that
    waits for the GPU warn; counted per source line over one run of ``steps`` steps. A line counted about once
    per step is a per-step sync (the loop's own checks: one per 16 steps)."""
    import collections
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            evaluate(EvalConfig(loaded, variants, steps=steps, batch=batch), notify=None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    where = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return {"steps": steps, "syncs": sum(where.values()), "where": dict(where.most_common(15))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out_json")
    ap.add_argument("--long", type=int, default=256)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", required=True)
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--sync-probe", type=int, default=32, help="steps of the host-sync probe run (0: none)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.runs.split(",") if n not in KNOWN_RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}; accepted: {sorted(KNOWN_RUNS)}")
    cuda = args.device.startswith("cuda")

    t = time.time()
    loaded, how = _load(args.model, args.device)
    load_s = time.time() - t
    print(f"{args.model}: {how} in {load_s:.1f} s", flush=True)
    t = time.time()
    # CUDA context, cuBLAS at both batch sizes, Triton kernels; eager: a failure of graph recording must not hide
    # the other numbers
    for fold, in_place in ((False, False), (False, True), (True, True)):  # every kernel the runs launch
        with _writes(in_place):
            evaluate(EvalConfig(loaded, args.variants, steps=4, batch=args.batch, cuda_graphs=False, fold=fold),
                     notify=None)
    print(f"warm-up (4 steps: unfolded with both write paths, folded; kernels compiled or loaded) {time.time() - t:.1f} s",
          flush=True)  # fmt: skip

    def settings(name: str) -> dict:
        parts = name.split("_")
        new = parts[0] == "new"
        kw = {"fold": new, "steps": args.short if "short" in parts else args.long}
        kw["kv_buffer"] = (new and "kvcat" not in parts) or "kvbuf" in parts
        if "eager" in parts:
            kw["cuda_graphs"] = False
        return kw

    checks = {}
    if cuda:
        from ssmquant.models import ssm_layout

        shape = (args.batch, *ssm_layout(loaded.model.config)["state_shape"])
        t = time.time()
        try:
            c = _writer_check(args.variants, shape, args.device)
        except Exception as err:  # keep the runs' numbers
            traceback.print_exc()
            c = {"kind": "exact", "error": f"{type(err).__name__}: {err}", "ok": False}
        checks["state_write_kernel_vs_torch"] = c
        print(f"state writes, Triton in place vs torch, {shape}: {'OK' if c['ok'] else 'FAILED'} {c} "
              f"({time.time() - t:.1f} s)", flush=True)  # fmt: skip

    diagnostics = {}
    if cuda and args.sync_probe:
        t = time.time()
        try:
            d = _sync_probe(loaded, args.variants, args.batch, args.sync_probe)
        except Exception as err:  # a diagnostic: keep going
            traceback.print_exc()
            d = {"error": f"{type(err).__name__}: {err}"}
        diagnostics["sync_probe"] = d
        print(f"host syncs of the default loop over {args.sync_probe} steps: {d} ({time.time() - t:.1f} s)", flush=True)

    runs, res = {}, {}

    def dump() -> dict:
        """eval_speed.json with what has run so far (rewritten after every run: a timeout keeps it)."""
        out = {
            "model": args.model,
            "how": how,
            "load_s": round(load_s, 2),
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "torch": torch.__version__,
            "batch": args.batch,
            "variants": args.variants.split(","),
            "decode_steps_per_s": {n: res[n]["timing"]["decode_steps_per_s"] for n in runs},
            "runs": res,
            "diagnostics": diagnostics,
            "checks": checks,
        }
        with open(args.out_json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        return out

    for name in args.runs.split(","):
        kw = settings(name)
        print(f"== {name}: {kw}", flush=True)
        t = time.time()
        # the old loop with the state writes of before (fake_quant_triton, a copy back, two finiteness checks)
        in_place = kw["fold"] or "inplace" in name
        try:
            with _writes(in_place):
                r = evaluate(EvalConfig(loaded, args.variants, batch=args.batch, **kw),
                             notify=lambda line: print("  " + line, flush=True))  # fmt: skip
        except EvalError as err:
            print(f"  {name} FAILED: {err}", flush=True)
            res[name] = {"error": str(err), "wall_s": round(time.time() - t, 2), **kw}
            continue
        except Exception as err:  # a bug (e.g. in graph recording): keep the other runs' numbers
            traceback.print_exc()
            res[name] = {"error": f"{type(err).__name__}: {err}", "wall_s": round(time.time() - t, 2), **kw}
            continue
        runs[name] = r
        tm = r.timing
        res[name] = {
            **kw,
            "in_place_writes": in_place,
            "wall_s": round(time.time() - t, 2),
            "timing": tm,
            "reference": r.reference,
            "summary": r.summary.to_dict(orient="records"),
            "notes": r.notes,
        }
        dump()
        w = tm["window_steps_per_s"]
        print(f"  {name}: {tm['decode_steps_per_s']:.2f} decode steps/s at batch {args.batch} ({kw['steps']} steps, "
              f"{tm['decode_s']:.1f} s); per {tm['check_every']}-step window {w}; allocator {tm.get('allocator')}; "
              f"graphs {tm.get('cuda_graphs')}", flush=True)  # fmt: skip

    pairs = [
        ("new_short", "new_eager_short", _exact),
        ("old_short", "old_eager_short", _exact),
        ("new_short", "new_short_again", _exact),
        ("new_long", "new_long_kvcat", _exact),
        ("old_long", "old_long_kvbuf", _exact),
        ("old_short", "old_short_kvbuf_inplace", _exact),
        ("new_short", "old_short", _agree),
        ("new_long", "old_long", _agree),
    ]
    for a, b, check in pairs:
        if a in runs and b in runs:
            c = checks[f"{a}_vs_{b}"] = check(runs[a], runs[b])
            print(f"{a} vs {b}: {'OK' if c['ok'] else 'FAILED'} {json.dumps(c)}", flush=True)
    print("decode steps/s:", json.dumps(dump()["decode_steps_per_s"]), flush=True)
    failed = [n for n, c in checks.items() if not c["ok"]] + [n for n in res if "error" in res[n]]
    if failed:
        print(f"FAILED: {failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
