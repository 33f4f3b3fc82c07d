"""Prompt-state stores: where an engine keeps a cached prefix's state before a later request restores it.

An engine with prefix caching keeps the state a prompt leaves in a cache; a request that hits the cache copies it
back into the live state pool and decodes from there in the live format. A prompt store says how that cached copy
is kept, and `restore` gives the values the live pool holds after the copy back, from which decoding continues.

- ``int8col``: SGLang's int8 prefix-cache checkpoint (``--enable-int8-mamba-checkpoint``,
  ``mem_cache/mamba_checkpoint_pool.py``, fact ``sglang.int8_checkpoint``): int8 codes with one scale per state
  column, that is per (head, key channel) reduced over the head's rows (SGLang's dim -2: d_v, Mamba-2's head_dim);
  amax clamped to >= 1e-8; scale = amax / 127 rounded to the live state dtype before it is used; codes
  round(state / scale) (half to even) clamped to [-127, 127]; restored as code x scale in float32, cast to the
  live dtype (a column whose scale rounds to zero comes back as zeros). The quantized state is the live pool's
  (already in the live dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .encodings import FormatError

INT8_COLUMN_QMAX = 127
INT8_COLUMN_AMAX_FLOOR = 1e-8


@dataclass(frozen=True)
class PromptStore:
    """A way an engine keeps a cached prefix's state: name (in variant names, after '+'), what it is, and the
    bytes of one head's cached state of [rows, state_dim] with scales in ``scale_bytes`` each."""

    name: str
    description: str

    def restore(self, state: torch.Tensor, live_dtype: torch.dtype) -> torch.Tensor:
        """The live pool's values after a cache hit: fp32 tensor of ``state``'s shape [..., rows, state_dim].
        state: the prompt's final state (any float dtype); live_dtype: the live pool's dtype."""
        if self.name == "int8col":
            return _int8_columns(state, live_dtype)
        raise FormatError(f"prompt store {self.name!r} has no restore")

    def bytes_per_head(self, rows: int, state_dim: int, scale_bytes: int) -> int:
        """Bytes of one head's cached state (codes and scales)."""
        return rows * state_dim + state_dim * scale_bytes


def _int8_columns(state: torch.Tensor, live_dtype: torch.dtype) -> torch.Tensor:
    live = state.to(live_dtype)
    x = live.float()
    amax = x.abs().amax(dim=-2, keepdim=True).clamp(min=INT8_COLUMN_AMAX_FLOOR)
    scale = (amax / INT8_COLUMN_QMAX).to(live_dtype).float()
    codes = torch.round(x / scale).clamp(-INT8_COLUMN_QMAX, INT8_COLUMN_QMAX)
    # a column whose scale rounds to 0 in the live dtype (float16 below 127 x 2^-24) comes back as zeros: whatever
    # int8 code the division by zero leaves, it is multiplied by a zero scale
    restored = torch.where(scale == 0, torch.zeros_like(codes), codes * scale)
    return restored.to(live_dtype).float()


PROMPT_STORES = {
    "int8col": PromptStore(
        "int8col",
        "int8 codes, one scale per (head, key channel) in the live dtype (SGLang's --enable-int8-mamba-checkpoint)",
    ),
}


def parse_prompt_store(name: str) -> PromptStore:
    """The prompt store named ``name``; FormatError listing the known ones otherwise."""
    key = str(name).strip().lower()
    if key not in PROMPT_STORES:
        raise FormatError(f"unknown prompt store {name!r}; accepted: {', '.join(PROMPT_STORES)}")
    return PROMPT_STORES[key]
