"""Capture the per-layer SSM decode inputs of a real model from its prefill, verified against the layer itself.

Capture reads each SSM mixer through torch's module hooks on its public submodules (``taps``): forward hooks
record the outputs of its input projections (and KDA's forget gate), and a forward pre-hook on its gated norm
receives the layer's own scan output. At that point the tap derives what the recurrence consumes, in the form the
kernels take: x, B, C, q, k, v after the causal conv and activation; dt = clamp(softplus(dt_raw + dt_bias),
time_step_limit) in fp32; g and beta as the mixer computes them; q = l2norm(q) / sqrt(Dk), k = l2norm(k) (each
family's own l2norm formula: GDN x * rsqrt(sum x^2 + eps), KDA x / sqrt(sum x^2 + eps)). Nothing of the model is
replaced: it computes what it always computes, with whatever scan transformers picked (mamba_ssm / FLA / hub
kernels / the torch reference).

Every capture is verified: the FP32 recurrence (``replay.reference_decode``) on the first ``VERIFY_STEPS``
derived steps must reproduce the layer's own scan output within ``VERIFY_TOLERANCE`` (relative L2 error, by the
model's activation dtype). A transformers release that lays a mixer out differently fails there with a
``CaptureVerificationError`` naming the layer and the transformers version, never with wrong numbers.

Memory stays bounded: each layer's inputs are handed to a callback (``capture_inputs``) or yielded
(``iter_capture``) as soon as the layer has run, moved to ``device`` (CPU by default); nothing else is
kept. The prefill stops right after the last requested layer. The prefill runs the model without its
LM head and without a cache. Where the prefill of the whole batch would not fit in GPU memory (the torch
reference scan of Mamba-2, which transformers falls back to without mamba_ssm, materialises
[batch, chunks, chunk, chunk, heads, state] products: 128 GiB for Nemotron-H-8B at 8 x 2048 tokens), it
runs in micro-batches of sequences (``micro_batch``); every layer's parts are joined along the batch
before the layer is handed on, so that callers see one batch either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator

import torch

from .. import kinds
from ..kinds import InputError, LayerInputs, remember_valid
from ..memory import free_bytes
from ..replay.reference import reference_decode
from ..sizing import layout_dims, prefill_bytes_per_token, prefill_layer_peak
from .compat import tested_range, transformers_version, untested_transformers_note, warn_if_untested_transformers
from .loading import LoadedModel, attention_dims, ssm_layout
from .mixers import CaptureError, SSMMixer, find_ssm_mixers
from .taps import MixerTap, expected_layouts, listen, tap_for
from .text import CORPUS_PATH, calibration_batch
from .torch_path import quiet_cpu_fallback_notices, use_torch_path_on_cpu

# Steps of every captured layer that verification decodes: two of Mamba-2's 128-token chunks, four of the delta
# rules' 64-token ones, so that a chunk boundary of the model's scan lies inside the check.
VERIFY_STEPS = 256
# Relative L2 error allowed between the FP32 recurrence on the captured inputs and the layer's own scan output, by
# the model's activation dtype. fp32: the two differ by summation order (chunked scan against a step loop); 16-bit:
# by the scan's own 16-bit rounding and by the conv, which a fused kernel may round differently from the torch path
# capture recomputes. A layout or formula that changed is off by tens of percent.
VERIFY_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 3e-2, torch.float16: 3e-2}


class CaptureVerificationError(CaptureError):
    """The recurrence on the captured inputs does not reproduce the layer's own output; the message names the
    layer, the error against the tolerance and the transformers version."""


_CAPTURE_LOCK = threading.Lock()


class _AllLayersCaptured(Exception):
    """Raised inside the forward once the last requested layer is recorded: the rest is not needed."""


class _ConsumerClosed(Exception):
    """The consumer of ``iter_capture`` stopped reading: abort the prefill."""


def _build(kind: str, raw: dict, steps: int, meta: dict) -> LayerInputs:
    """The validated inputs of the first ``steps`` steps, on the model's device and in its dtypes (views, no copy)."""
    inputs_type = kinds.get(kind).inputs_type
    fields = {n: (v[:, :steps] if v is not None and n in inputs_type.SEQUENCE_FIELDS else v) for n, v in raw.items()}
    try:
        return inputs_type(**fields, meta=dict(meta)).validate()
    except InputError as exc:  # e.g. an overflow in a low-precision model: say which layer
        raise CaptureError(f"layer {meta.get('layer')}: the captured inputs are invalid: {exc}") from exc


