"""Throughput of the fused decode-emulation kernels against their peers measured in the same run, on one GPU.

For Mamba-2 at Nemotron-3-Nano shapes (H=64, P=64, N=128, G=8), GDN at Qwen3.5-9B shapes (32 value heads, 16 key
heads, Dk=Dv=128) and KDA at GLM-5.3-Flash shapes (64 heads, Dk=Dv=128), batch 16, T=4096 steps, for fp8_e4m3, int8
and nvfp4 under conventional and replay16 decoding, it measures in one run:

- kernel: `emulate_triton_steps` (one launch for all T steps, the FP32 reference and the emulated state on chip,
  metrics every step; on a GPU KDA's 8-bit per-row variants run in the CUDA kernel, the "kernel" column says which);
  "simulate G/s" times the whole `simulate` call as analyze runs it (validation, the kernel and the reduction into
  window statistics, windows of 16 steps);
- eager: the layer kind's per-step emulation step (`kinds.get(kind).emulation_step`, the FP32 reference and one
  variant, state form) in a Python loop, the states round-tripping through memory every step;
- compiled: the same step under torch.compile in mode "default" (the functional loop) and "reduce-overhead" (CUDA
  graphs: the states updated in place at static addresses, a graph step begun per call), each compiled and timed in
  isolation after warm-up, a recompile while it is timed failing the run (`compiled_peers`); the faster mode is the
  peer. Compiled for every variant of --compile-variants (default all); a variant left out gets no "x compiled".
- all in one launch: the variants given to `emulate_triton_steps` together (`plan_launches`): each step's inputs read
  once and the FP32 reference advanced once for all of them; its G/s is per variant. It shares the reference, so its
  ratios to the peers (which advance their own) are not the bar: the per-variant table is.

Every time is the median of --reps (>= 3) runs after a warm-up run, with the rates of the slowest and fastest runs;
a ratio divides the medians, its range the extremes (kernel slowest / peer fastest .. kernel fastest / peer slowest).
G/s = G state-element-steps per second = batch x heads x rows x state_dim x steps / seconds / 1e9. The peers run
--peer-steps steps (their cost per step is constant) and are reported per step. One RESULTS.md section per layer
kind (`emulation-mamba2`, `emulation-gdn`, `emulation-kda`).

    python benchmarks/run.py emulation [--kinds mamba2,gdn,kda] [--formats fp8_e4m3,int8,nvfp4] [--steps 4096]
        [--batch 16] [--peer-steps 64] [--reps 5] [--compile-modes default,reduce-overhead | --no-compile]
        [--compile-variants all | fp8_e4m3@conventional,...] [--sweep] [--multi-sweep] [--update-results]
    python benchmarks/run.py emulation --device cpu --steps 4 --batch 1 --peer-steps 2 --reps 3 --no-compile
        (a check of the script in Triton's interpreter, small heads: not a measurement)
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.common import MIN_REPS, Result, Section, Timing, cuda_times, markdown_table, spread
from ssmquant import kinds
from ssmquant.kernels import emulate_triton_steps, fused_kernels, plan_launches
from ssmquant.kinds import GDNInputs, KDAInputs, Mamba2Inputs
from ssmquant.replay import StateStore, parse_variant
from ssmquant.simulate import simulate

FORMATS = ["fp8_e4m3", "int8", "nvfp4"]
# modifiers --formats may add to a format (nvfp4:sr, nvfp4:head, fp8_e4m3:head:sr): stochastic rounding, one scale
# per head; such a row's "x fp8 time" is against fp8_e4m3 with the same modifiers when that ran too
MODIFIERS = ("sr", "head")
SCHEMES = ["conventional", "replay16"]
KINDS = kinds.names()
# torch.compile modes of the compiled peer; the CUDA-graph ones run the in-place loop (`compiled_peer_loop`).
# max-autotune-no-cudagraphs (inductor autotunes every kernel's launch configuration, coordinate descent) is
# accepted but not in the default list: its compile takes far longer than the GPU runs allow.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead",)
LAYER_NAMES = {"mamba2": "Mamba-2 (Nemotron-3-Nano)", "gdn": "GDN (Qwen3.5-9B)", "kda": "KDA (GLM-5.3-Flash)"}

# Instructions per element-step of each kernel on a write step, for the floor (fp32 issue slots, integer ops).
# Counted where `python benchmarks/run.py sass` counts them: SASS of the kernel's time loop on a conventional write
# step, slow paths and fallbacks skipped (Triton 3.9 / NVRTC 13.0, sm_90a; per-row scales at BLOCK_P 16, one warp, and per-head
# scales at the whole-head tilings), all counted as
# FP32 issue slots (one instruction issues per lane-clock whatever its pipe). Mamba-2 int8 is not counted there: its
# entry is the earlier estimate (reference + variant update 3 + 3, two output dots 2 + 2, metrics 5, amax 2,
# encode/decode ~9 fp + ~10 int at half rate).
OPS_PER_ELEMENT_STEP = {
    ("mamba2", "fp8_e4m3"): (25.1, 0),
    ("mamba2", "int8"): (26, 10),
    ("mamba2", "nvfp4"): (25.1, 0),
    ("mamba2", "fp8_e4m3:sr"): (54.8, 0),
    ("mamba2", "nvfp4:sr"): (60.2, 0),
    ("gdn", "fp8_e4m3"): (23.9, 0),
    ("gdn", "int8"): (21.9, 0),
    ("gdn", "nvfp4"): (27.1, 0),
    ("gdn", "fp8_e4m3:sr"): (56.6, 0),
    ("gdn", "nvfp4:sr"): (63.7, 0),
    ("kda", "fp8_e4m3"): (24.4, 0),
    ("kda", "int8"): (22.4, 0),
    ("kda", "nvfp4"): (27.6, 0),
    ("kda", "fp8_e4m3:sr"): (57.3, 0),
    ("kda", "nvfp4:sr"): (64.2, 0),
    # per-head scales at the whole-head tilings (Mamba-2 64 rows x 4 warps, GDN / KDA 128 x 8), spills included
    ("mamba2", "fp8_e4m3:head"): (26.1, 0),
    ("mamba2", "nvfp4:head"): (36.8, 0),
    ("mamba2", "fp8_e4m3:head:sr"): (55.8, 0),
    ("mamba2", "nvfp4:head:sr"): (61.5, 0),
    ("gdn", "fp8_e4m3:head"): (34.6, 0),
    ("gdn", "nvfp4:head"): (37.6, 0),
    ("gdn", "fp8_e4m3:head:sr"): (70.3, 0),
    ("gdn", "nvfp4:head:sr"): (76.4, 0),
    ("kda", "fp8_e4m3:head"): (40.7, 0),
    ("kda", "nvfp4:head"): (43.8, 0),
    ("kda", "fp8_e4m3:head:sr"): (77.1, 0),
    ("kda", "nvfp4:head:sr"): (83.2, 0),
    # the KDA CUDA kernel (ssmquant/kernels/kda_cuda.py runs these on a GPU): fp32 q / k, bf16 v
    ("kda", "fp8_e4m3", "cuda"): (19.2, 0),
    ("kda", "int8", "cuda"): (19.2, 0),
    ("kda", "nvfp4", "cuda"): (23.9, 0),
}
# H200 SXM: 132 SMs x 128 FP32 lanes x ~1.98 GHz = 33.4 T FP32 instructions/s; integer ops ~half rate.
FP32_INSTR_PER_S = 132 * 128 * 1.98e9
INT_INSTR_PER_S = FP32_INSTR_PER_S / 2
# (heads, head_dim, state, groups) / (key heads, value heads, dk, dv) of the small layers of a CPU check: the full
# heads would take many minutes in Triton's interpreter
SMALL = {"mamba2": (2, 32, 32, 1), "gdn": (1, 2, 32, 32), "kda": (1, 2, 32, 32)}


def nano_inputs(batch, steps, device, small=False):
    """Nemotron-3-Nano's Mamba-2 layer (drawn on the CPU, then moved)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    h, p, n, grp = SMALL["mamba2"] if small else (64, 64, 128, 8)
    x = torch.nn.functional.silu(torch.randn(batch, steps, h, p, generator=g)).bfloat16()
    b = torch.nn.functional.silu(torch.randn(batch, steps, grp, n, generator=g)).bfloat16()
    c = torch.nn.functional.silu(torch.randn(batch, steps, grp, n, generator=g)).bfloat16()
    dt = torch.nn.functional.softplus(torch.randn(batch, steps, h, generator=g) - 4.0).clamp(min=1e-3)
    A = -torch.exp(torch.linspace(-1.0, 2.0, h))
    return Mamba2Inputs(x=x, dt=dt, B=b, C=c, A=A, D=torch.ones(h)).to(device)


