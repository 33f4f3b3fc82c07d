"""@triton.jit pieces shared by the Mamba-2 and GDN emulation kernels (other than rounding)."""

from __future__ import annotations

import triton
import triton.language as tl

from .rounding import round_to_bf16, round_to_grid


@triton.jit
def round_buffer(v, BUF: tl.constexpr):
    """Buffered inputs stored in the buffer dtype: 0 fp32 (as is), 1 bf16, 2 fp16 (RNE)."""
    if BUF == 1:
        return round_to_bf16(v, 0, False)
    elif BUF == 2:
        return round_to_grid(v, 0.0, 10, -14, 65504.0, False, False)
    else:
        return v


@triton.jit
def store_metrics(metrics_ptr, t, record_every, B, b, H, h, npb, pid_p, s_var, s_ref, y_var, y_ref, TILE: tl.constexpr):
    """At a recorded step, write this program's partial sums to metrics [R, B, H, NPB, 4]:
    ||S~ - S||^2, ||S||^2 over its tile and ||y~ - y||^2, ||y||^2 over its rows (TILE = tile elements)."""
    rec = ((t + 1) // record_every - 1).to(tl.int64)
    ds = s_var - s_ref
    dy = y_var - y_ref
    base = metrics_ptr + (((rec * B + b) * H + h) * npb + pid_p) * 4
    tl.store(base + 0, tl.sum(tl.reshape(ds * ds, [TILE]), axis=0))
    tl.store(base + 1, tl.sum(tl.reshape(s_ref * s_ref, [TILE]), axis=0))
    tl.store(base + 2, tl.sum(dy * dy, axis=0))
    tl.store(base + 3, tl.sum(y_ref * y_ref, axis=0))
