"""The decode's attention backends (decode.decode_attention): cuDNN's switched off on a GPU unless asked for, torch's
global SDPA settings restored afterwards (also on error), the option's plumbing through evaluate and the CLI, and its
documentation. torch's backend flags are process-wide settings that exist without a GPU, so a CUDA device object
exercises them on the CPU; the CPU's own attention kernels ignore them (results stay bit-identical)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ssmquant.cli import main
from ssmquant.evaluate import EvalConfig, EvalError, evaluate
from ssmquant.evaluate import decode as decode_mod
from ssmquant.evaluate import run as run_mod
from ssmquant.evaluate.decode import attention_refusal, decode_attention

CUDA = torch.device("cuda")  # a device object only: nothing runs on it
ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ["int8@conventional", "nvfp4@replay4"]
COLS = ["kl", "top1_agree", "delta_loss"]


def _flags() -> dict[str, bool]:
    b = torch.backends.cuda
    return {
        "cudnn": b.cudnn_sdp_enabled(),
        "flash": b.flash_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }


def _set(flags: dict[str, bool]) -> None:
    b = torch.backends.cuda
    b.enable_cudnn_sdp(flags["cudnn"])
    b.enable_flash_sdp(flags["flash"])
    b.enable_mem_efficient_sdp(flags["efficient"])
    b.enable_math_sdp(flags["math"])


@pytest.fixture
def sdpa_flags():
    """torch's SDPA flags as the test found them, put back afterwards whatever the test did."""
    before = _flags()
    yield before
    _set(before)


def test_decode_attention_switches_off_cudnn_only_and_restores_the_settings(sdpa_flags):
    _set({"cudnn": True, "flash": True, "efficient": True, "math": False})  # a user's own setting: math off
    user = _flags()
    with decode_attention(CUDA):
        assert _flags() == {"cudnn": False, "flash": True, "efficient": True, "math": False}
    assert _flags() == user
    with pytest.raises(RuntimeError, match="inside"), decode_attention(CUDA):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        raise RuntimeError("an error inside the decode")
    assert _flags() == user


@pytest.mark.parametrize("device, cudnn", [(CUDA, True), (torch.device("cpu"), False)])
def test_decode_attention_changes_nothing_with_cudnn_or_on_the_cpu(sdpa_flags, device, cudnn):
    with decode_attention(device, cudnn):
        assert _flags() == sdpa_flags


def test_decode_attention_refuses_when_only_cudnn_is_enabled(sdpa_flags):
    _set({"cudnn": True, "flash": False, "efficient": False, "math": False})
    assert attention_refusal(torch.device("cpu")) is None and attention_refusal(CUDA, cudnn=True) is None
    msg = attention_refusal(CUDA)
    assert "only cuDNN's" in msg and "cudnn_attention=True" in msg
    with pytest.raises(ValueError, match="only cuDNN's"), decode_attention(CUDA):
        pass
    assert _flags()["cudnn"] and not _flags()["flash"]


@pytest.fixture
def as_if_cuda(monkeypatch):
    """evaluate's attention context and refusal as for a model on a GPU; records the cuDNN flag at every attention
    call of the model (transformers calls torch.nn.functional.scaled_dot_product_attention)."""
    monkeypatch.setattr(run_mod, "decode_attention", lambda device, cudnn: decode_mod.decode_attention(CUDA, cudnn))
    monkeypatch.setattr(run_mod, "attention_refusal", lambda device, cudnn: decode_mod.attention_refusal(CUDA, cudnn))
    seen: list[bool] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def test_evaluate_decodes_without_cudnn_unless_asked(nemotron, sdpa_flags, as_if_cuda):
    seen = as_if_cuda
    default = evaluate(EvalConfig(nemotron, VARIANTS, steps=6, batch=2, seed=1))
    assert seen and not any(seen)  # every attention call of the decode ran with cuDNN off
    assert torch.backends.cuda.cudnn_sdp_enabled() == sdpa_flags["cudnn"]
    assert not default.config.cudnn_attention
    seen.clear()
    torch_choice = evaluate(EvalConfig(nemotron, VARIANTS, steps=6, batch=2, seed=1, cudnn_attention=True))
    assert seen and all(seen)
    assert torch_choice.config.cudnn_attention and torch_choice.report()["settings"]["cudnn_attention"] is True
    # on the CPU the flags select nothing: the same bits
    np.testing.assert_array_equal(default.positions[COLS].to_numpy(), torch_choice.positions[COLS].to_numpy())


def test_evaluate_restores_the_settings_after_an_error_in_the_loop(nemotron, sdpa_flags, as_if_cuda):
    def stop(done: int, total: int) -> None:
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        if done >= 3:
            raise KeyboardInterrupt  # what a user's Ctrl-C raises in the loop

    with pytest.raises(KeyboardInterrupt):
        evaluate(EvalConfig(nemotron, VARIANTS, steps=6, batch=2, fold=False), progress=stop)
    assert _flags() == sdpa_flags


def test_evaluate_refuses_before_decoding_when_only_cudnn_is_enabled(nemotron, sdpa_flags, as_if_cuda):
    _set({"cudnn": True, "flash": False, "efficient": False, "math": False})
    with pytest.raises(EvalError, match=r"only cuDNN's.*--cudnn-attention"):
        evaluate(EvalConfig(nemotron, VARIANTS, steps=6, batch=2))
    assert not as_if_cuda  # nothing was decoded


def test_cli_cudnn_attention_option(nemotron_byte_dir, tmp_path):
    help_text = CliRunner().invoke(main, ["eval", "--help"]).output
    assert "--cudnn-attention" in " ".join(help_text.split())
    assert "flash attention" in " ".join(help_text.split()) and "not bit-identical" in " ".join(help_text.split())
    base = ["eval", "--model", str(nemotron_byte_dir), "--variants", "int8", "--steps", "6", "--batch", "1"]
    base += ["--device", "cpu", "-q", "--no-plots"]
    for flag, expected in (([], False), (["--cudnn-attention"], True)):
        out = tmp_path / str(expected)
        res = CliRunner().invoke(main, base + flag + ["--out", str(out)])
        assert res.exit_code == 0, res.output
        assert json.loads((out / "eval.json").read_text())["settings"]["cudnn_attention"] is expected


def test_the_attention_default_is_documented():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### `ssmquant eval`") :]
    section = " ".join(section[: section.index("\n### ", 5)].split())
    assert "--cudnn-attention" in section and "last bits" in section and "flash attention" in section
    details = " ".join((ROOT / "ssmquant" / "evaluate" / "README.md").read_text().split())
    assert "*Attention.*" in details and "`cudnn_attention=True` (`--cudnn-attention`)" in details
    assert "in the last bits" in details
