"""Where a transformers SSM mixer's recurrence inputs can be read, through torch's module hooks only.

A tap describes one mixer layout by its public submodules and parameters, never by a private function of a
modeling file (those change their wrapping and calling convention between releases):

- ``recorded``: the submodules whose forward outputs capture records (the mixer's input projections, and KDA's
  forget gate, whose output is the per-channel log decay g);
- ``derive``: from those outputs and the mixer's public parameters, what the recurrence consumes, computed as
  the mixer's torch path does: the causal depthwise conv with its activation in the conv weight's dtype, then
  dt = clamp(softplus(dt_raw + dt_bias), time_step_limit) (Mamba-2, in fp32 as the kernels do),
  g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) (GDN), and the q / k normalisation of the
  kind (``qk_norm``) with q scaled by 1 / sqrt(Dk);
- ``norm``: the gated norm whose first input is the layer's own scan output (Mamba-2 including the D skip term).
  Capture compares the FP32 recurrence on the derived inputs with it, so a layout that changed under a new
  transformers release is an error naming the layer, never a silently different input.

Layouts (transformers 5.24 and 5.25 lay them out alike): NemotronH ``in_proj`` -> [gate, x B C, dt];
Qwen3.5 (dense and MoE) ``in_proj_qkv``, ``in_proj_a``, ``in_proj_b``; Qwen3-Next ``in_proj_qkvz`` and
``in_proj_ba``, reordered by the mixer's own ``fix_query_key_value_ordering``; GLM-5.3-Flash and Kimi-Linear
``q_proj``, ``k_proj``, ``v_proj`` through one conv, ``forget_gate`` and ``b_proj``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .qk_norm import kda_l2norm, l2norm

Recorded = dict[str, torch.Tensor]


def causal_conv(mixer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The mixer's causal depthwise conv and activation over [B, T, C] (returns [B, T, C] in x's dtype), computed
    as transformers' torch path ``causal_conv1d_fn`` does: in the conv weight's dtype, left padding K - 1."""
    from transformers.activations import ACT2FN  # with the model: transformers is imported by then

    conv = mixer.conv1d
    steps = x.shape[1]
    out = F.conv1d(
        x.transpose(1, 2).to(conv.weight.dtype),
        conv.weight,
        conv.bias,
        padding=conv.weight.shape[-1] - 1,
        groups=conv.weight.shape[0],
    )[..., :steps]
    out = ACT2FN[mixer.activation](out)
    return out.to(x.dtype).transpose(1, 2)


def _delta_rule(q, k, v, g, beta, norm) -> dict:
    """q / k in fp32, normalised by the kind's ``norm``, q scaled by 1 / sqrt(Dk) (the mixers pass
    use_qk_l2norm_in_kernel=True)."""
    q, k = norm(q.float()), norm(k.float())
    return {"q": q * q.shape[-1] ** -0.5, "k": k, "v": v, "g": g, "beta": beta, "initial_state": None}


def _heads(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.reshape(t.shape[0], t.shape[1], -1, dim)


def _nemotron_h(m, rec: Recorded) -> dict:
    gate_x_bc_dt = rec["in_proj"]  # [B, T, I + conv_dim + H]
    _, x_bc, dt_raw = gate_x_bc_dt.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    x_bc = causal_conv(m, x_bc)
    gn = m.n_groups * m.ssm_state_size
    x, b, c = x_bc.split([m.intermediate_size, gn, gn], dim=-1)
    lo, hi = m.time_step_limit
    dt = F.softplus(dt_raw.float() + m.dt_bias.float()).clamp(min=lo, max=hi)
    return {
        "x": _heads(x, m.head_dim),
        "dt": dt,
        "B": _heads(b, m.ssm_state_size),
        "C": _heads(c, m.ssm_state_size),
        "A": -torch.exp(m.A_log.float()),
        "D": m.D.float().reshape(m.num_heads),
        "initial_state": None,
    }


def _gdn_gates(m, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias), b.sigmoid()


def _qwen3_5(m, rec: Recorded) -> dict:
    qkv = causal_conv(m, rec["in_proj_qkv"])
    q, k, v = qkv.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    g, beta = _gdn_gates(m, rec["in_proj_a"], rec["in_proj_b"])
    return _delta_rule(_heads(q, m.head_k_dim), _heads(k, m.head_k_dim), _heads(v, m.head_v_dim), g, beta, l2norm)


def _qwen3_next(m, rec: Recorded) -> dict:
    q, k, v, _, b, a = m.fix_query_key_value_ordering(rec["in_proj_qkvz"], rec["in_proj_ba"])
    qkv = causal_conv(m, torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v)], dim=-1))
    q, k, v = qkv.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    g, beta = _gdn_gates(m, a, b)
    return _delta_rule(_heads(q, m.head_k_dim), _heads(k, m.head_k_dim), _heads(v, m.head_v_dim), g, beta, l2norm)


