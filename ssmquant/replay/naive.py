"""Naive torch references that emulate stored-state formats under decoding schemes.

Two forms, equal in exact arithmetic (tests prove they agree in FP32):

- state form (`form="state"`, the default and what the Triton kernels mirror op for op): the
  variant keeps its effective state S~ and advances it every step with the buffered (buffer-dtype
  rounded) inputs; at a write step S~ is replaced by its stored (rounded) value.
- literal form (`form="literal"`): the engines' checkpoint-plus-buffer computation. Mamba-2 outputs
  come from the output-only form y_t = abar_t (S0 C_t) + sum_j s_jt (B_j . C_t) x_j + D x_t; GDN
  rebuilds the state from the checkpoint and the buffered (u_j, k_j, g_j) at every step, and KDA
  the same with g_j a vector over the key channels. The checkpoint is rewritten (and rounded) at
  write steps from the rebuilt state.

What a KDA replay buffer holds follows the engines' RecoverSSM records: the corrected values
u_j = beta_j (v_j - S k_j), the normalised key k_j and the gate (vLLM
vllm/models/kimi_k3/nvidia/ops/recoverssm.py, `_kda_recoverssm_verify_kernel`: u in an fp32 record,
raw k | raw gate in the activation dtype; FlashInfer flashinfer/kda_kernels/kda_decode_wy_output_only.py,
grouped emit path: u and the normalised k in bf16, the raw gate as given). The gate is recomputed from
the model's own activation in both, so it is never rounded here; u and k are rounded to the scheme's
buffer dtype (":fp32" reproduces vLLM's records, the default bf16 FlashInfer's).

Conventional decoding is the state form with a write after every step and no buffer rounding. The
output at step t is computed from the unrounded new state (a decode kernel computes y from the state
in registers, then stores the state): rounding at step t affects outputs from step t+1 on.

At every step, per (batch, head), four metrics are kept: squared error and squared reference norm of
the state (Frobenius over [rows, state_dim]) and of the output (over rows). `simulate` reduces them into
window statistics (`trace.py`); nothing is sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import Encoding, Rounding, StateFormat
from ..formats.codec import element_index, encode
from ..formats.random import keyed_bits, stream_key, uniform_from_bits
from .inputs import KDAInputs, LayerInputs, Mamba2Inputs, is_validated
from .reference import (
    expand_groups,
    gdn_decays,
    gdn_delta,
    gdn_output,
    kda_decay,
    kda_decays,
    mamba2_decays,
    mamba2_output,
    mamba2_step,
)
from .variants import Variant

FORMS = ("state", "literal")


class StateStore:
    """Fake-quantizes a variant's state at write steps, with trusted inputs and no host syncs.

    For a state [B, H, rows, state_dim] this returns the FP32 values the format would store; the
    stochastic-rounding stream of the write after step t is t, its counter the flat element index.
    """

    def __init__(self, fmt: StateFormat, shape: tuple[int, ...], device, seed: int, static_scale=None):
        self.fmt = fmt
        self.seed = seed
        self.static = None
        if static_scale is not None:
            group = (*shape[:-2], shape[-2] // fmt.granularity.group_rows(shape[-2]))
            static_scale = static_scale.to(device=device, dtype=torch.float32)
            self.static = static_scale.expand(group)
        self.index = element_index(shape, device) if fmt.rounding is Rounding.SR else None

    def key(self, stream: int) -> torch.Tensor:
        """The stream key of the write after step `stream`, as a 0-d int64 tensor (compile-friendly)."""
        return torch.tensor(stream_key(self.seed, stream), dtype=torch.int64)

    def __call__(self, x: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
        """Stored FP32 values of x [B, H, rows, state_dim]; key: this write's `stream_key`."""
        if self.fmt.encoding is Encoding.FP32:
            return x
        bits = uniform = None
        if self.index is not None:
            bits = keyed_bits(key, self.index)
            uniform = uniform_from_bits(bits)
        return encode(self.fmt, x, static_scale=self.static, uniform=uniform, bits=bits).decode(self.fmt)