def qwen9b_inputs(batch, steps, device, small=False):
    """Qwen3.5-9B's GDN layer: 16 key heads, 32 value heads, Dk = Dv = 128."""
    g = torch.Generator(device="cpu").manual_seed(0)
    hk, hv, dk, dv = SMALL["gdn"] if small else (16, 32, 128, 128)
    q = torch.nn.functional.normalize(torch.randn(batch, steps, hk, dk, generator=g), dim=-1) / dk**0.5
    k = torch.nn.functional.normalize(torch.randn(batch, steps, hk, dk, generator=g), dim=-1)
    v = torch.randn(batch, steps, hv, dv, generator=g).bfloat16()
    gate = -torch.nn.functional.softplus(torch.randn(batch, steps, hv, generator=g) - 3.0)
    beta = torch.sigmoid(torch.randn(batch, steps, hv, generator=g))
    return GDNInputs(q=q, k=k, v=v, g=gate, beta=beta).to(device)


def glm53_flash_inputs(batch, steps, device, small=False):
    """GLM-5.3-Flash's KDA layer: 64 heads, Dk = Dv = 128, gate -5 sigmoid(f) with per-channel biases.

    Drawn on the device (the CPU would take minutes for these 2 G-element tensors)."""
    g = torch.Generator(device=device).manual_seed(0)
    h, d = (SMALL["kda"][1], SMALL["kda"][2]) if small else (64, 128)
    q = torch.nn.functional.normalize(torch.randn(batch, steps, h, d, generator=g, device=device), dim=-1) / d**0.5
    k = torch.nn.functional.normalize(torch.randn(batch, steps, h, d, generator=g, device=device), dim=-1)
    v = torch.randn(batch, steps, h, d, generator=g, device=device).bfloat16()
    bias = torch.linspace(-9.0, 0.0, h * d, device=device).reshape(h, d)
    gate = -5.0 * torch.sigmoid(torch.randn(batch, steps, h, d, generator=g, device=device) * 0.5 + bias)
    beta = torch.sigmoid(torch.randn(batch, steps, h, generator=g, device=device))
    return KDAInputs(q=q, k=k, v=v, g=gate, beta=beta)


