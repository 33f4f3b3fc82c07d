"""@triton.jit pieces shared by the emulation kernels (other than rounding), and the slot specs of a launch.

A launch carries up to MAX_SLOTS variants ("slots") beside one FP32 reference state; a program holds its rows of a
head's state, reference and slots, in registers for all T steps as a transposed tile [state_dim, BLOCK_P] (rows on
the fast axis: per-row reductions stay inside a thread; state dim in `rounding.tile_columns`' k-major order), reads
each step's inputs once and writes only per-step metrics. A slot computes exactly what it computes launched alone.
A slot's compile-time choices are one constexpr integer (`slot_spec`, unpacked by the spec_* helpers); its runtime
data (write mask, seed, static scales) sit in tensors stacked over the slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats.grids import FP16
from .rounding import constant, fake_quant_tile, round_to_bf16, round_to_grid, stream_key

FP16_MBITS = constant(FP16.mantissa_bits)
FP16_EMIN = constant(FP16.min_exponent)
FP16_MAX = constant(FP16.max_value)

# Variants carried by one launch: `analyze`'s default list (fp8_e4m3, int8, nvfp4 x conventional, replay16)
MAX_SLOTS = 6
MAX_REGISTERS = 255  # per thread, sm_90
REGISTER_FILE = 65536  # 32-bit registers per SM (and per thread block), sm_90
REGISTER_GRANULE = 8  # registers per thread are allocated in multiples of 8 (256 per warp)


def register_cap(num_warps: int) -> int | None:
    """ptxas's register cap (.maxnreg) for a delta-rule launch of num_warps warps: the most registers per thread at
    which the block still fits the register file (255 up to 8 warps, 128 at 16); None for one warp, which does not
    spill. Without it ptxas may trade registers for occupancy and spill the state tiles (lab/DESIGN_NOTES.md)."""
    if num_warps <= 1:
        return None
    fits = REGISTER_FILE // (32 * num_warps) // REGISTER_GRANULE * REGISTER_GRANULE
    return min(MAX_REGISTERS, fits)


# constexpr codes of a replay buffer's dtype (a scheme's buffer_dtype)
BUFFER_CODES = {"fp32": 0, "bf16": 1, "fp16": 2}


# A slot spec's fields, low bits first: format code, SR, STATIC, buffer code, then the group's rows above them.
FORMAT_BITS = 4
BUFFER_BITS = 2
_SR = 2**FORMAT_BITS
_STATIC = 2 * _SR
_BUFFER = 2 * _STATIC
_GROUP = _BUFFER * 2**BUFFER_BITS


def slot_spec(fmt_code: int, group_rows: int, static: bool, sr: bool, buf_code: int) -> int:
    """Pack one slot's constexpr choices: format code (FORMAT_BITS), SR, STATIC, buffer code (BUFFER_BITS), group
    rows; a code too wide for its field is a ValueError, never a neighbour's bit.

    A slot of format and buffer code 0 (fp32) takes the reference's step instead of computing it again: the compiler
    may contract two copies of one computation into FMAs differently, and an FP32 variant's error must be 0."""
    if not 0 <= fmt_code < 2**FORMAT_BITS:
        raise ValueError(f"format code {fmt_code} does not fit the slot spec's {FORMAT_BITS} bits")
    if not 0 <= buf_code < 2**BUFFER_BITS:
        raise ValueError(f"buffer code {buf_code} does not fit the slot spec's {BUFFER_BITS} bits")
    if group_rows < 1:
        raise ValueError(f"group rows must be >= 1, got {group_rows}")
    return fmt_code + _SR * int(sr) + _STATIC * int(static) + _BUFFER * buf_code + _GROUP * group_rows


@triton.constexpr_function
def spec_format(spec):
    """The format code of a slot spec (`slot_spec`); the spec_* functions also run on the host."""
    return spec % _SR