def _deliver(inputs: LayerInputs, device, dtype) -> LayerInputs:
    """Copies on ``device`` (the model's tensors are not kept alive); ``dtype`` casts the per-step tensors."""
    out = {}
    for f in dataclasses.fields(inputs):
        v = getattr(inputs, f.name)
        if isinstance(v, torch.Tensor):
            cast = dtype if dtype is not None and f.name in inputs.SEQUENCE_FIELDS else v.dtype
            v = v.to(device=device, dtype=cast, copy=True)
        out[f.name] = v
    delivered = dataclasses.replace(inputs, **out)
    if dtype is not None:
        return delivered.validate()
    remember_valid(delivered)  # the same values as the validated ``inputs``
    return delivered


def _verify(inputs: LayerInputs, scan_output: torch.Tensor, mixer: SSMMixer, tap: MixerTap) -> float:
    """Relative L2 error of the FP32 recurrence on the first ``VERIFY_STEPS`` captured steps against the layer's own
    scan output (the gated norm's input, any layout that flattens to [B, T, H, rows]); CaptureVerificationError
    above ``VERIFY_TOLERANCE``."""
    n = min(inputs.steps, VERIFY_STEPS)
    y_ref, _, _ = reference_decode(inputs.slice_steps(0, n))
    y_model = scan_output.detach().reshape(inputs.batch, -1, inputs.num_heads, inputs.rows)[:, :n].float()
    act = getattr(inputs, inputs.ACTIVATION_FIELD).dtype
    tol = VERIFY_TOLERANCE.get(act, VERIFY_TOLERANCE[torch.bfloat16])
    err = float((y_ref - y_model).norm() / y_model.norm().clamp_min(torch.finfo(torch.float32).tiny))
    if not err <= tol:  # NaN fails too
        version = transformers_version()
        advice = untested_transformers_note(version)
        advice = (
            f"ssmquant is tested with {tested_range()}: install a tested release"
            if advice
            else "this release is among the tested ones: please report it with the model's config"
        )
        raise CaptureVerificationError(
            f"layer {mixer.layer} ({type(mixer.module).__name__}): the FP32 recurrence on the captured inputs does "
            f"not reproduce the layer's own output (relative error {err:.3g} over {n} steps, tolerance {tol:g}) "
            f"with transformers {version}, read as the {tap.family} layout; {advice}"
        )
    return err


def _concat_batch(parts: list[LayerInputs], meta: dict) -> LayerInputs:
    """Join the micro-batches of one layer along the batch (per-step tensors; per-head ones are shared)."""
    if len(parts) == 1:
        return parts[0]
    joined = {name: torch.cat([getattr(p, name) for p in parts]) for name in parts[0].SEQUENCE_FIELDS}
    return dataclasses.replace(parts[0], **joined, meta=dict(meta))


def prefill_bytes_per_sequence(net: torch.nn.Module, tokens: int, device: torch.device | None = None) -> int:
    """Estimated peak bytes of one sequence's prefill of ``tokens`` positions on ``device`` (default: where the
    model's first parameter is) beyond the weights: the live activations of transformers' torch path at its largest
    SSM layer (``sizing.prefill_bytes_per_token``, the kind's chunked scan) and, where the prefill materialises them,
    the larger of one attention layer's [heads, tokens, tokens] scores (quadratic in the tokens) and KDA's scan
    decays (``sizing.prefill_layer_peak``). An estimate for sizing micro-batches, not a measurement."""
    config = net.config.get_text_config().to_dict()
    dims = layout_dims(ssm_layout(net.config))
    linear = int(tokens) * prefill_bytes_per_token(dims, config)
    device = next(net.parameters()).device if device is None else torch.device(device)
    return linear + prefill_layer_peak(dims, config, attention_dims(net.config), tokens, device)[1]


