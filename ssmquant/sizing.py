"""How big a run is, before it starts: a memory estimate checked against what is free, and a time estimate
measured on this machine.

- Memory (``analyze_memory``, ``eval_memory``, ``check_memory``): the large tensors a run allocates, from
  the shapes alone (the layer kind's bytes per token, ``ssmquant.kinds``; the larger of a prefill's attention scores,
  quadratic in its tokens, and KDA's torch-scan decays, ``prefill_layer_peak``), per pool (the compute device, and
  host memory for what capture keeps there). A run whose estimate exceeds the free memory of a pool is refused
  before any of it is allocated, with the estimate, its largest parts and the largest --steps that fits.
- Time (``probe_step_seconds``): the cost of one decode step of one layer for the run's variants, measured by
  running a few steps on random inputs of the run's exact state shape (a second at most), then scaled to the
  run. It is an estimate: model loading and capture are not included, and a busy machine runs slower.

The default sizes are in ``ssmquant.defaults``, the free memory in ``ssmquant.memory``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from . import kinds
from .defaults import CPU_DEFAULTS, GPU_DEFAULTS, default_sizes, describe_defaults
from .kinds import LayerDims
from .memory import GIB, SizingError, format_bytes, free_bytes
from .replay.trace import METRIC_BUFFER_BYTES
from .simulate import simulate

FP32 = 4
# Per decode step the torch backend costs ~3.3 ns per state element per variant on 2 cores (x86, torch 2.13,
# measured with nemotron-3-nano shapes); used only to size the probe's batch so that one run of it takes
# about PROBE_SECONDS.
PROBE_SECONDS = 0.3
PROBE_REPEATS = 3
_NS_PER_ELEMENT_STEP = 3.5e-9


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


# -- memory ---------------------------------------------------------------------------------------------


def layer_dims(kind: str, heads: int, rows: int, state_dim: int, groups: int) -> LayerDims:
    """The ``kinds.LayerDims`` every estimate here reads: heads, rows and state_dim of a per-head state, and its
    groups (Mamba-2's B/C groups, the delta rules' key heads)."""
    return LayerDims(kind, int(heads), int(rows), int(state_dim), int(groups))


def layout_dims(layout: dict) -> LayerDims:
    """``layer_dims`` of a model's SSM layout (``models.ssm_layout``: layer_kind, state_shape, groups)."""
    heads, rows, state_dim = layout["state_shape"]
    return layer_dims(layout["layer_kind"], heads, rows, state_dim, layout.get("groups") or heads)


def state_elements(dims: LayerDims) -> int:
    return dims.state_elements


def input_bytes_per_token(dims: LayerDims, act_bytes: int = FP32) -> int:
    """The decode inputs of one token as a model hands them over (activations in ``act_bytes``)."""
    return kinds.get(dims.kind).input_bytes_per_token(dims, act_bytes)


def emulation_bytes_per_token(dims: LayerDims, variants: int) -> int:
    """What the torch backend holds per token (``replay.naive.Emulation``): the kind's fp32 copies of the inputs
    with groups expanded to every head, and each variant's buffered copy."""
    return kinds.get(dims.kind).emulation_bytes_per_token(dims, variants)


@dataclass
class MemoryEstimate:
    """Estimated peak bytes of a run, per pool ("device": where it computes; "host": CPU memory)."""

    device: torch.device
    parts: list[tuple[str, str, int]] = field(default_factory=list)  # (label, pool, bytes)
    per_token: dict[str, int] = field(default_factory=dict)  # pool -> bytes that scale with batch x steps

    def add(self, label: str, pool: str, nbytes: float, per_token: float = 0.0) -> None:
        self.parts.append((label, pool, int(nbytes)))
        self.per_token[pool] = self.per_token.get(pool, 0) + int(per_token)

    def total(self, pool: str) -> int:
        return sum(b for _, p, b in self.parts if p == pool)

    @property
    def pools(self) -> list[str]:
        return list(dict.fromkeys(p for _, p, _ in self.parts))


def _pool(device) -> str:
    return "device" if _is_cuda(device) else "host"