def _kimi_delta(m, rec: Recorded) -> dict:
    qkv = causal_conv(m, torch.cat([rec["q_proj"], rec["k_proj"], rec["v_proj"]], dim=-1))
    q, k, v = (_heads(t, m.head_dim) for t in qkv.split([m.qkv_dim] * 3, dim=-1))
    return _delta_rule(q, k, v, rec["forget_gate"].float(), torch.sigmoid(rec["b_proj"]), kda_l2norm)


@dataclass(frozen=True)
class MixerTap:
    """One mixer layout: the submodules to record, the derivation of the recurrence inputs, the gated norm."""

    family: str
    kind: str  # the family's registered layer kind
    recorded: tuple[str, ...]
    norm: str
    derive: Callable[[torch.nn.Module, Recorded], dict]
    attributes: tuple[str, ...]  # the public attributes ``derive`` reads besides the recorded submodules

    def missing(self, mixer: torch.nn.Module) -> list[str]:
        """The attributes of this layout that ``mixer`` lacks (empty: the tap applies)."""
        return [
            a for a in (*self.recorded, self.norm, "conv1d", "activation", *self.attributes) if not hasattr(mixer, a)
        ]


TAPS: tuple[MixerTap, ...] = (
    MixerTap(
        "nemotron_h", "mamba2", ("in_proj",), "norm", _nemotron_h,
        ("intermediate_size", "conv_dim", "num_heads", "head_dim", "n_groups", "ssm_state_size", "time_step_limit",
         "dt_bias", "A_log", "D"),
    ),
    MixerTap(
        "qwen3_next", "gdn", ("in_proj_qkvz", "in_proj_ba"), "norm", _qwen3_next,
        ("fix_query_key_value_ordering", "key_dim", "value_dim", "head_k_dim", "head_v_dim", "A_log", "dt_bias"),
    ),
    MixerTap(
        "qwen3_5", "gdn", ("in_proj_qkv", "in_proj_a", "in_proj_b"), "norm", _qwen3_5,
        ("key_dim", "value_dim", "head_k_dim", "head_v_dim", "A_log", "dt_bias"),
    ),
    MixerTap(
        "kimi_delta", "kda", ("q_proj", "k_proj", "v_proj", "forget_gate", "b_proj"), "o_norm", _kimi_delta,
        ("qkv_dim", "head_dim"),
    ),
)  # fmt: skip


def tap_for(kind: str, mixer: torch.nn.Module) -> MixerTap | None:
    """The tap of ``kind`` whose layout ``mixer`` has, or None."""
    for tap in TAPS:
        if tap.kind == kind and not tap.missing(mixer):
            return tap
    return None


def listen(mixer: torch.nn.Module, tap: MixerTap, at_norm: Callable[[Recorded, tuple], tuple | None]) -> list:
    """Hook ``mixer`` as ``tap`` reads it: forward hooks record the outputs of ``tap.recorded``, and a forward
    pre-hook on ``tap.norm`` calls ``at_norm(recorded, norm_args)`` (the norm's first argument is the layer's own scan
    output), then forgets the recorded outputs. ``at_norm`` may return replacement arguments for the norm (torch's
    pre-hook contract: None keeps them). Returns the hook handles, for the caller to remove."""
    recorded: Recorded = {}

    def before_norm(_m, args):
        try:
            return at_norm(recorded, args)
        finally:
            recorded.clear()

    handles = [
        getattr(mixer, n).register_forward_hook(lambda _m, _a, output, n=n: recorded.__setitem__(n, output))
        for n in tap.recorded
    ]
    handles.append(getattr(mixer, tap.norm).register_forward_pre_hook(before_norm))
    return handles


def expected_layouts(kind: str) -> str:
    """The layouts of ``kind`` capture reads, for error messages: "family (attr, attr, ...)"."""
    return "; ".join(f"{t.family} ({', '.join((*t.recorded, t.norm))})" for t in TAPS if t.kind == kind)


__all__ = ["TAPS", "MixerTap", "causal_conv", "expected_layouts", "listen", "tap_for"]
