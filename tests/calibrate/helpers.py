"""Tiny layer sources for calibrate / export tests: real recurrences, small shapes, fast on a CPU.

A layer's parameters (A, D, dt bias; GDN gates) depend on the layer only; its sequences depend on
(layer, seed), so a source with another seed is held-out data of the same layers.
"""

import torch
import torch.nn.functional as F

from ssmquant.analysis import LayerSource

# bound at import: tests that replace `ssmquant.calibrate.calibrate` with a call of tiny_calibration still reach
# the real one
from ssmquant.calibrate import CalibrateConfig, calibrate
from ssmquant.kinds import GDNInputs, Mamba2Inputs

HEADS, ROWS, STATE, GROUPS = 2, 8, 32, 1


def tiny_mamba2(
    layer: int, *, batch=2, steps=24, seed=0, spike: float | None = None, rows=ROWS, state=STATE
) -> Mamba2Inputs:
    """Mamba-2 inputs [B, T, H=2, P=rows (8)], N=state (32), G=1. spike: multiply head 0's x at one step of
    sequence 0."""
    p = torch.Generator().manual_seed(1000 + layer)
    A = -torch.exp(torch.rand(HEADS, generator=p) * 2.0 - 1.0)
    D = torch.ones(HEADS)
    dt_bias = torch.rand(HEADS, generator=p) * 2.0 - 2.0
    g = torch.Generator().manual_seed(7919 * (seed + 1) + layer)
    x = F.silu(torch.randn(batch, steps, HEADS, rows, generator=g))
    if spike is not None:
        x[0, steps // 3, 0] *= spike
    b = F.silu(torch.randn(batch, steps, GROUPS, state, generator=g))
    c = F.silu(torch.randn(batch, steps, GROUPS, state, generator=g))
    dt = F.softplus(torch.randn(batch, steps, HEADS, generator=g) * 0.5 + dt_bias).clamp(min=1e-3)
    return Mamba2Inputs(x=x.bfloat16(), dt=dt, B=b.bfloat16(), C=c.bfloat16(), A=A, D=D, meta={"layer": layer})


def tiny_gdn(layer: int, *, batch=2, steps=24, seed=0, rows=ROWS, state=STATE) -> GDNInputs:
    """GDN inputs: Hv=2 value heads, Hk=1, Dk=state (32), Dv=rows (8)."""
    p = torch.Generator().manual_seed(2000 + layer)
    a_log = torch.rand(HEADS, generator=p) * 2.0 - 3.0
    g = torch.Generator().manual_seed(7919 * (seed + 1) + layer)
    q = F.normalize(torch.randn(batch, steps, 1, state, generator=g), dim=-1) / state**0.5
    k = F.normalize(torch.randn(batch, steps, 1, state, generator=g), dim=-1)
    v = torch.randn(batch, steps, HEADS, rows, generator=g)
    gate = -torch.exp(a_log) * F.softplus(torch.randn(batch, steps, HEADS, generator=g) - 2.0)
    beta = torch.sigmoid(torch.randn(batch, steps, HEADS, generator=g))
    return GDNInputs(q=q, k=k, v=v.bfloat16(), g=gate, beta=beta.bfloat16(), meta={"layer": layer})


def tiny_source(
    kind="mamba2", *, layers=(0, 1), batch=2, steps=24, seed=0, spike=None, rows=ROWS, state=STATE
) -> LayerSource:
    """rows / state: the layers' state rows and reduction dim (Mamba-2 head_dim / state size, GDN Dv / Dk)."""
    make = tiny_mamba2 if kind == "mamba2" else tiny_gdn

    def iterate(selected):
        for layer in selected:
            kw = {"spike": spike} if kind == "mamba2" else {}
            yield layer, make(layer, batch=batch, steps=steps, seed=seed, rows=rows, state=state, **kw)

    describe = {"kind": "test", "model": f"tiny-{kind}", "note": "tiny test layers"}
    return LayerSource("test", f"tiny-{kind}", list(layers), kind, (HEADS, rows, state), describe, iterate)


def tiny_calibration(
    kind="mamba2", *, batch=2, steps=24, rows=ROWS, state=STATE, backend="torch", heldout_spike=None, calibrate_kw=None,
    **cfg_kwargs,
):
    """Run `calibrate` on tiny sources (calibration seed 0, held-out seed 1); returns the CalibrationResult.
    rows / state: the layers' state rows and reduction dim (Mamba-2 64 / 128: what FlashInfer's 8-bit kernel
    takes); backend: "torch", or "triton" (the kernels: on a GPU where there is one, else on a CPU under
    TRITON_INTERPRET=1); heldout_spike: multiply head 0's x at one step of the first held-out sequence (Mamba-2);
    calibrate_kw: more keyword arguments of `calibrate` (progress, notify, time_left).

    choose_among defaults to "research" here (the library's default is "engines"): most fixtures measure settings
    of their own choice on layers of test sizes, which the engines' size rules refuse."""
    cfg_kwargs.setdefault("choose_among", "research")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    cfg = CalibrateConfig(model=f"tiny-{kind}", horizon=steps, batch=batch, device=device, backend=backend, **cfg_kwargs)
    spike = {"spike": heldout_spike} if heldout_spike is not None else {}
    return calibrate(
        cfg,
        source=tiny_source(kind, batch=batch, steps=steps, seed=0, rows=rows, state=state),
        heldout_source=tiny_source(kind, batch=batch, steps=steps, seed=1, rows=rows, state=state, **spike),
        **(calibrate_kw or {}),
    )