INPUTS = {"mamba2": nano_inputs, "gdn": qwen9b_inputs, "kda": glm53_flash_inputs}


def layer_inputs(kind, batch, steps, device):
    """The benchmark's layer of `kind` (INPUTS) on a GPU; on the CPU (a check of the script in Triton's
    interpreter) a small layer of the kind (SMALL)."""
    return INPUTS[kind](batch, steps, device, small=device != "cuda")


def cuda_time(fn, reps: int) -> float:
    """Median seconds of fn() over reps runs (`cuda_times`)."""
    return cuda_times(fn, reps).median


def peer_step_args(inputs, variant, steps):
    """The per-step arguments of the kind's emulation step after the two states: a list over the first `steps`
    steps of argument tuples (views of the whole-sequence tensors, prepared once): `Physics.step_args` of the
    variant's buffered inputs, then the write mask, the state store and the step's rounding key."""
    dev = inputs.device
    store = StateStore(variant.format, inputs.state_shape, dev, variant.seed)
    write = variant.scheme.write_mask(inputs.batch, inputs.steps).to(dev)
    keys = [store.key(t).to(dev) for t in range(steps)]
    buf = variant.scheme.buffer_torch_dtype if variant.scheme.rounds_buffer else torch.float32
    physics = kinds.of(inputs).physics(inputs)
    buffered = physics.buffered(buf)
    return [(*physics.step_args(t, buffered), write[:, t], store, keys[t]) for t in range(steps)]


def peer_loop(inputs, variant, steps, step_fn):
    """The eager peer: a per-step loop of `step_fn` (the kind's emulation step, states in and out) over the first
    `steps` steps; returns a closure that runs it and returns the last step's metrics [B, H, 4]. The closure's
    `marks` (a list) receives time.perf_counter() before the first step and after each step is enqueued."""
    args = peer_step_args(inputs, variant, steps)

    def run(marks=None):
        s_ref = torch.zeros(inputs.state_shape, device=inputs.device)
        s_var = torch.zeros_like(s_ref)
        if marks is not None:
            marks.append(time.perf_counter())
        for a in args:
            s_ref, s_var, m = step_fn(s_ref, s_var, *a)
            if marks is not None:
                marks.append(time.perf_counter())
        return m

    return run


def _in_place(step_fn):
    """step_fn with its two states updated in place (returns only the metrics): the form CUDA graphs can replay
    step after step, the states at fixed addresses and no graph output carried into the next step."""

    def step(s_ref, s_var, *args):
        new_ref, new_var, m = step_fn(s_ref, s_var, *args)
        s_ref.copy_(new_ref)
        s_var.copy_(new_var)
        return m

    return step


def compiled_peer_loop(inputs, variant, steps, step_fn, mode):
    """The compiled peer: `step_fn` under torch.compile in `mode` (COMPILE_MODES). Returns a closure like
    `peer_loop`'s (the last step's metrics; `marks` as there).

    default (and max-autotune-no-cudagraphs): the functional loop (states in, new states out), as the eager peer
    runs it; inductor writes the new states once. An in-place form may cost this mode two extra state copies per
    step; measured on an H200 the difference stayed within the functional loop's own spread between processes,
    which proves no cost, but the functional loop is the peer's natural form.
    reduce-overhead: CUDA graphs replay a step only with its states at fixed addresses, so the states are
    updated in place in two buffers marked static, and a new CUDA-graph step is begun before each call
    (torch.compiler.cudagraph_mark_step_begin: no output of a previous step is read again); the metrics are
    cloned out of the graph pool."""
    if mode not in CUDA_GRAPH_MODES:
        return peer_loop(inputs, variant, steps, torch.compile(step_fn, dynamic=False, mode=mode))
    args = peer_step_args(inputs, variant, steps)
    s_ref = torch.zeros(inputs.state_shape, device=inputs.device)
    s_var = torch.zeros_like(s_ref)
    torch._dynamo.mark_static_address(s_ref)
    torch._dynamo.mark_static_address(s_var)
    fn = torch.compile(_in_place(step_fn), dynamic=False, mode=mode)

    def run(marks=None):
        s_ref.zero_()
        s_var.zero_()
        if marks is not None:
            marks.append(time.perf_counter())
        for a in args:
            torch.compiler.cudagraph_mark_step_begin()
            m = fn(s_ref, s_var, *a)
            if marks is not None:
                marks.append(time.perf_counter())
        return m.clone()

    return run


