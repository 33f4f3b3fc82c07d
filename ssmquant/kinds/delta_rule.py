"""What Gated DeltaNet and Kimi Delta Attention share: the gated delta rule on a [Dv, Dk] state.

Per value head (key heads shared by Hv / Hk value heads; q and k L2-normalised, q scaled by 1/sqrt(Dk)):

    S_t = decay_t(S_{t-1})       u_t = beta_t (v_t - S_t k_t)       S_t = S_t + u_t k_t^T       y_t = S_t q_t

with the state kept [Dv, Dk] (transformers keeps [Dk, Dv]): a row is one value channel over the key channels.
The kinds differ only in the decay: GDN's one per head, KDA's one per key channel (`gdn.py`, `kda.py`). A replay
buffer holds the corrected values u_j and the keys k_j in the buffer dtype and the gates g_j in FP32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import (
    FP32_BYTES,
    Checks,
    InputError,
    LayerInputs,
    LayerKind,
    LiteralReplay,
    Physics,
    expand_groups,
    raise_input_error,
    remember_valid,
    step_metrics,
)
from .mamba2 import buffer_round


@dataclass
class DeltaRuleInputs(LayerInputs):
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

    SEQUENCE_FIELDS = ("q", "k", "v", "g", "beta")
    ACTIVATION_FIELD = "v"

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
    def num_groups(self) -> int:
        """Key heads Hk: the distinct key vectors of a step."""
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
        checks = Checks()
        checks.tensor("q", self.q, (b, t, hk, dk), dev)
        checks.tensor("k", self.k, (b, t, hk, dk), dev)
        checks.tensor("v", self.v, (b, t, hv, dv), dev)
        self._check_gate(checks, b, t, hv, dk, dev)
        checks.tensor("beta", self.beta, (b, t, hv), dev)
        if self.initial_state is not None:
            checks.tensor("initial_state", self.initial_state, (b, hv, dv, dk), dev, time_major=False)
        checks.rule(lambda: ((self.beta < 0) | (self.beta > 1)).any(),
                    lambda: raise_input_error("beta must lie in [0, 1] (it is sigmoid(b))"))  # fmt: skip
        checks.run()
        remember_valid(self)
        return self

    def _check_gate(self, checks: Checks, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
        raise NotImplementedError


def gdn_delta(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Corrected value u = beta * (v - S k) of the delta rule, fp32.

    state [B, H, Dv, Dk] (already decayed), k [B, H, Dk], v [B, H, Dv], beta [B, H] -> u [B, H, Dv].
    """
    kv = (state * k[:, :, None, :]).sum(-1)
    return beta[:, :, None] * (v - kv)


