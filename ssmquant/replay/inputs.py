"""Per-layer decode inputs of Mamba-2, Gated DeltaNet and Kimi Delta Attention, in the exact form the
recurrences consume.

The containers hold the inputs of one SSM layer for a batch of sequences over T decode steps, time
second (as transformers' mixers produce them). Tensors may be bf16 (as a model computes them) or
fp32; the recurrences compute in fp32. `validate()` is the one place where shapes, dtypes, devices and
finiteness are checked; everything downstream trusts a validated container.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class InputError(ValueError):
    """A decode-input tensor has the wrong shape, dtype, device or contains NaN/Inf."""


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device, time_major: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise InputError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.device != device:
        raise InputError(f"{name} is on {t.device}, expected {device} (all inputs on one device)")
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        where = f"batch {idx[0]}, step {idx[1]}" if time_major and len(idx) >= 2 else f"index {idx}"
        raise InputError(f"{name} contains NaN/Inf (first at {where})")


@dataclass
class Mamba2Inputs:
    """Decode inputs of one Mamba-2 layer.

    Shapes (B batch, T steps, H heads, P head_dim, G groups, N state size; heads h share group
    h // (H // G), as in transformers' `repeat_interleave`):

    - x:  [B, T, H, P]  the SSM input (after the conv and activation)
    - dt: [B, T, H]     time step after softplus(dt_raw + dt_bias) and the model's clamp (> 0)
    - B:  [B, T, G, N]
    - C:  [B, T, G, N]
    - A:  [H]           A = -exp(A_log) < 0
    - D:  [H]           skip term
    - initial_state: optional [B, H, P, N] state before step 0 (zeros if None)

    The state is S[P, N] per head: rows are head_dim channels, the scale reduction runs over N.
    """

    x: torch.Tensor
    dt: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    initial_state: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    kind = "mamba2"

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    @property
    def steps(self) -> int:
        return self.x.shape[1]

    @property
    def num_heads(self) -> int:
        return self.x.shape[2]

    @property
    def rows(self) -> int:
        """Rows of the per-head state (head_dim P)."""
        return self.x.shape[3]

    @property
    def state_dim(self) -> int:
        """Reduction dim of the per-head state (state size N)."""
        return self.B.shape[3]

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.num_heads, self.rows, self.state_dim)

    @property
    def device(self) -> torch.device:
        return self.x.device

    def validate(self) -> Mamba2Inputs:
        """Check shapes, dtypes, device and finiteness; return self. Raises InputError naming the problem."""
        if not isinstance(self.x, torch.Tensor) or self.x.ndim != 4:
            raise InputError(f"x must be a 4-D tensor [B, T, H, P], got {getattr(self.x, 'shape', self.x)}")
        b, t, h, p = self.x.shape
        if not isinstance(self.B, torch.Tensor) or self.B.ndim != 4:
            raise InputError(f"B must be a 4-D tensor [B, T, G, N], got {getattr(self.B, 'shape', self.B)}")
        g, n = self.B.shape[2], self.B.shape[3]
        if min(b, t, h, p, g, n) < 1:
            raise InputError(f"empty inputs: x {tuple(self.x.shape)}, B {tuple(self.B.shape)}")
        if h % g != 0:
            raise InputError(f"heads ({h}) must be a multiple of groups ({g}); B has shape {tuple(self.B.shape)}")
        dev = self.x.device
        _check("x", self.x, (b, t, h, p), dev)
        _check("dt", self.dt, (b, t, h), dev)
        _check("B", self.B, (b, t, g, n), dev)
        _check("C", self.C, (b, t, g, n), dev)
        _check("A", self.A, (h,), dev, time_major=False)
        _check("D", self.D, (h,), dev, time_major=False)
        if self.initial_state is not None:
            _check("initial_state", self.initial_state, (b, h, p, n), dev, time_major=False)
        if bool((self.dt <= 0).any()):
            raise InputError("dt must be > 0 (it is softplus(dt_raw + dt_bias) after the clamp)")
        if bool((self.A >= 0).any()):
            raise InputError("A must be < 0 (A = -exp(A_log)); pass A, not A_log")
        return self

    @property
    def num_groups(self) -> int:
        return self.B.shape[2]

    def slice_steps(self, start: int, stop: int) -> Mamba2Inputs:
        """Inputs of steps [start, stop) (same initial state)."""
        return dataclasses.replace(
            self,
            x=self.x[:, start:stop],
            dt=self.dt[:, start:stop],
            B=self.B[:, start:stop],
            C=self.C[:, start:stop],
        )

    def to(self, device: torch.device | str) -> Mamba2Inputs:
        def mv(t):
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            x=mv(self.x),
            dt=mv(self.dt),
            B=mv(self.B),
            C=mv(self.C),
            A=mv(self.A),
            D=mv(self.D),
            initial_state=mv(self.initial_state),
        )


@dataclass
class _DeltaRuleInputs:
    """Fields, shapes and checks shared by the gated delta rules (GDN, KDA); only the gate differs.

    Value head h uses key head h // (Hv // Hk), as in transformers' `repeat_interleave`. Subclasses
    define `kind` and `_check_gate`.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.v.shape[0]

    @property
    def steps(self) -> int:
        return self.v.shape[1]

    @property
    def num_heads(self) -> int:
        """Value heads Hv (one state per value head)."""
        return self.v.shape[2]

    @property
    def num_key_heads(self) -> int:
        return self.k.shape[2]

    @property
    def rows(self) -> int:
        """Rows of the per-head state (value dim Dv)."""
        return self.v.shape[3]

    @property
    def state_dim(self) -> int:
        """Reduction dim of the per-head state (key dim Dk)."""
        return self.k.shape[3]

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.num_heads, self.rows, self.state_dim)

    @property
    def device(self) -> torch.device:
        return self.v.device

    def validate(self):
        """Check shapes, dtypes, device and finiteness; return self. Raises InputError naming the problem."""
        if not isinstance(self.v, torch.Tensor) or self.v.ndim != 4:
            raise InputError(f"v must be a 4-D tensor [B, T, Hv, Dv], got {getattr(self.v, 'shape', self.v)}")
        if not isinstance(self.k, torch.Tensor) or self.k.ndim != 4:
            raise InputError(f"k must be a 4-D tensor [B, T, Hk, Dk], got {getattr(self.k, 'shape', self.k)}")
        b, t, hv, dv = self.v.shape
        hk, dk = self.k.shape[2], self.k.shape[3]
        if min(b, t, hv, dv, hk, dk) < 1:
            raise InputError(f"empty inputs: v {tuple(self.v.shape)}, k {tuple(self.k.shape)}")
        if hv % hk != 0:
            raise InputError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
        dev = self.v.device
        _check("q", self.q, (b, t, hk, dk), dev)
        _check("k", self.k, (b, t, hk, dk), dev)
        _check("v", self.v, (b, t, hv, dv), dev)
        self._check_gate(b, t, hv, dk, dev)
        _check("beta", self.beta, (b, t, hv), dev)
        if self.initial_state is not None:
            _check("initial_state", self.initial_state, (b, hv, dv, dk), dev, time_major=False)
        if bool(((self.beta < 0) | (self.beta > 1)).any()):
            raise InputError("beta must lie in [0, 1] (it is sigmoid(b))")
        return self

    def _check_gate(self, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
        raise NotImplementedError

    def slice_steps(self, start: int, stop: int):
        """Inputs of steps [start, stop) (same initial state)."""
        return dataclasses.replace(
            self,
            q=self.q[:, start:stop],
            k=self.k[:, start:stop],
            v=self.v[:, start:stop],
            g=self.g[:, start:stop],
            beta=self.beta[:, start:stop],
        )

    def to(self, device: torch.device | str):
        def mv(t):
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            q=mv(self.q),
            k=mv(self.k),
            v=mv(self.v),
            g=mv(self.g),
            beta=mv(self.beta),
            initial_state=mv(self.initial_state),
        )


