"""Capture the per-layer SSM decode inputs of a real model from its prefill.

Interception points (transformers 5.x, see README): every supported mixer hands its recurrence
inputs to one module-level function of its modeling file, and computes nothing after that call
except the gated norm and out_proj:

- NemotronH (``modeling_nemotron_h.py``): ``NemotronHMamba2Mixer.forward`` calls
  ``mamba2_chunk_scan(x, dt_raw, A, B, C, chunk_size, D=..., dt_bias=..., dt_softplus=True,
  dt_limit=..., initial_states=...)`` with x, B, C after the conv and SiLU and A = -exp(A_log);
- Qwen3.5, Qwen3.5-MoE, Qwen3-Next (``modeling_qwen3_5.py``, ``modeling_qwen3_5_moe.py``,
  ``modeling_qwen3_next.py``): ``*GatedDeltaNet.forward`` calls ``torch_chunk_gated_delta_rule(q, k, v,
  g=g, beta=beta, initial_state=..., use_qk_l2norm_in_kernel=True)`` with q, k, v after the conv and
  SiLU, g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b);
- GLM-5.3-Flash and Kimi-Linear (``modeling_glm5_next.py``, ``modeling_kimi_linear.py``, 5.24):
  ``Glm5NextTextLinearAttention.forward`` / ``KimiLinearDeltaAttention.forward`` call
  ``chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=..., use_qk_l2norm_in_kernel=True)``
  with q, k, v after the conv and SiLU, g the per-key-channel log decays of the forget gate (fp32) and
  beta = sigmoid(b).

Capture replaces that module-global name for the duration of a prefill with a wrapper that records the
arguments and then calls the original. The original is whatever transformers picked
(``use_kernel_func_from_hub_with_fallback``: mamba_ssm / FLA when installed, else the torch
reference), so capture works with or without those packages and never changes what the model computes.
From the arguments the wrapper derives exactly what the recurrence consumes, in fp32 as the kernels
do: dt = clamp(softplus(dt_raw + dt_bias), dt_limit); q = l2norm(q) / sqrt(Dk), k = l2norm(k) (each family's own
l2norm formula: GDN x * rsqrt(sum x^2 + eps), KDA x / sqrt(sum x^2 + eps)).
Forward pre-hooks on the mixers tell the wrapper which layer is running.

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
import functools
import inspect
import queue
import sys
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ..kinds import GDNInputs, InputError, KDAInputs, Mamba2Inputs
from ..memory import free_bytes
from .loading import LoadedModel
from .mixers import CaptureError, SSMMixer, find_ssm_mixers
from .qk_norm import kda_l2norm, l2norm
from .text import CORPUS_PATH, calibration_batch
from .torch_path import use_torch_path_on_cpu

LayerInputs = Mamba2Inputs | GDNInputs | KDAInputs

# The module-level functions the mixers call, per layer kind.
INTERCEPTED_FUNCTIONS = {
    "mamba2": "mamba2_chunk_scan",
    "gdn": "torch_chunk_gated_delta_rule",
    "kda": "chunk_kimi_delta_attention",
}

_CAPTURE_LOCK = threading.Lock()


class _AllLayersCaptured(Exception):
    """Raised inside the forward once the last requested layer is recorded: the rest is not needed."""


class _ConsumerClosed(Exception):
    """The consumer of ``iter_capture`` stopped reading: abort the prefill."""


def _mamba2_inputs(a: dict) -> dict:
    """Recurrence inputs from the arguments of ``mamba2_chunk_scan``."""
    dt = a["dt"].float()
    if a.get("dt_bias") is not None:
        dt = dt + a["dt_bias"].float()
    if a.get("dt_softplus"):
        dt = F.softplus(dt)
    lo, hi = a.get("dt_limit") or (0.0, float("inf"))
    dt = dt.clamp(min=lo, max=hi)
    x = a["hidden_states"]
    heads = x.shape[2]
    d = a.get("D")
    d = torch.zeros(heads, device=x.device) if d is None else d.float()
    init = a.get("initial_states")
    return {
        "x": x,
        "dt": dt,
        "B": a["B"],
        "C": a["C"],
        "A": a["A"].float(),
        "D": d.reshape(heads),
        "initial_state": None if init is None else init.float(),
    }


def _delta_rule_inputs(a: dict, norm) -> dict:
    """Recurrence inputs from the arguments of a delta-rule torch path: q / k in fp32, L2-normalised by ``norm``
    when the call asks for it, q scaled by 1 / sqrt(Dk); the initial state from transformers' [B, H, Dk, Dv] to
    the inputs' [B, H, Dv, Dk]."""
    q, k = a["query"].float(), a["key"].float()
    if a.get("use_qk_l2norm_in_kernel"):
        q, k = norm(q), norm(k)
    q = q * q.shape[-1] ** -0.5
    init = a.get("initial_state")
    return {
        "q": q,
        "k": k,
        "v": a["value"],
        "g": a["g"],
        "beta": a["beta"],
        "initial_state": None if init is None else init.float().transpose(-1, -2),
    }