def gdn_output(state: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """y = S^T q in transformers' layout, i.e. sum over Dk of our [Dv, Dk] state: -> [B, H, Dv]."""
    return (state * q[:, :, None, :]).sum(-1)


def kda_decay(state: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """diag(alpha) S in transformers' [Dk, Dv] layout, i.e. our [Dv, Dk] state scaled along its last dim.

    state [B, H, Dv, Dk], alpha [B, H, Dk] -> [B, H, Dv, Dk].
    """
    return state * alpha[:, :, None, :]


def delta_rule(s, k, v, beta, q, buffer_dtype=torch.float32):
    """The delta-rule update of an already decayed state s [B, H, Dv, Dk] (GDN and KDA alike): u stored in
    ``buffer_dtype``, S + u k^T, and y = S^T q. Returns (new state, y [B, H, Dv])."""
    u = buffer_round(gdn_delta(s, k, v, beta), buffer_dtype)
    s = s + u[..., None] * k[:, :, None, :]
    return s, gdn_output(s, q)


def delta_rule_emulation_step(decay, s_ref, s_var, alpha, q, k, kb, v, beta, buffer_dtype, write, store, key):
    """One decode step of the FP32 reference and one variant (state form) of a gated delta rule whose decay is
    ``decay(s, alpha)``. s_ref, s_var [B, H, Dv, Dk]; alpha [B, H] (GDN) or [B, H, Dk] (KDA); beta [B, H]; q, k, kb
    (buffered k) [B, H, Dk]; v [B, H, Dv]; write bool [B]; store, key as `mamba2_emulation_step`; buffer_dtype: the
    dtype u is buffered in. Returns (s_ref, s_var, metrics [B, H, 4])."""
    s_ref, y_ref = delta_rule(decay(s_ref, alpha), k, v, beta, q)
    s_var, y_var = delta_rule(decay(s_var, alpha), kb, v, beta, q, buffer_dtype)
    s_var = torch.where(write[:, None, None, None], store(s_var, key), s_var)
    return s_ref, s_var, step_metrics(s_var, s_ref, y_var, y_ref)


class DeltaRulePhysics(Physics):
    """fp32 decays alpha, g, q, k (key heads expanded), v, beta of one layer; ``decay(s, alpha_t)`` is the kind's."""

    def __init__(self, kind: DeltaRuleKind, inputs: DeltaRuleInputs):
        heads = inputs.num_heads
        self.kind, self.inputs = kind, inputs
        self.alpha = kind.decays(inputs)  # [B, T, Hv] (GDN) or [B, T, Hv, Dk] (KDA)
        self.g = inputs.g.float()
        self.q = expand_groups(inputs.q.float(), heads)
        self.k = expand_groups(inputs.k.float(), heads)
        self.v = inputs.v.float()
        self.beta = inputs.beta.float()

    def buffered(self, dtype: torch.dtype):
        """(kb [B, T, H, Dk], buffer dtype): the keys as a replay ring stores them, and the dtype of its u."""
        return expand_groups(buffer_round(self.inputs.k.float(), dtype), self.inputs.num_heads), dtype

    def step_args(self, t, buffered) -> tuple:
        """Arguments of `delta_rule_emulation_step` after the two states (and the decay), for step t."""
        kb, dtype = buffered
        return (self.alpha[:, t], self.q[:, t], self.k[:, t], kb[:, t], self.v[:, t], self.beta[:, t], dtype)

    def advance(self, s, t, buffered=None):
        k, dtype = (self.k[:, t], torch.float32) if buffered is None else (buffered[0][:, t], buffered[1])
        return delta_rule(self.kind.decay(s, self.alpha[:, t]), k, self.v[:, t], self.beta[:, t], self.q[:, t], dtype)


class DeltaRuleLiteral(LiteralReplay):
    """Checkpoint + buffer: the state rebuilt from the checkpoint and the buffered (u_j, k_j, g_j) at every step."""

    def __init__(self, physics: DeltaRulePhysics, buffered, cap: int):
        inp = physics.inputs
        super().__init__(inp.batch, cap, inp.device)
        self.p, (self.kb, self.dtype) = physics, buffered
        self.u_buf = torch.zeros(inp.batch, cap, inp.num_heads, inp.rows, device=inp.device)

    def step(self, s0, t):
        p = self.p
        bsz = s0.shape[0]
        ar = torch.arange(bsz, device=s0.device)
        held = self.held
        prev = p.kind.rebuild(s0, held, self.buf_idx, self.u_buf, self.kb, p.g, self.cap)  # S_{t-1}
        k = self.kb[:, t]
        decayed = p.kind.decay(prev, p.alpha[:, t])
        u = buffer_round(gdn_delta(decayed, k, p.v[:, t], p.beta[:, t]), self.dtype)
        self.buf_idx[ar, held] = t
        self.u_buf[ar, held] = u
        held = held + 1
        self.held = held
        rebuilt = p.kind.rebuild(s0, held, self.buf_idx, self.u_buf, self.kb, p.g, self.cap)
        return rebuilt, gdn_output(rebuilt, p.q[:, t])


class DeltaRuleKind(LayerKind):
    """The gated delta rule; a subclass gives the decay (``decays``, ``decay``) and the buffer's ``rebuild``."""

    cache_transposed = True

    @staticmethod
    def decay(s: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rebuild(self, s0, held, buf_idx, u_buf, kb, g, cap) -> torch.Tensor:
        """The state from checkpoint s0 [B, H, Dv, Dk] and the first ``held`` buffered entries (steps buf_idx
        [B, cap], corrected values u_buf [B, cap, H, Dv], keys kb [B, T, H, Dk], gates g [B, T, ...])."""
        raise NotImplementedError

    def physics(self, inputs):
        return DeltaRulePhysics(self, inputs)

    def emulation_step(self, s_ref, s_var, *args):
        return delta_rule_emulation_step(self.decay, s_ref, s_var, *args)

    def literal(self, physics, buffered, buffer_dtype, cap):
        return DeltaRuleLiteral(physics, buffered, cap)

    def reference_states(self, inputs, every=1):
        bsz, steps, heads = inputs.batch, inputs.steps, inputs.num_heads
        state = (
            torch.zeros(bsz, heads, inputs.rows, inputs.state_dim, device=inputs.device, dtype=torch.float32)
            if inputs.initial_state is None
            else inputs.initial_state.float().clone()
        )
        alpha_all = self.decays(inputs)
        for t in range(steps):
            k = expand_groups(inputs.k[:, t : t + 1].float(), heads)[:, 0]  # [B, Hv, Dk]
            state = self.decay(state, alpha_all[:, t])
            u = gdn_delta(state, k, inputs.v[:, t].float(), inputs.beta[:, t].float())
            state = state + u[:, :, :, None] * k[:, :, None, :]
            if (t + 1) % every == 0:
                yield t + 1, state

    def gate_elements(self, dims) -> int:
        """FP32 gate elements of one step (GDN: one per head)."""
        return dims.heads

    def input_bytes_per_token(self, dims, act_bytes=FP32_BYTES):
        h, r, n, g = dims.heads, dims.rows, dims.state_dim, dims.groups
        return FP32_BYTES * 2 * g * n + act_bytes * (h * r + h) + FP32_BYTES * h  # q/k fp32, v/beta activations, g fp32

    def emulation_bytes_per_token(self, dims, variants):
        h, r, n = dims.heads, dims.rows, dims.state_dim
        return FP32_BYTES * (3 * h + 2 * h * n + h * r + variants * h * n)  # alpha, g, beta, q, k, v; per variant kb

    def ring_row(self, dims):
        return dims.heads * dims.rows + dims.groups * dims.state_dim, self.gate_elements(dims)  # u and k; the gates

    fused_prefill_package = "fla"

    def prefill_scan_elements(self, dims, chunk):
        h, r, n = dims.heads, dims.rows, dims.state_dim
        return 3 * chunk * h + 2 * h * r * n / chunk + 2 * h * n + 4 * h * r  # torch_chunk_gated_delta_rule

    def random_gate(self, batch, steps, dims, gen, device) -> torch.Tensor:
        raise NotImplementedError

    def random_inputs(self, dims, batch, steps, *, device="cpu", seed=0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        h, r, n, g = dims.heads, dims.rows, dims.state_dim, dims.groups

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device)

        q = torch.nn.functional.normalize(rand(batch, steps, g, n), dim=-1) * n**-0.5
        k = torch.nn.functional.normalize(rand(batch, steps, g, n), dim=-1)
        v = rand(batch, steps, h, r)
        gate = self.random_gate(batch, steps, dims, gen, device)
        beta = torch.rand(batch, steps, h, generator=gen).to(device)
        return self.inputs_type(q, k, v, gate, beta).validate()
