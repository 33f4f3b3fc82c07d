"""`lab.engines.env.engine_status`: whether a real engine kernel can run here, and when it cannot, one line that
names what is missing and how to get it (CPU: the machine's answers are faked)."""

from __future__ import annotations

import importlib

import pytest
import torch

from lab.engines import env


@pytest.fixture
def gpu_like(monkeypatch):
    """A machine that looks like an sm_90 GPU host to engine_status."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))


def _one_line(st):
    assert not st.ok and st.reason and "\n" not in st.reason, st
    return st.reason


@pytest.mark.parametrize("name", ["flashinfer", "fla"])
def test_no_gpu_is_one_line(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "need a CUDA GPU" in _one_line(env.engine_status(name))


@pytest.mark.parametrize("name", ["flashinfer", "fla"])
def test_a_missing_engine_names_the_pinned_version_and_the_bundle(monkeypatch, gpu_like, name):
    real = importlib.import_module

    def missing(mod, *a, **k):
        if mod.split(".")[0] in ("flashinfer", "fla"):
            raise ModuleNotFoundError(f"No module named '{mod.split('.')[0]}'\n(more lines the user need not see)")
        return real(mod, *a, **k)

    monkeypatch.setattr(importlib, "import_module", missing)
    module, dist, pin = env.ENGINES[name]
    line = _one_line(env.engine_status(name))
    assert f"{dist}=={pin} is not importable (No module named" in line and "python -m lab.engines.bundle" in line


def test_an_old_gpu_is_refused_with_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "compute capability >= 8.0" in _one_line(env.engine_status("flashinfer"))


def test_another_version_is_refused_naming_both(monkeypatch, gpu_like):
    fake = type("M", (), {"__name__": "fla.ops.gated_delta_rule"})()
    monkeypatch.setattr(importlib, "import_module", lambda mod, *a, **k: fake)
    monkeypatch.setattr(env, "_version", lambda mod: "0.1.0")
    line = _one_line(env.engine_status("fla"))
    assert "is version 0.1.0" in line and env.ENGINES["fla"][2] in line


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(ValueError, match="accepted: flashinfer, fla"):
        env.engine_status("sglang")
