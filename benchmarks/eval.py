"""`ssmquant eval` in its two modes, side by side in one run: decode-step equivalents per second.

    python benchmarks/run.py eval                                   # the shipped models, CPU, 512 steps x 4
    python benchmarks/run.py eval --device cuda --steps 4096 --batch 8
    python benchmarks/run.py eval --models tiny-qwen --steps 16 --batch 1 --reps 1   # a check: not a measurement
    python benchmarks/run.py eval --device cuda --models nemotron-3-nano --layers 6   # a preset: random weights
    python benchmarks/run.py eval --device cuda --models nemotron-3-nano --modes layer --steps 32768 --batch 8 \
        --variants fp8_e4m3,int8@replay16,nvfp4 --text studies/tiny_models/data/heldout.txt --text-split all

A model is a shipped one (its weights) or a preset (`ssmquant presets`), built in memory with random weights at its
full sizes (``models.build.build_random_model``; --layers N: its first N decoder layers, a slice).

For each model, `evaluate` runs the same variants (default fp8_e4m3, int8, nvfp4, each conventional and replay16)
over the same held-out sequences twice per repetition: `--mode decode` (teacher-forced token by token through the
model's cache) and `--mode layer` (one forward per variant, the SSM recurrences replaced by the emulation's outputs,
``evaluate.layer_major``), after one untimed run of each mode (Triton's compiles, cuDNN's plans). A rate is
steps x batch x variants / the evaluation's own decode time (the timing's decode_s: the model is loaded before); the
table gives the median over --reps (min-max), the ratio layer / decode, each mode's wall time and mean KL (their
agreement is tested in tests/evaluate/test_layer_major.py). RESULTS.md key `eval-<device>`; with --modes layer
alone (horizons the token-by-token path cannot reach in the time) `eval-<device>-layer`; --section NAME appends
`-NAME` (a model measured in a run of its own, e.g. a full-size preset whose two modes fill a device call, keeps the
other models' table). --steps below 256 or --batch 1 make the run a check of the script, not a measurement.
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks.common import Result, Section, markdown_table

MODELS = ("tiny-nemotron", "tiny-qwen", "tiny-kda")
VARIANTS = "fp8_e4m3,int8,nvfp4,fp8_e4m3@replay16,int8@replay16,nvfp4@replay16"
MODES = ("decode", "layer")


def add_arguments(ap) -> None:
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated models (shipped names or presets)")
    ap.add_argument("--variants", default=VARIANTS, help="the variants of both modes")
    ap.add_argument("--steps", type=int, default=512, help="decode steps")
    ap.add_argument("--batch", type=int, default=4, help="sequences")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each mode (the median is reported)")
    ap.add_argument("--layers", type=int, default=None, help="a preset's first N decoder layers (default: all)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run (decode, layer)")
    ap.add_argument("--text", default=None, help="text file to decode (default: the shipped corpus)")
    ap.add_argument("--text-split", default="heldout", choices=("heldout", "all"), help="eval --text-split")
    ap.add_argument("--section", default=None, help="a suffix of the RESULTS.md key (eval-<device>[-layer]-NAME)")


def _load(name: str, args):
    """(the model, how the table names it): a shipped model's weights, or a preset's random weights."""
    from ssmquant.models import load_model
    from ssmquant.models.build import build_random_model
    from ssmquant.models.loading import SHIPPED_MODELS

    if name in SHIPPED_MODELS:
        return load_model(name, device=args.device), name
    loaded = build_random_model(name, devices=args.device, num_layers=args.layers, progress=lambda *a: None)
    layers = f"{args.layers} layers" if args.layers else "all layers"
    return loaded, f"{name} (random weights, {layers})"


def _log(line: str) -> None:
    """A stage's line on stderr as it ends, so that a run cut short by a time limit still says how far it got."""
    print(line, file=sys.stderr, flush=True)


def _allocated(device: str) -> int:
    """On CUDA: the bytes the allocator holds on ``device`` now (the loaded model); else 0."""
    import torch

    dev = torch.device(device)
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def _layer_memory(res, before: int, previous: dict) -> dict:
    """A layer-mode run's memory: the estimate its memory check read (GiB, the device's part), the sequences per
    forward it chose, what compared its logits (the fused kernel or torch), and on CUDA the allocator's peak during the evaluation (``evaluate`` resets it on the model's
    device) beyond the ``before`` bytes held when it started, the largest over the repetitions so far
    (``previous``)."""
    est = res.timing.get("memory_estimate_GiB") or {}
    out = {"estimate_GiB": float(est.get("device", est.get("host", float("nan")))),
           "forward_batch": int(res.timing.get("forward_batch", 0)), "metrics": res.timing.get("metrics")}  # fmt: skip
    if "peak_gpu_memory_GiB" in res.timing:
        peak = float(res.timing["peak_gpu_memory_GiB"]) - before / 2**30
        out["peak_GiB"] = max(peak, previous.get("peak_GiB", peak))
    return out


