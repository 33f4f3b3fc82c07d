"""fla 0.6.0's `fused_recurrent_kda` under the Triton interpreter (CPU) against the replay's KDA step.

Runs only where fla (and its import-time dependency einops) is importable, e.g. with the engine bundle on the
path: `PYTHONPATH=$PWD:/work/main/.stage-engines/bundle pytest tests/engines/test_fla_kda_interpret.py`; the
test suite sets TRITON_INTERPRET=1 without a GPU (tests/conftest.py). The interpreter evaluates the kernel in
NumPy fp32 with no fused multiply-adds, so the state it returns after one call, rounded to bf16, equals the
emulation's `kda_advance` from the same bf16 state in every word (seen: 1.0); in fp32 the summation order of
S k and S q differs, so words and outputs agree only to fp32 noise.
"""

import pytest
import torch

from lab.engines import oracle
from ssmquant.kinds import KDAInputs
from ssmquant.models.synthetic import synthetic_inputs
from ssmquant.simulate import triton_interpreting

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not triton_interpreting(), reason="the CPU twin of the GPU test (TRITON_INTERPRET=1)"
)


def _tiny_glm(steps):
    """GLM-5.3-Flash layer 0 draws cut to 2 heads, Dk 16, Dv 32 (the kernel's BV is 32)."""
    inp = synthetic_inputs("glm-5.3-flash", 0, batch=1, steps=steps)
    return KDAInputs(
        q=inp.q[:, :, :2, :16].contiguous(), k=inp.k[:, :, :2, :16].contiguous(),
        v=inp.v[:, :, :2, :32].contiguous(), g=inp.g[:, :, :2, :16].contiguous(), beta=inp.beta[:, :, :2].contiguous(),
    ).validate()  # fmt: skip


@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_fla_kda_interpreted_matches_the_emulation(state):
    pytest.importorskip("einops", reason="fla 0.6.0 imports einops")
    pytest.importorskip("fla.ops.kda", reason="fla 0.6.0 not on the path (the engine bundle)")
    r = oracle.run_fla_kda(_tiny_glm(6), oracle.FlaCase(state, steps=6, op="kda"))
    tf, out = r["teacher_forced"], r["out_curves"]
    assert r["case"] == f"fla fused_recurrent_kda {state}"
    if state == "bf16":
        assert tf["state_identical_mean"] == 1.0, tf
        assert out["max_rel_gap_vs_real"]["ideal"] <= 0.05, out
    else:
        assert tf["state_identical_mean"] >= 0.5, tf  # fp32: summation order, the rest within fp32 noise
        assert out["final_window"]["real"] <= 1e-6, out


def test_fla_kda_rejects_gdn_inputs_and_cases():
    gdn = synthetic_inputs("qwen3.5-9b", 0, batch=1, steps=2)
    with pytest.raises(ValueError, match="KDAInputs"):
        oracle.run_fla_kda(gdn, oracle.FlaCase("bf16", steps=2, op="kda"))
    with pytest.raises(ValueError, match="op 'kda'"):
        oracle.run_fla_kda(_tiny_glm(2), oracle.FlaCase("bf16", steps=2))
