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
from .rounding import FORMAT_CODES, fake_quant_tile, stream_key, tile_columns


@triton.jit
def _state_tile(s_ptr, R, N, seed, stream, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, KMAJOR: tl.constexpr):
    """Program m's tile of a [M, R, N] FP32 state, transposed [BLOCK_N, BLOCK_R] as the emulation kernels hold it:
    (m, row indices, element offsets (SR's counters), in-bounds mask, values (0 outside), SR key of (seed, stream))."""
    m = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_R)
    cols = tile_columns(BLOCK_N, KMAJOR)
    ok = (cols < N)[:, None] & (rows < R)[None, :]
    offs = (m * R + rows)[None, :] * N + cols[:, None]  # the kernels' transposed tile [BLOCK_N, BLOCK_R]
    s = tl.load(s_ptr + offs, mask=ok, other=0.0)
    return m, rows, offs, ok, s, stream_key(seed, stream)


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
    m, rows, offs, ok, s, key = _state_tile(s_ptr, R, N, seed, stream, BLOCK_R, BLOCK_N, KMAJOR)
    scale = tl.full([BLOCK_R], 1.0, tl.float32)
    if STATIC:
        scale = tl.load(scale_ptr + m * R + rows, mask=rows < R, other=1.0)
    # the Mamba-2 kernel's tile (KMAJOR) takes per-head nvfp4 scales as one scalar, the delta-rule kernel's does not
    out = fake_quant_tile(s, scale, offs, key, BLOCK_N, BLOCK_R, FMT, GROUP, STATIC, SR, KMAJOR, KMAJOR)
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


@triton.jit
def _store_state_kernel(
    s_ptr,  # [M, R, N] fp32, rewritten in place
    keep_ptr,  # [M // HEADS] int8: 1 where the sequence's state is stored this step (MASKED)
    flags_ptr,  # [M, 2] int32: non-finite elements of the tile before and after the store
    R,
    N,
    HEADS,
    seed,
    stream,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    SR: tl.constexpr,
    MASKED: tl.constexpr,
):
    # _fake_quant_kernel's tile (row-major columns): the same element offsets, so the same SR element counters
    m, rows, offs, ok, s, key = _state_tile(s_ptr, R, N, seed, stream, BLOCK_R, BLOCK_N, False)
    out = fake_quant_tile(s, tl.full([BLOCK_R], 1.0, tl.float32), offs, key, BLOCK_N, BLOCK_R, FMT, GROUP, False, SR)
    if MASKED:
        keep = tl.load(keep_ptr + m // HEADS)
        out = tl.where(keep != 0, out, s)
    # the whole tile is loaded before any of it is stored, and programs own disjoint tiles: in place is safe
    tl.store(s_ptr + offs, out, mask=ok)
    flt_max = 3.4028234663852886e38  # |x| <= FLT_MAX is false for NaN and +-inf: torch.isfinite
    tl.store(flags_ptr + 2 * m, tl.sum(tl.sum(tl.where(tl.abs(s) <= flt_max, 0, 1), axis=1), axis=0))
    tl.store(flags_ptr + 2 * m + 1, tl.sum(tl.sum(tl.where(tl.abs(out) <= flt_max, 0, 1), axis=1), axis=0))


def store_state_triton(
    fmt: StateFormat,
    state: torch.Tensor,
    flags: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    seed: int = 0,
    stream: int = 0,
) -> None:
    """Store a state [B, H, rows, state_dim] (contiguous FP32) in ``fmt`` in place: ``fake_quant_triton``'s values
    (the same bits) where ``keep`` [B] (int8, 1 = store) is set, or everywhere when it is None; the rest untouched.
    ``flags`` [B * H, 2] int32 receives, per (sequence, head) tile, the number of non-finite elements before and
    after. One pass over the state (fake-quant, masked copy and finiteness checks would take six). Dynamic scales
    only (the evaluation's formats)."""
    check_seed(seed)
    if state.dtype != torch.float32 or not state.is_contiguous() or state.dim() != 4:
        raise ValueError(f"store_state_triton needs a contiguous float32 [B, H, rows, state_dim] state, got "
                         f"{state.dtype} {tuple(state.shape)} (contiguous: {state.is_contiguous()})")  # fmt: skip
    if fmt.scale_mode is ScaleMode.STATIC:
        raise ValueError(f"store_state_triton stores dynamic-scale formats only, got {fmt.name}")
    b, h, r, n = state.shape
    if flags.shape != (b * h, 2) or flags.dtype != torch.int32 or not flags.is_contiguous():
        raise ValueError(f"flags must be a contiguous int32 [{b * h}, 2] tensor, got {flags.dtype} {tuple(flags.shape)}")
    block_r, block_n = triton.next_power_of_2(r), triton.next_power_of_2(n)
    # 32 tile elements per thread: no spill on a Mamba-2 head [64, 128] (lab/DESIGN_NOTES.md); warps change no result
    warps = min(16, max(4, block_r * block_n // 1024))
    _store_state_kernel[(b * h,)](
        state,
        keep if keep is not None else flags,
        flags,
        r,
        n,
        h,
        seed,
        stream,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        FMT=FORMAT_CODES[fmt.encoding],
        GROUP=group_rows_for_kernel(fmt, r, block_r),
        SR=fmt.rounding is Rounding.SR,
        MASKED=keep is not None,
        num_warps=warps,
        enable_fp_fusion=False,
    )
