"""Counter-based random bits for stochastic rounding, identical on every backend.

The random word for one element is a pure function of (seed, stream, index): `stream` numbers the
write (the decode step whose state is being stored), `index` is the element's flat position in the
[..., rows, state_dim] state. No generator state is carried, so a Triton kernel that computes the same
hash (`ssmquant.kernels.rounding.random_bits`) draws the same bits as this torch reference, in any
order and on any device.

The mixer is an xorshift-multiply hash on 32-bit words. Its multipliers are below 2^31 so that the
products of 32-bit words fit in int64 here without overflow; the Triton version works in uint32 with
wrap-around and gives the same low 32 bits.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX_MUL_1 = 0x7FEB352D
MIX_MUL_2 = 0x1B873593
STREAM_SALT = 0x3C6EF372


def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """Bijective avalanche mix of 32-bit words held in int64 tensors (or Python ints)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MUL_1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL_2) & MASK32
    return x ^ (x >> 16)


def stream_key(seed: int, stream: int) -> int:
    """The 32-bit key of one (seed, stream) pair (a Python int; kernels compute it the same way)."""
    return mix32((seed & MASK32) ^ mix32((stream + STREAM_SALT) & MASK32))


def random_bits(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits per element: int64 tensor in [0, 2^32), shape of `index` (int64 flat indices)."""
    return keyed_bits(stream_key(seed, stream), index)


def keyed_bits(key: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`random_bits` given the precomputed `stream_key` (an int or a 0-d int64 tensor)."""
    return mix32((mix32((index & MASK32) ^ key) + key) & MASK32)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Top 24 random bits -> FP32 uniform in [0, 1), exactly k * 2^-24."""
    return (bits >> 8).to(torch.float32) * (2.0**-24)


def check_seed(seed: int) -> int:
    """Validate a stochastic-rounding seed (an int in [0, 2^32))."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    return seed
