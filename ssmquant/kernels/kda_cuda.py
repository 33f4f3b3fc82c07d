"""Fused KDA decode emulation as a CUDA kernel (compiled at run time by NVRTC): one RNE variant with dynamic per-row
scales (FP8 E4M3, INT8 or NVFP4) beside the FP32 reference, all T steps in one launch; `available` and `eligible`
say where it replaces `delta_rule.py`'s Triton kernel, which issues more instructions per element-step
(lab/DESIGN_NOTES.md).

It computes what `delta_rule.py` computes, in another order of the Dk sums (the two agree to FP32 noise); FP8 E4M3
rounds by the hardware conversion (cvt.rn.satfinite.e4m3x2.f32: torch's float8_e4m3fn cast for finite |x| <= 448),
NVFP4 as `rounding.nvfp4_blocks`, with its fallbacks (kda_cuda.cu). tests/kernels/test_kda_cuda.py holds it to the
Triton kernel's bound and checks its writes against the codec (`nvfp4_write`, the DEBUG_STATES build).

Layout: one warp per (batch, value head, 16 value rows); lane l holds row l % 16 and key channels
[64 (l // 16), 64 (l // 16) + 64) of both states. k, q and the decays are staged a step ahead through shared memory
(cp.async where no conversion is needed: ASYNC_LOADS), keeping the registers for the states.

`kda_cuda.cu` -> `kernel_source` (its #defines) -> `_compiled` (NVRTC, cached per configuration) -> `kda_cuda_launch`
(no validation; `ssmquant.simulate` validates).
"""

from __future__ import annotations

import functools
import importlib.resources
import os

import torch

from ..formats import Encoding, Rounding, ScaleMode
from .common import BUFFER_CODES as _BUFFERS
from .host import batch_slices, write_mask_on
from .registry import VariantKernel, register_variant_kernel

DK = 128  # key channels the kernel is written for (two lanes x 64 per row)
ROWS_PER_WARP = 16
# the FMT codes of the Triton kernels (kda_cuda.cu branches on 3, 4 and 5)
_FORMATS = {e: e.kernel_code for e in (Encoding.FP8_E4M3, Encoding.INT8, Encoding.NVFP4)}
_QMAX = {e.kernel_code: f"{e.max_code:.1f}f" for e in _FORMATS}  # NVFP4: 6 x 448, s2 = amax / QMAX
FMT_NVFP4 = Encoding.NVFP4.kernel_code
SOURCE_FILE = "kda_cuda.cu"  # package data beside this module


_LOADS = {
    torch.float32: ("float", "ld_f32"),
    torch.bfloat16: ("unsigned short", "ld_bf16"),
    torch.float16: ("unsigned short", "ld_f16"),
}


def kernel_source(
    fmt: int,
    buf: int,
    always: bool,
    has_s0: bool,
    qk_dtype: torch.dtype,
    v_dtype: torch.dtype,
    debug_states: bool = False,
    has_sv0: bool = False,
) -> str:
    """The CUDA source of one configuration: fmt 3 (FP8 E4M3), 4 (INT8) or 5 (NVFP4); buf 0 / 1 / 2 (buffered k
    and u in fp32 / bf16 / fp16); always: every step writes (no write mask read); has_s0: an initial state;
    debug_states: the kernel also stores its state before and after every step's write (tests only); has_sv0: the
    variant's own initial state (the initial state stored in its format)."""
    (qk_t, qk_load), (v_t, v_load) = _LOADS[qk_dtype], _LOADS[v_dtype]
    defs = {
        "FMT": str(fmt),
        "QMAX": _QMAX[fmt],
        "BUF": str(buf),
        "ALWAYS": str(int(always)),
        "HAS_S0": str(int(has_s0)),
        "HAS_SV0": str(int(has_sv0)),
        "DEBUG_STATES": str(int(debug_states)),
        "QK_T": qk_t,
        "QK_F32": str(int(qk_dtype == torch.float32)),
        "V_T": v_t,
        "LOAD_QK(p)": f"{qk_load}(p)",
        "LOAD_V(p)": f"{v_load}(p)",
    }
    return "".join(f"#define {name} {value}\n" for name, value in defs.items()) + _source()


@functools.cache
def _source() -> str:
    """The kernel's CUDA source (``kda_cuda.cu``), read once."""
    return importlib.resources.files(__package__).joinpath(SOURCE_FILE).read_text()


# --fmad=false: no product is contracted into an add unless written as __fmaf_rn (the writes' products must round
# on their own, as in the reference)
NVRTC_OPTIONS = ("--fmad=false",)


@functools.cache
def _compiled(kernel: str, *config):
    return torch.cuda._compile_kernel(kernel_source(*config), kernel, nvcc_options=list(NVRTC_OPTIONS))


def available(device: torch.device) -> bool:
    """Whether the CUDA kernel can run on ``device``: a CUDA GPU of compute capability >= 8.9 (the E4M3
    conversion), torch's NVRTC wrapper, and SSMQUANT_KDA_CUDA not set to 0."""
    if os.environ.get("SSMQUANT_KDA_CUDA", "1") == "0" or device.type != "cuda":
        return False
    if torch.version.cuda is None or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def eligible(variant, kind: str, state_dim: int, rows: int) -> bool:
    """Whether the kernel computes this variant: KDA, Dk = 128, Dv a multiple of 16, FP8 E4M3, INT8 or NVFP4 with
    RNE and dynamic per-row scales, buffered inputs in fp32, bf16 or fp16; any write mask and initial state."""
    fmt = variant.format
    return (
        kind == "kda"
        and state_dim == DK
        and rows % ROWS_PER_WARP == 0
        and fmt.encoding in _FORMATS
        and fmt.rounding is Rounding.RNE
        and fmt.scale_mode is ScaleMode.DYNAMIC
        and fmt.granularity.rows == 1
        and (not variant.scheme.rounds_buffer or variant.scheme.buffer_dtype in _BUFFERS)
    )


