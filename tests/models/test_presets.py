"""Presets against ARCHITECTURE.md's reference shapes and against transformers' own config classes."""

from __future__ import annotations

import pytest

from ssmquant.models import (
    GDNShape,
    KDAShape,
    Mamba2Shape,
    PresetError,
    get_preset,
    list_presets,
    presets_frame,
    ssm_layout,
)

MiB = 2**20

# ARCHITECTURE.md reference shapes: SSM layers, total layers, heads x rows x state_dim, groups / key heads, FP32 MiB per layer.
DESIGN_TABLE = [
    ("nemotron-3-nano", 23, 52, (64, 64, 128), 8, 2),
    ("nemotron-3-super", 40, 88, (128, 64, 128), 8, 4),
    ("nemotron-h-8b", 24, 52, (128, 64, 128), 8, 4),
    ("qwen3.5-0.8b", 18, 24, (16, 128, 128), 16, 1),
    ("qwen3.5-9b", 24, 32, (32, 128, 128), 16, 2),
    ("qwen3.5-35b-a3b", 30, 40, (32, 128, 128), 16, 2),
    ("qwen3.5-122b-a10b", 36, 48, (64, 128, 128), 16, 4),
    ("qwen3-next-80b", 36, 48, (32, 128, 128), 16, 2),
    # Not in ARCHITECTURE.md: from the published configs (see presets.py sources).
    ("qwen3.5-27b", 48, 64, (48, 128, 128), 16, 3),
    ("qwen3.5-397b-a17b", 45, 60, (64, 128, 128), 16, 4),
    # KDA (ARCHITECTURE.md gives heads x dims; the layer counts are the configs')
    ("glm-5.3-flash", 34, 45, (64, 128, 128), 64, 4),
    ("kimi-linear-48b-a3b", 20, 27, (32, 128, 128), 32, 2),
]


def test_every_preset_is_checked():
    assert sorted(list_presets()) == sorted(row[0] for row in DESIGN_TABLE)


@pytest.mark.parametrize("name,ssm,total,shape,groups,mib", DESIGN_TABLE, ids=[r[0] for r in DESIGN_TABLE])
def test_design_table(name, ssm, total, shape, groups, mib):
    p = get_preset(name)
    assert (p.num_ssm_layers, p.num_layers, p.state_shape, p.groups) == (ssm, total, shape, groups)
    assert p.fp32_state_bytes_per_layer() == mib * MiB
    assert p.fp32_state_bytes_per_sequence() == ssm * mib * MiB
    assert len(p.ssm_layers) == ssm and all(0 <= i < total for i in p.ssm_layers)


def test_nemotron_3_nano_layout():
    p = get_preset("nemotron-3-nano")
    assert p.layer_pattern == "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    assert p.ssm_layers == (0, 2, 4, 7, 9, 11, 14, 16, 18, 21, 23, 25, 28, 30, 32, 35, 37, 39, 41, 44, 46, 48, 50)
    s = p.shape
    assert isinstance(s, Mamba2Shape)
    assert (s.n_groups, s.conv_kernel, s.chunk_size, s.time_step_min, s.time_step_max) == (8, 4, 128, 0.001, 0.1)
    assert p.hf_repo == "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16" and p.architecture == "NemotronHForCausalLM"


@pytest.mark.parametrize("name", [n for n in list_presets() if get_preset(n).layer_kind == "gdn"])
def test_qwen_full_attention_every_fourth_layer(name):
    p = get_preset(name)
    assert isinstance(p.shape, GDNShape)
    assert p.ssm_layers == tuple(i for i in range(p.num_layers) if (i + 1) % 4 != 0)
    assert (p.shape.key_head_dim, p.shape.value_head_dim, p.shape.conv_kernel) == (128, 128, 4)


