"""Teacher-forced token-by-token decoding with transformers' own cache.

Each ``TeacherForced`` run owns one cache. Step t feeds token t of every sequence (``ids[:, t]``) as a
one-token forward with ``use_cache=True`` and returns the logits that predict token t + 1. The first step
runs on an empty cache (the mixers take their chunked path for that one token and allocate the cache);
every later step takes the mixers' single-token decode path (NemotronH: ``mamba2_selective_state_update``;
Qwen3.5 / Qwen3-Next: ``torch_recurrent_gated_delta_rule``; GLM-5.3-Flash / Kimi-Linear:
``recurrent_kimi_delta_attention``; or the kernels transformers picked for them).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers.cache_utils import DynamicLayer


def cache_keyword(net: torch.nn.Module) -> str:
    """The forward's cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values`` (older 5.x)."""
    params = inspect.signature(net.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The cache object a forward returned (``cache`` or ``past_key_values`` attribute), or None."""
    for name in ("cache", "past_key_values"):
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    return None


class TeacherForced:
    """One model run over ``ids`` [B, P + T + 1] (on the embedding's device): a prompt of P tokens, then one token
    per forward.

    With ``prompt`` P > 0, ``prefill()`` runs the first P tokens in one forward (the model's chunked path) and must
    come first. ``step(t)`` must then be called for t = 0, 1, 2, ... in order; it feeds token P + t and returns
    FP32 logits [B, V] for the position after it. ``cache`` is the transformers cache after the last forward (None
    before the first).
    """

    def __init__(self, net: torch.nn.Module, ids: torch.Tensor, prompt: int = 0):
        self.net = net
        self.ids = ids
        self.prompt = prompt
        self.cache = None
        self.next_step = 0
        self._kw = cache_keyword(net)

    def prefill(self) -> None:
        """The prompt's forward (its logits are not decode steps: dropped)."""
        if self.prompt < 1 or self.cache is not None:
            raise RuntimeError("prefill runs once, first, and only with a prompt")
        self._forward(self.ids[:, : self.prompt])

    def step(self, t: int) -> torch.Tensor:
        if t != self.next_step or (self.prompt and self.cache is None):
            raise RuntimeError(f"decode steps must run in order after the prefill: expected step {self.next_step}, got {t}")
        out = self._forward(self.ids[:, self.prompt + t : self.prompt + t + 1])
        self.next_step += 1
        return out.logits[:, -1].float()

    def _forward(self, input_ids: torch.Tensor):
        kwargs = {"input_ids": input_ids, "use_cache": True}
        if self.cache is not None:
            kwargs[self._kw] = self.cache
        out = self.net(**kwargs)
        if self.cache is None:
            self.cache = output_cache(out)
            if self.cache is None:
                raise RuntimeError(f"{type(self.net).__name__} returned no cache with use_cache=True")
        return out

    def preallocate_kv(self) -> int:
        """Give every attention layer of the cache (a transformers ``DynamicLayer``) room for all of ``ids``'
        tokens: ``KVBuffer``. Call after the first step (and after ``expand``). Returns the layers converted."""
        if self.cache is None:
            raise RuntimeError("preallocate_kv needs the cache of a first step")
        layers = getattr(self.cache, "layers", [])
        converted = 0
        for i, layer in enumerate(layers):
            if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
                layers[i] = KVBuffer.from_layer(layer, self.ids.shape[1])
                converted += 1
        return converted

    def expand(self, index: torch.Tensor) -> None:
        """Re-index the run's sequences along the batch: cache and ids become ``[index]`` (int64 [B'] on the
        ids' device). transformers' beam-search API ``Cache.reorder_cache`` does it for every layer (keys,
        values, conv and recurrent states). Used after step 0 to fold copies of a run into one batch."""
        if self.cache is None:
            raise RuntimeError("expand needs the cache of a first step")
        if not hasattr(self.cache, "reorder_cache"):
            raise RuntimeError(f"{type(self.cache).__name__} has no reorder_cache (transformers >= 5.2x has it)")
        self.cache.reorder_cache(index)
        self.ids = self.ids[index]


class KVBuffer(DynamicLayer):
    """transformers' ``DynamicLayer`` whose keys and values live in buffers of ``capacity`` tokens allocated once.

    ``DynamicLayer.update`` concatenates every step (``torch.cat``: a new [B, H, n + 1, D] tensor, the whole cache
    copied, an allocation that grows with n). Here the new token is written into the buffer and the layer's
    ``keys`` / ``values`` are views of its first n + 1 tokens: the same values and shapes, only the batch and head
    strides differ (the capacity's), so attention reads the same numbers (bit-identical logits on the CPU and, by
    eval_speed.sh, on the GPU). Anything that replaces ``keys`` (``reorder_cache``, ``crop``: inherited) makes the
    next update copy them into a new buffer, so the inherited methods stay correct.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H, capacity, D] each
        self._views: tuple[torch.Tensor, ...] = ()  # what update last handed out as keys, values

    @classmethod
    def from_layer(cls, layer: DynamicLayer, capacity: int) -> KVBuffer:
        new = cls(capacity)
        new.lazy_initialization(layer.keys, layer.values)
        new.keys, new.values = layer.keys, layer.values
        return new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        q = key_states.shape[-2]
        if self._buffers is None or self.keys is not self._views[0] or n + q > self.capacity:
            size = max(self.capacity, n + q)
            self._buffers = tuple(x.new_empty(*x.shape[:-2], size, x.shape[-1]) for x in (key_states, value_states))
            if n:
                self._buffers[0][..., :n, :] = self.keys
                self._buffers[1][..., :n, :] = self.values
        kb, vb = self._buffers
        kb[..., n : n + q, :] = key_states
        vb[..., n : n + q, :] = value_states
        self.keys, self.values = kb[..., : n + q, :], vb[..., : n + q, :]
        self._views = (self.keys, self.values)
        return self.keys, self.values


@contextlib.contextmanager
def decode_attention(device: torch.device, cudnn: bool = False):
    """Inside: scaled-dot-product attention on a CUDA ``device`` without cuDNN's fused kernel, unless ``cudnn``.

    Recent torch CUDA builds put cuDNN's attention first on sm90 / sm100 (aten/src/ATen/native/transformers/cuda/
    sdp_utils.cpp, ``check_prefer_cudnn_attention``), and its host side builds a cuDNN graph and
    execution plan for every new set of shapes and strides, cached per thread (aten/src/ATen/native/cudnn/MHA.cpp,
    ``MHAParams``). A teacher-forced decode has a new KV length at every step, so the first run of a process built
    one plan per step: the new lengths cost host time at every step, and the first run of a process decodes slower
    than a repeat (lab/DESIGN_NOTES.md). And cuDNN's
    outputs were not the same bits from run to run (the FP32 reference's logits too), even from the same cached
    plans on the same values.

    Inside this context cuDNN is switched off and the other backends keep torch's settings and order: flash
    attention where it supports the inputs (there: every decode step, 36.5 steps/s in a run after the cuDNN ones,
    two runs bit-identical, one with the KV cache in a preallocated buffer; a probe gave the same bits for a view
    of a buffer as for a contiguous tensor at every KV length), else memory-efficient or math attention; these
    pick their kernels from the shapes alone. torch's settings are restored on exit, also on error. On the CPU,
    or with ``cudnn=True`` (torch's own choice), nothing changes.

    Raises ValueError when cuDNN is the only backend enabled (nothing to fall back to).
    """
    if device.type != "cuda" or cudnn:
        yield
        return
    from torch.nn.attention import sdpa_kernel

    refusal = attention_refusal(device, cudnn)
    if refusal is not None:
        raise ValueError(refusal)
    with sdpa_kernel(_backends_without_cudnn()):
        yield


def _backends_without_cudnn() -> list:
    """The SDPA backends torch has enabled on CUDA, cuDNN's left out (flash, memory-efficient, math)."""
    from torch.nn.attention import SDPBackend

    enabled = {
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled(),
    }
    return [backend for backend, on in enabled.items() if on]


def attention_refusal(device: torch.device, cudnn: bool = False) -> str | None:
    """Why ``decode_attention(device, cudnn)`` cannot run (torch has only cuDNN's attention enabled), or None."""
    if device.type != "cuda" or cudnn or _backends_without_cudnn():
        return None
    return (
        "decode attention without cuDNN needs flash, memory-efficient or math attention enabled in torch, but only "
        "cuDNN's is (torch.backends.cuda.enable_flash_sdp etc.); enable one, or use cudnn_attention=True "
        "(--cudnn-attention)"
    )
