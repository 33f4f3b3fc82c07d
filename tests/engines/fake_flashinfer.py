"""A stand-in `flashinfer.mamba` whose kernels are ssmquant's torch re-computations.

It takes the real kernels' arguments (tie_hdim views of dt, A, D; rand_seed as a CUDA-style int64
tensor), so the oracle driver can run end to end without a GPU: every teacher-forced comparison must
then be bit-identical, which checks the driver's plumbing and ring bookkeeping, not the engine.
"""

from __future__ import annotations

import sys
import types

from ssmquant.engines import flashinfer as fi


def checkpointing_ssu(
    state, x_cache, B_cache, dt_cache, ring_start, pnat, x, dt, A, B, C, out, D=None, state_scale=None,
    rand_seed=None, philox_rounds=10, algorithm="auto",
):  # fmt: skip
    assert dt.stride(-1) == 0 and A.stride(1) == 0 and A.stride(2) == 0 and D.stride(1) == 0, "tie_hdim views"
    rs = None if rand_seed is None else int(rand_seed.item())
    y = fi.checkpointing_ssu_reference(
        state, state_scale, x_cache, B_cache, dt_cache, ring_start, pnat, x, dt[..., 0], A[:, 0, 0], B, C, D[:, 0],
        rand_seed=rs, philox_rounds=philox_rounds,
    )  # fmt: skip
    out.copy_(y)
    return out


def selective_state_update(state, x, dt, A, B, C, D, state_scale=None, rand_seed=None, algorithm="auto"):
    rs = None if rand_seed is None else int(rand_seed.item())
    return fi.selective_state_update_reference(
        state, state_scale, x, dt[..., 0], A[:, 0, 0], B, C, D[:, 0], rand_seed=rs
    )


def install(monkeypatch) -> None:
    """Make `from flashinfer.mamba import ...` resolve to this module for one test."""
    pkg = types.ModuleType("flashinfer")
    mod = types.ModuleType("flashinfer.mamba")
    mod.checkpointing_ssu = checkpointing_ssu
    mod.selective_state_update = selective_state_update
    pkg.mamba = mod
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mamba", mod)