def _gdn_inputs(a: dict) -> dict:
    """Recurrence inputs from the arguments of ``torch_chunk_gated_delta_rule``."""
    return _delta_rule_inputs(a, l2norm)


def _kda_inputs(a: dict) -> dict:
    """Recurrence inputs from the arguments of ``chunk_kimi_delta_attention`` (its g is fp32-cast there too)."""
    out = _delta_rule_inputs(a, kda_l2norm)
    out["g"] = out["g"].float()
    return out


_PER_STEP = {
    "mamba2": ("x", "dt", "B", "C"),
    "gdn": ("q", "k", "v", "g", "beta"),
    "kda": ("q", "k", "v", "g", "beta"),
}
_INPUT_CLASSES = {"mamba2": Mamba2Inputs, "gdn": GDNInputs, "kda": KDAInputs}


def _finish(kind: str, t: dict, steps: int, device, dtype, meta: dict) -> LayerInputs:
    out = {}
    for name, v in t.items():
        if v is None:
            out[name] = None
            continue
        if name in _PER_STEP[kind]:
            v = v[:, :steps]
            v = v.to(device=device, dtype=dtype or v.dtype, copy=True)
        else:
            v = v.to(device=device, copy=True)
        out[name] = v
    cls = _INPUT_CLASSES[kind]
    try:
        return cls(**out, meta=dict(meta)).validate()
    except InputError as exc:  # e.g. an overflow in a low-precision model: say which layer
        raise CaptureError(f"layer {meta.get('layer')}: the captured inputs are invalid: {exc}") from exc


def _concat_batch(kind: str, parts: list[LayerInputs], meta: dict) -> LayerInputs:
    """Join the micro-batches of one layer along the batch (per-step tensors; per-head ones are shared)."""
    if len(parts) == 1:
        return parts[0]
    joined = {name: torch.cat([getattr(p, name) for p in parts]) for name in _PER_STEP[kind]}
    return dataclasses.replace(parts[0], **joined, meta=dict(meta))


