"""Triton is not a dependency (a CPU install is a third smaller without it, issue 27): the CPU path of every
command runs without it, and asking for the fused kernels without it is one clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Python treats a None entry in sys.modules as a module that cannot be imported: `import triton` raises
# ModuleNotFoundError and importlib.util.find_spec("triton") answers None, as on an installation without it
NO_TRITON = "import sys; sys.modules['triton'] = None\n"


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TRITON + code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_analyze_and_calibrate_run_on_the_cpu_without_triton(tmp_path):
    code = """
from ssmquant.cli import main
import sys
for args in (
    ["analyze", "--model", "tiny-nemotron", "--layers", "0", "--steps", "32", "--batch", "1", "--device", "cpu",
     "--out", "a", "-q"],
    ["calibrate", "--model", "tiny-kda", "--layers", "0", "--horizon", "8", "--batch", "1", "--budget", "1",
     "--candidates", "int8", "--schemes", "conventional", "--calibration", "none", "--no-verify",
     "--device", "cpu", "--out", "c", "-q"],
):
    try:
        main(args, standalone_mode=False)
    except SystemExit as e:
        assert not e.code, (args[0], e.code)
assert "triton" not in {m for m in sys.modules if sys.modules[m] is not None}, "triton was imported"
print("ok")
"""
    res = _run(code, tmp_path)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
    assert (tmp_path / "a" / "summary.csv").exists() and (tmp_path / "c").is_dir()


def test_the_fused_backend_without_triton_is_one_clear_error(tmp_path):
    code = """
import torch
from ssmquant.simulate import BackendError, resolve_backend
from ssmquant.kinds import Mamba2Inputs
x = Mamba2Inputs(x=torch.zeros(1, 2, 1, 4), dt=torch.ones(1, 2, 1), B=torch.zeros(1, 2, 1, 8),
                 C=torch.zeros(1, 2, 1, 8), A=-torch.ones(1), D=torch.ones(1))
assert resolve_backend("auto", x) == "torch"
import os
os.environ["TRITON_INTERPRET"] = "1"
try:
    resolve_backend("triton", x)
except BackendError as err:
    print(err)
"""
    res = _run(code, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "the fused kernels need Triton, which is not installed" in res.stdout and "backend='torch'" in res.stdout
