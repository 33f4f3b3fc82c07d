"""Kimi Delta Attention (GLM-5.3-Flash, Kimi-Linear, Kimi-K3): the delta rule with one decay per key channel,

    S_t = diag(exp(g_t)) S_{t-1},   g_t: [Dk] log decays

(`delta_rule.py` has the rest; transformers' `recurrent_kimi_delta_attention`, fla `fused_recurrent_kda`). A row
of the state mixes key channels that decay at different rates. What a KDA replay buffer holds follows the engines'
RecoverSSM records: the corrected values u_j, the normalised key k_j and the gate (recomputed from the model's
activation, so never rounded here); a checkpoint rebuilds as S = diag(exp(G_h)) S_0 + sum_j u_j (k_j * exp(G_h -
G_j))^T with G the running per-key-channel sum of the buffered g.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Checks, InputError, TransformersFamily, register
from .delta_rule import DeltaRuleInputs, DeltaRuleKind, delta_rule, kda_decay


@dataclass
class KDAInputs(DeltaRuleInputs):
    """Decode inputs of one Kimi Delta Attention layer (GLM-5.3-Flash, Kimi-Linear, Kimi-K3).

    The fields and shapes of GDNInputs except the gate (B batch, T steps, Hk key heads, Hv value heads,
    Dk key dim, Dv value dim; the real models have Hk = Hv):

    - q:    [B, T, Hk, Dk]  L2-normalised and scaled by 1/sqrt(Dk)
    - k:    [B, T, Hk, Dk]  L2-normalised
    - v:    [B, T, Hv, Dv]
    - g:    [B, T, Hv, Dk]  log decays <= 0, one per key channel: GLM-5.3-Flash's
                            lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) in [-5, 0], Kimi-Linear's
                            -exp(A_log) * softplus(f + dt_bias)
    - beta: [B, T, Hv]      sigmoid(b) in (0, 1)
    - initial_state: optional [B, Hv, Dv, Dk] state before step 0 (zeros if None)

    The state is kept [Dv, Dk] per head (vLLM's and FlashInfer's KDA caches keep [V, K], this layout).
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

    def _check_gate(self, checks: Checks, b: int, t: int, hv: int, dk: int, dev: torch.device) -> None:
        checks.tensor("g", self.g, (b, t, hv, dk), dev)

        def positive():
            idx = tuple(int(i) for i in (self.g > 0).nonzero()[0])
            raise InputError(
                f"g must be <= 0 (log decays, exp(g) in (0, 1]); got {float(self.g[idx]):.4g} at batch {idx[0]}, "
                f"step {idx[1]}, head {idx[2]}, key channel {idx[3]}"
            )

        checks.rule(lambda: (self.g > 0).any(), positive)


def kda_decays(inputs: KDAInputs) -> torch.Tensor:
    """Per-step, per-key-channel decay exp(g_t), fp32 [B, T, Hv, Dk]."""
    return torch.exp(inputs.g.float())


def kda_advance(s, alpha, k, v, beta, q, buffer_dtype: torch.dtype = torch.float32):
    """One Kimi Delta Attention step from state s [B, H, Dv, Dk]: returns (new state, y [B, H, Dv]).

    alpha [B, H, Dk] (per-key-channel decay exp(g)); beta [B, H]; k (as buffered), q [B, H, Dk];
    v [B, H, Dv]; u is stored in `buffer_dtype` before it updates the state, as for GDN.
    """
    return delta_rule(kda_decay(s, alpha), k, v, beta, q, buffer_dtype)


class KimiDeltaAttention(DeltaRuleKind):
    name = "kda"
    title = "Kimi Delta Attention"
    short = "KDA"
    prefill_scan_kernel = "chunk_kda"
    inputs_type = KDAInputs
    model_names = "GLM-5.3-Flash, Kimi-Linear"
    # transformers 5.24 maps glm5_next only in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    transformers_families = (
        TransformersFamily(
            "glm5_next",
            ("Glm5NextForConditionalGeneration",),
            {"glm5_next": "Glm5NextForConditionalGeneration"},
            image_text=True,
        ),
        TransformersFamily("kimi_linear", ("KimiLinearForCausalLM",), {"kimi_linear": "KimiLinearForCausalLM"}),
    )
    # KimiLinearDeltaAttention, Glm5NextTextLinearAttention: a per-channel forget gate tells them from softmax ones
    mixer_class_suffixes = ("DeltaAttention", "LinearAttention")
    mixer_attributes = ("forget_gate",)
    # no engine stores an 8-bit or NVFP4 KDA state: what vLLM (Kimi-K3, GLM-5.3-Flash), FlashInfer and TensorRT-LLM
    # offer below float32 is a bfloat16 state rounded at every token (ssmquant/engines/facts.py, vllm.kda_*,
    # flashinfer.fused_kda_decode, trtllm.kda), so analyze asks whether that is good enough by default
    analyze_baselines = ("bf16@conventional",)

    def prefill_pair_elements(self, dims, chunk):
        # transformers' torch chunk_kimi_delta_attention: decay_mask [chunks, chunk, chunk, Dk] per head (chunk x Dk
        # per token), live through its intra-chunk loop, and the two products of its size that it enters: 3 x chunk
        # x H x Dk per token (tiny-kda, one forward of 8 x 2048 tokens on the CPU: 217 KB per token at the peak
        # against 44.5 KB estimated without them; fla's chunk_kda holds none)
        return 3 * chunk * dims.heads * dims.state_dim

    def gate_elements(self, dims):
        return dims.heads * dims.state_dim  # one FP32 gate per key channel

    def decays(self, inputs):
        return kda_decays(inputs)

    decay = staticmethod(kda_decay)  # s [B, H, Dv, Dk] decayed per key channel by alpha [B, H, Dk]

    def rebuild(self, s0, held, buf_idx, u_buf, kb, g, cap):
        bsz = s0.shape[0]
        ar = torch.arange(bsz, device=s0.device)
        j = torch.arange(cap, device=s0.device)
        valid = j[None, :] < held[:, None]  # [B, cap]
        g_buf = torch.where(valid[..., None, None], g[ar[:, None], buf_idx], 0.0)  # [B, cap, H, Dk]
        big_g = torch.cumsum(g_buf, 1)
        g_h = torch.where(held[:, None, None] > 0, big_g[ar, (held - 1).clamp(min=0)], 0.0)  # [B, H, Dk]
        w = torch.where(valid[..., None, None], torch.exp(g_h[:, None] - big_g), 0.0)  # [B, cap, H, Dk]
        k_buf = kb[ar[:, None], buf_idx]  # [B, cap, H, Dk]
        return kda_decay(s0, torch.exp(g_h)) + torch.einsum("bjhv,bjhk->bhvk", u_buf, w * k_buf)

    def random_gate(self, batch, steps, dims, gen, device):
        return -torch.rand(batch, steps, dims.heads, dims.state_dim, generator=gen).to(device)

    def config_layout(self, text_config):
        t = text_config  # every head has its own q / k: as many groups as heads
        return (t.linear_num_heads, t.linear_head_dim, t.linear_head_dim), t.linear_num_heads


KDA = register(KimiDeltaAttention())