@triton.constexpr_function
def spec_sr(spec):
    """Whether a slot spec rounds stochastically."""
    return (spec // _SR) % 2 == 1


@triton.constexpr_function
def spec_static(spec):
    """Whether a slot spec takes static scales."""
    return (spec // _STATIC) % 2 == 1


@triton.constexpr_function
def spec_buffer(spec):
    """The buffer code of a slot spec."""
    return (spec // _BUFFER) % 2**BUFFER_BITS


@triton.constexpr_function
def spec_group(spec):
    """The rows per scale group of a slot spec."""
    return spec // _GROUP


@triton.constexpr_function
def slot_takes_reference_step(spec):
    """Whether this slot takes the reference's step as its own: fp32 format and buffer (`slot_spec`)."""
    return spec % _SR == 0 and (spec // _BUFFER) % 2**BUFFER_BITS == 0


@triton.jit
def round_buffer(v, BUF: tl.constexpr):
    """Buffered inputs stored in the buffer dtype: 0 fp32 (as is), 1 bf16, 2 fp16 (RNE)."""
    if BUF == 1:
        return round_to_bf16(v, 0, False)
    elif BUF == 2:
        return round_to_grid(v, 0.0, FP16_MBITS, FP16_EMIN, FP16_MAX, False, False)
    else:
        return v


@triton.jit
def slot_round_buffer(v, SPEC: tl.constexpr):
    """`round_buffer` with the slot's buffer dtype."""
    return round_buffer(v, spec_buffer(SPEC))


@triton.jit
def slot_static_scale(scale_ptr, k, slot_stride, head_base, rows, row_ok, BLOCK_P: tl.constexpr, SPEC: tl.constexpr):
    """Slot k's static decode scale of each row [BLOCK_P] (ones when the slot scales dynamically)."""
    if spec_static(SPEC):
        return tl.load(scale_ptr + k * slot_stride + head_base + rows, mask=row_ok, other=1.0)
    else:
        return tl.full([BLOCK_P], 1.0, tl.float32)


@triton.jit
def slot_initial_state(sv0_ptr, k, slot_stride, offs, mask, s_ref, NV: tl.constexpr, HAS_SV0: tl.constexpr):
    """Slot k's state tile before step 0: from [NV, B, H, rows, state_dim] (the initial state stored in the slot's
    format, ``replay.naive.stored_initial_states``), else the reference's tile s_ref."""
    if HAS_SV0 and k < NV:
        return tl.load(sv0_ptr + k * slot_stride + offs, mask=mask, other=0.0)
    else:
        return s_ref


@triton.jit
def slot_write(
    s,
    k,
    t,
    bt,
    BT,
    write_ptr,
    seed_ptr,
    static_scale,
    sr_index,
    BN: tl.constexpr,
    BR: tl.constexpr,
    SPEC: tl.constexpr,
    KMAJOR: tl.constexpr = False,
    HEAD_SCALAR: tl.constexpr = False,
):
    """Slot k's `fake_quant_tile` of its state tile at step t, where its write mask [NV, B, T] says so."""
    if tl.load(write_ptr + k * BT + bt) != 0:
        key = stream_key(tl.load(seed_ptr + k), t)
        s = fake_quant_tile(
            s,
            static_scale,
            sr_index,
            key,
            BN,
            BR,
            spec_format(SPEC),
            spec_group(SPEC),
            spec_static(SPEC),
            spec_sr(SPEC),
            KMAJOR,
            HEAD_SCALAR,
        )
    return s


@triton.jit
def store_slot_output(out_ptr, k, slot_stride, offs, y, mask):
    """Slot k's output rows y [BLOCK_P] at one step to outputs [NV, B, T, H, rows] (offs: the step's row offsets
    within a slot), rounded to the outputs' dtype."""
    p = out_ptr + k * slot_stride + offs
    tl.store(p, y.to(p.dtype.element_ty), mask=mask)


@triton.jit
def store_slot_metrics(
    metrics_ptr, k, slot_stride, base, s_var, s_ref, y_var, y_ref, ss_ref, yy_ref, TILE: tl.constexpr
):
    """Slot k's partial sums at a recorded step to metrics [NV, R, B, H, NPB, 4] (base: this program's offset in a
    slot), as `store_metrics`; the reference's two (ss_ref, yy_ref) are summed once for all slots."""
    ds = s_var - s_ref
    dy = y_var - y_ref
    p = metrics_ptr + k * slot_stride + base
    tl.store(p + 0, tl.sum(tl.reshape(ds * ds, [TILE]), axis=0))
    tl.store(p + 1, ss_ref)
    tl.store(p + 2, tl.sum(dy * dy, axis=0))
    tl.store(p + 3, yy_ref)


@triton.jit
def store_metrics(metrics_ptr, t, B, b, H, h, npb, pid_p, s_var, s_ref, y_var, y_ref, TILE: tl.constexpr):
    """Write step t's partial sums of this program to metrics [T, B, H, NPB, 4] (one variant):
    ||S~ - S||^2, ||S||^2 over its tile and ||y~ - y||^2, ||y||^2 over its rows (TILE = tile elements)."""
    ds = s_var - s_ref
    dy = y_var - y_ref
    base = metrics_ptr + (((tl.cast(t, tl.int64) * B + b) * H + h) * npb + pid_p) * 4
    tl.store(base + 0, tl.sum(tl.reshape(ds * ds, [TILE]), axis=0))
    tl.store(base + 1, tl.sum(tl.reshape(s_ref * s_ref, [TILE]), axis=0))
    tl.store(base + 2, tl.sum(dy * dy, axis=0))
    tl.store(base + 3, tl.sum(y_ref * y_ref, axis=0))
