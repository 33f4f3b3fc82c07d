"""Tiny random-init hybrid checkpoints (NemotronH, Qwen3.5 dense and MoE, Qwen3-Next, GLM-5.3-Flash and
Kimi-Linear), saved with
save_pretrained to a temporary directory, so that tests load them through the path a user's checkpoint
takes. All fp32 (CPU loading policy), widths of a few dozen, a handful of layers.

The SSM parameters are re-drawn so that the recurrence matters in the outputs (at init B, C are tiny
and y is almost D * x), dt covers the model's clamp, and heads decay at different rates.
"""

from __future__ import annotations

import pytest
import torch

VOCAB = 300

_NEMOTRON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    hybrid_override_pattern="M*M-M",
    mamba_num_heads=8,
    mamba_head_dim=8,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,  # several chunks and a padded tail for T = 37
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    time_step_min=0.05,  # transformers clamps dt at time_step_min: some steps hit it
    time_step_max=0.5,
    dtype="float32",
)
# Dv != Dk and Hv = 2 Hk so that a transposed state or a wrong head grouping cannot pass.
_QWEN_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    dtype="float32",
)
# KDA: 3 heads so that a head mix-up cannot pass; both families have Dk = Dv (one linear_head_dim).
_KDA_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=96,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    linear_num_heads=3,
    linear_head_dim=16,
    mlp_layer_types=["dense"] * 4,
    pad_token_id=None,
    dtype="float32",
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def energise(model: torch.nn.Module, seed: int = 0) -> None:
    """Redraw the SSM mixers' parameters so that the state carries signal (see module docstring)."""
    from ssmquant.models import find_ssm_mixers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mixer in find_ssm_mixers(model).values():
            m = mixer.module
            for name, lin in m.named_children():
                if isinstance(lin, torch.nn.Linear) and name != "out_proj":
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * lin.in_features**-0.5)
            m.conv1d.weight.copy_((torch.rand(m.conv1d.weight.shape, generator=g) * 2 - 1) * 0.8)
            if mixer.kind == "kda":
                # decay rates exp(A_log) in [0.37, 7.4] and per-channel biases spread over (-6, 2): the key
                # channels of a head decay from almost not at all to almost completely per step
                fg = m.forget_gate
                for lin in (fg.f_a_proj, fg.f_b_proj):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * lin.in_features**-0.5)
                fg.A_log.copy_(torch.rand(fg.A_log.shape, generator=g) * 3.0 - 1.0)
                fg.dt_bias.copy_(torch.rand(fg.dt_bias.shape, generator=g) * 8.0 - 6.0)
                continue
            h = m.A_log.numel()
            if mixer.kind == "mamba2":
                m.A_log.copy_(torch.rand(h, generator=g) * 2.5 - 1.0)  # A in [-4.5, -0.37]
                m.dt_bias.copy_(torch.rand(h, generator=g) * 4.0 - 4.0)
                m.D.copy_(torch.randn(h, generator=g) * 0.1)
            else:
                m.A_log.copy_(torch.rand(h, generator=g) * 4.0 - 3.0)
                m.dt_bias.copy_(torch.rand(h, generator=g) * 5.0 - 4.0)


def _save(model, path, seed):
    energise(model, seed)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def nemotron_dir(tmp_path_factory):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(1)
    return _save(NemotronHForCausalLM(NemotronHConfig(**_NEMOTRON)), tmp_path_factory.mktemp("nemotron_h"), 1)


@pytest.fixture(scope="session")
def qwen35_dir(tmp_path_factory):
    """A Qwen3.5 checkpoint as published: Qwen3_5ForConditionalGeneration (text + vision)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(2)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=_QWEN_TEXT, vision_config=_VISION))
    return _save(model, tmp_path_factory.mktemp("qwen3_5"), 2)


@pytest.fixture(scope="session")
def qwen35_moe_dir(tmp_path_factory):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(3)
    cfg = Qwen3_5MoeConfig(text_config=dict(_QWEN_TEXT, **_MOE), vision_config=_VISION)
    return _save(Qwen3_5MoeForConditionalGeneration(cfg), tmp_path_factory.mktemp("qwen3_5_moe"), 3)


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(4)
    return _save(Qwen3NextForCausalLM(Qwen3NextConfig(**_QWEN_TEXT, **_MOE)), tmp_path_factory.mktemp("qwen3_next"), 4)


@pytest.fixture(scope="session")
def glm5_next_dir(tmp_path_factory):
    """A GLM-5.3-Flash checkpoint as published: Glm5NextForConditionalGeneration (text + vision), 3 KDA + 1 DSA."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(5)
    text = dict(_KDA_TEXT, q_lora_rank=16, index_topk=8, index_head_dim=8, index_n_heads=1, index_kpool=4, hc_mult=2)
    cfg = Glm5NextConfig(text_config=text, vision_config=dict(_VISION, projection_intermediate_size=64))
    return _save(Glm5NextForConditionalGeneration(cfg), tmp_path_factory.mktemp("glm5_next"), 5)


def save_kimi_linear(text: dict, path, seed: int):
    """A Kimi-Linear checkpoint (KimiLinearForCausalLM) of the text config ``text``: 3 KDA + 1 MLA layers,
    softplus gate, energised and saved to ``path`` (shared with tests/evaluate's byte-vocabulary model)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(
        **text,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        bos_token_id=None,
        eos_token_id=None,
    )
    return _save(KimiLinearForCausalLM(cfg), path, seed)


@pytest.fixture(scope="session")
def kimi_linear_dir(tmp_path_factory):
    """A Kimi-Linear checkpoint (KimiLinearForCausalLM): 3 KDA + 1 MLA, softplus gate."""
    return save_kimi_linear(_KDA_TEXT, tmp_path_factory.mktemp("kimi_linear"), 6)


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer saved as HF tokenizer files (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20], trainer=trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def load_cpu(spec, **kwargs):
    """load_model pinned to the CPU, so that tests load fp32 weights on any machine (GPU hosts too)."""
    from ssmquant.models import load_model

    return load_model(spec, device="cpu", **kwargs)


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())