def auto_micro_batch(net: torch.nn.Module, batch: int, tokens: int, device: torch.device, free=None) -> int:
    """Sequences per prefill pass so that the estimated prefill peak fits in half the free memory of the
    device the prefill runs on (GPU memory, or the host's available memory for the CPU). A model spread over
    several devices runs each layer's prefill on the device holding it: the least free of them counts.
    ``free``: the free-memory reader (``memory.free_bytes``; tests pass fakes)."""

    free = free or free_bytes
    per_seq = prefill_bytes_per_sequence(net, tokens, device)
    if not per_seq:
        return batch
    devices = {torch.device(device)} | {p.device for p in net.parameters()}
    rooms = [r for r in (free(d) for d in devices) if r is not None]
    if not rooms:
        return batch
    return max(1, min(batch, int(0.5 * min(rooms)) // per_seq))


class _State:
    def __init__(self, wanted, on_layer, steps, device, dtype, meta, stop_early):
        self.wanted = set(wanted)
        self.done: set[int] = set()
        self.on_layer = on_layer
        self.steps = steps
        self.device = device
        self.dtype = dtype
        self.meta = meta
        self.stop_early = stop_early


def mixer_taps(mixers: dict[int, SSMMixer]) -> dict[int, MixerTap]:
    """The tap of every mixer (``find_ssm_mixers``), by layer; CaptureError naming the first mixer whose layout
    capture does not know."""
    out = {}
    for layer, mixer in mixers.items():
        tap = tap_for(mixer.kind, mixer.module)
        if tap is None:
            raise CaptureError(
                f"layer {layer} ({type(mixer.module).__name__}): capture knows no layout of this {mixer.kind} mixer "
                f"under transformers {transformers_version()}; it reads {expected_layouts(mixer.kind)}. ssmquant is "
                f"tested with {tested_range()}"
            )
        out[layer] = tap
    return out


@contextlib.contextmanager
def _hooked(mixers: dict[int, SSMMixer], taps: dict[int, MixerTap], state: _State):
    """Forward hooks on each mixer's recorded submodules and a pre-hook on its gated norm, for one prefill pass."""
    handles = []
    try:
        for layer, mixer in mixers.items():
            tap = taps[layer]

            def at_norm(recorded, args, layer=layer, mixer=mixer, tap=tap):
                if layer in state.done:
                    return
                missing = [n for n in tap.recorded if n not in recorded]
                if missing or not args:
                    raise CaptureError(
                        f"layer {layer} ({type(mixer.module).__name__}): its gated norm ran before {', '.join(missing)} "
                        f"(transformers {transformers_version()} computes this mixer in another order than the "
                        f"{tap.family} layout capture reads; tested: {tested_range()})"
                    )
                meta = dict(state.meta, layer=layer, kind=tap.kind)
                native = _build(tap.kind, tap.derive(mixer.module, recorded), state.steps, meta)
                native.meta["capture_error"] = _verify(native, args[0], mixer, tap)
                state.done.add(layer)
                state.on_layer(layer, _deliver(native, state.device, state.dtype))
                if state.stop_early and state.done >= state.wanted:
                    raise _AllLayersCaptured

            handles += listen(mixer.module, tap, at_norm)
        yield
    finally:
        for h in handles:
            h.remove()


def _unpack(model) -> tuple[torch.nn.Module, dict]:
    if isinstance(model, LoadedModel):
        meta = {
            "source": "shipped" if model.source.kind == "shipped" else "checkpoint",
            "model": model.source.name,
            "location": model.source.location,
            "architecture": model.arch.architecture,
        }
        return model.model, meta
    cfg = getattr(model, "config", None)
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    return model, {"source": "checkpoint", "model": getattr(cfg, "name_or_path", "") or arch, "architecture": arch}


def capture_inputs(
    model: torch.nn.Module | LoadedModel,
    input_ids: torch.Tensor,
    on_layer: Callable[[int, LayerInputs], None],
    *,
    layers: list[int] | None = None,
    steps: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    meta: dict | None = None,
    stop_early: bool = True,
    micro_batch: int | None = None,
) -> list[int]:
    """Run the prefill of ``input_ids`` [B, T] and call ``on_layer(layer_idx, inputs)`` for each SSM layer.

    ``inputs`` is a Mamba2Inputs / GDNInputs / KDAInputs of the first ``steps`` tokens (default all T), in the form
    the recurrence consumes (module docstring), on ``device``. ``dtype=None`` keeps what the model
    computes: x, B, C, v, beta in the model's activation dtype; dt, q, k, g, A, D in fp32 (derived in
    fp32 as the kernels do). A dtype casts the per-step tensors. ``layers`` selects decoder layers
    (default all SSM layers). ``meta`` is merged into every layer's meta (with "source", "model",
    "layer", "tokens"). ``micro_batch``: sequences per prefill pass (default: as many as fit, see
    ``auto_micro_batch``); with several passes each layer is handed on after the last pass reaches it, its
    parts joined along the batch (host memory then holds the earlier passes' inputs of every layer).
    Every layer is verified before it is handed on (module docstring): the relative error of each pass is in
    ``meta["capture_error"]`` of the inputs (the largest over the passes).
    Returns the captured layer indices in order.
    Raises CaptureError for more steps than tokens (both numbers), unknown layers, mixers of a layout capture does
    not know, or layers whose inputs were never seen; CaptureVerificationError where a layer's verification fails.
    """
    net, base_meta = _unpack(model)
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.ndim != 2
        or input_ids.dtype not in (torch.int64, torch.int32)
    ):
        raise CaptureError(
            f"input_ids must be an integer tensor [batch, tokens], got {getattr(input_ids, 'shape', input_ids)}"
        )
    tokens = int(input_ids.shape[1])
    if steps is None:
        steps = tokens
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise CaptureError(f"steps must be a positive integer, got {steps!r}")
    if steps > tokens:
        raise CaptureError(
            f"requested {steps} steps but the prefill captures only {tokens} tokens per sequence; "
            f"pass sequences of at least {steps} tokens or ask for at most {tokens} steps"
        )
    use_torch_path_on_cpu(net)
    mixers = find_ssm_mixers(net)
    if not mixers:
        raise CaptureError(
            f"{type(net).__name__} has no Mamba-2, Gated DeltaNet or Kimi Delta Attention mixer "
            "(is it a NemotronH / Qwen3.5 / Qwen3-Next / GLM-5.3-Flash / Kimi-Linear model?)"
        )
    wanted = list(mixers) if layers is None else [int(i) for i in layers]
    unknown = [i for i in wanted if i not in mixers]
    if unknown:
        raise CaptureError(f"layers {unknown} are not SSM layers of this model; its SSM layers are {list(mixers)}")
    chosen = {i: mixers[i] for i in wanted}
    taps = mixer_taps(chosen)
    warn_if_untested_transformers()
    order: list[int] = []

    def record(layer, inputs):
        order.append(layer)
        on_layer(layer, inputs)

    batch = int(input_ids.shape[0])
    full_meta = dict(base_meta, **(meta or {}), tokens=tokens, steps=steps, batch=batch)
    # The decoder stack alone: the LM head's logits (B x T x vocab) are not needed.
    body = getattr(net, "base_model", net)
    embed = net.get_input_embeddings() if hasattr(net, "get_input_embeddings") else None
    ids = input_ids.to(embed.weight.device) if embed is not None else input_ids
    if ids.device.type == "cpu":
        quiet_cpu_fallback_notices()
    if micro_batch is None:
        micro_batch = auto_micro_batch(net, batch, tokens, ids.device)
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise CaptureError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    starts = list(range(0, batch, micro_batch))
    held: dict[int, list[LayerInputs]] = {i: [] for i in wanted}

    def hold(layer, inputs):
        held[layer].append(inputs)

    def last_pass(layer, inputs):
        parts = [*held.pop(layer), inputs]
        worst = max(p.meta["capture_error"] for p in parts)
        record(layer, _concat_batch(parts, dict(inputs.meta, batch=batch, capture_error=worst)))

    if not _CAPTURE_LOCK.acquire(blocking=False):
        raise CaptureError("another capture is running in this process; captures cannot overlap")
    was_training = net.training
    try:
        net.eval()  # NemotronH takes a fused training-only path otherwise
        for start in starts:
            last = start == starts[-1]
            state = _State(
                wanted, last_pass if last else hold, steps, torch.device(device), dtype, full_meta, stop_early
            )
            with torch.no_grad(), _hooked(chosen, taps, state):
                try:
                    body(input_ids=ids[start : start + micro_batch], use_cache=False)
                except _AllLayersCaptured:
                    pass
            if not last and state.done != set(wanted):
                break  # reported as missing below
    finally:
        net.train(was_training)
        _CAPTURE_LOCK.release()
    missing = [i for i in wanted if i not in state.done]
    if missing:
        norms = sorted({f"{type(mixers[i].module).__name__}.{taps[i].norm}" for i in missing})
        raise CaptureError(
            f"no SSM inputs were captured for layers {missing}: the prefill never called {', '.join(norms)} "
            "(a hub kernel replacing the whole mixer, e.g. a model loaded with use_kernels=True, bypasses it); "
            "load the model without hub kernels"
        )
    return order


def capture_all(model, input_ids: torch.Tensor, **kwargs) -> dict[int, LayerInputs]:
    """All requested layers at once: {layer_idx: inputs}. Keyword arguments as ``capture_inputs``.

    Holds every layer in memory; for large models prefer ``iter_capture`` or ``capture_inputs``.
    """
    out: dict[int, LayerInputs] = {}
    capture_inputs(model, input_ids, lambda i, x: out.__setitem__(i, x), **kwargs)
    return out


def iter_capture(model, input_ids: torch.Tensor, **kwargs) -> Iterator[tuple[int, LayerInputs]]:
    """Yield (layer_idx, inputs) layer by layer while the prefill runs (keyword arguments as ``capture_inputs``).

    The prefill runs in a worker thread and waits while the consumer holds a layer, so at most one layer
    is queued ahead: host memory stays at about two layers' inputs. Closing the generator early stops
    the prefill; an error in the prefill is raised here.
    """
    q: queue.Queue = queue.Queue(maxsize=1)
    closed = threading.Event()

    def put(item):
        while True:
            if closed.is_set():
                raise _ConsumerClosed
            try:
                q.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def worker():
        try:
            capture_inputs(model, input_ids, lambda i, x: put(("layer", i, x)), **kwargs)
            put(("done", None, None))
        except _ConsumerClosed:
            pass
        except BaseException as exc:  # handed to the consumer, raised there
            with contextlib.suppress(_ConsumerClosed):
                put(("error", exc, None))

    thread = threading.Thread(target=worker, name="ssmquant-capture", daemon=True)
    thread.start()
    try:
        while True:
            kind, a, b = q.get()
            if kind == "layer":
                yield a, b
            elif kind == "error":
                raise a
            else:
                return
    finally:
        closed.set()
        thread.join()


def capture_text_batch(
    loaded: LoadedModel,
    *,
    batch: int,
    steps: int,
    seed: int = 0,
    split: str = "calibration",
    text: str | None = None,
    text_path: str | None = None,
) -> tuple[torch.Tensor, dict]:
    """Token ids [batch, steps] of calibration text for ``loaded`` and the meta describing them.

    Text: ``text``, else the file ``text_path``, else the shipped corpus; tokenised with the model's
    tokenizer and selected with ``text.select_sequences`` (seeded; calibration and held-out splits are
    disjoint). Pass the ids to ``iter_capture`` / ``capture_inputs`` with ``meta=`` the returned dict.
    """
    ids = calibration_batch(
        batch, steps, tokenizer=loaded.tokenizer, text=text, text_path=text_path, seed=seed, split=split
    )
    origin = (
        "inline" if text is not None else str(text_path) if text_path is not None else f"shipped:{CORPUS_PATH.name}"
    )
    return ids, {"text": {"origin": origin, "split": split, "seed": seed, "batch": batch, "length": steps}}