def test_kda_presets():
    glm, kimi = get_preset("glm-5.3-flash"), get_preset("kimi-linear-48b-a3b")
    assert isinstance(glm.shape, KDAShape) and isinstance(kimi.shape, KDAShape)
    assert glm.shape.gate_lower_bound == -5.0 and kimi.shape.gate_lower_bound is None
    assert glm.ssm_layers == tuple(i for i in range(45) if i % 4 != 3)
    # Kimi-Linear's config lists its layers 1-indexed: kda_layers 1-3, 5-7, ..., 25, 26; full attention 4, 8, ..., 27
    assert [i + 1 for i in kimi.ssm_layers] == [i for i in range(1, 27) if i % 4 != 0]
    assert kimi.layer_pattern[-1] == "F"


def _config_of(p) -> dict:
    """A config.json dict holding the preset's published fields."""
    if p.layer_kind == "kda":
        s = p.shape
        linear = {"num_heads": s.num_heads, "head_dim": s.head_dim, "short_conv_kernel_size": s.conv_kernel}
        if p.model_type == "kimi_linear":
            linear["kda_layers"] = [i + 1 for i in p.ssm_layers]
            linear["full_attn_layers"] = [i + 1 for i in range(p.num_layers) if i not in p.ssm_layers]
            base = {"num_hidden_layers": p.num_layers, "hidden_size": p.hidden_size, "linear_attn_config": linear}
            return {"architectures": [p.architecture], "model_type": p.model_type, **base}
        linear["gate_lower_bound"] = s.gate_lower_bound
        text = {"num_hidden_layers": p.num_layers, "hidden_size": p.hidden_size, "linear_attn_config": linear}
        return {"architectures": [p.architecture], "model_type": p.model_type, "text_config": text}
    if p.layer_kind == "mamba2":
        s = p.shape
        return {
            "architectures": [p.architecture],
            "model_type": p.model_type,
            "hybrid_override_pattern": p.layer_pattern,
            "mamba_num_heads": s.num_heads,
            "mamba_head_dim": s.head_dim,
            "ssm_state_size": s.state_size,
            "n_groups": s.n_groups,
            "hidden_size": p.hidden_size,
        }
    s = p.shape
    text = {
        "num_hidden_layers": p.num_layers,
        "full_attention_interval": 4,
        "linear_num_value_heads": s.num_value_heads,
        "linear_num_key_heads": s.num_key_heads,
        "linear_key_head_dim": s.key_head_dim,
        "linear_value_head_dim": s.value_head_dim,
        "hidden_size": p.hidden_size,
    }
    if p.model_type == "qwen3_next":
        return {"architectures": [p.architecture], "model_type": p.model_type, **text}
    return {"architectures": [p.architecture], "model_type": p.model_type, "text_config": text}


@pytest.mark.parametrize("name", list_presets())
def test_presets_agree_with_transformers_config_classes(name):
    """transformers' config class, given the published fields, builds SSM mixers at the preset's layers."""
    p = get_preset(name)
    layout = ssm_layout(_config_of(p))
    assert layout["layer_kind"] == p.layer_kind
    assert layout["num_layers"] == p.num_layers
    assert layout["ssm_layers"] == p.ssm_layers
    assert layout["state_shape"] == p.state_shape


def test_get_preset_names():
    assert get_preset("Qwen3.5_9B").name == "qwen3.5-9b"
    with pytest.raises(PresetError, match=r"unknown preset 'llama-3'.*nemotron-3-nano.*qwen3-next-80b"):
        get_preset("llama-3")


def test_non_ssm_layer_names_the_ssm_layers():
    with pytest.raises(PresetError, match=r"layer 3 of qwen3.5-0.8b is not an SSM layer.*\[0, 1, 2, 4,"):
        get_preset("qwen3.5-0.8b").layer_position(3)


def test_presets_frame():
    df = presets_frame()
    assert list(df["preset"]) == list_presets()
    row = df.set_index("preset").loc["nemotron-3-nano"]
    assert (row["ssm_layers"], row["total_layers"], row["heads"], row["rows"], row["state_dim"]) == (
        23,
        52,
        64,
        64,
        128,
    )
    assert row["fp32_bytes_per_sequence"] == 23 * 2 * MiB
    assert row["state_elements_per_sequence"] * 4 == row["fp32_bytes_per_sequence"]
    assert row["state_rows_per_sequence"] == 23 * 64 * 64