@dataclasses.dataclass
class PeerResult:
    """One compiled peer mode, measured by `compiled_peers`.

    timing: seconds per step of each timed run (`cuda_times` of the --peer-steps loop / steps); compile_s: compile
    and warm-up; host_s: host seconds per step to enqueue the loop's first HOST_STEPS steps (the launch queue
    cannot be full there, so it is the host's own cost: a peer whose host cost reaches its time per step is
    host-bound); graphs / frames / graph_breaks: dynamo's counters after warm-up (one graph, one frame, no break
    expected); rel_diff: its last-step metrics against the eager loop's; gpu: `gpu_state()` just before timing;
    profile: `profile_peer` of one more run, when asked."""

    mode: str
    timing: Timing
    compile_s: float
    host_s: float
    graphs: int
    frames: int
    graph_breaks: int
    rel_diff: float
    inductor: dict
    gpu: str
    profile: dict | None = None

    def summary(self, elems: int) -> dict:
        """JSON-ready fields (rates in G state-element-steps/s)."""
        return {
            "mode": self.mode,
            "G/s": elems / self.timing.median / 1e9,
            "G/s (slowest-fastest)": spread(lambda x: elems / x / 1e9, self.timing),
            "G/s (runs)": [elems / x / 1e9 for x in self.timing],
            "us per step (runs)": [x * 1e6 for x in self.timing],
            "host us per step (first steps)": self.host_s * 1e6,
            "compile + warm-up s": self.compile_s,
            "graphs": self.graphs,
            "frames": self.frames,
            "graph breaks": self.graph_breaks,
            "rel diff vs eager": self.rel_diff,
            "inductor cudagraph counters": self.inductor,
            "gpu before timing": self.gpu,
            "profile": self.profile,
        }


HOST_STEPS = 8  # steps whose enqueue time gives the host's cost per step (about 10-20 launches each)


def gpu_state() -> str:
    """The GPU's clocks, temperature, power, utilisation and clock-event reasons (nvidia-smi), and the host's load
    average: a line for the log beside each compiled peer, so that a slow one can be told from a throttled or
    shared machine. Never raises."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if not torch.cuda.is_available():
        return f"no GPU; loadavg {load}"
    fields = "clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,memory.used"
    for extra in (",clocks_event_reasons.active", ""):
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}{extra}", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            )
        except (OSError, subprocess.SubprocessError) as err:
            return f"nvidia-smi failed ({type(err).__name__}); loadavg {load}"
        if out.returncode == 0:
            return f"{fields}{extra}: {out.stdout.strip().splitlines()[0]}; loadavg {load}"
    return f"nvidia-smi rc {out.returncode}: {out.stderr.strip()[:200]}; loadavg {load}"


def isolate() -> None:
    """Drop what earlier measurements left behind before a compiled peer: dynamo's compiled code and guards (also
    the CUDA-graph trees of reduce-overhead), Python garbage, and the caching allocator's free blocks."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def host_enqueue_s(comp, steps: int) -> float:
    """Host seconds per step to enqueue the first HOST_STEPS steps of comp (a peer loop taking `marks`)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    marks = []
    comp(marks=marks)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    n = min(HOST_STEPS, steps)
    return (marks[n] - marks[0]) / n


def profile_peer(comp, steps: int, top: int = 8) -> dict:
    """One run of comp under torch.profiler: the device's busy time per step (the sum of its kernels' and copies'
    durations) and the `top` kernels by time, each with its calls and microseconds per step. On the CPU (a check
    of the script) the same from the CPU operators' self times, which mean nothing for the GPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        comp()
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [(e.key, e.count, getattr(e, attr)) for e in prof.key_averages() if getattr(e, attr) > 0]
    events.sort(key=lambda e: -e[2])
    if not events:
        return {"error": "the profiler recorded no timed events"}
    return {
        "busy us per step": sum(e[2] for e in events) / steps,
        "launches per step": sum(e[1] for e in events) / steps,
        "top": [
            {"name": name[:120], "calls per step": count / steps, "us per step": us / steps}
            for name, count, us in events[:top]
        ],
    }