def _evaluate(loaded, args, mode: str, steps: int):
    from ssmquant.evaluate import EvalConfig, evaluate

    return evaluate(EvalConfig(loaded, args.variants, steps=steps, batch=args.batch, mode=mode, text=args.text,
                               text_split=args.text_split))  # fmt: skip


def run(args) -> Result:
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in MODES if m in args.modes.split(",")]
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown or not modes:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; accepted: {', '.join(MODES)}")
    if args.section is not None and not args.section.replace("-", "").isalnum():
        raise SystemExit(f"--section {args.section!r}: letters, digits and '-' only (a RESULTS.md key)")
    rows, raw = [], {}
    for name in models:
        t0 = time.perf_counter()
        loaded, label = _load(name, args)
        _log(f"{label}: loaded in {time.perf_counter() - t0:.1f} s")
        rates: dict[str, list[float]] = {m: [] for m in modes}
        walls: dict[str, list[float]] = {m: [] for m in modes}
        kl: dict[str, float] = {}
        memory: dict[str, float | int] = {}  # layer mode: the memory check's estimate, its forward batch, the peak

        warm = args.steps if args.steps % 16 else min(args.steps, 64)  # Triton specialises T on divisibility by 16
        for mode in modes:
            t0 = time.perf_counter()
            _evaluate(loaded, args, mode, warm)
            _log(f"{label}: untimed {mode} run of {warm} steps in {time.perf_counter() - t0:.1f} s")
        for rep in range(args.reps):
            for mode in modes:
                before = _allocated(args.device)
                t0 = time.perf_counter()
                res = _evaluate(loaded, args, mode, args.steps)
                walls[mode].append(time.perf_counter() - t0)
                _log(f"{label}: {mode} repetition {rep + 1}/{args.reps} in {walls[mode][-1]:.1f} s")
                if mode == "layer":
                    memory = _layer_memory(res, before, memory)
                    _log(f"{label}: layer memory {memory}")
                n = len(res.variants)
                rates[mode].append(args.steps * args.batch * n / res.timing["decode_s"])
                kl[mode] = float(res.summary["kl_mean"].mean())
        med = {m: statistics.median(r) for m, r in rates.items()}
        raw[label] = {"rates": rates, "wall_s": walls, "kl_mean": kl, "layer_memory": memory}
        ratio = f"{med['layer'] / med['decode']:.2f}x" if len(modes) == len(MODES) else "-"
        rows.append(
            {
                "model": label,
                **{f"{m} steps/s": f"{med[m]:.3g} ({min(rates[m]):.3g}-{max(rates[m]):.3g})" for m in modes},
                "layer / decode": ratio,
                **{f"{m} wall s": f"{statistics.median(walls[m]):.1f}" for m in modes},
                **{f"{m} mean KL": f"{kl[m]:.3g}" for m in modes},
                **({"layer peak / estimate GiB": f"{memory['peak_GiB']:.2f} / {memory['estimate_GiB']:.2f} "
                    f"({memory['forward_batch']} per forward)"} if "peak_GiB" in memory else {}),
            }
        )  # fmt: skip
    text = "the shipped corpus" if args.text is None else args.text
    body = (
        f"`ssmquant eval` of {len(models)} models, {args.steps} steps x {args.batch} sequences x the variants "
        f"{args.variants}, on {args.device} ({args.text_split} split of {text}); decode-step equivalents per second "
        f"(steps x sequences x variants / the evaluation's decode time) and the evaluation's wall time (the model "
        f"loaded before), median of {args.reps} (min-max).\n\n" + markdown_table(rows)
    )
    measurement = args.steps >= 256 and args.batch > 1
    if len(modes) == len(MODES):
        key, title = f"eval-{args.device}", f"`ssmquant eval`: layer-major vs token by token ({args.device})"
    else:
        key, title = f"eval-{args.device}-{modes[0]}", f"`ssmquant eval --mode {modes[0]}` alone ({args.device})"
    if args.section:
        key, title = f"{key}-{args.section}", f"{title[:-1]}, {args.section})"
    return Result({key: Section(title, body)}, raw, measurement=measurement)
