"""studies/tiny_models/train.py: model configs, the training scan port, and a CPU smoke run end to end.

The smoke run trains on a stand-in corpus cut from the shipped corpus.txt (the real training text is
git-ignored), so it runs in CI; the tiny models' own numbers are checked by the tests of the shipped models.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "studies" / "tiny_models" / "train.py"


@pytest.fixture(scope="module")
def tm():
    spec = importlib.util.spec_from_file_location("tiny_models_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("arch", ["tiny-nemotron", "tiny-qwen", "tiny-kda"])
def test_config_builds_within_budget(tm, arch):
    model = tm.build_model(arch, seed=0)
    params = tm.param_breakdown(model)
    assert params["total"] == sum(p.numel() for p in model.parameters())
    assert 2 * params["total"] <= 8_000_000  # bf16 weights within ~8 MB
    cfg = model.config
    assert cfg.vocab_size == 256
    types = list(cfg.layer_types)
    assert types.count("full_attention") >= 1 and types.count("linear_attention") >= 4
    if arch == "tiny-nemotron":
        assert (cfg.mamba_head_dim, cfg.ssm_state_size) == (64, 128)
        assert cfg.mamba_num_heads % cfg.n_groups == 0 and cfg.n_groups >= 1
    elif arch == "tiny-kda":
        # GLM-5.3-Flash's pattern: attention at every 4th layer, KDA elsewhere
        assert all((t == "full_attention") == ((i + 1) % 4 == 0) for i, t in enumerate(types))
        assert cfg.linear_head_dim == 64 and cfg.linear_num_heads >= 2
    else:
        assert all((t == "full_attention") == ((i + 1) % 4 == 0) for i, t in enumerate(types))
        assert cfg.linear_num_value_heads > cfg.linear_num_key_heads
    assert len(tm.ssm_mixers(model)) == types.count("linear_attention")


def test_einsum_scan_matches_transformers_reference(tm):
    from transformers.models.nemotron_h import modeling_nemotron_h as mod

    torch.manual_seed(0)
    b, T, H, P, G, N, chunk = 2, 75, 4, 8, 2, 16, 32  # T not a multiple of the chunk
    x = torch.randn(b, T, H, P)
    dt = torch.randn(b, T, H) - 2
    A = -torch.rand(H) * 2
    B, C = torch.randn(b, T, G, N), torch.randn(b, T, G, N)
    D, dt_bias, s0 = torch.randn(H), torch.randn(H) * 0.1, torch.randn(b, H, P, N)
    kw = dict(chunk_size=chunk, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(1e-3, math.inf))
    ref_y, ref_s = mod.mamba2_chunk_scan(x, dt, A, B, C, initial_states=s0, return_final_states=True, **kw)
    y, s = tm.ssd_chunk_scan_einsum(x, dt, A, B, C, initial_states=s0, return_final_states=True, z=None, **kw)
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, ref_s, rtol=1e-4, atol=1e-4)


def test_lr_schedule(tm):
    assert tm.lr_factor(0.0, 0.04, 0.05) > 0
    assert tm.lr_factor(0.04, 0.04, 0.05) == pytest.approx(1.0)
    assert tm.lr_factor(1.0, 0.04, 0.05) == pytest.approx(0.05)
    xs = [tm.lr_factor(p / 100, 0.04, 0.05) for p in range(4, 101)]
    assert all(a >= b for a, b in zip(xs, xs[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tiny-nemotron", "tiny-qwen", "tiny-kda"])
def test_smoke_run_end_to_end(tm, arch, tmp_path, monkeypatch):
    # two of the eight evaluation windows: the pipeline is the same, the windows' cost on 2 CPU cores is most of
    # the run (the full protocol is checked on the shipped models by tests/models/test_shipped.py)
    monkeypatch.setattr(tm, "EVAL_OFFSETS", tm.EVAL_OFFSETS[:2])
    text = (REPO / "ssmquant" / "models" / "data" / "corpus.txt").read_bytes()
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_bytes(text[:200_000])
    (data / "heldout.txt").write_bytes(text[200_000:])
    out = tmp_path / arch
    argv = ["--arch", arch, "--smoke", "--out", str(out), "--data-dir", str(data), "--allow-other-corpus"]
    assert tm.main(argv) == 0
    for f in ("config.json", "model.safetensors", "eval.json", "run_info.json", "train_log.jsonl", "model_card.md"):
        assert (out / f).is_file(), f
    info = json.loads((out / "run_info.json").read_text())
    assert info["reload_exact"] and "finish_error" not in info
    assert info["training"]["steps"] == 3
    assert info["weights_bytes"] <= 8_100_000
    assert info["decays"]["num_heads"] == info["init"]["decays"]["num_heads"] > 0
    ev = json.loads((out / "eval.json").read_text())
    assert ev["protocol"]["offsets"] == list(tm.EVAL_OFFSETS)
    assert ev["bits_per_byte"] == pytest.approx(ev["loss_nats_per_byte"] / math.log(2))
    assert "time_step_limit" not in json.loads((out / "config.json").read_text())
    # the CPU re-evaluation a shipped-model test does reproduces eval.json
    assert tm.check_eval(out) == 0
    # and ssmquant's own loader takes the checkpoint as a byte-level model
    from ssmquant.models.loading import load_model, read_config, resolve_model, ssm_layout
    from ssmquant.models.text import ByteTokenizer

    loaded = load_model(str(out), device="cpu")
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    layout = ssm_layout(read_config(resolve_model(str(out))))
    assert list(layout["ssm_layers"]) == info["ssm_layers"]