def compiled_peers(inputs, variant, args, step_fn, eager_m, profile=False) -> dict[str, PeerResult | None]:
    """Time the compiled peer in every mode of --compile-modes: {mode: PeerResult, or None when the mode failed}.

    Each mode is compiled and timed in isolation (`isolate` before and after: no compiled code, CUDA graphs or
    cached blocks of another peer alive), after its compile run, a second run (reduce-overhead records its CUDA
    graphs there) and `cuda_times`' own warm-up run. The timed runs must reuse the warm-up's compiled code:
    dynamo may not recompile while they run (torch._dynamo.config.error_on_recompile, and its frame and graph
    counters compared before and after); a recompile there sets args.failed and the mode counts as failed.
    A mode that fails or skips CUDA graphs is printed, not hidden. eager_m: the eager loop's last metrics, which
    the compiled loops must reproduce (printed: their relative difference). profile: also `profile_peer` one run
    after the timing."""
    from torch._dynamo.utils import counters

    elems = math.prod(inputs.state_shape)
    results = {}
    for mode in [m for m in args.compile_modes.split(",") if m]:
        isolate()
        counters.clear()
        try:
            comp = compiled_peer_loop(inputs, variant, args.peer_steps, step_fn, mode)
            t0 = time.time()
            comp()  # compile (reduce-overhead: a warm-up run)
            m = comp()  # reduce-overhead: CUDA graphs record here; cuda_times warms up once more
            if args.device == "cuda":
                torch.cuda.synchronize()
            compile_s = time.time() - t0
            graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
            breaks = sum(counters["graph_break"].values())
            gpu = gpu_state()
            with torch._dynamo.config.patch(error_on_recompile=True):
                t = Timing(x / args.peer_steps for x in cuda_times(comp, args.reps))
                host = host_enqueue_s(comp, args.peer_steps)
            if (counters["stats"]["unique_graphs"], counters["frames"]["total"]) != (graphs, frames):
                raise RuntimeError(
                    f"dynamo compiled again while the peer was timed: graphs {graphs} -> "
                    f"{counters['stats']['unique_graphs']}, frames {frames} -> {counters['frames']['total']}"
                )
            prof = None
            if profile:
                try:
                    prof = profile_peer(comp, args.peer_steps)
                except Exception as err:  # noqa: BLE001 - a diagnostic; the timing above stands
                    prof = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        except Exception as err:  # noqa: BLE001 - a peer mode that fails is reported, the others still run
            recompiled = isinstance(err, torch._dynamo.exc.RecompileError) or "compiled again" in str(err)
            if recompiled:
                args.failed = True
            print(
                f"  {'FAIL: ' if recompiled else ''}compiled peer mode={mode} FAILED: {type(err).__name__}: "
                f"{str(err).splitlines()[0][:300]}",
                flush=True,
            )
            results[mode] = None
            continue
        finally:
            comp = None
            isolate()
        skips = {k: v for k, v in dict(counters["inductor"]).items() if "cudagraph" in k}
        rel = float(((m.double() - eager_m.double()).abs().sum() / eager_m.double().abs().sum()).item())
        results[mode] = r = PeerResult(mode, t, compile_s, host, graphs, frames, breaks, rel, skips, gpu, prof)
        busy = "" if prof is None else f", device busy {prof.get('busy us per step', float('nan')):.0f} us/step"
        print(
            f"  compiled {inputs.kind} {variant.name} mode={mode}: {elems / t.median / 1e9:.1f} G/s "
            f"({spread(lambda x: elems / x / 1e9, t)}), {t.median * 1e6:.0f} us/step, host {host * 1e6:.0f} us/step"
            f"{busy}, compile + warm-up {compile_s:.0f} s, {graphs} graph(s) {frames} frame(s) {breaks} break(s), "
            f"last-step metrics vs eager: rel diff {rel:.1e}{f', inductor {skips}' if skips else ''}; {r.gpu}",
            flush=True,
        )
    return results


def default_variants(args):
    """The benchmarked variants: --formats x SCHEMES (the six defaults of `analyze` unless narrowed)."""
    return [parse_variant(f"{fmt}@{scheme}") for fmt in args.formats.split(",") for scheme in SCHEMES]


def multi_row(kind, inputs, kind_rows, args):
    """The variants of `kind_rows` in one launch, against their separate launches and peers."""
    variants = default_variants(args)
    kernels = fused_kernels(inputs, variants)
    on_cuda = [v for v, k in zip(variants, kernels) if k == "cuda"]
    plan = plan_launches([v for v, k in zip(variants, kernels) if k != "cuda"], inputs.rows, inputs.state_dim)
    nv = len(variants)
    elems = math.prod(inputs.state_shape)
    t_all = cuda_times(lambda: drain(emulate_triton_steps(inputs, variants)), args.reps)
    t_one = t_all.median
    t_sim = cuda_time(lambda: simulate(inputs, variants, backend="triton", record_every=min(16, args.steps)), args.reps)
    t_six = sum(r["kernel ms"] for r in kind_rows) / 1e3
    rate = nv * elems * args.steps / t_one / 1e9
    # the eager loops one after the other: nv states advanced in the sum of their per-step times
    eager = nv * elems / sum(elems / (r["eager G/s"] * 1e9) for r in kind_rows) / 1e9
    # the compiled loops one after the other, when every variant's peer was compiled
    compiled = [r["compiled G/s (faster)"] for r in kind_rows]
    compiled = None if None in compiled else nv * elems / sum(elems / (c * 1e9) for c in compiled) / 1e9
    row = {
        "launches (BLOCK_P, warps)": " + ".join(
            [f"{len(on_cuda)} CUDA launches of one variant"] * bool(on_cuda)
            + [f"{len(idx)} variants {tiling}" for idx, tiling in plan]
        ),
        "one launch ms": t_one * 1e3,
        "separate launches ms": t_six * 1e3,
        "speed-up": t_six / t_one,
        "G/s per variant": rate,
        "G/s per variant (slowest-fastest)": spread(lambda x: nv * elems * args.steps / x / 1e9, t_all),
        "simulate G/s per variant": nv * elems * args.steps / t_sim / 1e9,
        "eager G/s (loops in turn)": eager,
        "x eager": rate / eager,
        "compiled G/s (loops in turn)": compiled,
        "x compiled (shared reference: not the bar)": None if compiled is None else rate / compiled,
    }
    print(f"{kind} all {nv} in one launch: {rate:.0f} G/s per variant, {t_six / t_one:.2f}x separate launches", flush=True)
    return row


