"""Mamba-2 (NemotronH, Nemotron-3): inputs, the FP32 recurrence and its checkpoint-plus-buffer form.

Per head h (H heads, head_dim P, state size N, G groups; heads share B and C within a group):

    a_t = exp(dt_t * A_h)        S_t = a_t * S_{t-1} + dt_t * x_t B_t^T        y_t = S_t C_t + D_h * x_t

The state is S[P, N] per head: rows are head_dim channels, the scale reduction runs over N. A replay buffer
holds x_j, B_j (in the buffer dtype) and dt_j (FP32); the output-only form of a step from checkpoint S_0 is
y_t = abar_t (S_0 C_t) + sum_j s_jt (B_j . C_t) x_j + D x_t with abar_t = exp(A pre_t), s_jt = dt_j exp(A (pre_t
- pre_j)) and pre the running sum of the buffered dt.
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
    TransformersFamily,
    expand_groups,
    raise_input_error,
    register,
    remember_valid,
    step_metrics,
)


@dataclass
class Mamba2Inputs(LayerInputs):
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
    SEQUENCE_FIELDS = ("x", "dt", "B", "C")
    ACTIVATION_FIELD = "x"

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
    def num_groups(self) -> int:
        return self.B.shape[2]

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
        checks = Checks()
        checks.tensor("x", self.x, (b, t, h, p), dev)
        checks.tensor("dt", self.dt, (b, t, h), dev)
        checks.tensor("B", self.B, (b, t, g, n), dev)
        checks.tensor("C", self.C, (b, t, g, n), dev)
        checks.tensor("A", self.A, (h,), dev, time_major=False)
        checks.tensor("D", self.D, (h,), dev, time_major=False)
        if self.initial_state is not None:
            checks.tensor("initial_state", self.initial_state, (b, h, p, n), dev, time_major=False)
        checks.rule(lambda: (self.dt <= 0).any(),
                    lambda: raise_input_error("dt must be > 0 (it is softplus(dt_raw + dt_bias) after the clamp)"))  # fmt: skip
        checks.rule(lambda: (self.A >= 0).any(),
                    lambda: raise_input_error("A must be < 0 (A = -exp(A_log)); pass A, not A_log"))  # fmt: skip
        checks.run()
        remember_valid(self)
        return self


def mamba2_decays(inputs: Mamba2Inputs) -> torch.Tensor:
    """Per-step decay a_t = exp(dt_t * A_h), fp32 [B, T, H]."""
    return torch.exp(inputs.dt.float() * inputs.A.float())


def mamba2_step(state: torch.Tensor, a: torch.Tensor, dtx: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One Mamba-2 state update S <- a * S + (dt * x) B^T, fp32.

    state [B, H, P, N], a [B, H], dtx [B, H, P] (= dt * x), b [B, H, N]. Returns the new state.
    The order (a * S first, the outer product second, one add) is the order every backend follows.
    """
    return a[:, :, None, None] * state + dtx[:, :, :, None] * b[:, :, None, :]


