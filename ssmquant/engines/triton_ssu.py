"""The Mamba-2 conventional decode of vLLM and TensorRT-LLM, re-computed in torch one call at a time.

Both engines decode Mamba-2 with a Triton `selective_state_update` descended from mamba_ssm 2.2.4's
(vLLM 0.33.0 `vllm/model_executor/layers/mamba/ops/mamba_ssm.py`, the default `--mamba-backend triton`;
TensorRT-LLM main@1d2bb3b `tensorrt_llm/_torch/modules/mamba/selective_state_update.py`, called by
`Mamba2Mixer` for decode). With one dt per head (`TIE_HDIM`, both engines pass dt, A, dt_bias with
stride 0 over head_dim) one call computes, per head:

    dA    = exp(A * dt)                    vLLM: fast_exp = exp2(LOG2E * (A * dt)) (triton_helpers.py);
                                           TRT-LLM: tl.exp(A * dt); both compile to ex2.approx.f32 of
                                           fp32(A * dt) * 0x3FB8AA3B (vLLM's with .ftz)
    dB    = B * dt                         (fp32, the [N] vector of the group)
    state = state * dA + dB * x            contracted by ptxas into fma(state, dA, fp32(dB * x))
    out   = sum_n(state * C) + x * D       a reduction tree, then fma(x, D, sum)
    store = state.to(state dtype)          cvt.rn: round to nearest even (fp32 / bf16 / fp16)

(the contraction and the instructions were read from the PTX both kernels compile to for sm_90 with
Triton 3.9: `fma.rn.f32 %s, %dA, %s, %p` after `mul.f32 %p, %dB, %x`; lab/README.md, the engine oracles). That is the ideal recurrence except three FP32 details: the decay's
`ex2.approx` (a few ulp from `exp`), the input term's order (dt * B, then x; the ideal takes dt * x,
then B) and one rounding for state * dA + input (FMA). The decay is computed here by a one-line Triton
kernel with the engine's own expression, so on the GPU it carries the engine's exact bits (and the
interpreter's on CPU); the FMA is taken in float64 and rounded once to float32, which equals the
hardware FMA except when the double result lies exactly on a float32 tie (a relative window of
2^-53 around each tie; not seen in the oracle runs).

vLLM also rounds fp16 state stochastically (`cvt.rs.f16x2.f32`, SM 10.x only); that is not re-computed
here. dt_softplus / dt_bias are applied by the engines before the update; ssmquant's inputs carry the
final dt, so the oracle passes dt_bias = 0 and dt_softplus = False.
"""

from __future__ import annotations

import os

import torch

LOG2E = 1.4426950408889634
ENGINE_EXP = {"vllm": "exp2_ftz", "trtllm": "exp"}  # how each kernel writes the decay (same instruction)


def _triton_runs(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


_KERNEL = None


def _decay_kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _ssu_decay(a_ptr, dt_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            a = tl.load(a_ptr + offs, mask=m, other=0.0)
            dt = tl.load(dt_ptr + offs, mask=m, other=0.0)
            if FAST:  # vLLM triton_helpers.fast_exp
                r = tl.math.exp2(1.4426950408889634 * (a * dt))
            else:  # TensorRT-LLM tl.exp
                r = tl.exp(a * dt)
            tl.store(out_ptr + offs, r, mask=m)

        _KERNEL = _ssu_decay
    return _KERNEL


def ssu_decays(A: torch.Tensor, dt: torch.Tensor, engine: str = "vllm") -> torch.Tensor:
    """dA = exp(A * dt) as the engine's kernel computes it: A [H], dt [..., H] fp32 -> [..., H] fp32.

    With a GPU (or TRITON_INTERPRET=1) the engine's own Triton expression runs, giving its bits; elsewhere
    torch.exp2(fp32(A * dt) * fp32(LOG2E)), which may differ from ex2.approx by a few ulp.
    """
    if engine not in ENGINE_EXP:
        raise ValueError(f"unknown engine {engine!r}; accepted: {', '.join(ENGINE_EXP)}")
    dt = dt.float().contiguous()
    a = A.float().expand_as(dt).contiguous()
    if not _triton_runs(dt.device):
        return torch.exp2((a * dt) * torch.tensor(LOG2E, dtype=torch.float32))
    import triton

    out = torch.empty_like(dt)
    n = dt.numel()
    _decay_kernel()[(triton.cdiv(n, 1024),)](a, dt, out, n, FAST=engine == "vllm", BLOCK=1024)
    return out


def ssu_update(state: torch.Tensor, da: torch.Tensor, dt: torch.Tensor, x: torch.Tensor, b: torch.Tensor, fused: bool = True):
    """One state update in the engines' order: state [B, H, P, N] fp32, da / dt [B, H], x [B, H, P], b [B, H, N].

    fused: the engines' compiled form, fma(state, dA, fp32(fp32(dt * B) * x)) (GPU); False: two roundings,
    fp32(state * dA) + fp32(dt * B * x), what the Triton interpreter computes.
    """
    p = (b * dt[..., None])[:, :, None, :] * x[..., None]  # [B, H, P, N], fp32(fp32(B * dt) * x)
    if fused:
        return (state.double() * da.double()[..., None, None] + p.double()).float()
    return state * da[..., None, None] + p


def ssu_output(state: torch.Tensor, c: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out = sum_n(state * C) + D x (the sum in torch's order, not the kernel's tree): -> [B, H, P]."""
    return (state * c[:, :, None, :]).sum(-1) + d[None, :, None] * x