MULTI_SWEEP = [(2, 1), (4, 1), (8, 1)]  # the planned (4, 1), half and twice its rows


def multi_sweep(kind, inputs, args):
    """Time the all-variant launch at several tilings, on the first 1024 steps (median of 2 runs; printed and kept
    in the JSON, not in the tables)."""
    out = []
    variants = default_variants(args)
    steps = min(inputs.steps, 1024)
    sub = inputs.slice_steps(0, steps)
    elems = len(variants) * math.prod(sub.state_shape) * steps
    for block_p, warps in MULTI_SWEEP:
        t = cuda_time(lambda p=block_p, w=warps: drain(emulate_triton_steps(sub, variants, tiling=(p, w))), 2)
        print(
            f"multi-sweep {kind} BLOCK_P={block_p:3d} warps={warps:2d}: {t * 1e3:8.2f} ms  "
            f"{elems / t / 1e9:7.0f} G/s per variant",
            flush=True,
        )
        out.append({"layer": kind, "BLOCK_P": block_p, "warps": warps, "ms": t * 1e3, "G/s per variant": elems / t / 1e9})
    return out


def drain(slices) -> None:
    """Run a generator of kernel launches to the end (each yields a batch slice's per-step metrics)."""
    for _ in slices:
        pass


SWEEP = [(8, 1), (16, 1), (32, 2), (64, 4), (128, 8)]


def sweep(args, dev, kind_names):
    """Time fp8_e4m3 conventional at several tilings (median of 2 runs; printed and kept in the JSON)."""
    out = []
    variant = parse_variant("fp8_e4m3@conventional")
    for kind in kind_names:
        inputs = layer_inputs(kind, args.batch, min(args.steps, 1024), dev)
        elems = math.prod(inputs.state_shape) * inputs.steps
        for block_p, warps in SWEEP:
            if block_p > inputs.rows:
                continue
            t = cuda_time(
                lambda i=inputs, p=block_p, w=warps: drain(emulate_triton_steps(i, [variant], tiling=(p, w))), 2
            )
            print(
                f"sweep {kind} BLOCK_P={block_p:3d} warps={warps:2d}: {t * 1e3:8.2f} ms  {elems / t / 1e9:7.0f} G/s",
                flush=True,
            )
            out.append({"layer": kind, "BLOCK_P": block_p, "warps": warps, "ms": t * 1e3, "G/s": elems / t / 1e9})
    return out


def add_arguments(ap) -> None:
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--peer-steps", type=int, default=64, help="steps timed for the per-step peers")
    ap.add_argument("--reps", type=int, default=5, help=f"timed runs per measurement (>= {MIN_REPS}): the median is reported")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer (--compile-modes '')")
    ap.add_argument(
        "--compile-modes",
        default="default,reduce-overhead",
        help=f"comma-separated torch.compile modes of the compiled peer, among {', '.join(COMPILE_MODES)}; each is "
        "timed and the faster one is the peer of 'x compiled'",
    )
    ap.add_argument(
        "--compile-variants",
        default="all",
        help="comma-separated variants (fmt@scheme) whose torch.compile peer is compiled and timed, or 'all' (default); "
        "the others get no 'x compiled'",
    )
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated layer kinds among {', '.join(KINDS)}")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats (default: all three)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script (interpreter)")
    ap.add_argument("--sweep", action="store_true", help="also time tilings (BLOCK_P, num_warps) of fp8 conventional")
    ap.add_argument("--multi-sweep", action="store_true", help="also time tilings of the all-variant launch")
    ap.add_argument("--profile-peers", action="store_true", help="also profile one run of each compiled peer")


def _format_ok(spec: str) -> bool:
    base, *mods = spec.split(":")
    return base in FORMATS and all(m in MODIFIERS for m in mods) and len(set(mods)) == len(mods)