MAX_LAUNCH_VARIANTS = 6  # ssmquant.kernels.common.MAX_SLOTS: variants carried by one kernel launch


def launch_metric_bytes_per_sequence(dims: LayerDims, variants: int, steps: int) -> int:
    """Bytes of one sequence's per-step metrics in a launch carrying min(variants, 6) variants: NV x T x H x
    row blocks x 4 fp32, the row blocks from the tile that ``kernels.plan_blocks`` picks for dynamic scales
    (rows per warp from the register budget of 128 state elements per thread over the NV + 1 states; the
    formula of ``kernels.planning._rows_per_warp``, here without importing Triton). An upper bound for formats whose
    scale groups need more rows (fewer, larger blocks)."""
    nv = max(1, min(variants, MAX_LAUNCH_VARIANTS))
    per_state = 1 << ((128 // (nv + 1)).bit_length() - 1)
    rows_per_warp = max(1, 32 * per_state // (1 << (dims.state_dim - 1).bit_length()))
    blocks = -(-dims.rows // rows_per_warp)
    return nv * steps * dims.heads * blocks * 4 * FP32


def analyze_memory(
    dims: LayerDims,
    *,
    batch: int,
    steps: int,
    variants: int,
    recorded: int,
    device: torch.device,
    backend: str,
    prefill: dict | None = None,
    capture_device: torch.device | None = None,
    workers: int = 1,
    lanes: int = 1,
    ahead: bool = False,
    prompt: int = 0,
    attention: AttentionDims | None = None,
) -> MemoryEstimate:
    """Peak memory of emulating one layer at a time on ``device`` (``analyze``, ``calibrate``), with capture
    when ``prefill`` (``prefill_bytes_per_token``'s config) is given: the prefill runs on ``capture_device``
    and the captured inputs of up to two layers wait in host memory (``models.capture.iter_capture``).

    Several GPUs (``workers`` > 1 emulation devices, ``analysis.devices``): each device holds one layer's
    emulation at a time, so this per-device estimate is checked on each of them; the prefill of a model
    spread over them runs a part on each (counted on every device, an upper bound); the host holds one
    more queued layer per worker. ``lanes`` > 1: the device emulates that many layers at once (one CUDA
    stream each, ``analysis.devices.run_on_devices``), so every per-layer part of the device counts that many
    times, plus the inputs of the next layer generated while they run. ``ahead``: synthetic inputs made ahead
    on another stream (``analysis.sources.made_ahead``): two more layers' inputs, one waiting and one being
    drawn with its fp32 buffers (one sequence at a time, ``models.synthetic``). ``prompt``: tokens captured before
    the ``steps`` decode steps (``kinds.after_prompt``): held and prefilled with them, not emulated. ``attention``:
    the captured model's attention layers, whose scores the prefill holds where it materialises them
    (``prefill_layer_peak``: or KDA's scan decays, whichever is larger)."""
    device = torch.device(device)
    pool = _pool(device)
    est = MemoryEstimate(device)
    tokens = batch * steps  # emulated
    held_tokens = batch * (prompt + steps)  # captured: the prompt's and the decoded ones
    per_token = input_bytes_per_token(dims)
    est.add("one layer's inputs (prompt and decode steps)", pool, held_tokens * per_token, per_token)
    if backend == "torch":
        em = emulation_bytes_per_token(dims, variants)
        est.add(f"torch emulation of {variants} variants (fp32 copies of the inputs)", pool, tokens * em, em)
    else:  # the kernels read the inputs in place; per-step decays are precomputed
        est.add("per-step decays", pool, tokens * FP32 * dims.heads, FP32 * dims.heads)
    states = (1 + variants) * batch * state_elements(dims) * FP32 * 3  # reference + variants, and a step's temporaries
    est.add("states", pool, states)
    # every step is measured (replay.trace): per-step metrics, then window statistics in float64
    step_metrics = dims.heads * 4 * FP32
    if backend == "torch":
        est.add("per-step metrics of every variant", pool, variants * tokens * step_metrics, variants * step_metrics)
    else:  # one launch's buffer, [NV, T, batch slice, H, row blocks, 4]; slices keep it under METRIC_BUFFER_BYTES
        per_seq = launch_metric_bytes_per_sequence(dims, variants, steps)
        seqs = min(batch, max(1, METRIC_BUFFER_BYTES // per_seq))
        # the buffer, its sum over the row blocks, and one variant's float64 copy with its temporaries
        work = seqs * steps * step_metrics * (min(variants, MAX_LAUNCH_VARIANTS) + 2 * 2 * 2)
        est.add("per-step metrics of one launch", pool, seqs * per_seq + work)
    # windows (mean, last, maxima) and the per-step sums over the batch that the pooled maxima need
    per_step_sums = variants * dims.heads * 4 * 8
    est.add("window statistics", pool, variants * recorded * batch * dims.heads * 12 * 8 + steps * per_step_sums,
            -(-per_step_sums // batch))  # fmt: skip
    if lanes > 1:
        one = est.total(pool)
        est.add(f"{lanes - 1} more layer(s) emulated at once on other streams", pool, (lanes - 1) * one,
                (lanes - 1) * est.per_token.get(pool, 0))  # fmt: skip
        est.add("the next layer's inputs, generated meanwhile", pool, held_tokens * per_token, per_token)
    if ahead:
        est.add("two more layers' inputs, made ahead", pool, 2 * held_tokens * per_token, 2 * per_token)
        # fp32 draws, the conv output and its activation of one sequence: ~3 fp32 copies of a step's inputs
        est.add("drawing them (one sequence's fp32 buffers)", pool, (prompt + steps) * per_token * 6)
    if prefill is not None:
        cap = torch.device(capture_device or device)
        pt = prefill_bytes_per_token(dims, prefill)
        # the capture prefills in micro-batches sized to the free memory (models.capture.auto_micro_batch),
        # down to one sequence: that is the part that must fit
        est.add("prefill activations of the capture (one sequence)", _pool(cap), (prompt + steps) * pt)
        what, peak = prefill_layer_peak(dims, prefill, attention, prompt + steps, cap)
        if peak:
            est.add(peak_label(what, "the capture's prefill", "[heads, L, L]", one_sequence=True), _pool(cap), peak)
        if pool != "host" or cap.type != "cpu":
            waiting = 2 if workers <= 1 else 2 + workers
            held = waiting * input_bytes_per_token(dims)
            est.add(f"captured inputs waiting in host memory ({waiting} layers)", "host", held_tokens * held, held)
        else:
            held = input_bytes_per_token(dims)
            est.add("the next layer's captured inputs", "host", held_tokens * held, held)
    return est


def prefill_bytes_per_token(dims: LayerDims, config: dict, *, scan: bool = True) -> int:
    """Rough live bytes per token of a prefill through transformers' torch path, for the largest layer; ``scan``
    False: with the SSM mixers' chunked scans skipped (``models.scan_substitution``), the mixer holding its
    projections and their convolution (twice its decode inputs) instead.

    The SSM mixers' chunked scans dominate: Mamba-2 (``mamba2_chunk_scan``) holds L, G and M of
    [chunk, H] per token, the chunk states [H, P, N] per chunk and fp32 copies of x, B, C; GDN
    (``torch_chunk_gated_delta_rule``, chunk 64) the same pattern with [Dv, Dk] states (the kind's
    ``prefill_scan_elements``). Add the MLP and
    residual activations. Checked against the shipped models (x 1.5 below their measured peaks, so the
    estimate is scaled up by 1.5).
    """
    kind = kinds.get(dims.kind)
    chunk = int(config.get("chunk_size") or kind.default_chunk)
    hidden = int(config.get("hidden_size") or 0)
    inter = int(config.get("intermediate_size") or 0)
    ssm = kind.prefill_scan_elements(dims, chunk) if scan else 2 * kind.input_bytes_per_token(dims) / FP32
    return int(1.5 * FP32 * (ssm + 16 * hidden + 2 * inter))


# Where a prefill materialises an attention layer's [heads, L, L] scores, it holds about this many FP32 copies of them
# at its peak (the scores, their softmax and a temporary). Measured: the peak RSS of one forward (use_cache=False,
# logits_to_keep=1) of tiny-kda (4 heads, MLA under sdpa, on the CPU) beyond the loaded model was 2.9 / 6.3 GB for one
# sequence of 8192 / 12288 tokens and 7.1 GB for 8 of 4096 (3.4 / 6.8 / 7.6 GB of RSS in all), set at its attention
# layers: 10-11 bytes per head per L^2; tiny-qwen under eager attention, 10.0 at 8192. Three copies (12 bytes) bound
# them.
ATTENTION_SCORE_COPIES = 3


@dataclass(frozen=True)
class AttentionDims:
    """A model's attention layers as the prefill estimates read them: how many (``layers``), their query heads
    (``heads``), transformers' attention implementation ("sdpa", "eager", ...; None: unknown, counted as eager), and
    whether the value head dim differs from the query / key one (``value_dim_differs``: multi-head latent attention,
    such as Kimi-Linear's 48 against 32)."""

    layers: int
    heads: int
    implementation: str | None = "sdpa"
    value_dim_differs: bool = False


def attention_scores_materialised(attention: AttentionDims, device) -> bool:
    """Whether a prefill on ``device`` holds each attention layer's [heads, L, L] scores.

    Eager attention (or an unknown implementation) always. sdpa on CUDA never: its flash and memory-efficient
    kernels keep no L x L matrix. sdpa on the CPU where the value head dim differs from the query / key one: torch's
    CPU flash kernel needs them equal and sdpa falls back to its math path (measured: tiny-kda's MLA at 12288 tokens
    holds 6.3 GB of scores; tiny-qwen and tiny-nemotron, equal head dims, hold none). Other implementations
    (flash_attention_2, flex_attention) run without an L x L matrix on CUDA; elsewhere they are counted."""
    implementation = attention.implementation or "eager"
    if implementation == "eager":
        return True
    if _is_cuda(device):
        return False
    return attention.value_dim_differs or "sdpa" not in implementation


def attention_score_bytes(attention: AttentionDims | None, tokens: int, device) -> int:
    """Peak bytes of the attention scores in the prefill of one sequence of ``tokens`` positions on ``device``:
    heads x tokens^2 x FP32 x ATTENTION_SCORE_COPIES where they are materialised
    (``attention_scores_materialised``), else 0. The attention layers run one after another: one layer's scores are
    live at a time. 0 for a model without attention layers (``attention`` None or no layers). A batch of B sequences
    holds B times this."""
    if attention is None or attention.layers < 1 or not attention_scores_materialised(attention, device):
        return 0
    return attention.heads * int(tokens) ** 2 * FP32 * ATTENTION_SCORE_COPIES


def scan_pair_bytes(dims: LayerDims, config: dict, tokens: int, device) -> int:
    """Bytes the SSM layer's torch prefill scan holds for the position pairs of its chunks (the kind's
    ``prefill_pair_elements``; KDA's decays) over one sequence of ``tokens`` on ``device``: 0 where the kind's fused
    library kernel runs instead (``torch_prefill``)."""
    kind = kinds.get(dims.kind)
    if not kind.torch_prefill(device):
        return 0
    chunk = int(config.get("chunk_size") or kind.default_chunk)
    return int(int(tokens) * FP32 * kind.prefill_pair_elements(dims, chunk))


def prefill_layer_peak(
    dims: LayerDims, config: dict, attention: AttentionDims | None, tokens: int, device, *, scan: bool = True
) -> tuple[str, int]:
    """The part of the prefill of one sequence of ``tokens`` positions on ``device`` that one layer holds only while
    it runs, beyond the activations every layer keeps (``prefill_bytes_per_token``): ("scores", one attention layer's
    scores, ``attention_score_bytes``) or ("pairs", the SSM scan's position-pair decays, ``scan_pair_bytes``; none
    where the scans are skipped, ``scan`` False), whichever is larger (different layers hold them, never at once);
    bytes 0 when neither is held."""
    scores = attention_score_bytes(attention, tokens, device)
    pairs = scan_pair_bytes(dims, config, tokens, device) if scan else 0
    return ("scores", scores) if scores >= pairs else ("pairs", pairs)


def peak_label(what: str, of: str, shape: str, one_sequence: bool = False) -> str:
    """A memory-estimate line for ``prefill_layer_peak``'s part ``what`` of the prefill ``of``, the scores' shape
    ``shape`` ("[heads, L, L]"); ``one_sequence``: the line counts one sequence of a batch prefilled one at a time."""
    scope = "one sequence; " if one_sequence else ""
    if what == "scores":
        return f"attention scores of {of} ({scope}one layer's {shape} fp32 x {ATTENTION_SCORE_COPIES})"
    return f"the KDA scan's decays of {of} ({scope}one layer's [chunk, chunk, Dk] per chunk and head, fp32 x 3)"


def eval_memory(
    dims: LayerDims,
    *,
    batch: int,
    steps: int,
    variants: int,
    ssm_layers: int,
    attention_layers: int,
    kv_per_token: int,
    vocab: int,
    device: torch.device,
) -> MemoryEstimate:
    """Peak memory of ``evaluate`` beyond the weights: one cache per run (the reference and each variant)
    with every SSM layer's state and an attention KV cache growing to ``steps`` tokens, the per-position
    metrics, and one step's logits per run."""
    device = torch.device(device)
    pool = _pool(device)
    est = MemoryEstimate(device)
    runs = 1 + variants
    est.add("SSM states of every run", pool, runs * batch * ssm_layers * state_elements(dims) * FP32 * 2)
    kv = runs * attention_layers * kv_per_token
    est.add("attention KV caches of every run", pool, kv * batch * steps, kv)
    est.add("per-position metrics", pool, (variants * 3 + 1) * batch * steps * 8, (variants * 3 + 1) * 8)
    est.add("logits", pool, 3 * runs * batch * vocab * FP32)
    return est


# The layer-major evaluation compares logits in chunks of positions: each chunk's logits of the reference and one
# variant (FP32) and the metrics' float64 log-probabilities and probabilities stay under this many bytes.
METRIC_CHUNK_BYTES = 1 << 30
METRIC_BYTES_PER_LOGIT = 2 * FP32 + 3 * 8


def metric_chunk_rows(vocab: int, bytes_per_logit: int = METRIC_BYTES_PER_LOGIT) -> int:
    """Positions per chunk of the layer-major metrics: as many as METRIC_CHUNK_BYTES holds (at least one), at
    ``bytes_per_logit`` (default: the torch path's; the fused kernel's holds the reference's and one variant's logits
    in the head's dtype)."""
    return max(1, METRIC_CHUNK_BYTES // (int(vocab) * int(bytes_per_logit)))


def layer_major_memory(
    dims: LayerDims,
    config: dict,
    *,
    batch: int,
    tokens: int,
    vocab: int,
    device: torch.device,
    variants: int = 1,
    attention: AttentionDims | None = None,
    scans_skipped: bool = False,
    hidden_bytes: int = FP32,
) -> MemoryEstimate:
    """Peak memory of a layer-major evaluation beyond the weights (``evaluate.layer_major``): one forward of
    ``batch`` x ``tokens`` positions (the prefill's live activations, ``prefill_bytes_per_token``, without the SSM
    mixers' own scans where ``scans_skipped`` (``models.scan_substitution``), and where they are materialised the
    scores of one of the ``attention`` layers or KDA's scan decays, ``prefill_layer_peak``), one
    layer's derived recurrence inputs and its torch emulation of one variant, the final hidden states of the
    reference and the ``variants`` variants (``hidden_bytes`` each element: the dtype in which
    ``layer_major.variant_hidden`` keeps them until the metrics, the output head's), and one chunk of positions'
    logits and float64 metrics (``metric_chunk_rows``)."""
    device = torch.device(device)
    pool = _pool(device)
    est = MemoryEstimate(device)
    positions = batch * tokens
    per_token = prefill_bytes_per_token(dims, config, scan=not scans_skipped)
    label = "the forward's activations" + (" (the SSM mixers' own scans skipped)" if scans_skipped else "")
    est.add(label, pool, positions * per_token, per_token)
    what, peak = prefill_layer_peak(dims, config, attention, tokens, device, scan=not scans_skipped)
    if peak:
        est.add(peak_label(what, "the forward", "[batch, heads, L, L]"), pool, batch * peak)
    emulation = input_bytes_per_token(dims) + emulation_bytes_per_token(dims, 1)
    est.add("one layer's inputs and emulation", pool, positions * emulation, emulation)
    hidden = (1 + variants) * int(config.get("hidden_size") or 0) * int(hidden_bytes)
    est.add("the final hidden states of the reference and the variants", pool, positions * hidden, hidden)
    rows = min(positions, metric_chunk_rows(vocab))
    est.add("one chunk of positions' logits and float64 metrics", pool, rows * vocab * METRIC_BYTES_PER_LOGIT, 0)
    return est


def largest_fitting_steps(need_at, room: int, steps: int) -> int:
    """The largest s in [1, steps - 1] with ``need_at(s) <= room`` (bytes), 0 when none; ``need_at`` must not
    decrease with s. Bisection: about log2(steps) evaluations."""
    lo, hi = 0, steps - 1  # need_at(lo) fits (lo = 0: nothing yet), need_at(hi + 1) does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need_at(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_memory(
    est: MemoryEstimate,
    *,
    batch: int,
    steps: int,
    lower: str = "--steps or --batch",
    free=free_bytes,
    at_steps=None,
    batch_note: str = "",
) -> None:
    """Raise SizingError when a pool's estimate exceeds its free memory (``free(device)``), naming the
    estimate, its largest parts, what is free and the largest number of steps that fits at this batch.

    ``at_steps(s)``: the same run's estimate at s steps. With it, the largest fitting --steps is searched for
    (exact for parts that grow with the steps alone, such as one sequence's buffers, or the metric buffer of a
    launch); without it, it is extrapolated from the parts that scale with batch x steps (``per_token``), which
    counts an analysis' step-only parts as fixed and may say "lower the batch first" where a smaller --steps fits
    at that batch. ``batch_note``: follows the batch
    in the hint, where it is not the one the user gave (calibrate's calibration and held-out sequences)."""
    for pool in est.pools:
        dev = est.device if pool == "device" else torch.device("cpu")
        room = free(dev)
        need = est.total(pool)
        if room is None or need <= room:
            continue
        parts = sorted((p for p in est.parts if p[1] == pool), key=lambda p: -p[2])[:3]
        what = ", ".join(f"{label} {format_bytes(b)}" for label, _, b in parts)
        if at_steps is not None:
            fit = largest_fitting_steps(lambda s, pool=pool: at_steps(s).total(pool), room, steps)
        else:
            fixed = need - est.per_token.get(pool, 0) * batch * steps
            per_step = est.per_token.get(pool, 0) * batch
            fit = int((room - fixed) // per_step) if per_step and room > fixed else 0
        where = f"GPU {dev}" if dev.type == "cuda" else "host"
        if fit >= 1:
            hint = f"at most ~{fit} steps fit at batch {batch}{batch_note}"
        else:
            hint = "lower the batch first" if batch > 1 else "not even one step fits at batch 1"
        raise SizingError(
            f"this run needs about {format_bytes(need)} of {where} memory (estimate; largest parts: {what}) but only "
            f"{format_bytes(room)} is free; lower {lower} ({hint})"
        )


# -- time -----------------------------------------------------------------------------------------------


def random_inputs(dims: LayerDims, batch: int, steps: int, *, device="cpu", seed: int = 0):
    """Random decode inputs of ``dims`` (the kind's inputs) with realistic ranges, for timing."""
    return kinds.get(dims.kind).random_inputs(dims, batch, steps, device=device, seed=seed)


def probe_step_seconds(
    dims: LayerDims, variants, batch: int, steps: int, *, record_every: int = 1, device="cpu", backend="torch"
) -> float:
    """Seconds per decode step of one layer at ``batch`` for ``variants`` keeping metrics every
    ``record_every`` steps, measured here.

    Runs the emulation on random inputs of the layer's exact state shape for a few steps (enough to
    include a replay flush, at most ``steps``) with a batch small enough to take ~PROBE_SECONDS, after a
    short warm-up, and scales linearly to ``batch`` (the per-step work is linear in the batch). The
    fastest of two or three runs counts: on a shared machine a run can stall for many times its length.
    """
    longest = max((v.scheme.buffer_len for v in variants), default=1)
    n = max(1, min(steps, max(16, 2 * longest)))
    per_batch = n * (1 + len(variants)) * (dims.heads * dims.rows * dims.state_dim) * _NS_PER_ELEMENT_STEP
    b = max(1, min(batch, int(PROBE_SECONDS / per_batch)))
    simulate(random_inputs(dims, b, min(n, 2), device=device, seed=1), variants, backend=backend)
    inputs = random_inputs(dims, b, n, device=device)
    runs, start = [], time.perf_counter()
    for i in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        simulate(inputs, variants, backend=backend, record_every=min(n, record_every))
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
        if i >= 1 and time.perf_counter() - start > 3 * PROBE_SECONDS:
            break
    return min(runs) / n * (batch / b)


def format_seconds(s: float) -> str:
    """'45 s', '3.5 min', '2.1 h'."""
    if not math.isfinite(s):
        return "unknown"
    if s < 90:
        return f"{max(1, round(s))} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


# A time-left estimate made from the first unit of work (a layer, the first decode steps) is revised once, from
# the next unit alone, when the two rates differ by more than this factor: the first unit carries the kernel
# compiles of a cold cache (on a GPU, the first layer of a `calibrate` of nemotron-h-8b took about 5x the time of
# each of the other 23).
REVISE_FACTOR = 1.5


def needs_revision(first: float, later: float) -> bool:
    """Whether two times (or rates) of one unit of work differ by more than ``REVISE_FACTOR``: the rule both
    ``LayerEstimate`` and eval's ``Clock`` revise their first estimate by."""
    return max(first, later) > REVISE_FACTOR * max(min(first, later), 1e-9)


class LayerEstimate:
    """Time-left lines for a loop over ``total`` layers run ``parallel`` at a time.

    ``done(seconds)`` after each layer with that layer's own time: after the first it prints "the first layer
    took ...: about ... more" (then ``suffix``); after the second, when its time and the first's differ by more
    than ``REVISE_FACTOR`` (compiles, first-call costs), a revised estimate from the second alone. Nothing is
    printed when ``notify`` is None or there is one layer.
    """

    def __init__(self, total: int, parallel: int, notify, suffix: str = ""):
        self.total, self.parallel, self.notify, self.suffix = total, max(1, parallel), notify, suffix
        self.done_layers = 0
        self.first: float | None = None  # the first layer's time

    def done(self, seconds: float) -> None:
        self.done_layers += 1
        n = self.done_layers
        if self.notify is None or self.total <= 1 or n > 2:
            return
        left = self.total - n
        if n == 1:
            self.first = seconds
            more = seconds * left / self.parallel
            self.notify(
                f"the first layer took {format_seconds(seconds)}: about {format_seconds(more)} more for the other "
                f"{left} layers" + self.suffix
            )
            return
        if left > 0 and needs_revision(self.first, seconds):
            self.notify(
                f"revised: the second layer took {format_seconds(seconds)} (the first {format_seconds(self.first)}, "
                f"kernel compiles included): about {format_seconds(seconds * left / self.parallel)} more for the "
                f"other {left} layers" + self.suffix
            )


__all__ = [
    "CPU_DEFAULTS",
    "GPU_DEFAULTS",
    "LayerEstimate",
    "REVISE_FACTOR",
    "ATTENTION_SCORE_COPIES",
    "AttentionDims",
    "MemoryEstimate",
    "SizingError",
    "GIB",
    "free_bytes",
    "analyze_memory",
    "attention_score_bytes",
    "peak_label",
    "prefill_layer_peak",
    "scan_pair_bytes",
    "attention_scores_materialised",
    "check_memory",
    "largest_fitting_steps",
    "needs_revision",
    "default_sizes",
    "describe_defaults",
    "eval_memory",
    "emulation_bytes_per_token",
    "format_seconds",
    "free_bytes",
    "input_bytes_per_token",
    "layer_dims",
    "layout_dims",
    "prefill_bytes_per_token",
    "probe_step_seconds",
    "random_inputs",
]
