"""A standalone fake-quantize kernel: `fake_quant_tile` applied to a whole state tensor.

Its reference is `ssmquant.formats.codec` (quantize then dequantize). It exists so that the tile
helper every emulation kernel uses can be tested bit for bit, on its own, for every format.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import Rounding, ScaleMode, StateFormat
from ..formats.random import check_seed
from .rounding import FORMAT_CODES, fake_quant_tile, stream_key


@triton.jit
def _fake_quant_kernel(
    s_ptr,  # [M, R, N] fp32
    out_ptr,  # [M, R, N] fp32
    scale_ptr,  # [M, R] fp32 static decode scale of each row's group (STATIC)
    R,
    N,
    seed,
    stream,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    STATIC: tl.constexpr,
    SR: tl.constexpr,
    KMAJOR: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_R)
    if KMAJOR:  # the Mamba-2 kernel's tile order: position k * (BLOCK_N // 16) + i holds column 16 i + k
        pos = tl.arange(0, BLOCK_N)
        cols = (pos % (BLOCK_N // 16)) * 16 + pos // (BLOCK_N // 16)
    else:
        cols = tl.arange(0, BLOCK_N)
    ok = (cols < N)[:, None] & (rows < R)[None, :]
    offs = (m * R + rows)[None, :] * N + cols[:, None]  # the kernels' transposed tile [BLOCK_N, BLOCK_R]
    s = tl.load(s_ptr + offs, mask=ok, other=0.0)
    scale = tl.full([BLOCK_R], 1.0, tl.float32)
    if STATIC:
        scale = tl.load(scale_ptr + m * R + rows, mask=rows < R, other=1.0)
    key = stream_key(seed, stream)
    out = fake_quant_tile(s, scale, offs, key, BLOCK_N, BLOCK_R, FMT, GROUP, STATIC, SR, KMAJOR)
    tl.store(out_ptr + offs, out, mask=ok)


def group_rows_for_kernel(fmt: StateFormat, rows: int, block_rows: int) -> int:
    """The kernel's GROUP constexpr: rows per scale group, the whole tile for per-head scales."""
    if fmt.granularity.rows is None:
        return block_rows
    g = fmt.granularity.rows
    if g & (g - 1):
        raise ValueError(f"the Triton kernels need a power-of-two rows group, got {fmt.granularity.name}")
    return g


def fake_quant_triton(
    fmt: StateFormat,
    state: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    seed: int = 0,
    stream: int = 0,
    kmajor: bool = False,
) -> torch.Tensor:
    """Fake-quantize a state [..., rows, state_dim] with the kernels' tile helper (one program per head).

    scale: static decode scales with the group shape [..., rows // group_rows] (static formats only);
    kmajor: hold the tile in the Mamba-2 kernel's k-major order (state_dim padded to a multiple of 16).
    Returns FP32 values of the same shape; bit-identical to `fmt.fake_quant` by construction and test.
    """
    check_seed(seed)
    x = state.float().contiguous()
    *lead, r, n = x.shape
    m = x.numel() // (r * n)
    block_r = triton.next_power_of_2(r)
    if kmajor and triton.next_power_of_2(n) % 16:
        raise ValueError(f"kmajor tiles need state_dim >= 16 (whole 16-element blocks), got state shape {tuple(x.shape)}")
    group = group_rows_for_kernel(fmt, r, block_r)
    static = fmt.scale_mode is ScaleMode.STATIC
    rows_scale = None
    if static:
        g = fmt.granularity.group_rows(r)
        rows_scale = scale.float().expand(*lead, r // g).repeat_interleave(g, -1).contiguous()
    out = torch.empty_like(x)
    _fake_quant_kernel[(m,)](
        x,
        out,
        rows_scale if rows_scale is not None else x,
        r,
        n,
        seed,
        stream,
        BLOCK_R=block_r,
        BLOCK_N=triton.next_power_of_2(n),
        FMT=FORMAT_CODES[fmt.encoding],
        GROUP=group,
        STATIC=static,
        SR=fmt.rounding is Rounding.SR,
        KMAJOR=kmajor,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
