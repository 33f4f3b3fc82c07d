"""Resolving model names, architecture detection and the loader's error messages."""

from __future__ import annotations

import json

import pytest
import torch

from ssmquant.models import (
    SUPPORTED_ARCHITECTURES,
    ByteTokenizer,
    ModelLoadError,
    UnsupportedArchitectureError,
    detect_architecture,
    find_ssm_mixers,
    loading,
    resolve_model,
)

from .conftest import load_cpu


def test_preset_name_resolves_to_its_hub_repo():
    src = resolve_model("nemotron-3-nano")
    assert (src.kind, src.location, src.preset.name) == (
        "hub",
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        "nemotron-3-nano",
    )


def test_hub_id_and_local_dir(nemotron_dir):
    assert resolve_model("someone/some-model").kind == "hub"
    src = resolve_model(nemotron_dir)
    assert src.kind == "local" and src.is_local


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_cpu(tmp_path)


def test_missing_path_file_and_nonsense(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        resolve_model(f)
    with pytest.raises(ModelLoadError, match=r"not a preset.*presets: nemotron-3-nano"):
        resolve_model("no such model!")


def test_shipped_models(tmp_path, monkeypatch, nemotron_dir):
    monkeypatch.setattr(loading, "_PACKAGE_ROOT", tmp_path)
    monkeypatch.setattr(loading, "SHIPPED_MODELS", {"tiny-gone": "assets/tiny-gone", "tiny": "assets/tiny"})
    with pytest.raises(ModelLoadError, match="registered but its files are missing"):
        resolve_model("tiny-gone")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "tiny").symlink_to(nemotron_dir, target_is_directory=True)
    assert list(loading.available_shipped_models()) == ["tiny"]
    src = resolve_model("tiny")
    assert src.kind == "shipped"
    loaded = load_cpu("tiny")
    assert loaded.source.kind == "shipped"
    from ssmquant.models import capture_all

    caps = capture_all(loaded, torch.randint(0, 256, (1, 4)), layers=[0])
    assert caps[0].meta["source"] == "shipped" and caps[0].meta["model"] == "tiny"


def test_hub_offline_error_suggests_local_path_or_synthetic():
    with pytest.raises(ModelLoadError, match=r"cannot fetch 'ssmquant-tests/absent'.*local directory.*--synthetic"):
        load_cpu("ssmquant-tests/absent", local_files_only=True)


@pytest.mark.parametrize("arch", sorted(SUPPORTED_ARCHITECTURES))
def test_detect_supported(arch):
    info = detect_architecture({"architectures": [arch], "model_type": "x"})
    assert info.architecture == arch and info.layer_kind == SUPPORTED_ARCHITECTURES[arch][1]


def test_detect_by_model_type_and_unsupported():
    assert detect_architecture({"model_type": "qwen3_next"}).architecture == "Qwen3NextForCausalLM"
    assert detect_architecture({"text_config": {"model_type": "qwen3_5_text"}}).family == "qwen3_5"
    with pytest.raises(
        UnsupportedArchitectureError, match=r"LlamaForCausalLM.*supported architectures: NemotronHForCausalLM"
    ):
        detect_architecture({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_linear_attention_of_an_unknown_kind_is_refused_naming_the_known_kinds():
    cfg = {"architectures": ["MiniMaxM1ForCausalLM"], "model_type": "minimax_m1"}
    cfg["layer_types"] = ["linear_attention", "full_attention"]
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"MiniMaxM1ForCausalLM has linear-attention layers of a kind ssmquant does not know .*known kinds: "
        r"mamba2: Mamba-2 .*; gdn: Gated DeltaNet .*; kda: Kimi Delta Attention",
    ):
        detect_architecture(cfg)


@pytest.mark.parametrize(
    "arch,family", [("Glm5NextForConditionalGeneration", "glm5_next"), ("KimiLinearForCausalLM", "kimi_linear")]
)
def test_kda_architectures(arch, family):
    info = detect_architecture({"architectures": [arch], "model_type": family})
    assert (info.family, info.layer_kind) == (family, "kda")


def test_unsupported_checkpoint_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    with pytest.raises(UnsupportedArchitectureError, match="Qwen3_5MoeForConditionalGeneration"):
        load_cpu(tmp_path)


def test_qwen35_vlm_checkpoint_loads_its_text_model_with_the_saved_weights(qwen35_dir):
    """Published Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration; we load only the text model."""
    from transformers import Qwen3_5ForConditionalGeneration

    loaded = load_cpu(qwen35_dir)
    assert type(loaded.model).__name__ == "Qwen3_5ForCausalLM"
    full = Qwen3_5ForConditionalGeneration.from_pretrained(qwen35_dir, dtype=torch.float32)
    ours, theirs = find_ssm_mixers(loaded.model), find_ssm_mixers(full)
    assert sorted(ours) == sorted(theirs) == [0, 1, 2]
    for i in ours:
        for name, p in theirs[i].module.named_parameters():
            assert torch.equal(dict(ours[i].module.named_parameters())[name], p), (i, name)


def test_tokenizer_files_or_byte_level(nemotron_dir, hf_tokenizer_dir, tmp_path):
    assert isinstance(load_cpu(nemotron_dir).tokenizer, ByteTokenizer)  # vocab 300, no tokenizer files
    import shutil

    ckpt = tmp_path / "with_tok"
    shutil.copytree(nemotron_dir, ckpt)
    for f in hf_tokenizer_dir.iterdir():
        shutil.copy(f, ckpt / f.name)
    tok = load_cpu(ckpt).tokenizer
    assert not isinstance(tok, ByteTokenizer) and tok("the fox")["input_ids"]


def test_bad_dtype(nemotron_dir):
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        load_cpu(nemotron_dir, dtype="float8")


def test_models_load_with_their_own_torch_paths_not_hub_kernels(nemotron_dir):
    """transformers 5.25 kernelizes a model by default, with kernels downloaded from the Hub on a GPU (offline: a
    ValueError about the kernels' publisher; online: third-party code in place of the mixers' own): ssmquant loads
    with use_kernels=False, the paths capture verifies against."""
    loaded = load_cpu(nemotron_dir)
    assert loaded.model.use_kernels is False