@dataclass
class EmulationResult:
    """Output of `emulate`.

    metrics: FP32 [V, T, B, H, 4] with METRIC_NAMES along the last dim, at every step;
    steps: int64 [T], the 1-based step numbers (tokens decoded);
    outputs / states: per variant [B, T, H, rows] / [B, T, H, rows, state_dim] when requested;
    final_states: per variant [B, H, rows, state_dim], the emulated state after the last step;
    ref_outputs / ref_states: the FP32 reference, when requested.
    """

    metrics: torch.Tensor
    steps: torch.Tensor
    final_states: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None
    states: list[torch.Tensor] | None = None
    ref_outputs: torch.Tensor | None = None
    ref_states: torch.Tensor | None = None


def _buffer_round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round buffered inputs to the buffer dtype (torch's RNE cast), back to FP32."""
    return t if dtype == torch.float32 else t.to(dtype).float()


def _metrics(s_var, s_ref, y_var, y_ref) -> torch.Tensor:
    """[B, H, 4] squared errors and reference norms (FP32, summed over rows and state_dim)."""
    ds, dy = s_var - s_ref, y_var - y_ref
    return torch.stack(
        [(ds * ds).sum((-1, -2)), (s_ref * s_ref).sum((-1, -2)), (dy * dy).sum(-1), (y_ref * y_ref).sum(-1)], -1
    )


def mamba2_advance(s, a, dt, x_state, b_state, c, d, x):
    """One Mamba-2 step from state s [B, H, P, N]: returns (new state, y [B, H, P]).

    a, dt [B, H]; x_state [B, H, P] and b_state [B, H, N] are the inputs as stored (buffered inputs
    for replay); c [B, H, N]; d [H]; x [B, H, P] the current input for the skip term.
    """
    s = mamba2_step(s, a, dt[..., None] * x_state, b_state)
    return s, mamba2_output(s, c, d, x)


def gdn_advance(s, alpha, k, v, beta, q, buffer_dtype: torch.dtype = torch.float32):
    """One Gated DeltaNet step from state s [B, H, Dv, Dk]: returns (new state, y [B, H, Dv]).

    alpha, beta [B, H]; k (as buffered), q [B, H, Dk]; v [B, H, Dv]; the corrected value u is
    stored in `buffer_dtype` before it updates the state (replay buffers u, not v).
    """
    return _delta_rule(alpha[..., None, None] * s, k, v, beta, q, buffer_dtype)


def _delta_rule(s, k, v, beta, q, buffer_dtype):
    """The delta-rule update of an already decayed state s [B, H, Dv, Dk] (GDN and KDA alike): u in
    `buffer_dtype`, S + u k^T, and y = S^T q."""
    u = _buffer_round(gdn_delta(s, k, v, beta), buffer_dtype)
    s = s + u[..., None] * k[:, :, None, :]
    return s, gdn_output(s, q)


def kda_advance(s, alpha, k, v, beta, q, buffer_dtype: torch.dtype = torch.float32):
    """One Kimi Delta Attention step from state s [B, H, Dv, Dk]: returns (new state, y [B, H, Dv]).

    alpha [B, H, Dk] (per-key-channel decay exp(g)); beta [B, H]; k (as buffered), q [B, H, Dk];
    v [B, H, Dv]; u is stored in `buffer_dtype` before it updates the state, as for GDN.
    """
    return _delta_rule(kda_decay(s, alpha), k, v, beta, q, buffer_dtype)


def mamba2_emulation_step(s_ref, s_var, a, dt, x, xb, b, bb, c, d, write, store, key):
    """One decode step of the FP32 reference and one variant (state form), Mamba-2.

    s_ref, s_var [B, H, P, N]; a, dt [B, H]; x, xb (buffered x) [B, H, P]; b, bb (buffered B), c
    [B, H, N]; d [H]; write bool [B]; store: the variant's StateStore; key: its stream key.
    Returns (s_ref, s_var, metrics [B, H, 4]). This is the per-step function of the benchmark's
    eager and compiled peers; the kernels follow it op for op.
    """
    s_ref, y_ref = mamba2_advance(s_ref, a, dt, x, b, c, d, x)
    s_var, y_var = mamba2_advance(s_var, a, dt, xb, bb, c, d, x)
    s_var = torch.where(write[:, None, None, None], store(s_var, key), s_var)
    return s_ref, s_var, _metrics(s_var, s_ref, y_var, y_ref)


def gdn_emulation_step(s_ref, s_var, alpha, q, k, kb, v, beta, write, store, key, buffer_dtype):
    """One decode step of the FP32 reference and one variant (state form), Gated DeltaNet.

    s_ref, s_var [B, H, Dv, Dk]; alpha, beta [B, H]; q, k, kb (buffered k) [B, H, Dk]; v [B, H, Dv];
    write bool [B]; buffer_dtype: the dtype u is buffered in. Returns (s_ref, s_var, metrics [B, H, 4]).
    """
    s_ref, y_ref = gdn_advance(s_ref, alpha, k, v, beta, q)
    s_var, y_var = gdn_advance(s_var, alpha, kb, v, beta, q, buffer_dtype)
    s_var = torch.where(write[:, None, None, None], store(s_var, key), s_var)
    return s_ref, s_var, _metrics(s_var, s_ref, y_var, y_ref)


def kda_emulation_step(s_ref, s_var, alpha, q, k, kb, v, beta, write, store, key, buffer_dtype):
    """One decode step of the FP32 reference and one variant (state form), Kimi Delta Attention.

    s_ref, s_var [B, H, Dv, Dk]; alpha [B, H, Dk]; beta [B, H]; q, k, kb (buffered k) [B, H, Dk];
    v [B, H, Dv]; write bool [B]; buffer_dtype: the dtype u is buffered in. Returns (s_ref, s_var,
    metrics [B, H, 4]).
    """
    s_ref, y_ref = kda_advance(s_ref, alpha, k, v, beta, q)
    s_var, y_var = kda_advance(s_var, alpha, kb, v, beta, q, buffer_dtype)
    s_var = torch.where(write[:, None, None, None], store(s_var, key), s_var)
    return s_ref, s_var, _metrics(s_var, s_ref, y_var, y_ref)


def emulate(
    inputs: LayerInputs,
    variants: list[Variant],
    *,
    form: str = "state",
    return_outputs: bool = False,
    return_states: bool = False,
) -> EmulationResult:
    """Run the FP32 reference and every variant over all T steps of one layer, in torch.

    inputs: Mamba2Inputs, GDNInputs or KDAInputs (validated here, unless `is_validated`). Returns an EmulationResult whose
    metrics hold every step ([V, T, B, H, 4]).
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if not is_validated(inputs):  # (unchanged since it passed: not again)
        inputs.validate()
    if isinstance(inputs, Mamba2Inputs):
        runner = _Mamba2Emulation(inputs, variants, form)
    elif isinstance(inputs, KDAInputs):
        runner = _KDAEmulation(inputs, variants, form)
    else:
        runner = _GDNEmulation(inputs, variants, form)
    return runner.run(return_outputs, return_states)


class _Emulation:
    """The shared time loop; subclasses supply the per-step physics of one layer kind."""

    def __init__(self, inputs: LayerInputs, variants: list[Variant], form: str):
        self.inputs, self.variants, self.form = inputs, variants, form
        self.shape = inputs.state_shape
        bsz, steps = inputs.batch, inputs.steps
        dev = inputs.device
        self.masks = [v.scheme.write_mask(bsz, steps).to(dev) for v in variants]
        self.any_write = [m.any(0).tolist() for m in self.masks]
        self.stores = [StateStore(v.format, self.shape, dev, v.seed, v.static_scale) for v in variants]
        init = inputs.initial_state
        self.s0 = torch.zeros(self.shape, device=dev) if init is None else init.float().clone()

    def run(self, return_outputs, return_states) -> EmulationResult:
        inp = self.inputs
        bsz, steps, heads, rows = inp.batch, inp.steps, inp.num_heads, inp.rows
        dev = inp.device
        metrics = torch.full((len(self.variants), steps, bsz, heads, 4), float("nan"), device=dev)
        outs = [torch.empty(bsz, steps, heads, rows, device=dev) for _ in self.variants] if return_outputs else None
        sts = [torch.empty(bsz, steps, *self.shape[1:], device=dev) for _ in self.variants] if return_states else None
        ref_out = torch.empty(bsz, steps, heads, rows, device=dev) if return_outputs else None
        ref_st = torch.empty(bsz, steps, *self.shape[1:], device=dev) if return_states else None
        self.start()
        last = [None] * len(self.variants)
        for t in range(steps):
            s_ref, y_ref = self.ref_step(t)
            for i in range(len(self.variants)):
                s_var, y_var = self.variant_step(i, t)
                last[i] = s_var
                metrics[i, t] = _metrics(s_var, s_ref, y_var, y_ref)
                if outs is not None:
                    outs[i][:, t] = y_var
                if sts is not None:
                    sts[i][:, t] = s_var
            if ref_out is not None:
                ref_out[:, t] = y_ref
            if ref_st is not None:
                ref_st[:, t] = s_ref
        steps_1based = torch.arange(1, steps + 1, dtype=torch.int64)
        return EmulationResult(metrics, steps_1based, last, outs, sts, ref_out, ref_st)

    def write(self, i: int, t: int, s: torch.Tensor) -> torch.Tensor:
        """Store s (rounded) where variant i writes after step t; unchanged elsewhere."""
        if not self.any_write[i][t]:
            return s
        stored = self.stores[i](s, stream_key(self.variants[i].seed, t))
        return torch.where(self.masks[i][:, t, None, None, None], stored, s)


def _engine_step(runner, i: int):
    """The engine profile's step object of variant i (`ssmquant.engines.emulation`), None for the ideal arithmetic."""
    from ..engines.profiles import arithmetic

    kind = arithmetic(runner.variants[i].engine, runner.inputs.kind)
    if kind == "ideal":
        return None
    from ..engines.emulation import Mamba2EngineStep, Mamba2SSUStep

    return Mamba2SSUStep(runner, i) if kind == "triton_ssu" else Mamba2EngineStep(runner, i)


class _Mamba2Emulation(_Emulation):
    def start(self):
        inp, heads = self.inputs, self.inputs.num_heads
        self.a = mamba2_decays(inp)  # [B, T, H]
        self.x = inp.x.float()
        self.dt = inp.dt.float()
        self.b = expand_groups(inp.B.float(), heads)
        self.c = expand_groups(inp.C.float(), heads)
        self.d = inp.D.float()
        self.A = inp.A.float()
        self.s_ref = self.s0.clone()
        # Buffered inputs as each variant stores them (rounded to its buffer dtype).
        self.xb, self.bb = [], []
        for v in self.variants:
            dtype = v.scheme.buffer_torch_dtype if v.scheme.rounds_buffer else torch.float32
            self.xb.append(_buffer_round(inp.x.float(), dtype))
            self.bb.append(expand_groups(_buffer_round(inp.B.float(), dtype), heads))
        self.s_var = [self.s0.clone() for _ in self.variants]
        if self.form == "literal":
            cap = max(v.scheme.buffer_len for v in self.variants)
            bsz = inp.batch
            self.held = [torch.zeros(bsz, dtype=torch.int64, device=inp.device) for _ in self.variants]
            self.buf_idx = [torch.zeros(bsz, cap, dtype=torch.int64, device=inp.device) for _ in self.variants]
            self.cap = cap
        # a variant under an engine profile other than `ideal` steps as that engine computes
        self.engine = [_engine_step(self, i) for i in range(len(self.variants))]

    def ref_step(self, t):
        x = self.x[:, t]
        self.s_ref, y = mamba2_advance(
            self.s_ref, self.a[:, t], self.dt[:, t], x, self.b[:, t], self.c[:, t], self.d, x
        )
        return self.s_ref, y

    def variant_step(self, i, t):
        if self.engine[i] is not None:
            self.s_var[i], y = self.engine[i].step(t)
            return self.s_var[i], y
        if self.form == "literal":
            return self._literal_step(i, t)
        s, y = mamba2_advance(
            self.s_var[i],
            self.a[:, t],
            self.dt[:, t],
            self.xb[i][:, t],
            self.bb[i][:, t],
            self.c[:, t],
            self.d,
            self.x[:, t],
        )
        self.s_var[i] = self.write(i, t, s)
        return self.s_var[i], y

    def _literal_step(self, i, t):
        """Checkpoint + buffer: output-only form for y, rebuilt state for the metrics and flushes."""
        bsz = self.inputs.batch
        ar = torch.arange(bsz, device=self.s0.device)
        held = self.held[i]
        self.buf_idx[i][ar, held] = t
        held = held + 1
        j = torch.arange(self.cap, device=self.s0.device)
        valid = j[None, :] < held[:, None]  # [B, cap]
        steps_idx = self.buf_idx[i]  # [B, cap] step of each buffered entry
        dt_buf = torch.where(valid[..., None], self.dt[ar[:, None], steps_idx], 0.0)  # [B, cap, H]
        pre = torch.cumsum(dt_buf, 1)  # [B, cap, H]
        pre_t = pre[ar, held - 1]  # [B, H]
        abar = torch.exp(self.A * pre_t)  # [B, H]
        s_jt = dt_buf * torch.exp(self.A * (pre_t[:, None] - pre))  # [B, cap, H]
        s_jt = torch.where(valid[..., None], s_jt, 0.0)
        x_buf = self.xb[i][ar[:, None], steps_idx]  # [B, cap, H, P]
        b_buf = self.bb[i][ar[:, None], steps_idx]  # [B, cap, H, N]
        c_t = self.c[:, t]  # [B, H, N]
        s0 = self.s_var[i]  # the checkpoint
        s0c = (s0 * c_t[:, :, None, :]).sum(-1)  # [B, H, P]
        bc = (b_buf * c_t[:, None]).sum(-1)  # [B, cap, H]
        y = abar[..., None] * s0c + ((s_jt * bc)[..., None] * x_buf).sum(1) + self.d[None, :, None] * self.x[:, t]
        rebuilt = abar[..., None, None] * s0 + torch.einsum("bjh,bjhp,bjhn->bhpn", s_jt, x_buf, b_buf)
        flush = self.masks[i][:, t]
        stored = self.write(i, t, rebuilt)
        self.s_var[i] = torch.where(flush[:, None, None, None], stored, s0)
        self.held[i] = torch.where(flush, 0, held)
        return stored, y


class _GDNEmulation(_Emulation):
    def start(self):
        inp, heads = self.inputs, self.inputs.num_heads
        self.alpha = gdn_decays(inp)  # [B, T, Hv]
        self.g = inp.g.float()
        self.q = expand_groups(inp.q.float(), heads)
        self.k = expand_groups(inp.k.float(), heads)
        self.v = inp.v.float()
        self.beta = inp.beta.float()
        self.s_ref = self.s0.clone()
        self.kb, self.buf_dtype = [], []
        for var in self.variants:
            dtype = var.scheme.buffer_torch_dtype if var.scheme.rounds_buffer else torch.float32
            self.buf_dtype.append(dtype)
            self.kb.append(expand_groups(_buffer_round(inp.k.float(), dtype), heads))
        self.s_var = [self.s0.clone() for _ in self.variants]
        if self.form == "literal":
            bsz, dev = inp.batch, inp.device
            cap = max(v.scheme.buffer_len for v in self.variants)
            self.cap = cap
            self.held = [torch.zeros(bsz, dtype=torch.int64, device=dev) for _ in self.variants]
            self.buf_idx = [torch.zeros(bsz, cap, dtype=torch.int64, device=dev) for _ in self.variants]
            self.u_buf = [torch.zeros(bsz, cap, heads, inp.rows, device=dev) for _ in self.variants]

    # the one difference KDA makes to these steps is how a decay applies (per head / per key channel)
    advance = staticmethod(gdn_advance)

    @staticmethod
    def decay(s, alpha):
        """s [B, H, Dv, Dk] decayed by alpha [B, H]."""
        return alpha[..., None, None] * s

    def ref_step(self, t):
        self.s_ref, y = self.advance(
            self.s_ref, self.alpha[:, t], self.k[:, t], self.v[:, t], self.beta[:, t], self.q[:, t]
        )
        return self.s_ref, y

    def variant_step(self, i, t):
        if self.form == "literal":
            return self._literal_step(i, t)
        s, y = self.advance(
            self.s_var[i],
            self.alpha[:, t],
            self.kb[i][:, t],
            self.v[:, t],
            self.beta[:, t],
            self.q[:, t],
            self.buf_dtype[i],
        )
        self.s_var[i] = self.write(i, t, s)
        return self.s_var[i], y

    def _rebuild(self, i, s0, held):
        """State from checkpoint + the first `held` buffered entries: [B, H, Dv, Dk].

        S = exp(G_h) S0 + sum_j exp(G_h - G_j) u_j k_j^T with G the running sum of buffered g.
        """
        bsz = self.inputs.batch
        ar = torch.arange(bsz, device=s0.device)
        j = torch.arange(self.cap, device=s0.device)
        valid = j[None, :] < held[:, None]  # [B, cap]
        idx = self.buf_idx[i]
        g_buf = torch.where(valid[..., None], self.g[ar[:, None], idx], 0.0)  # [B, cap, H]
        big_g = torch.cumsum(g_buf, 1)
        g_h = torch.where(held[:, None] > 0, big_g[ar, (held - 1).clamp(min=0)], 0.0)  # [B, H]
        w = torch.where(valid[..., None], torch.exp(g_h[:, None] - big_g), 0.0)  # [B, cap, H]
        k_buf = self.kb[i][ar[:, None], idx]  # [B, cap, H, Dk]
        return torch.exp(g_h)[..., None, None] * s0 + torch.einsum("bjh,bjhv,bjhk->bhvk", w, self.u_buf[i], k_buf)

    def _literal_step(self, i, t):
        bsz = self.inputs.batch
        ar = torch.arange(bsz, device=self.s0.device)
        s0, held = self.s_var[i], self.held[i]
        prev = self._rebuild(i, s0, held)  # S_{t-1} from checkpoint + buffer
        k = self.kb[i][:, t]
        decayed = self.decay(prev, self.alpha[:, t])
        u = _buffer_round(gdn_delta(decayed, k, self.v[:, t], self.beta[:, t]), self.buf_dtype[i])
        self.buf_idx[i][ar, held] = t
        self.u_buf[i][ar, held] = u
        held = held + 1
        rebuilt = self._rebuild(i, s0, held)
        y = gdn_output(rebuilt, self.q[:, t])
        flush = self.masks[i][:, t]
        stored = self.write(i, t, rebuilt)
        self.s_var[i] = torch.where(flush[:, None, None, None], stored, s0)
        self.held[i] = torch.where(flush, 0, held)
        return stored, y


class _KDAEmulation(_GDNEmulation):
    """GDN's emulation with the decay applied per key channel: alpha and g are [B, T, H, Dk]."""

    advance = staticmethod(kda_advance)
    decay = staticmethod(kda_decay)  # s [B, H, Dv, Dk] decayed per key channel by alpha [B, H, Dk]

    def start(self):
        super().start()
        self.alpha = kda_decays(self.inputs)  # [B, T, Hv, Dk]

    def _rebuild(self, i, s0, held):
        """State from checkpoint + the first `held` buffered entries: [B, H, Dv, Dk].

        S = diag(exp(G_h)) S0 + sum_j u_j (k_j * exp(G_h - G_j))^T, G the running per-key-channel sum of
        the buffered g (vLLM's RecoverSSM commit folds the same terms, one step at a time).
        """
        bsz = self.inputs.batch
        ar = torch.arange(bsz, device=s0.device)
        j = torch.arange(self.cap, device=s0.device)
        valid = j[None, :] < held[:, None]  # [B, cap]
        idx = self.buf_idx[i]
        g_buf = torch.where(valid[..., None, None], self.g[ar[:, None], idx], 0.0)  # [B, cap, H, Dk]
        big_g = torch.cumsum(g_buf, 1)
        g_h = torch.where(held[:, None, None] > 0, big_g[ar, (held - 1).clamp(min=0)], 0.0)  # [B, H, Dk]
        w = torch.where(valid[..., None, None], torch.exp(g_h[:, None] - big_g), 0.0)  # [B, cap, H, Dk]
        k_buf = self.kb[i][ar[:, None], idx]  # [B, cap, H, Dk]
        return kda_decay(s0, torch.exp(g_h)) + torch.einsum("bjhv,bjhk->bhvk", self.u_buf[i], w * k_buf)
