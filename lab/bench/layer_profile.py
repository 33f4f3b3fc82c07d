"""Where eval --mode layer spends its time: one evaluation under torch's profiler, its kernels grouped.

    python lab/bench/layer_profile.py --model tiny-qwen --steps 256 --batch 2 --device cpu      # a check of the script
    python lab/bench/layer_profile.py --model nemotron-3-nano --layers 14 --steps 2048 --batch 8 --device cuda

One untimed evaluation first (Triton's compiles), then one under ``torch.profiler``. The device time of every
kernel (CPU operators on the CPU) is put into a group by its name: ssmquant's recurrence kernels (the Triton
``*_emulate_kernel`` of ``ssmquant.kernels``), matrix products, the model's own SSM scan (the chunked einsum scan or a
fused library kernel, whose output the layer mode discards), the metrics' softmax / log-softmax, and the rest; it
prints each group's share and the top kernels. A model is a shipped one or a preset (random weights).
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import torch

from ssmquant.evaluate import EvalConfig, evaluate

VARIANTS = "fp8_e4m3@conventional,int8@replay16,nvfp4@conventional"
# first match wins; names as the profiler reports them (CUDA kernel names, or aten operators on the CPU)
GROUPS = (
    ("recurrence (ssmquant kernels)", re.compile(r"_emulate_kernel")),
    ("model's SSM scan (discarded)", re.compile(r"chunk_gated_delta|chunk_fwd|chunk_scan|chunk_state|ssd_|cumsum")),
    ("matrix products", re.compile(r"gemm|sm90_xmma|cutlass|matmul|addmm|\bmm\b|bmm|einsum|nvjet", re.I)),
    ("metrics (softmax, log-softmax)", re.compile(r"softmax|logsumexp|log_softmax", re.I)),
)


def _group(name: str) -> str:
    for label, pattern in GROUPS:
        if pattern.search(name):
            return label
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen", help="a shipped model or a preset (random weights)")
    ap.add_argument("--layers", type=int, default=None, help="a preset's first N decoder layers (default: all)")
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=15, help="kernels listed")
    ap.add_argument("--by-module", action="store_true",
                    help="also one evaluation timed per module (synchronised wall of each mixer and its children, "
                         "and of ssmquant's recurrence)")  # fmt: skip
    ap.add_argument("--sync-sites", action="store_true",
                    help="also one evaluation under torch.cuda.set_sync_debug_mode('warn'): the lines that synchronise "
                         "the host with the GPU, counted")  # fmt: skip
    args = ap.parse_args()
    from ssmquant.models import load_model
    from ssmquant.models.build import build_random_model
    from ssmquant.models.loading import SHIPPED_MODELS

    if args.model in SHIPPED_MODELS:
        model = load_model(args.model, device=args.device)
    else:
        model = build_random_model(args.model, devices=args.device, num_layers=args.layers, progress=lambda *a: None)
    cfg = EvalConfig(model, args.variants, steps=args.steps, batch=args.batch, mode="layer", device=args.device)
    evaluate(cfg)
    cuda = torch.device(args.device).type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        res = evaluate(cfg)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    per_kernel: dict[str, float] = defaultdict(float)
    launches = 0
    runtime: dict[str, list] = defaultdict(lambda: [0, 0.0])  # CUDA runtime calls: [count, host ms]
    host_ops: dict[str, float] = defaultdict(float)  # aten operators' self host time, ms
    for ev in prof.events():
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time / 1e3  # us -> ms
            launches += 1
        elif cuda and ev.name.startswith("cuda"):
            runtime[ev.name][0] += 1
            runtime[ev.name][1] += ev.self_cpu_time_total / 1e3
        if cuda and ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("aten::"):
            host_ops[ev.name] += ev.self_cpu_time_total / 1e3
        elif not cuda and ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("aten::"):
            per_kernel[ev.name] += ev.self_cpu_time_total / 1e3
    total = sum(per_kernel.values())
    groups: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        groups[_group(name)] += ms
    where = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{args.model} ({args.layers or 'all'} layers), {args.steps} steps x {args.batch}, {args.variants}; {where}, "
          f"torch {torch.__version__}; profiled wall {wall:.2f} s (decode_s {res.timing.get('decode_s')}), "
          f"{'device' if cuda else 'self CPU'} time {total / 1e3:.2f} s")  # fmt: skip
    print("group | ms | share")
    for label, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{label} | {ms:.1f} | {100 * ms / max(total, 1e-9):.1f}%")
    print("kernel | group | ms")
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{name[:90]} | {_group(name)} | {ms:.1f}")
    if cuda:
        # a wall time far above the device time is host-bound: launches, synchronisations, Python
        print(f"device kernels launched: {launches}")
        print("runtime call | count | host ms")
        for name, (count, ms) in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:8]:
            print(f"{name} | {count} | {ms:.1f}")
        print("aten operator | self host ms")
        for name, ms in sorted(host_ops.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{name} | {ms:.1f}")
    if args.by_module:
        by_module(model.model, cfg, cuda)
    if args.sync_sites and cuda:
        sync_sites(cfg)


def sync_sites(cfg: EvalConfig) -> None:
    """One more evaluation with torch's synchronisation debug mode: each warning is attributed to the innermost
    frame of ssmquant's or transformers' code on the stack (a warning's own frame may be torch's Python) whose CUDA
    operation waited for the GPU (a device-to-host copy, a synchronise, a pageable host-to-device copy); prints them
    by count."""
    import traceback
    import warnings

    counts: dict[str, int] = defaultdict(int)

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if "/ssmquant/" in f.filename or "/transformers/" in f.filename]
        where = ours[-1] if ours else None
        site = f"{where.filename.split('site-packages/')[-1]}:{where.lineno}" if where else f"{filename}:{lineno}"
        counts[site] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            evaluate(cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"synchronising CUDA operations in one evaluation: {sum(counts.values())}")
    print("line | count")
    for site, n in sorted(counts.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{site} | {n}")


def by_module(net: torch.nn.Module, cfg: EvalConfig, cuda: bool) -> None:
    """One more evaluation with every decoder layer's mixer, the mixers' children and ssmquant's recurrence
    (``simulate.simulate_outputs``) timed by synchronised wall clock; prints the sums by module class and child."""
    import ssmquant.evaluate.layer_major as layer_major

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spent: dict[str, list] = defaultdict(lambda: [0, 0.0])  # [calls, s]
    started: dict[tuple, list[float]] = defaultdict(list)  # a stack per (module, label): re-entrant or shared modules

    def pre(module, _args, label):
        sync()
        started[(id(module), label)].append(time.perf_counter())

    def post(module, _args, _out, label):
        sync()
        spent[label][0] += 1
        spent[label][1] += time.perf_counter() - started[(id(module), label)].pop()

    handles, mixers = [], set()
    for layer in net.base_model.layers:
        # NemotronH's blocks hold one mixer each; Qwen3.5's and Kimi's decoder layers are timed whole (their
        # block norms and MLP / MoE included)
        mixer = layer.mixer if hasattr(layer, "mixer") else layer
        kind = type(mixer).__name__
        mixers.add(kind)
        targets = [(mixer, kind)] + [(c, f"{kind}.{n}") for n, c in mixer.named_children()]
        for module, label in targets:
            handles.append(module.register_forward_pre_hook(lambda m, a, label=label: pre(m, a, label)))
            handles.append(module.register_forward_hook(lambda m, a, o, label=label: post(m, a, o, label)))
    real = layer_major.simulate_outputs

    def timed(*a, **kw):
        sync()
        t = time.perf_counter()
        out = real(*a, **kw)
        sync()
        spent["ssmquant recurrence (simulate_outputs, inside the mixers' norm)"][0] += 1
        spent["ssmquant recurrence (simulate_outputs, inside the mixers' norm)"][1] += time.perf_counter() - t
        return out

    layer_major.simulate_outputs = timed
    try:
        sync()
        t0 = time.perf_counter()
        evaluate(cfg)
        sync()
        wall = time.perf_counter() - t0
    finally:
        layer_major.simulate_outputs = real
        for h in handles:
            h.remove()
    print(f"by module (synchronised), evaluation wall {wall:.2f} s; a mixer's time includes its children's")
    print("module | calls | s | share of wall")
    for label, (calls, secs) in sorted(spent.items(), key=lambda kv: -kv[1][1]):
        print(f"{label} | {calls} | {secs:.3f} | {100 * secs / wall:.1f}%")
    outside = wall - sum(spent[k][1] for k in mixers)
    print(f"outside the timed modules (embedding, output head, metrics, host) | - | {outside:.3f} | "
          f"{100 * outside / wall:.1f}%")


if __name__ == "__main__":
    main()