def mamba2_output(state: torch.Tensor, c: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y = S C + D x: state [B, H, P, N], c [B, H, N], d [H], x [B, H, P] -> [B, H, P]."""
    return (state * c[:, :, None, :]).sum(-1) + d[None, :, None] * x


def mamba2_advance(s, a, dt, x_state, b_state, c, d, x):
    """One Mamba-2 step from state s [B, H, P, N]: returns (new state, y [B, H, P]).

    a, dt [B, H]; x_state [B, H, P] and b_state [B, H, N] are the inputs as stored (buffered inputs
    for replay); c [B, H, N]; d [H]; x [B, H, P] the current input for the skip term.
    """
    s = mamba2_step(s, a, dt[..., None] * x_state, b_state)
    return s, mamba2_output(s, c, d, x)


def buffer_round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round buffered inputs to the buffer dtype (torch's RNE cast), back to FP32."""
    return t if dtype == torch.float32 else t.to(dtype).float()


class Mamba2Physics(Physics):
    """fp32 a, dt, x [B, T, H(, P)], b, c [B, T, H, N] (groups expanded), d and A [H] of one layer."""

    def __init__(self, inputs: Mamba2Inputs):
        heads = inputs.num_heads
        self.inputs = inputs
        self.a = mamba2_decays(inputs)  # [B, T, H]
        self.x = inputs.x.float()
        self.dt = inputs.dt.float()
        self.b = expand_groups(inputs.B.float(), heads)
        self.c = expand_groups(inputs.C.float(), heads)
        self.d = inputs.D.float()
        self.A = inputs.A.float()

    def buffered(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(xb [B, T, H, P], bb [B, T, H, N]): x and B as a replay ring stores them."""
        inp = self.inputs
        return buffer_round(inp.x.float(), dtype), expand_groups(buffer_round(inp.B.float(), dtype), inp.num_heads)

    def step_args(self, t, buffered) -> tuple:
        """The arguments of `mamba2_emulation_step` after the two states, for step t and a variant's buffers."""
        xb, bb = buffered
        return (self.a[:, t], self.dt[:, t], self.x[:, t], xb[:, t], self.b[:, t], bb[:, t], self.c[:, t], self.d)

    def advance(self, s, t, buffered=None):
        x = self.x[:, t]
        xb, bb = (x, self.b[:, t]) if buffered is None else (buffered[0][:, t], buffered[1][:, t])
        return mamba2_advance(s, self.a[:, t], self.dt[:, t], xb, bb, self.c[:, t], self.d, x)


class Mamba2Literal(LiteralReplay):
    """Checkpoint + buffer: the output-only form for y, the rebuilt state for the metrics and flushes."""

    def __init__(self, physics: Mamba2Physics, buffered, cap: int):
        inp = physics.inputs
        super().__init__(inp.batch, cap, inp.device)
        self.p, (self.xb, self.bb) = physics, buffered

    def step(self, s0, t):
        p = self.p
        bsz = s0.shape[0]
        ar = torch.arange(bsz, device=s0.device)
        held = self.held
        self.buf_idx[ar, held] = t
        held = held + 1
        self.held = held
        j = torch.arange(self.cap, device=s0.device)
        valid = j[None, :] < held[:, None]  # [B, cap]
        steps_idx = self.buf_idx  # [B, cap] step of each buffered entry
        dt_buf = torch.where(valid[..., None], p.dt[ar[:, None], steps_idx], 0.0)  # [B, cap, H]
        pre = torch.cumsum(dt_buf, 1)  # [B, cap, H]
        pre_t = pre[ar, held - 1]  # [B, H]
        abar = torch.exp(p.A * pre_t)  # [B, H]
        s_jt = dt_buf * torch.exp(p.A * (pre_t[:, None] - pre))  # [B, cap, H]
        s_jt = torch.where(valid[..., None], s_jt, 0.0)
        x_buf = self.xb[ar[:, None], steps_idx]  # [B, cap, H, P]
        b_buf = self.bb[ar[:, None], steps_idx]  # [B, cap, H, N]
        c_t = p.c[:, t]  # [B, H, N]
        s0c = (s0 * c_t[:, :, None, :]).sum(-1)  # [B, H, P]
        bc = (b_buf * c_t[:, None]).sum(-1)  # [B, cap, H]
        y = abar[..., None] * s0c + ((s_jt * bc)[..., None] * x_buf).sum(1) + p.d[None, :, None] * p.x[:, t]
        rebuilt = abar[..., None, None] * s0 + torch.einsum("bjh,bjhp,bjhn->bhpn", s_jt, x_buf, b_buf)
        return rebuilt, y


class Mamba2(LayerKind):
    name = "mamba2"
    title = "Mamba-2"
    short = "Mamba-2"
    inputs_type = Mamba2Inputs
    model_names = "NemotronH"
    transformers_families = (
        TransformersFamily("nemotron_h", ("NemotronHForCausalLM",), {"nemotron_h": "NemotronHForCausalLM"}),
    )
    mixer_class_suffixes = ("Mamba2Mixer",)
    default_chunk = 128

    def decays(self, inputs):
        return mamba2_decays(inputs)

    def emulation_step(self, *args):
        return mamba2_emulation_step(*args)

    def physics(self, inputs):
        return Mamba2Physics(inputs)

    def literal(self, physics, buffered, buffer_dtype, cap):
        return Mamba2Literal(physics, buffered, cap)

    def reference_states(self, inputs, every=1):
        bsz, steps, heads = inputs.batch, inputs.steps, inputs.num_heads
        state = (
            torch.zeros(bsz, heads, inputs.rows, inputs.state_dim, device=inputs.device, dtype=torch.float32)
            if inputs.initial_state is None
            else inputs.initial_state.float().clone()
        )
        a_all = mamba2_decays(inputs)  # [B, T, H]
        for t in range(steps):
            dtx = inputs.dt[:, t].float()[..., None] * inputs.x[:, t].float()  # [B, H, P]
            b = expand_groups(inputs.B[:, t : t + 1].float(), heads)[:, 0]  # [B, H, N]
            state = mamba2_step(state, a_all[:, t], dtx, b)
            if (t + 1) % every == 0:
                yield t + 1, state

    def input_bytes_per_token(self, dims, act_bytes=FP32_BYTES):
        h, r, n, g = dims.heads, dims.rows, dims.state_dim, dims.groups
        return act_bytes * (h * r + 2 * g * n) + FP32_BYTES * h  # x [H, P], B/C [G, N] as activations; dt [H] fp32

    def emulation_bytes_per_token(self, dims, variants):
        h, r, n = dims.heads, dims.rows, dims.state_dim
        return FP32_BYTES * (2 * h + h * r + 2 * h * n + variants * (h * r + h * n))  # a, dt, x, b, c; per variant xb, bb

    def ring_row(self, dims):
        return dims.heads * dims.rows + dims.groups * dims.state_dim, dims.heads  # x and B; dt per head

    fused_prefill_package = "mamba_ssm"
    prefill_scan_kernel = "mamba_chunk_scan_combined"

    def prefill_scan_elements(self, dims, chunk):
        h, r, n = dims.heads, dims.rows, dims.state_dim
        # transformers' torch mamba2_chunk_scan (einsums, 5.24 and 5.25): L, G and M of [chunk, H] per token, live
        # to its end, with segment_sum's and the einsums' transient copies (6 in all); the chunk states, their
        # concatenation and the propagated states ([H, P, N] per chunk: 4); B and C repeated to every head and
        # B's decayed copy (4 of [H, N]); x, dt x, the D residual, the diagonal and off-diagonal outputs and their
        # permuted copies (10 of [H, P]). The [chunks, chunks, H] inter-chunk decay (T H / chunk^2 per token) is
        # left out: under 1% of the rest below 64K positions.
        return 6 * chunk * h + 4 * h * r * n / chunk + 4 * h * n + 10 * h * r

    def random_inputs(self, dims, batch, steps, *, device="cpu", seed=0):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        h, r, n, g = dims.heads, dims.rows, dims.state_dim, dims.groups

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device)

        dt = torch.rand(batch, steps, h, generator=gen).mul(0.1).add(1e-3).to(device)
        a = -torch.arange(1, h + 1, dtype=torch.float32, device=device)
        return Mamba2Inputs(rand(batch, steps, h, r), dt, rand(batch, steps, g, n), rand(batch, steps, g, n), a,
                            torch.ones(h, device=device)).validate()  # fmt: skip


    def config_layout(self, text_config):
        t = text_config
        return (t.mamba_num_heads, t.mamba_head_dim, t.ssm_state_size), t.n_groups


MAMBA2 = register(Mamba2())


def mamba2_emulation_step(s_ref, s_var, a, dt, x, xb, b, bb, c, d, write, store, key):
    """One decode step of the FP32 reference and one variant (state form), Mamba-2.

    s_ref, s_var [B, H, P, N]; a, dt [B, H]; x, xb (buffered x) [B, H, P]; b, bb (buffered B), c
    [B, H, N]; d [H]; write bool [B]; store: the variant's store (``replay.naive.StateStore``: (state, key) ->
    stored FP32 values); key: its stream key. Returns (s_ref, s_var, metrics [B, H, 4]). The per-step function of
    the benchmark's eager and compiled peers (`step_args` gives its arguments); the kernels follow it op for op.
    """
    s_ref, y_ref = mamba2_advance(s_ref, a, dt, x, b, c, d, x)
    s_var, y_var = mamba2_advance(s_var, a, dt, xb, bb, c, d, x)
    s_var = torch.where(write[:, None, None, None], store(s_var, key), s_var)
    return s_ref, s_var, step_metrics(s_var, s_ref, y_var, y_ref)