def check_arguments(args) -> tuple[list[str], list[str], set[str]]:
    """(kinds, compile modes, variants whose compiled peer is timed) of the arguments; exits on a bad one."""
    if args.no_compile:
        args.compile_modes = ""
    if args.reps < MIN_REPS:
        sys.exit(f"--reps must be at least {MIN_REPS} (each time is a median with its spread), got {args.reps}")
    formats = [f for f in args.formats.split(",") if f]
    if not formats or not all(_format_ok(f) for f in formats):
        sys.exit(f"--formats takes a comma-separated list of {', '.join(FORMATS)}, each with optional modifiers "
                 f"among {', '.join(MODIFIERS)} (nvfp4:sr, nvfp4:head), got {args.formats!r}")  # fmt: skip
    names = [f"{fmt}@{scheme}" for fmt in formats for scheme in SCHEMES]
    compile_variants = set(names) if args.compile_variants == "all" else set(args.compile_variants.split(","))
    if not compile_variants <= set(names):
        sys.exit(f"--compile-variants takes 'all' or a comma-separated subset of {', '.join(names)}, "
                 f"got {args.compile_variants!r}")  # fmt: skip
    modes = [m for m in args.compile_modes.split(",") if m]
    if any(m not in COMPILE_MODES for m in modes):
        sys.exit(f"--compile-modes takes a comma-separated subset of {', '.join(COMPILE_MODES)}, got {args.compile_modes!r}")
    kind_names = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kind_names or any(k not in KINDS for k in kind_names):
        sys.exit(f"--kinds takes a comma-separated subset of {', '.join(KINDS)}, got {args.kinds!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("the emulation benchmark needs a CUDA GPU (or --device cpu, in Triton's interpreter, to check it)")
    return kind_names, modes, compile_variants


def variant_row(kind, inputs, variant, args, modes, compile_variants, json_rows) -> dict:
    """Time one variant's kernel, its simulate call, its eager peer and its compiled peers; returns its table row
    (and appends the variant's per-run measurements to json_rows)."""
    elems = math.prod(inputs.state_shape)
    work = elems * args.steps  # state element-steps of one kernel launch
    fmt = variant.name.split("@")[0]  # one of FORMATS, perhaps with MODIFIERS (default_variants)

    def kernel_rate_of(x):
        return work / x / 1e9

    def peer_rate_of(x):
        return elems / x / 1e9

    t_kernel = cuda_times(lambda: drain(emulate_triton_steps(inputs, [variant])), args.reps)
    kernel_rate = kernel_rate_of(t_kernel.median)
    # the whole measurement as analyze runs it: validation, kernel, window statistics
    t_sim = cuda_time(lambda: simulate(inputs, [variant], backend="triton", record_every=min(16, args.steps)), args.reps)
    step_fn = kinds.of(inputs).emulation_step
    eager = peer_loop(inputs, variant, args.peer_steps, step_fn)
    t_eager = cuda_time(eager, args.reps) / args.peer_steps
    eager_rate = elems / t_eager / 1e9
    kernel = fused_kernels(inputs, [variant])[0]  # which fused kernel ran it
    results = {}
    if modes and variant.name in compile_variants:
        eager_m = eager()
        del eager  # its per-step argument lists: nothing of the eager loop stays alive beside the peers
        results = compiled_peers(inputs, variant, args, step_fn, eager_m, profile=args.profile_peers)
    json_rows.append(
        {
            "layer": kind,
            "variant": variant.name,
            "kernel": kernel,
            "kernel G/s (runs)": [kernel_rate_of(x) for x in t_kernel],
            "eager G/s": eager_rate,
            "compiled peers": {m: None if r is None else r.summary(elems) for m, r in results.items()},
        }
    )
    timings = {m: None if r is None else r.timing for m, r in results.items()}
    ok = {m: t for m, t in timings.items() if t is not None}
    faster = min(ok, key=lambda m: ok[m].median) if ok else None  # the faster mode is the peer
    peer = ok.get(faster)
    counted = OPS_PER_ELEMENT_STEP.get((kind, fmt, kernel), OPS_PER_ELEMENT_STEP.get((kind, fmt)))
    if counted is not None:  # the formats the sass benchmark counts (per row and per head, RNE and SR)
        fp_ops, int_ops = counted
        floor_rate = 1 / max(fp_ops / FP32_INSTR_PER_S, int_ops / INT_INSTR_PER_S) / 1e9
    else:
        floor_rate = None
    row = {
        "variant": variant.name,
        "kernel": kernel,
        "kernel ms": t_kernel.median * 1e3,
        "kernel G/s": kernel_rate,
        "kernel G/s (slowest-fastest)": spread(kernel_rate_of, t_kernel),
        "simulate G/s": elems * args.steps / t_sim / 1e9,
        "eager G/s": eager_rate,
        "x eager": kernel_rate / eager_rate,
        **{
            f"compiled G/s ({mode})": None if timings.get(mode) is None else peer_rate_of(timings[mode].median)
            for mode in modes
        },
        "compiled G/s (faster)": None if peer is None else peer_rate_of(peer.median),
        "compiled (slowest-fastest)": None if peer is None else spread(peer_rate_of, peer),
        "x compiled": None if peer is None else kernel_rate / peer_rate_of(peer.median),
        "x compiled (range)": None
        if peer is None
        else f"{kernel_rate_of(t_kernel.slowest) / peer_rate_of(peer.fastest):.1f}-"
        f"{kernel_rate_of(t_kernel.fastest) / peer_rate_of(peer.slowest):.1f}",
        "floor G/s (est.)": floor_rate,
        "% of floor": None if floor_rate is None else 100 * kernel_rate / floor_rate,
    }
    print(
        f"{kind} {variant.name}: kernel {kernel_rate:.0f} G/s ({spread(kernel_rate_of, t_kernel)}), eager "
        f"{eager_rate:.1f} G/s, compiled "
        f"{'-' if peer is None else f'{peer_rate_of(peer.median):.1f} G/s ({faster})'}",
        flush=True,
    )
    return row


def add_fp8_ratio(rows: list[dict], runs: dict[str, list[float]]) -> None:
    """Each row's kernel time over fp8_e4m3's under the same scheme (and the same modifiers, where fp8_e4m3 ran with
    them) in the same run ("x fp8 time": the ratio of the medians, above 1 is slower; its range: this kernel's
    slowest run against fp8's fastest .. its fastest against fp8's slowest). runs: variant name -> the kernel's G/s
    of each timed run. Nothing when fp8_e4m3 was not run."""
    for r in rows:
        spec, scheme = r["variant"].split("@")
        same = "".join(f":{m}" for m in spec.split(":")[1:])
        fp8 = next((f for f in (f"fp8_e4m3{same}@{scheme}", f"fp8_e4m3@{scheme}") if f in runs), None)
        if fp8 is None:
            continue
        r["x fp8 of"] = fp8
        mine, ref = runs[r["variant"]], runs[fp8]
        r["x fp8 time"] = f"{statistics.median(ref) / statistics.median(mine):.2f}"
        r["x fp8 time (range)"] = f"{min(ref) / max(mine):.2f}-{max(ref) / min(mine):.2f}"


def kind_section(kind, rows, multi, args, modes) -> Section:
    peers = (
        f"compiled: the same step under torch.compile ({', '.join(modes)}), each mode compiled and timed in "
        "isolation, the faster one the peer"
        if modes
        else "no compiled peer in this run"
    )
    body = (
        f"Batch {args.batch}, {args.steps} steps per kernel launch (metrics every step), {args.peer_steps} steps per "
        f"peer run; every time the median of {args.reps} runs after a warm-up, ranges are the slowest-fastest runs. "
        f"G/s = G state-element-steps per second. Eager: the kind's per-step emulation step in a Python loop; "
        f"{peers}; x compiled (range) = kernel slowest / peer fastest .. kernel fastest / peer slowest. Floor: "
        "the H200's FP32 issue rate over the kernel's instructions per element-step on a write step (OPS_PER_ELEMENT_STEP), "
        "an estimate, not a measurement; a replay16 step writes once in 16 steps, so its floor is low and can be passed. x fp8 time: the kernel's time over "
        "that of x fp8 of (fp8_e4m3 under the same scheme, with the same modifiers where it ran with them) in this run (range: slowest against "
        "fastest runs).\n\n"
        + markdown_table(rows)
        + ("\nAll variants in one launch (the FP32 reference shared: these ratios are not the bar):\n\n"
           + markdown_table(multi) if multi else "")  # fmt: skip
    )
    return Section(f"Emulation throughput: {LAYER_NAMES[kind]}", body)


def run(args) -> Result:
    kind_names, modes, compile_variants = check_arguments(args)
    args.failed = False  # set by compiled_peers when a peer recompiles while it is timed
    dev = args.device
    raw = {"rows": {}, "all in one launch": {}, "variants": [], "sweep": [], "multi sweep": []}
    save = getattr(args, "save_partial", None) or (lambda raw: None)
    if args.sweep:
        raw["sweep"] = sweep(args, dev, kind_names)
    sections = {}
    for kind in kind_names:
        inputs = layer_inputs(kind, args.batch, args.steps, dev)
        rows = raw["rows"][kind] = []
        for variant in default_variants(args):
            rows.append(variant_row(kind, inputs, variant, args, modes, compile_variants, raw["variants"]))
            save(raw)  # a run cut short keeps what it measured
        add_fp8_ratio(rows, {v["variant"]: v["kernel G/s (runs)"] for v in raw["variants"] if v["layer"] == kind})
        multi = [multi_row(kind, inputs, rows, args)]
        raw["all in one launch"][kind] = multi
        if args.multi_sweep:
            raw["multi sweep"] += multi_sweep(kind, inputs, args)
        save(raw)
        sections[f"emulation-{kind}"] = kind_section(kind, rows, multi, args, modes)
        del inputs
        if dev == "cuda":
            torch.cuda.empty_cache()
    failed = "a compiled peer recompiled while it was timed (above)" if args.failed else None
    return Result(sections, raw, measurement=dev == "cuda", failed=failed)