def prefill_bytes_per_sequence(net: torch.nn.Module, tokens: int) -> int:
    """Estimated peak GPU bytes of one sequence's prefill beyond the weights: the Mamba-2 torch scan's
    [chunks, chunk, chunk, heads, state] fp32 products (two alive at once); 0 for other mixers, whose
    chunked scans stay small. An estimate for sizing micro-batches, not a measurement."""
    cfg = getattr(net, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    chunk = getattr(cfg, "chunk_size", None)
    heads = getattr(cfg, "mamba_num_heads", None)
    state = getattr(cfg, "ssm_state_size", None)
    if not (chunk and heads and state):
        return 0
    chunks = -(-tokens // chunk)
    return 2 * chunks * chunk * chunk * heads * state * 4


def auto_micro_batch(net: torch.nn.Module, batch: int, tokens: int, device: torch.device, free=None) -> int:
    """Sequences per prefill pass so that the estimated prefill peak fits in half the free memory of the
    device the prefill runs on (GPU memory, or the host's available memory for the CPU). A model spread over
    several devices runs each layer's prefill on the device holding it: the least free of them counts.
    ``free``: the free-memory reader (``memory.free_bytes``; tests pass fakes)."""

    free = free or free_bytes
    per_seq = prefill_bytes_per_sequence(net, tokens)
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
        self.current: int | None = None
        self.on_layer = on_layer
        self.steps = steps
        self.device = device
        self.dtype = dtype
        self.meta = meta
        self.stop_early = stop_early


def _make_wrapper(original: Callable, kind: str, state: _State) -> Callable:
    sig = inspect.signature(original)  # follows functools.wraps to the torch reference's signature
    build = {"mamba2": _mamba2_inputs, "gdn": _gdn_inputs, "kda": _kda_inputs}[kind]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        layer = state.current
        if layer is not None and layer in state.wanted and layer not in state.done:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            arguments.update(arguments.pop("kwargs", {}) or {})
            meta = dict(state.meta, layer=layer, kind=kind)
            inputs = _finish(kind, build(arguments), state.steps, state.device, state.dtype, meta)
            state.done.add(layer)
            state.on_layer(layer, inputs)
            if state.stop_early and state.done >= state.wanted:
                raise _AllLayersCaptured
        return original(*args, **kwargs)

    wrapper._ssmquant_capture = True
    return wrapper


@contextlib.contextmanager
def _intercept(mixers: dict[int, SSMMixer], state: _State):
    patched: list[tuple[object, str, Callable]] = []
    handles = []
    try:
        for mixer in mixers.values():
            mod = sys.modules[type(mixer.module).__module__]
            fname = INTERCEPTED_FUNCTIONS[mixer.kind]
            if not any(m is mod and f == fname for m, f, _ in patched):
                original = getattr(mod, fname, None)
                if original is None:
                    raise CaptureError(
                        f"{mod.__name__} has no {fname}: this transformers version is not supported by capture"
                    )
                patched.append((mod, fname, original))
                setattr(mod, fname, _make_wrapper(original, mixer.kind, state))

            def pre(_m, _args, layer=mixer.layer):
                state.current = layer

            def post(_m, _args, _out):
                state.current = None

            handles.append(mixer.module.register_forward_pre_hook(pre))
            handles.append(mixer.module.register_forward_hook(post))
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, fname, original in reversed(patched):
            setattr(mod, fname, original)
        state.current = None


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
    Returns the captured layer indices in order.
    Raises CaptureError for more steps than tokens (both numbers), unknown layers, or layers whose
    inputs were never intercepted.
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
    if micro_batch is None:
        micro_batch = auto_micro_batch(net, batch, tokens, ids.device)
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise CaptureError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    starts = list(range(0, batch, micro_batch))
    held: dict[int, list[LayerInputs]] = {i: [] for i in wanted}
    kinds = {i: mixers[i].kind for i in wanted}

    def hold(layer, inputs):
        held[layer].append(inputs)

    def last_pass(layer, inputs):
        record(layer, _concat_batch(kinds[layer], [*held.pop(layer), inputs], dict(inputs.meta, batch=batch)))

    if not _CAPTURE_LOCK.acquire(blocking=False):
        raise CaptureError("another capture is running in this process; captures cannot overlap")
    was_training = net.training
    try:
        net.eval()  # NemotronH takes a fused training-only path otherwise
        for start in starts:
            last = start == starts[-1]
            state = _State(wanted, last_pass if last else hold, steps, torch.device(device), dtype, full_meta, stop_early)
            with torch.no_grad(), _intercept({i: mixers[i] for i in wanted}, state):
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
        fnames = sorted({INTERCEPTED_FUNCTIONS[mixers[i].kind] for i in missing})
        raise CaptureError(
            f"no SSM inputs were intercepted for layers {missing}: the mixers did not call {', '.join(fnames)} "
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
