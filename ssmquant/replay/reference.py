"""Plain FP32 decode recurrences of Mamba-2, Gated DeltaNet and Kimi Delta Attention (no format, no scheme).

These are the ground truth that every emulated variant is compared with, and the functions that the
oracle tests check against transformers' own decode paths. The per-step arithmetic is shared with the
emulating references in `naive.py` through `mamba2_step`, `gdn_delta` / `gdn_output` and `kda_decay`,
so that a variant in format fp32 reproduces this reference bit for bit. KDA is GDN's delta rule with
the decay applied per key channel (the last dim of our [Dv, Dk] state), as transformers'
`recurrent_kimi_delta_attention` (models/glm5_next, models/kimi_linear, 5.24) does it.
"""

from __future__ import annotations

import torch

from .inputs import GDNInputs, KDAInputs, LayerInputs, Mamba2Inputs, is_validated


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, T, G, N] -> [B, T, H, N]: head h reads group h // (H // G) (transformers' repeat_interleave)."""
    return t.repeat_interleave(num_heads // t.shape[2], dim=2)


def mamba2_decays(inputs: Mamba2Inputs) -> torch.Tensor:
    """Per-step decay a_t = exp(dt_t * A_h), fp32 [B, T, H].

    Computed once, outside the time loop, and shared by every backend: the kernels receive it as an
    input so that all backends apply bit-identical decays.
    """
    return torch.exp(inputs.dt.float() * inputs.A.float())


def gdn_decays(inputs: GDNInputs) -> torch.Tensor:
    """Per-step decay alpha_t = exp(g_t), fp32 [B, T, Hv] (see `mamba2_decays`)."""
    return torch.exp(inputs.g.float())


def kda_decays(inputs: KDAInputs) -> torch.Tensor:
    """Per-step, per-key-channel decay exp(g_t), fp32 [B, T, Hv, Dk] (see `mamba2_decays`)."""
    return torch.exp(inputs.g.float())


def kda_decay(state: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """diag(alpha) S in transformers' [Dk, Dv] layout, i.e. our [Dv, Dk] state scaled along its last dim.

    state [B, H, Dv, Dk], alpha [B, H, Dk] -> [B, H, Dv, Dk].
    """
    return state * alpha[:, :, None, :]


def mamba2_step(state: torch.Tensor, a: torch.Tensor, dtx: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One Mamba-2 state update S <- a * S + (dt * x) B^T, fp32.

    state [B, H, P, N], a [B, H], dtx [B, H, P] (= dt * x), b [B, H, N]. Returns the new state.
    The order (a * S first, the outer product second, one add) is the order every backend follows.
    """
    return a[:, :, None, None] * state + dtx[:, :, :, None] * b[:, :, None, :]


def mamba2_output(state: torch.Tensor, c: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y = S C + D x: state [B, H, P, N], c [B, H, N], d [H], x [B, H, P] -> [B, H, P]."""
    return (state * c[:, :, None, :]).sum(-1) + d[None, :, None] * x


def gdn_delta(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Corrected value u = beta * (v - S k) of the delta rule, fp32.

    state [B, H, Dv, Dk] (already decayed), k [B, H, Dk], v [B, H, Dv], beta [B, H] -> u [B, H, Dv].
    """
    kv = (state * k[:, :, None, :]).sum(-1)
    return beta[:, :, None] * (v - kv)


def gdn_output(state: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """y = S^T q in transformers' layout, i.e. sum over Dk of our [Dv, Dk] state: -> [B, H, Dv]."""
    return (state * q[:, :, None, :]).sum(-1)


def reference_decode(
    inputs: LayerInputs, *, return_states: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode all T steps in FP32 with no storage rounding.

    Returns (y, final_state, states):
    - Mamba-2: y [B, T, H, P] (including the D skip term), final_state [B, H, P, N]
    - GDN/KDA: y [B, T, Hv, Dv], final_state [B, Hv, Dv, Dk] (transformers' [Dk, Dv] transposed)
    - states:  [B, T, H, rows, state_dim] after every step when return_states, else None.
    The inputs are validated here (unless `is_validated`: unchanged since they passed).
    """
    if not is_validated(inputs):  # (unchanged since it passed: not again)
        inputs.validate()
    bsz, steps, heads, rows, sdim = inputs.batch, inputs.steps, inputs.num_heads, inputs.rows, inputs.state_dim
    dev = inputs.device
    state = (
        torch.zeros(bsz, heads, rows, sdim, device=dev, dtype=torch.float32)
        if inputs.initial_state is None
        else inputs.initial_state.float().clone()
    )
    ys = torch.empty(bsz, steps, heads, rows, device=dev, dtype=torch.float32)
    states = torch.empty(bsz, steps, heads, rows, sdim, device=dev) if return_states else None
    if isinstance(inputs, Mamba2Inputs):
        a_all = mamba2_decays(inputs)
        x_all = inputs.x.float()
        dtx_all = inputs.dt.float()[..., None] * x_all
        b_all = expand_groups(inputs.B.float(), heads)
        c_all = expand_groups(inputs.C.float(), heads)
        d = inputs.D.float()
        for t in range(steps):
            state = mamba2_step(state, a_all[:, t], dtx_all[:, t], b_all[:, t])
            ys[:, t] = mamba2_output(state, c_all[:, t], d, x_all[:, t])
            if states is not None:
                states[:, t] = state
    else:
        alpha_all = kda_decays(inputs) if isinstance(inputs, KDAInputs) else gdn_decays(inputs)[..., None]
        q_all = expand_groups(inputs.q.float(), heads)
        k_all = expand_groups(inputs.k.float(), heads)
        v_all = inputs.v.float()
        beta_all = inputs.beta.float()
        for t in range(steps):
            state = kda_decay(state, alpha_all[:, t])  # GDN: alpha [B, H, 1] broadcasts over Dk
            u = gdn_delta(state, k_all[:, t], v_all[:, t], beta_all[:, t])
            state = state + u[:, :, :, None] * k_all[:, t, :, None, :]
            ys[:, t] = gdn_output(state, q_all[:, t])
            if states is not None:
                states[:, t] = state
    return ys, state, states
