"""Gated DeltaNet (Qwen3.5, Qwen3-Next): the delta rule with one decay per head,

    S_t = exp(g_t) S_{t-1},   g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0

(`delta_rule.py` has the rest). A replay checkpoint rebuilds as S = exp(G_h) S_0 + sum_j exp(G_h - G_j) u_j k_j^T
with G the running sum of the buffered g.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Checks, TransformersFamily, raise_input_error, register
from .delta_rule import DeltaRuleInputs, DeltaRuleKind, delta_rule


@dataclass
class GDNInputs(DeltaRuleInputs):
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
    and the scale reduction runs over Dk, the "row" of a GDN state.
    """

    kind = "gdn"

    def _check_gate(self, checks: Checks, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
        checks.tensor("g", self.g, (b, t, hv), dev)
        checks.rule(lambda: (self.g > 0).any(),
                    lambda: raise_input_error("g must be <= 0 (it is the log of the decay exp(g) in (0, 1])"))  # fmt: skip


def gdn_decays(inputs: GDNInputs) -> torch.Tensor:
    """Per-step decay alpha_t = exp(g_t), fp32 [B, T, Hv]."""
    return torch.exp(inputs.g.float())


def gdn_advance(s, alpha, k, v, beta, q, buffer_dtype: torch.dtype = torch.float32):
    """One Gated DeltaNet step from state s [B, H, Dv, Dk]: returns (new state, y [B, H, Dv]).

    alpha, beta [B, H]; k (as buffered), q [B, H, Dk]; v [B, H, Dv]; the corrected value u is
    stored in `buffer_dtype` before it updates the state (replay buffers u, not v).
    """
    return delta_rule(alpha[..., None, None] * s, k, v, beta, q, buffer_dtype)


class GatedDeltaNet(DeltaRuleKind):
    name = "gdn"
    title = "Gated DeltaNet"
    short = "GDN"
    prefill_scan_kernel = "chunk_gated_delta_rule"
    inputs_type = GDNInputs
    model_names = "Qwen3.5, Qwen3-Next"
    transformers_families = (
        TransformersFamily(
            "qwen3_5",
            ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
            {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_text": "Qwen3_5ForCausalLM"},
        ),
        TransformersFamily(
            "qwen3_5_moe",
            ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
            {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"},
        ),
        TransformersFamily("qwen3_next", ("Qwen3NextForCausalLM",), {"qwen3_next": "Qwen3NextForCausalLM"}),
    )
    mixer_class_suffixes = ("GatedDeltaNet",)

    def decays(self, inputs):
        return gdn_decays(inputs)

    @staticmethod
    def decay(s, alpha):
        """s [B, H, Dv, Dk] decayed by alpha [B, H]."""
        return alpha[..., None, None] * s

    def rebuild(self, s0, held, buf_idx, u_buf, kb, g, cap):
        bsz = s0.shape[0]
        ar = torch.arange(bsz, device=s0.device)
        j = torch.arange(cap, device=s0.device)
        valid = j[None, :] < held[:, None]  # [B, cap]
        g_buf = torch.where(valid[..., None], g[ar[:, None], buf_idx], 0.0)  # [B, cap, H]
        big_g = torch.cumsum(g_buf, 1)
        g_h = torch.where(held[:, None] > 0, big_g[ar, (held - 1).clamp(min=0)], 0.0)  # [B, H]
        w = torch.where(valid[..., None], torch.exp(g_h[:, None] - big_g), 0.0)  # [B, cap, H]
        k_buf = kb[ar[:, None], buf_idx]  # [B, cap, H, Dk]
        return torch.exp(g_h)[..., None, None] * s0 + torch.einsum("bjh,bjhv,bjhk->bhvk", w, u_buf, k_buf)

    def random_gate(self, batch, steps, dims, gen, device):
        return -torch.rand(batch, steps, dims.heads, generator=gen).to(device)

    def config_layout(self, text_config):
        t = text_config  # value heads x value dim x key dim; the key heads are the q / k groups
        return (t.linear_num_value_heads, t.linear_value_head_dim, t.linear_key_head_dim), t.linear_num_key_heads


GDN = register(GatedDeltaNet())
