"""Teacher-forced token-by-token decoding with transformers' own cache.

Each ``TeacherForced`` run owns one cache. Step t feeds token t of every sequence (``ids[:, t]``) as a
one-token forward with ``use_cache=True`` and returns the logits that predict token t + 1. The first step
runs on an empty cache (the mixers take their chunked path for that one token and allocate the cache);
every later step takes the mixers' single-token decode path (NemotronH: ``mamba2_selective_state_update``;
Qwen3.5 / Qwen3-Next: ``torch_recurrent_gated_delta_rule``; GLM-5.3-Flash / Kimi-Linear:
``recurrent_kimi_delta_attention``; or the kernels transformers picked for them).
"""

from __future__ import annotations

import inspect

import torch


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
    """One model run over ``ids`` [B, T + 1] (on the embedding's device), one token per forward.

    ``step(t)`` must be called for t = 0, 1, 2, ... in order; it returns FP32 logits [B, V] for the
    position after token t. ``cache`` is the transformers cache after the last step (None before step 0).
    """

    def __init__(self, net: torch.nn.Module, ids: torch.Tensor):
        self.net = net
        self.ids = ids
        self.cache = None
        self.next_step = 0
        self._kw = cache_keyword(net)

    def step(self, t: int) -> torch.Tensor:
        if t != self.next_step:
            raise RuntimeError(f"decode steps must run in order: expected step {self.next_step}, got {t}")
        kwargs = {"input_ids": self.ids[:, t : t + 1], "use_cache": True}
        if self.cache is not None:
            kwargs[self._kw] = self.cache
        out = self.net(**kwargs)
        if self.cache is None:
            self.cache = output_cache(out)
            if self.cache is None:
                raise RuntimeError(f"{type(self.net).__name__} returned no cache with use_cache=True")
        self.next_step += 1
        return out.logits[:, -1].float()

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
