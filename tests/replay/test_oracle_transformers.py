"""Oracle: our FP32 recurrences reproduce the SSM states that transformers' own decode keeps in its cache.

Tiny random-init NemotronH (Mamba-2) and Qwen3.5 / Qwen3-Next (Gated DeltaNet) models are built from
configs (no download) and decoded token by token with a cache by transformers itself. The SSM inputs
each mixer hands to its scan functions are recorded by wrapping those functions (the first token goes
through the chunked prefill path, the rest through the single-step decode path), converted into the
form our recurrence consumes, and replayed; after every token the cache's recurrent state must match
our state within 1e-5 relative error.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F

from ssmquant.kinds import GDNInputs, KDAInputs, Mamba2Inputs
from ssmquant.models.torch_path import use_torch_path_on_cpu
from ssmquant.replay import reference_decode

pytestmark = pytest.mark.gpu  # runs on a CUDA GPU at the real shapes when one is present (`pytest -m gpu`)

transformers = pytest.importorskip("transformers")

STEPS = 12
BATCH = 2
TOL = 1e-5


@contextlib.contextmanager
def wrapped(module, names, record):
    """Temporarily replace module-level functions by recorders that call the originals."""
    saved = {n: getattr(module, n) for n in names}

    def make(name, fn):
        def recorder(*args, **kwargs):
            record.append((name, args, kwargs))
            return fn(*args, **kwargs)

        return recorder

    try:
        for n, fn in saved.items():
            setattr(module, n, make(n, fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


def decode_with_cache(model, tokens):
    """Token-by-token decode with transformers' cache; yields the cache after each token."""
    cache = None
    for t in range(tokens.shape[1]):
        out = model(input_ids=tokens[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.past_key_values
        yield cache


def rel(a, b):
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


# --- Mamba-2: NemotronH ------------------------------------------------------------------------------


def tiny_nemotron_h():
    cfg = transformers.NemotronHConfig(
        vocab_size=64,
        hidden_size=64,
        layers_block_type=["mamba", "mlp", "attention", "mamba"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        mamba_num_heads=8,
        mamba_head_dim=12,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=8,
        use_mamba_kernels=False,
    )
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(cfg).float().eval()
    use_torch_path_on_cpu(model)  # CPU tensors take transformers' torch path, whatever kernel packages are installed
    # spread the decays across heads so that the test exercises long and short memory
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = layer.mixer
            if hasattr(mixer, "A_log"):
                mixer.A_log.copy_(torch.linspace(-2.0, 1.5, mixer.num_heads))
                mixer.dt_bias.copy_(torch.linspace(-4.0, -1.0, mixer.num_heads))
                mixer.D.copy_(torch.linspace(0.5, 1.5, mixer.num_heads))
    return model


def mamba2_inputs_from_records(records, layer_count):
    """Per layer, rebuild Mamba2Inputs from the recorded chunk-scan (step 0) and decode calls."""
    per_layer = [[] for _ in range(layer_count)]
    k = 0
    for name, args, kw in records:
        per_layer[k % layer_count].append((name, args, kw))
        k += 1
    out = []
    for calls in per_layer:
        xs, dts, bs, cs = [], [], [], []
        for name, args, kw in calls:
            if name == "mamba2_chunk_scan":
                x, dt, A, B, C = args[:5]  # x [b, 1, H, P], dt raw [b, 1, H], B/C [b, 1, G, N]
                dt = F.softplus(dt + kw["dt_bias"])
                dt = torch.clamp(dt, kw["dt_limit"][0], kw["dt_limit"][1])
                A_vec, D_vec = A, kw["D"]
                xs.append(x)
                dts.append(dt)
                bs.append(B)
                cs.append(C)
            else:  # mamba2_selective_state_update: state, x [b, H, P], dt [b, H, P], A [H, P, N], B/C [b, G, N]
                _, x, dt, A, B, C, D = args[:7]
                dt = F.softplus(dt[..., 0] + kw["dt_bias"][:, 0])  # the decode path does not clamp
                xs.append(x[:, None])
                dts.append(dt[:, None])
                bs.append(B[:, None])
                cs.append(C[:, None])
        out.append(
            Mamba2Inputs(
                x=torch.cat(xs, 1), dt=torch.cat(dts, 1), B=torch.cat(bs, 1), C=torch.cat(cs, 1), A=A_vec, D=D_vec
            )
        )
    return out


def test_mamba2_recurrence_matches_nemotron_h_decode_cache():
    model = tiny_nemotron_h()
    mod = importlib.import_module(type(model).__module__)
    mamba_layers = [i for i, t in enumerate(model.config.layers_block_type) if t == "linear_attention"]
    assert mamba_layers == [0, 3]
    tokens = torch.randint(0, 64, (BATCH, STEPS))
    records, states = [], []
    with torch.no_grad(), wrapped(mod, ["mamba2_chunk_scan", "mamba2_selective_state_update"], records):
        for cache in decode_with_cache(model, tokens):
            states.append([cache.get_recurrent_state(i).clone() for i in mamba_layers])
    assert sum(1 for r in records if r[0] == "mamba2_selective_state_update") == (STEPS - 1) * len(mamba_layers)
    inputs = mamba2_inputs_from_records(records, len(mamba_layers))
    for li, inp in enumerate(inputs):
        _, _, ours = reference_decode(inp, return_states=True)
        for t in range(STEPS):
            theirs = states[t][li]  # [b, H, P, N]
            assert rel(ours[:, t], theirs) < TOL, (li, t, rel(ours[:, t], theirs))


# --- Gated DeltaNet: Qwen3.5 and Qwen3-Next -----------------------------------------------------------


def tiny_gdn_model(kind):
    common = dict(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
    )
    torch.manual_seed(0)
    if kind == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**common)
        model = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        model = transformers.Qwen3NextForCausalLM(cfg)
    use_torch_path_on_cpu(model)  # the oracle is transformers' torch path, also where fla is installed
    return model.float().eval()


def gdn_inputs_from_records(records, layer_count, num_v_heads):
    per_layer = [[] for _ in range(layer_count)]
    for k, rec in enumerate(records):
        per_layer[k % layer_count].append(rec)
    out = []
    for calls in per_layer:
        qs, ks, vs, gs, betas = [], [], [], [], []
        for _name, args, kw in calls:
            q, k, v = args[:3]  # [b, 1, Hk, Dk], [b, 1, Hk, Dk], [b, 1, Hv, Dv]
            assert kw["use_qk_l2norm_in_kernel"]
            # transformers' l2norm: x * rsqrt(sum(x^2) + 1e-6), computed in fp32; q scaled by 1/sqrt(Dk)
            q = q.float() * torch.rsqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6)
            k = k.float() * torch.rsqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
            qs.append(q / q.shape[-1] ** 0.5)
            ks.append(k)
            vs.append(v)
            gs.append(kw["g"])
            betas.append(kw["beta"])
        out.append(
            GDNInputs(
                q=torch.cat(qs, 1), k=torch.cat(ks, 1), v=torch.cat(vs, 1), g=torch.cat(gs, 1), beta=torch.cat(betas, 1)
            )
        )
    return out


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_gdn_recurrence_matches_transformers_decode_cache(kind):
    model = tiny_gdn_model(kind)
    mod = importlib.import_module(type(model).__module__)
    types = model.config.layer_types
    gdn_layers = [i for i, t in enumerate(types) if t == "linear_attention"]
    assert gdn_layers == [0, 1, 2]  # full attention at every 4th layer
    tokens = torch.randint(0, 64, (BATCH, STEPS))
    records, states = [], []
    names = ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"]
    with torch.no_grad(), wrapped(mod, names, records):
        for cache in decode_with_cache(model, tokens):
            states.append([cache.get_recurrent_state(i).clone() for i in gdn_layers])
    inputs = gdn_inputs_from_records(records, len(gdn_layers), model.config.linear_num_value_heads)
    for li, inp in enumerate(inputs):
        _, _, ours = reference_decode(inp, return_states=True)
        for t in range(STEPS):
            theirs = states[t][li].transpose(-1, -2)  # transformers keeps [Dk, Dv]; we keep [Dv, Dk]
            assert rel(ours[:, t], theirs) < TOL, (kind, li, t, rel(ours[:, t], theirs))


# --- Kimi Delta Attention: Kimi-Linear and GLM-5.3-Flash ---------------------------------------------

# Dv = Dk here (both models have one linear_head_dim); 3 heads so that a head mix-up cannot pass.
_KDA_TEXT = dict(
    vocab_size=64,
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
)


def tiny_kda_model(kind):
    """A 4-layer Kimi-Linear (3 KDA + 1 MLA, softplus gate) or GLM-5.3-Flash (3 KDA + 1 DSA, gate bounded
    below by -5) at their transformers initialisation (FLA's A_log / dt_bias init)."""
    torch.manual_seed(0)
    if kind == "kimi_linear":
        cfg = transformers.KimiLinearConfig(
            **_KDA_TEXT,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            bos_token_id=None,
            eos_token_id=None,
        )
        model = transformers.KimiLinearForCausalLM(cfg).float().eval()
        use_torch_path_on_cpu(model)
        return model
    text = dict(_KDA_TEXT, q_lora_rank=16, index_topk=8, index_head_dim=8, index_n_heads=1, index_kpool=4, hc_mult=2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    cfg = transformers.Glm5NextConfig(text_config=text, vision_config=dict(vision, projection_intermediate_size=64))
    model = transformers.Glm5NextForConditionalGeneration(cfg).float().eval()
    use_torch_path_on_cpu(model)
    return model


def fla_l2norm(x):
    # transformers' KDA l2norm (models/glm5_next/modeling_glm5_next.py `l2norm`): x / sqrt(sum(x^2) + 1e-6), fp32
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_inputs_from_records(records, layer_count):
    per_layer = [[] for _ in range(layer_count)]
    for k, rec in enumerate(records):
        per_layer[k % layer_count].append(rec)
    out = []
    for calls in per_layer:
        qs, ks, vs, gs, betas = [], [], [], [], []
        for _name, args, kw in calls:
            q, k, v = args[:3]  # [b, 1, H, Dk], [b, 1, H, Dk], [b, 1, H, Dv]
            assert kw["use_qk_l2norm_in_kernel"]
            q, k = fla_l2norm(q.float()), fla_l2norm(k.float())
            qs.append(q / q.shape[-1] ** 0.5)
            ks.append(k)
            vs.append(v)
            gs.append(kw["g"])  # [b, 1, H, Dk] log decays
            betas.append(kw["beta"])
        out.append(
            KDAInputs(
                q=torch.cat(qs, 1), k=torch.cat(ks, 1), v=torch.cat(vs, 1), g=torch.cat(gs, 1), beta=torch.cat(betas, 1)
            )
        )
    return out


@pytest.mark.parametrize("kind", ["kimi_linear", "glm5_next"])
def test_kda_recurrence_matches_transformers_decode_cache(kind):
    model = tiny_kda_model(kind)
    layer0 = model.model.language_model.layers[0] if kind == "glm5_next" else model.model.layers[0]
    mod = importlib.import_module(type(layer0.self_attn).__module__)
    types = (model.config.get_text_config()).layer_types
    kda_layers = [i for i, t in enumerate(types) if t == "linear_attention"]
    assert kda_layers == [0, 1, 2]
    tokens = torch.randint(0, 64, (BATCH, STEPS))
    records, states = [], []
    names = ["chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"]
    with torch.no_grad(), wrapped(mod, names, records):
        for cache in decode_with_cache(model, tokens):
            states.append([cache.get_recurrent_state(i).clone() for i in kda_layers])
    assert [r[0] for r in records[:3]] == ["chunk_kimi_delta_attention"] * 3
    assert sum(r[0] == "recurrent_kimi_delta_attention" for r in records) == (STEPS - 1) * 3
    inputs = kda_inputs_from_records(records, len(kda_layers))
    spread = []
    for li, inp in enumerate(inputs):
        spread.append(float(inp.g.std(-1).mean()))  # the key channels of a head decay differently
        _, _, ours = reference_decode(inp, return_states=True)
        for t in range(STEPS):
            theirs = states[t][li].transpose(-1, -2)  # transformers keeps [Dk, Dv]; we keep [Dv, Dk]
            assert rel(ours[:, t], theirs) < TOL, (kind, li, t, rel(ours[:, t], theirs))
    assert min(spread) > 0
