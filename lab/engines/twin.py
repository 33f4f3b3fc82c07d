"""The Triton twin of an engine profile checked against the profile's torch reference, step by step, and timed.

    python -m lab.engines.twin compare --out compare.json [--device cuda] [--batch 8] [--steps 1024] [--heads 64]
                                    [--variants int8@replay16,...] [--jobs 5]
    python -m lab.engines.twin timing --out timing.json [--steps 256] [--timing-variants ...] [--real int8,fp8_e4m3]
                                    [--reps 3] [--jobs 3]
    python -m lab.engines.twin recipes TRITON_DIR TORCH_DIR --out recipes.json

Both backends of the `flashinfer` profile (`engines.emulation.Mamba2EngineStep`, torch; `kernels.mamba2_engine`,
Triton) run the same inputs. At every step each side reports, per (batch, head): the metrics (squared errors and
reference norms, FP32 sums in the backend's own order), the output y [P] and exact fingerprints of what the
variant's state carries (`fingerprint`): the state the metrics see, the checkpoint's code values (replay) and
its per-row decode scales (8-bit). States are elementwise arithmetic plus an order-free amax, so the twin must
equal the torch profile bit for bit there; outputs and metrics sum over the state's last dimension in each
backend's own order, so they are compared as the fraction of bit-identical values and the largest relative
difference. `timing` times the twin as analyses run it (no probe) against the `ideal` fused kernel (and, with
`--real` and FlashInfer importable, the real `checkpointing_ssu` over the same number of steps), after a warm-up:
the first calls (compiles, timed apart) run first in one process per variant (`warm`, --jobs at once), so the
timed calls find the kernels compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ssmquant.kinds import Mamba2Inputs
from ssmquant.replay.variants import Variant

# fingerprint columns: the metric state, the checkpoint (code values or stored values), the decode scales
FINGERPRINTS = ("state", "codes", "scales")
DEFAULT_VARIANTS = (
    "int8@replay16", "fp8_e4m3@replay16", "int8:sr@replay16", "fp8_e4m3:sr@replay16", "bf16@replay16",
    "fp16:sr@conventional", "int16@conventional",
)  # fmt: skip


def fingerprint(v: torch.Tensor, dims: int = 2) -> torch.Tensor:
    """Exact fingerprint of FP32 v over its last `dims` dims (a state [..., P, N]: 2; per-row scales [..., P]: 1):
    the sum of each element's bit pattern (as int32) times its 1-based flat position there, int64 [...]. Sums of
    integers do not depend on their order, so the Triton kernel's partial sums over row blocks add up to the
    same value; a single changed bit (-0 vs +0 included) changes it."""
    tail = v.shape[v.dim() - dims :]
    w = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=v.device).reshape(tail)
    return (v.float().contiguous().view(torch.int32).to(torch.int64) * w).sum(tuple(range(-dims, 0)))


def probe_profile(inputs: Mamba2Inputs, variant: Variant):
    """The torch profile of one engine-profile variant, step by step (the loop of `replay.emulate`).

    Returns (metrics [T, B, H, 4] fp32, fingerprints int64 [T, B, H, 3] (zero where the variant keeps no
    checkpoint / no decode scales), outputs [T, B, H, P] fp32), as `kernels.mamba2_engine.engine_probe`.
    """
    from ssmquant.engines.emulation import engine_step
    from ssmquant.kinds import step_metrics
    from ssmquant.replay.naive import Emulation

    inputs.validate()
    runner = Emulation(inputs, [variant], "state", engine_step)
    eng = runner.engine[0]
    bsz, steps, heads, rows = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows
    dev = inputs.device
    metrics = torch.empty(steps, bsz, heads, 4, device=dev)
    fps = torch.zeros(steps, bsz, heads, 3, dtype=torch.int64, device=dev)
    ys = torch.empty(steps, bsz, heads, rows, device=dev)
    replay = getattr(eng, "replay", False)
    for t in range(steps):
        runner.s_ref, y_ref = runner.physics.advance(runner.s_ref, t)
        s_var, y = runner.variant_step(0, t)
        metrics[t] = step_metrics(s_var, runner.s_ref, y, y_ref)
        ys[t] = y
        fps[t, ..., 0] = fingerprint(s_var)
        if replay:
            fps[t, ..., 1] = fingerprint(eng.codes)
            if eng.dec is not None:
                fps[t, ..., 2] = fingerprint(eng.dec, 1)
    return metrics, fps, ys


def _bits_same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)


def compare_probes(twin, prof, variant: Variant) -> dict:
    """Agreement of the twin's probe with the torch profile's (both as returned by the probe functions).

    Per fingerprint: the fraction of (step, batch, head) entries identical and the first step (1-based)
    where one differs (None: none). Outputs and metrics: fraction of bit-identical values and the largest
    relative difference (|twin - torch| / max(|torch|, tiny)).
    """
    from ssmquant.replay.schemes import SchemeKind

    m_t, f_t, y_t = (x.cpu() for x in twin)
    m_p, f_p, y_p = (x.cpu() for x in prof)
    replay = variant.scheme.kind is SchemeKind.REPLAY
    eight = variant.format.encoding.value in ("int8", "fp8_e4m3")
    kept = {"state": True, "codes": replay, "scales": replay and eight}
    out: dict = {"variant": variant.name, "steps": int(m_t.shape[0]), "batch": int(m_t.shape[1]), "heads": int(m_t.shape[2])}
    for k, name in enumerate(FINGERPRINTS):
        if not kept[name]:
            continue
        same = f_t[..., k] == f_p[..., k]
        bad = (~same).flatten(1).any(1).nonzero()
        out[f"{name}_identical"] = float(same.double().mean())
        out[f"{name}_first_diff_step"] = None if bad.numel() == 0 else int(bad[0, 0]) + 1
    tiny = torch.finfo(torch.float32).tiny
    for name, a, b in (("output", y_t, y_p), ("metric", m_t, m_p)):
        out[f"{name}_identical"] = float(_bits_same(a, b).double().mean())
        rel = (a.double() - b.double()).abs() / b.double().abs().clamp(min=tiny)
        out[f"{name}_max_rel_diff"] = float(rel.max())
    # the error metrics as analyze reports them (relative errors pooled over batch and heads, per step)
    for name, e, r in (("state_rel_err", 0, 1), ("out_rel_err", 2, 3)):
        rt = (m_t[..., e].double().sum((1, 2)) / m_t[..., r].double().sum((1, 2))).sqrt()
        rp = (m_p[..., e].double().sum((1, 2)) / m_p[..., r].double().sum((1, 2))).sqrt()
        out[f"{name}_max_rel_diff"] = float(((rt - rp).abs() / rp.clamp(min=tiny)).nan_to_num(0.0).max())
        out[f"{name}_last"] = [float(rt[-1]), float(rp[-1])]
    return out


def bit_identical(result: dict) -> bool:
    """Every kept fingerprint identical at every step (the twin's contract with the torch profile)."""
    return all(result[f"{n}_identical"] == 1.0 for n in FINGERPRINTS if f"{n}_identical" in result)


# --- timing ------------------------------------------------------------------------------------------------


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def _seconds(fn, dev: torch.device) -> float:
    """Seconds of one fn() (synchronised), perf_counter: what a caller waits, host work and compiles included."""
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def _median_seconds(fn, dev: torch.device, reps: int = 3, warm: bool = True) -> list[float]:
    """Seconds of fn() per repetition, sorted (after one warm-up call unless warm=False): CUDA events on a GPU,
    perf_counter else."""
    if warm:
        fn()
        _sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            out.append(_seconds(fn, dev))
    return sorted(out)


def _timed_backends(spec: str):
    """(label, [variant]) of the twin (`spec` under the flashinfer profile) and of the ideal arithmetic."""
    from ssmquant.replay import parse_variant

    return [("twin", [parse_variant(spec + "~flashinfer")]), ("ideal", [parse_variant(spec)])]


def warm_twin(inputs: Mamba2Inputs, spec: str) -> dict:
    """The first two calls of the twin and of the ideal kernel on `spec`, as analyses launch them (`emulate_triton`,
    no probe), in this process: the first compiles (or loads Triton's on-disk cache), the second runs only.
    compile_s = first - second. Run in processes of their own before `time_twin`, so that its warm-up finds
    the compiled kernels in the cache."""
    from ssmquant.kernels import emulate_triton

    dev = inputs.device
    row: dict = {"variant": spec}
    for label, v in _timed_backends(spec):
        first = _seconds(lambda v=v: emulate_triton(inputs, v), dev)
        second = _seconds(lambda v=v: emulate_triton(inputs, v), dev)
        row.update({f"{label}_first_call_s": first, f"{label}_second_call_s": second, f"{label}_compile_s": first - second})
    return row


def time_twin(inputs: Mamba2Inputs, spec: str, reps: int = 3) -> dict:
    """The fused emulation of `spec` under the flashinfer profile (the twin) and the ideal arithmetic, end to end
    as analyses run them (`emulate_triton`: coefficient tables, launch without the probe, metrics), and the
    profile's coefficient tables alone. Returns the seconds of the first call here (a compile, or a load from
    Triton's cache after `warm_twin`), the sorted seconds of `reps` calls after it, and G state-element-steps
    per second (median)."""
    from ssmquant.engines.profiles import flashinfer_tables
    from ssmquant.kernels import emulate_triton
    from ssmquant.replay import parse_variant
    from ssmquant.replay.schemes import SchemeKind

    dev = inputs.device
    elements = inputs.batch * inputs.num_heads * inputs.rows * inputs.state_dim * inputs.steps
    row: dict = {"variant": spec, "batch": inputs.batch, "steps": inputs.steps, "heads": inputs.num_heads}
    for label, v in _timed_backends(spec):
        fn = lambda v=v: emulate_triton(inputs, v)  # noqa: E731
        row[f"{label}_first_call_here_s"] = _seconds(fn, dev)
        secs = _median_seconds(fn, dev, reps, warm=False)
        row[f"{label}_s"] = secs
        row[f"{label}_gsteps"] = elements / _median(secs) / 1e9
    v = parse_variant(spec)
    if v.scheme.kind is SchemeKind.REPLAY:
        mask = v.scheme.write_mask(inputs.batch, inputs.steps).to(dev)
        row["tables_s"] = _median_seconds(lambda: flashinfer_tables(inputs, mask, v.scheme.buffer_len), dev, reps)
    row["twin_over_ideal"] = _median(row["twin_s"]) / _median(row["ideal_s"])
    return row


def time_real_checkpointing(inputs: Mamba2Inputs, state: str, reps: int = 3) -> dict:
    """FlashInfer's `checkpointing_ssu` (max_window 16, one token per call) over inputs.steps calls at the inputs'
    batch and shapes: cycles of one flushing call (16 ring tokens) and 15 calls that read 8 ring tokens (the mean
    of 1..15; `oracle._ckpt_timing_call`), as one-token decode with L=16 runs them. Captured in a CUDA graph when
    possible (the host's launch cost left out), else launched eagerly (then the host may dominate). Returns
    seconds per steps (sorted repetitions) and G state-element-steps per second (median)."""
    from flashinfer.mamba import checkpointing_ssu

    from .oracle import STATE_DTYPES, _Cache, _ckpt_timing_call

    dev = inputs.device
    bsz, steps, heads, p = inputs.x.shape
    groups, n = inputs.B.shape[2], inputs.B.shape[3]
    c = _Cache(STATE_DTYPES[state], bsz, heads, groups, p, n, 17, dev)
    c.state.copy_(torch.randn(c.state.shape, device=dev).clamp(-100, 100).to(c.state.dtype))
    c.x.normal_()
    c.b.normal_()
    c.dt.uniform_(0.001, 0.1)
    flush = _ckpt_timing_call(checkpointing_ssu, c, inputs, flush=True)
    hold = _ckpt_timing_call(checkpointing_ssu, c, inputs, flush=False)

    def cycle():
        flush()
        for _ in range(15):
            hold()

    cycles = max(1, steps // 16)
    method = "cuda graph"
    first = None
    try:
        first = _seconds(cycle, dev)  # loads the ahead-of-time module
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cycle()
        run = lambda: [graph.replay() for _ in range(cycles)]  # noqa: E731
    except Exception as err:  # noqa: BLE001 - capture is an optimisation; the eager loop runs the same calls
        torch.cuda.synchronize(dev)
        method = f"eager (graph capture failed: {type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err) else ''})"
        run = lambda: [cycle() for _ in range(cycles)]  # noqa: E731
    secs = _median_seconds(run, dev, reps)
    elements = bsz * heads * p * n * cycles * 16
    return {"kernel": f"checkpointing_ssu {state} L=16", "batch": bsz, "steps": cycles * 16, "method": method,
            "first_cycle_s": first, "s": secs, "gsteps": elements / _median(secs) / 1e9}  # fmt: skip


# --- calibrate under the profile: the Triton backend against the torch backend --------------------------------

_ERROR_COLUMNS = {"out_rel_err": "out", "out_rel_err_max": "out", "state_rel_err": "state", "state_rel_err_max": "state"}


def compare_recipes(triton_dir: Path, torch_dir: Path, rtol_state: float = 1e-5, rtol_out: float = 1e-3) -> dict:
    """Two `ssmquant calibrate` recipes of the same run on the two backends: the same choices (per layer, global,
    the refusals) and the same measured errors within the twin's tolerances (states are bit-identical, so state
    errors differ by FP32 summation order only, rtol_state; outputs are summed in another order, rtol_out), in
    candidates.csv and in the held-out verification. Returns the differences found and `ok`."""
    import pandas as pd

    from ssmquant.calibrate import CONFIG_NAME

    for d in (triton_dir, torch_dir):
        if not (d / CONFIG_NAME).is_file():
            raise SystemExit(f"{d} holds no recipe ({CONFIG_NAME} missing): did its calibrate run fail?")
    cfg = [json.loads((d / CONFIG_NAME).read_text()) for d in (triton_dir, torch_dir)]
    backends = [c["producer"]["environment"].get("backend") for c in cfg]
    choices = [{int(r["layer"]): r["setting"]["name"] for r in c["layers"]} for c in cfg]
    glob = [((c.get("global") or {}).get("setting") or {}).get("name") for c in cfg]  # None: no global setting
    refused = [sorted(c["engine_profile"]["refused"]) for c in cfg]
    elapsed = [c["producer"].get("elapsed_s") for c in cfg]
    out: dict = {"backends": backends, "elapsed_s": elapsed, "choices": choices[0], "global": glob[0], "mismatches": []}
    if choices[0] != choices[1]:
        out["mismatches"].append(f"per-layer choices differ: triton {choices[0]} torch {choices[1]}")
    if glob[0] != glob[1]:
        out["mismatches"].append(f"global setting differs: triton {glob[0]} torch {glob[1]}")
    if refused[0] != refused[1]:
        out["mismatches"].append(f"refused settings differ: triton {refused[0]} torch {refused[1]}")
    cands = [pd.read_csv(d / "candidates.csv").set_index(["layer", "setting"]).sort_index() for d in (triton_dir, torch_dir)]
    if list(cands[0].index) != list(cands[1].index) or not cands[0]["runnable"].equals(cands[1]["runnable"]):
        out["mismatches"].append("candidates.csv lists other settings or runnability")
    worst: dict = {}
    rows = [("candidates", cands[0], cands[1])]
    verified = [bool(c.get("verification")) for c in cfg]
    if verified[0] != verified[1]:
        out["mismatches"].append(f"held-out verification ran in one backend only (triton, torch: {verified})")
    elif verified[0]:  # (--no-verify: none)
        ver = [pd.DataFrame(c["verification"]["per_layer"]).set_index("layer").sort_index() for c in cfg]
        rows.append(("verification", ver[0], ver[1]))
    for table, a, b in rows:
        for col, kind in _ERROR_COLUMNS.items():
            if col not in a.columns:
                continue
            x, y = a[col].astype(float), b[col].astype(float)
            if not x.isna().equals(y.isna()):
                out["mismatches"].append(f"{table}.{col}: measured in one backend only")
                continue
            rel = ((x - y).abs() / y.abs().clip(lower=1e-30)).dropna()
            value = float(rel.max()) if len(rel) else 0.0
            worst[f"{table}.{col}"] = value
            if value > (rtol_state if kind == "state" else rtol_out):
                out["mismatches"].append(f"{table}.{col}: relative difference {value:.3g} over {rtol_state if kind == 'state' else rtol_out}")
    out["max_rel_diff"] = worst
    out["tolerances"] = {"state": rtol_state, "out": rtol_out}
    out["ok"] = not out["mismatches"]
    return out


_LIST_FLAGS = {"compare": "--variants", "warm": "--timing-variants"}


def child_argv(part: str, argv: list[str], parent: str, spec: str, out: Path) -> list[str]:
    """The command line (after `-m lab.engines.twin`) of one variant's `part` (compare or warm) in a process
    of its own: the parent's (`parent` part) without its part, variant lists, --jobs and --out, plus these."""
    flags = ("--variants", "--timing-variants", "--jobs", "--out")
    base, skip, named = [], False, False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif a == parent and not named:
            named = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            base.append(a)
    return [part, *base, _LIST_FLAGS[part], spec, "--jobs", "1", "--out", str(out)]


def _in_processes(part: str, argv: list[str], args, specs: list[str]) -> tuple[list[dict], list[str]]:
    """`part` (compare or warm) of each variant in its own process (this module with --jobs 1), at most args.jobs
    at a time; their rows in the order given and the variants that failed. A SIGTERM (the caller's time limit)
    stops them."""
    import os
    import signal
    import subprocess

    parts = [args.out.with_name(f"{args.out.stem}.{part}{i}.json") for i in range(len(specs))]
    procs: list[subprocess.Popen] = []

    def stop(signum, frame):
        for p in procs:
            p.kill()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    pending = list(zip(specs, parts))
    running: list[tuple[str, Path, subprocess.Popen]] = []
    failed = []
    while pending or running:
        while pending and len(running) < args.jobs:
            spec, out = pending.pop(0)
            cmd = [sys.executable, "-m", "lab.engines.twin", *child_argv(part, argv, args.part, spec, out)]
            p = subprocess.Popen(cmd, env=os.environ.copy())
            procs.append(p)
            running.append((spec, out, p))
        time.sleep(0.2)
        for item in [r for r in running if r[2].poll() is not None]:
            running.remove(item)
            if item[2].returncode != 0:
                failed.append(item[0])
    rows = []
    for spec, path in zip(specs, parts):
        if path.is_file():
            rows += json.loads(path.read_text())["rows"]
            path.unlink()
        elif spec not in failed:
            failed.append(spec)
    return rows, failed


# --- driver ------------------------------------------------------------------------------------------------


def _layer(batch: int, steps: int, heads: int, device) -> Mamba2Inputs:
    """The synthetic Nemotron-3-Nano Mamba-2 layer (`oracle.nano_layer`: x, B, C in bf16), its first `heads` heads
    (whole groups of 8)."""
    from .oracle import nano_layer

    inp = nano_layer(batch, steps, device)
    if heads >= inp.num_heads:
        return inp
    hpg = inp.num_heads // inp.B.shape[2]
    if heads % hpg:
        raise SystemExit(f"--heads must be a multiple of the layer's {hpg} heads per group, got {heads}")
    g = heads // hpg
    return Mamba2Inputs(
        x=inp.x[:, :, :heads], dt=inp.dt[:, :, :heads], B=inp.B[:, :, :g], C=inp.C[:, :, :g], A=inp.A[:heads],
        D=inp.D[:heads], meta=dict(inp.meta),
    ).validate()  # fmt: skip


def _environment(device: torch.device) -> dict:
    import platform

    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def main(argv: list[str] | None = None) -> int:
    from ssmquant.kernels.mamba2_engine import engine_probe
    from ssmquant.replay import parse_variant
    from ssmquant.simulate import check_engines

    ap = argparse.ArgumentParser(prog="python -m lab.engines.twin", description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("compare", "timing", "warm", "recipes"), help="compare: twin vs torch profile, "
                    "step by step; timing: twin vs ideal (and the real kernel), after `warm` (the first calls: compiles) "
                    "in --jobs processes; recipes: two calibrate recipes (TRITON TORCH)")  # fmt: skip
    ap.add_argument("dirs", nargs="*", type=Path, help="recipes: the Triton-backend and the torch-backend recipe")
    ap.add_argument("--out", type=Path, required=True, help="JSON file of the results (rewritten after every item)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=64, help="the layer's first heads (whole groups of 8)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="compare: flashinfer-profile variants")
    ap.add_argument("--timing-variants", default="int8@replay16,fp8_e4m3@replay16,int16@conventional",
                    help="timing / warm: variants timed under the flashinfer profile and the ideal arithmetic")  # fmt: skip
    ap.add_argument("--real", default="int8,fp8_e4m3", help="timing: checkpointing_ssu state dtypes ('' for none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1, help="compare, and timing's warm-up: variants in parallel "
                    "processes (Triton compiles on one CPU core each; the GPU work is small)")  # fmt: skip
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    if args.part == "recipes":
        if len(args.dirs) != 2:
            ap.error("recipes takes two recipe folders: the Triton backend's, then the torch backend's")
        res = compare_recipes(*args.dirs)
        args.out.write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return 0 if res["ok"] else 1

    dev = torch.device(args.device)
    results: dict = {"environment": _environment(dev), "args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    save = lambda: args.out.write_text(json.dumps(results, indent=1))  # noqa: E731
    specs = args.variants.split(",")
    argv = argv if argv is not None else sys.argv[1:]
    if args.part == "compare" and args.jobs > 1 and len(specs) > 1:
        results["rows"], failed = _in_processes("compare", argv, args, specs)
        save()
        if failed:
            print(f"[twin] failed or states NOT bit-identical to the torch profile: {', '.join(failed)}", flush=True)
        return 1 if failed else 0
    inp = _layer(args.batch, args.steps, args.heads, dev)
    shape = f"batch {inp.batch} x {inp.steps} steps x {inp.num_heads} heads x {inp.rows} x {inp.state_dim}"
    failed = []
    if args.part == "compare":
        for spec in specs:
            v = parse_variant(spec + "~flashinfer")
            check_engines([v], inp, "state")
            t0 = time.perf_counter()
            twin = engine_probe(inp, v)
            _sync(dev)
            t1 = time.perf_counter()
            prof = probe_profile(inp, v)
            _sync(dev)
            t2 = time.perf_counter()
            row = compare_probes(twin, prof, v)
            row.update(twin_with_compile_s=t1 - t0, torch_s=t2 - t1, bit_identical_states=bit_identical(row))
            results["rows"].append(row)
            save()
            states = " ".join(f"{n} {row[f'{n}_identical']:.6f}" for n in FINGERPRINTS if f"{n}_identical" in row)
            print(f"[twin] {v.name} ({shape}): {states}; outputs identical {row['output_identical']:.5f} "
                  f"(max rel {row['output_max_rel_diff']:.2e}); out_rel_err curve max rel diff "
                  f"{row['out_rel_err_max_rel_diff']:.2e}, state {row['state_rel_err_max_rel_diff']:.2e}; "
                  f"twin {t1 - t0:.2f} s, torch {t2 - t1:.2f} s", flush=True)  # fmt: skip
            if not row["bit_identical_states"]:
                failed.append(v.name)
    elif args.part == "warm":
        for spec in args.timing_variants.split(","):
            results["rows"].append(warm_twin(inp, spec))
            save()
    else:
        timed = args.timing_variants.split(",")
        # the first calls (compiles) in one process per variant, --jobs at once; the timing loads them from the cache
        t0 = time.perf_counter()
        results["warm"], warm_failed = _in_processes("warm", argv, args, timed)
        results["warm_wall_s"], results["warm_jobs"] = time.perf_counter() - t0, min(args.jobs, len(timed))
        save()
        for w in results["warm"]:
            print(f"[twin] first calls of {w['variant']} in a process of its own ({results['warm_jobs']} compiling at once): twin "
                  f"{w['twin_first_call_s']:.2f} s (compile {w['twin_compile_s']:.2f} s), ideal "
                  f"{w['ideal_first_call_s']:.2f} s (compile {w['ideal_compile_s']:.2f} s)", flush=True)  # fmt: skip
        if warm_failed:
            print(f"[twin] warm-up failed for {', '.join(warm_failed)} (the timing compiles them itself)", flush=True)
        for spec in timed:
            row = time_twin(inp, spec, args.reps)
            results["rows"].append(row)
            save()
            print(f"[twin] timing {spec} ({shape}): twin {_median(row['twin_s']) * 1e3:.1f} ms "
                  f"({row['twin_gsteps']:.3g} G state-element-steps/s), ideal {_median(row['ideal_s']) * 1e3:.1f} ms "
                  f"({row['ideal_gsteps']:.3g}), twin / ideal time {row['twin_over_ideal']:.2f}; first call here: twin "
                  f"{row['twin_first_call_here_s']:.2f} s, ideal {row['ideal_first_call_here_s']:.2f} s", flush=True)  # fmt: skip
        real = [s for s in args.real.split(",") if s]
        if real:
            from .env import engine_status

            st = engine_status("flashinfer")
            ok = st.ok and dev.type == "cuda"
            reason = None if ok else st.reason if not st.ok else f"needs a CUDA device, not {dev}"
            results["flashinfer"] = {"ok": ok, "version": st.version, "reason": reason}
            if not ok:
                print(f"[twin] real checkpointing_ssu not timed: {reason}", flush=True)
            for state in real if ok else []:
                row = time_real_checkpointing(inp, state, args.reps)
                results["rows"].append(row)
                save()
                print(f"[twin] timing {row['kernel']} ({shape}, {row['method']}): {_median(row['s']) * 1e3:.1f} ms "
                      f"({row['gsteps']:.3g} G state-element-steps/s)", flush=True)  # fmt: skip
    save()
    if failed:
        print(f"[twin] states NOT bit-identical to the torch profile: {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