def variant_config(variant) -> tuple[int, int]:
    """(format code, buffer code) of an eligible variant."""
    buf = _BUFFERS[variant.scheme.buffer_dtype] if variant.scheme.rounds_buffer else 0
    return _FORMATS[variant.format.encoding], buf


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The kernel's FP8 E4M3 store-and-reload of a flat fp32 CUDA tensor of even length (for its tests)."""
    out = torch.empty_like(x)
    n = x.numel()
    fn = _compiled("round_e4m3_check", 3, 0, False, False, torch.float32, torch.float32)
    fn(grid=((n // 2 + 31) // 32, 1, 1), block=(32, 1, 1), args=[x, out, n])
    return out


def nvfp4_write(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's NVFP4 store-and-reload of a contiguous fp32 CUDA state [rows, 128] (rows a multiple of 16), for
    its tests: (the values that come back, [rows / 16] int32: 1 where the 16 rows' warp took the fallback)."""
    rows = x.shape[0]
    out = torch.empty_like(x)
    fallback = torch.full((rows // ROWS_PER_WARP,), -1, device=x.device, dtype=torch.int32)
    fn = _compiled("nvfp4_write_check", FMT_NVFP4, 0, True, False, torch.float32, torch.float32)
    fn(grid=(rows // ROWS_PER_WARP, 1, 1), block=(32, 1, 1), args=[x, out, fallback])
    return out, fallback


def kda_cuda_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    s0: torch.Tensor | None,
    write: torch.Tensor,
    *,
    fmt: int,
    buf: int,
    always: bool,
    states: torch.Tensor | None = None,
    slot_s0: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on contiguous CUDA inputs; returns metrics [T, B, Hv, Dv / 16, 4] fp32 (row-block partial sums).

    q, k [B, T, Hk, 128]; v [B, T, Hv, Dv] (fp32, bf16 or fp16); alpha [B, T, Hv, 128] fp32 (the decays exp(g));
    beta [B, T, Hv] fp32; s0 [B, Hv, Dv, 128] fp32 or None; slot_s0: the variant's state before step 0 (s0
    stored in its format), same shape, or None (s0 itself; needs s0 when given); write [B, T] int8 (ignored when always);
    fmt 3 (FP8 E4M3) / 4 (INT8) / 5 (NVFP4); buf 0 / 1 / 2: buffered k and u in fp32 / bf16 / fp16.
    states: None, or fp32 [T, 2, B, Hv, Dv, 128] that receives the variant's state before and after each step's
    write (a separate build of the kernel, for the tests).
    """
    bsz, steps, hv, dv = v.shape
    hk = k.shape[2]
    npb = dv // ROWS_PER_WARP
    metrics = torch.full((steps, bsz, hv, npb, 4), float("nan"), device=v.device, dtype=torch.float32)
    fn = _compiled(
        "kda_emulate", fmt, buf, always, s0 is not None, q.dtype, v.dtype, states is not None, slot_s0 is not None
    )
    # the decays and the initial states are read 16 bytes at a time: a contiguous view that starts off a 16-byte
    # boundary (a slice of a flat buffer) is copied to a fresh, aligned one
    alpha, s0, slot_s0 = (t if t is None or t.data_ptr() % 16 == 0 else t.clone() for t in (alpha, s0, slot_s0))
    dummy = alpha  # any CUDA pointer: not read without HAS_S0 / HAS_SV0 / DEBUG_STATES
    s0_arg, sv0_arg, states_arg = (dummy if t is None else t for t in (s0, slot_s0, states))
    args = [q, k, v, alpha, beta, s0_arg, sv0_arg, write, metrics, states_arg, bsz, steps, hv, hk, dv]
    fn(grid=(npb, bsz * hv, 1), block=(32, 1, 1), args=args)
    return metrics


def variant_steps(inputs, variant, shared: dict, s0, metric_budget: int, stored):
    """One eligible variant through the kernel, one batch slice per launch: yields (b0, metrics [T, b, H, 4]).
    shared: the fused kernel's operands (q, k, v, alpha, beta); stored: the variant's initial state as stored, or
    None."""
    q, k = shared["q"], shared["k"]
    if q.dtype != k.dtype:  # the kernel reads both with one load
        q, k = q.float(), k.float()
    bsz, steps, heads = inputs.batch, inputs.steps, inputs.num_heads
    blocks = inputs.rows // ROWS_PER_WARP
    fmt, buf = variant_config(variant)
    write, always = write_mask_on(variant.scheme, bsz, steps, inputs.device)
    for b0, b1 in batch_slices(bsz, steps * heads * blocks * 4 * 4, metric_budget):
        m = kda_cuda_launch(
            q[b0:b1],
            k[b0:b1],
            shared["v"][b0:b1],
            shared["alpha"][b0:b1],
            shared["beta"][b0:b1],
            None if s0 is None else s0[b0:b1],
            write[b0:b1],
            fmt=fmt,
            buf=buf,
            always=always,
            slot_s0=None if stored is None else stored[b0:b1].contiguous(),
        )
        yield b0, m.sum(3)  # row-block partial sums -> [T, b, H, 4]


register_variant_kernel("kda", VariantKernel("cuda", available, eligible, variant_steps))
