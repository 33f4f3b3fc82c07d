"""Per-layer decode inputs of Mamba-2, Gated DeltaNet and Kimi Delta Attention, in the exact form the
recurrences consume.

The containers hold the inputs of one SSM layer for a batch of sequences over T decode steps, time
second (as transformers' mixers produce them). Tensors may be bf16 (as a model computes them) or
fp32; the recurrences compute in fp32. `validate()` is the one place where shapes, dtypes, devices and
finiteness are checked; everything downstream trusts a validated container.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class InputError(ValueError):
    """A decode-input tensor has the wrong shape, dtype, device or contains NaN/Inf."""


def _meta_problem(name: str, t, shape: tuple[int, ...], device: torch.device) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.dtype not in _FLOAT_DTYPES:
        return f"{name} must be float32, bfloat16 or float16, got {t.dtype}"
    if tuple(t.shape) != tuple(shape):
        return f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}"
    if t.device != device:
        return f"{name} is on {t.device}, expected {device} (all inputs on one device)"
    return None


class _Checks:
    """The checks of one ``validate``, in order, with one read-back of the device's answers.

    Shapes, dtypes and devices are checked at once; the value checks (NaN/Inf, a sign rule) are queued as
    0-d flags on the tensors' device and read back together (one wait for the device instead of one per
    check: the wait also holds back the host while the device still runs earlier work). ``run`` raises the
    error the checks one by one would have raised first: value checks before the first bad shape / dtype /
    device, which stops the collection (later tensors are not looked at)."""

    def __init__(self):
        self.items: list[tuple] = []  # (flag or None, raise-function)
        self.stopped = False

    def tensor(self, name: str, t, shape: tuple[int, ...], device: torch.device, time_major: bool = True) -> None:
        if self.stopped:
            return
        problem = _meta_problem(name, t, shape, device)
        if problem is not None:
            self.stopped = True
            self.items.append((None, lambda: _raise(problem)))
            return

        def nonfinite():
            idx = tuple(int(i) for i in (~torch.isfinite(t)).nonzero()[0])
            where = f"batch {idx[0]}, step {idx[1]}" if time_major and len(idx) >= 2 else f"index {idx}"
            raise InputError(f"{name} contains NaN/Inf (first at {where})")

        self.items.append(((~torch.isfinite(t)).any(), nonfinite))

    def rule(self, flag, fail) -> None:
        """``flag()``: a 0-d bool tensor, true when the rule is broken; ``fail()`` raises its error."""
        if not self.stopped:
            self.items.append((flag(), fail))

    def run(self) -> None:
        flags = [f for f, _ in self.items if f is not None]
        values = iter(torch.stack(flags).tolist() if flags else [])
        for flag, fail in self.items:
            if flag is None or next(values):
                fail()


def _raise(message: str):
    raise InputError(message)


def _tensors(inputs) -> tuple:
    """(field name, tensor, in-place version counter) of each tensor field of an inputs container."""
    return tuple(
        (f.name, t, t._version)
        for f in dataclasses.fields(inputs)
        if isinstance(t := getattr(inputs, f.name), torch.Tensor)
    )


def _remember_valid(inputs) -> None:
    """Record that ``validate()`` passed on exactly these tensors, with their version counters. The record
    holds weak references: it must not keep a tensor alive after the container dropped it (a field replaced,
    or a host copy that ``to()`` moved to the GPU), which would hold memory the run believes freed."""
    inputs._valid_as = tuple((name, weakref.ref(t), version) for name, t, version in _tensors(inputs))


def _carry_valid(src, dst):
    """``dst``, made from ``src`` by ``to()``: it keeps src's record, which still holds where ``to`` returned
    the same tensors (already on the device), and not where it copied them."""
    if getattr(src, "_valid_as", None) is not None:
        dst._valid_as = src._valid_as
    return dst


def is_validated(inputs) -> bool:
    """Whether ``inputs.validate()`` has passed on the very tensors the container holds now, none of them
    replaced or changed in place since (the same objects, the same ``Tensor._version``). Lets a consumer skip a
    second validation of inputs validated where they were made: on a GPU its read-back waits for all the
    work queued on the stream."""
    seen = getattr(inputs, "_valid_as", None)
    if seen is None:
        return False
    now = _tensors(inputs)
    return len(now) == len(seen) and all(
        a[0] == b[0] and a[1] is b[1]() and a[2] == b[2] for a, b in zip(now, seen, strict=True)
    )


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
        checks = _Checks()
        checks.tensor("x", self.x, (b, t, h, p), dev)
        checks.tensor("dt", self.dt, (b, t, h), dev)
        checks.tensor("B", self.B, (b, t, g, n), dev)
        checks.tensor("C", self.C, (b, t, g, n), dev)
        checks.tensor("A", self.A, (h,), dev, time_major=False)
        checks.tensor("D", self.D, (h,), dev, time_major=False)
        if self.initial_state is not None:
            checks.tensor("initial_state", self.initial_state, (b, h, p, n), dev, time_major=False)
        checks.rule(lambda: (self.dt <= 0).any(),
                    lambda: _raise("dt must be > 0 (it is softplus(dt_raw + dt_bias) after the clamp)"))  # fmt: skip
        checks.rule(lambda: (self.A >= 0).any(), lambda: _raise("A must be < 0 (A = -exp(A_log)); pass A, not A_log"))
        checks.run()
        _remember_valid(self)
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

        return _carry_valid(self, dataclasses.replace(
            self,
            x=mv(self.x),
            dt=mv(self.dt),
            B=mv(self.B),
            C=mv(self.C),
            A=mv(self.A),
            D=mv(self.D),
            initial_state=mv(self.initial_state),
        ))


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
        checks = _Checks()
        checks.tensor("q", self.q, (b, t, hk, dk), dev)
        checks.tensor("k", self.k, (b, t, hk, dk), dev)
        checks.tensor("v", self.v, (b, t, hv, dv), dev)
        self._check_gate(checks, b, t, hv, dk, dev)
        checks.tensor("beta", self.beta, (b, t, hv), dev)
        if self.initial_state is not None:
            checks.tensor("initial_state", self.initial_state, (b, hv, dv, dk), dev, time_major=False)
        checks.rule(lambda: ((self.beta < 0) | (self.beta > 1)).any(),
                    lambda: _raise("beta must lie in [0, 1] (it is sigmoid(b))"))  # fmt: skip
        checks.run()
        _remember_valid(self)
        return self

    def _check_gate(self, checks: _Checks, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
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

        return _carry_valid(self, dataclasses.replace(
            self,
            q=mv(self.q),
            k=mv(self.k),
            v=mv(self.v),
            g=mv(self.g),
            beta=mv(self.beta),
            initial_state=mv(self.initial_state),
        ))


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

    def _check_gate(self, checks: _Checks, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
        checks.tensor("g", self.g, (b, t, hv), dev)
        checks.rule(lambda: (self.g > 0).any(),
                    lambda: _raise("g must be <= 0 (it is the log of the decay exp(g) in (0, 1])"))  # fmt: skip


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

    def _check_gate(self, checks: _Checks, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
        checks.tensor("g", self.g, (b, t, hv, dk), dev)

        def positive():
            idx = tuple(int(i) for i in (self.g > 0).nonzero()[0])
            raise InputError(
                f"g must be <= 0 (log decays, exp(g) in (0, 1]); got {float(self.g[idx]):.4g} at batch {idx[0]}, "
                f"step {idx[1]}, head {idx[2]}, key channel {idx[3]}"
            )

        checks.rule(lambda: (self.g > 0).any(), positive)


LayerInputs = Mamba2Inputs | GDNInputs | KDAInputs