@dataclass
class GDNInputs(_DeltaRuleInputs):
    """Decode inputs of one Gated DeltaNet layer.

    Shapes (B batch, T steps, Hk key heads, Hv value heads, Dk key dim, Dv value dim; value head h
    uses key head h // (Hv // Hk), as in transformers' `repeat_interleave`):

    - q:    [B, T, Hk, Dk]  L2-normalised and scaled by 1/sqrt(Dk)
    - k:    [B, T, Hk, Dk]  L2-normalised
    - v:    [B, T, Hv, Dv]
    - g:    [B, T, Hv]      log decay g = -exp(A_log) * softplus(a + dt_bias) <= 0
    - beta: [B, T, Hv]      sigmoid(b) in (0, 1)
    - initial_state: optional [B, Hv, Dv, Dk] state before step 0 (zeros if None)

    The state is stored transposed to [Dv, Dk] (transformers keeps [Dk, Dv]): rows are value channels
    and the scale reduction runs over Dk, which is DESIGN.md's "row" of a GDN state.
    """

    kind = "gdn"

    def _check_gate(self, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
        _check("g", self.g, (b, t, hv), dev)
        if bool((self.g > 0).any()):
            raise InputError("g must be <= 0 (it is the log of the decay exp(g) in (0, 1])")


@dataclass
class KDAInputs(_DeltaRuleInputs):
    """Decode inputs of one Kimi Delta Attention layer (GLM-5.3-Flash, Kimi-Linear, Kimi-K3).

    KDA is the gated delta rule of GDN with a decay per key channel instead of one per head: the same
    fields and shapes as GDNInputs except the gate (B batch, T steps, Hk key heads, Hv value heads,
    Dk key dim, Dv value dim; the real models have Hk = Hv):

    - q:    [B, T, Hk, Dk]  L2-normalised and scaled by 1/sqrt(Dk)
    - k:    [B, T, Hk, Dk]  L2-normalised
    - v:    [B, T, Hv, Dv]
    - g:    [B, T, Hv, Dk]  log decays <= 0, one per key channel: GLM-5.3-Flash's
                            lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) in [-5, 0], Kimi-Linear's
                            -exp(A_log) * softplus(f + dt_bias)
    - beta: [B, T, Hv]      sigmoid(b) in (0, 1)
    - initial_state: optional [B, Hv, Dv, Dk] state before step 0 (zeros if None)

    The state is kept [Dv, Dk] per head (transformers keeps [Dk, Dv]; vLLM's and FlashInfer's KDA
    caches keep [V, K], this layout): a row is one value channel over the key channels, which decay at
    their own rates.
    """

    kind = "kda"

    def validate(self) -> KDAInputs:
        """Check shapes, dtypes, device and finiteness; return self. Raises InputError naming the problem."""
        if isinstance(self.g, torch.Tensor) and self.g.ndim == 3:
            raise InputError(
                f"g has shape {tuple(self.g.shape)}, one decay per head: that is Gated DeltaNet (use GDNInputs); "
                "KDA takes one log decay per key channel, g [B, T, Hv, Dk]"
            )
        return super().validate()

    def _check_gate(self, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
        _check("g", self.g, (b, t, hv, dk), dev)
        if bool((self.g > 0).any()):
            idx = tuple(int(i) for i in (self.g > 0).nonzero()[0])
            raise InputError(
                f"g must be <= 0 (log decays, exp(g) in (0, 1]); got {float(self.g[idx]):.4g} at batch {idx[0]}, "
                f"step {idx[1]}, head {idx[2]}, key channel {idx[3]}"
            )


LayerInputs = Mamba2Inputs | GDNInputs | KDAInputs
