"""The flashinfer profile's Triton twin (`kernels.mamba2_engine`) against its torch reference (`engines.emulation`),
step by step: the states the twin carries must be the torch profile's bit for bit (`engines.twin`).

The probe fingerprints, at every step and per (batch, head), the state the metrics see, the checkpoint's codes
and its decode scales with an order-free integer sum, so the kernel's partial sums over row blocks and torch's
sum over the whole head give the same integer exactly when every bit agrees. Outputs and metrics are sums over
the state's last dimension in each backend's own order: compared with stated tolerances.
"""

import pytest
import torch

from lab.engines.oracle import bf16_inputs
from lab.engines.twin import bit_identical, compare_probes, fingerprint, probe_profile
from ssmquant.kinds import Mamba2Inputs
from ssmquant.models.synthetic import synthetic_inputs
from ssmquant.replay import parse_variant
from ssmquant.simulate import triton_interpreting

pytestmark = pytest.mark.gpu  # runs on a CUDA GPU at the real shapes when one is present (`pytest -m gpu`)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
kernels = pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")


def _layer(steps=21, heads=2, p=12, n=48, batch=2) -> Mamba2Inputs:
    """The first heads / rows / state columns of the synthetic Nemotron-3-Nano layer, as the engines receive it."""
    inp = bf16_inputs(synthetic_inputs("nemotron-3-nano", 0, batch=batch, steps=steps))
    return Mamba2Inputs(
        x=inp.x[:, :, :heads, :p], dt=inp.dt[:, :, :heads], B=inp.B[:, :, :1, :n], C=inp.C[:, :, :1, :n],
        A=inp.A[:heads], D=inp.D[:heads],
    ).validate().to(DEV)  # fmt: skip


def test_fingerprint_is_order_free_and_sees_every_bit():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 8, 16, generator=g)
    fp = fingerprint(s)
    assert fp.shape == (2, 3) and fp.dtype == torch.int64
    # the kernel adds row blocks' partial sums: the same integer
    w = torch.arange(1, 8 * 16 + 1).reshape(8, 16)
    bits = s.view(torch.int32).to(torch.int64) * w
    assert torch.equal(bits[..., :4, :].sum((-1, -2)) + bits[..., 4:, :].sum((-1, -2)), fp)
    for change in ("one bit", "negative zero", "swap"):
        t = s.clone()
        if change == "one bit":
            t.view(torch.int32)[1, 2, 5, 7] ^= 1
        elif change == "negative zero":
            s[1, 2, 0, 0], t[1, 2, 0, 0] = 0.0, -0.0
            fp = fingerprint(s)
        else:
            t[1, 2, 0, 0], t[1, 2, 0, 1] = s[1, 2, 0, 1], s[1, 2, 0, 0]
        diff = fingerprint(t) != fp
        assert diff[1, 2] and int(diff.sum()) == 1, change
    scales = torch.rand(2, 3, 8, generator=g)
    assert fingerprint(scales, 1).shape == (2, 3)


@kernels
@pytest.mark.parametrize(
    "spec",
    ["int8@replay4", "int8:sr@replay4", "fp8_e4m3:sr@replay8", "fp8_e4m3@replay16", "bf16@replay4",
     "fp16:sr@replay4", "fp16:sr@conventional", "int16@conventional"],
)  # fmt: skip
def test_twin_states_are_the_torch_profiles_bit_for_bit(spec):
    from ssmquant.kernels.mamba2_engine import engine_probe

    inp = _layer()
    v = parse_variant(spec + "~flashinfer", seed=3)
    twin, prof = engine_probe(inp, v), probe_profile(inp, v)
    row = compare_probes(twin, prof, v)
    assert bit_identical(row), row
    kept = [n for n in ("state", "codes", "scales") if f"{n}_identical" in row]
    eight = spec.startswith(("int8", "fp8"))
    assert kept == ["state"] if "conventional" in spec else kept == ["state", "codes"] + ["scales"] * eight
    # outputs: the same terms summed in another order; |diff| within 4 FP32 ulps of the output's scale per head
    y_t, y_p = twin[2].cpu().double(), prof[2].cpu().double()
    scale = y_p.abs().amax(-1, keepdim=True)
    assert ((y_t - y_p).abs() <= 4 * 2.0**-23 * scale).all(), float(((y_t - y_p).abs() / scale).max())
    # the state error curve analyze reports agrees to FP32 summation noise; the output error's, per step and pooled,
    # to the output sums' noise (1e-6 of the output norm: it dominates an int16 state's tiny error) plus 1e-3 of itself
    assert row["state_rel_err_max_rel_diff"] < 1e-5, row
    m_t, m_p = twin[0].cpu().double().sum((1, 2)), prof[0].cpu().double().sum((1, 2))
    gap = (m_t[:, 2].sqrt() - m_p[:, 2].sqrt()).abs()
    assert (gap <= 1e-6 * m_p[:, 3].sqrt() + 1e-3 * m_p[:, 2].sqrt()).all(), float(gap.max())


@kernels
def test_the_probe_changes_no_metric():
    """The probe is a separately compiled kernel; its metrics must be the analysis kernel's, bit for bit."""
    from ssmquant.kernels import emulate_triton
    from ssmquant.kernels.mamba2_engine import engine_probe

    inp = _layer(steps=13)
    for spec in ("fp8_e4m3:sr@replay4", "fp16:sr@conventional"):
        v = parse_variant(spec + "~flashinfer", seed=1)
        assert torch.equal(engine_probe(inp, v)[0], emulate_triton(inp, [v])[0]), spec


@pytest.fixture
def minus_as_zero_minus(monkeypatch):
    """Triton 3.6's unary minus of a float (`semantic.minus`: 0 - x, so -(+0.0) is +0.0), as the H200 run compiled
    it; Triton 3.9 emits fneg. Patched into the interpreter so that a CPU run sees the GPU's signed zeros."""
    from triton.language.semantic import TritonSemantic

    plain = TritonSemantic.minus

    def minus(self, input):
        if not input.type.scalar.is_floating():
            return plain(self, input)
        zero = self.make_tensor(self.builder.get_null_value(input.type.scalar.to_ir(self.builder)), input.type.scalar)
        return self.sub(zero, input, True)

    monkeypatch.setattr(TritonSemantic, "minus", minus)


@pytest.mark.skipif(not triton_interpreting(), reason="patches the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("spec", ["fp16:sr@conventional", "fp8_e4m3:sr@replay4"])
def test_twin_keeps_negative_zeros_whatever_unary_minus_compiles_to(spec, minus_as_zero_minus):
    """The first H200 run: fp16:sr@conventional and fp8_e4m3:sr@replay16 stored +0.0 where the torch profile (and
    FlashInfer's cvt_rs_*_sw, which OR the sign bit back) store -0.0 for a negative value rounded to zero; the kernel
    negates no float, so the bits do not depend on how Triton compiles a unary minus."""
    from ssmquant.kernels.mamba2_engine import engine_probe

    inp = _layer(steps=9)
    # state column 0 about 2^-20 of the row's largest: its scaled 8-bit values lie below fp8's smallest subnormal
    # (2^-9), so stochastic rounding takes some of the negative ones to -0.0 (as tiny values do at full shapes)
    bm = inp.B.clone()
    bm[..., 0] *= 2.0**-20
    inp = Mamba2Inputs(x=inp.x, dt=inp.dt, B=bm, C=inp.C, A=inp.A, D=inp.D).validate()
    v = parse_variant(spec + "~flashinfer", seed=3)
    twin, prof = engine_probe(inp, v), probe_profile(inp, v)
    row = compare_probes(twin, prof, v)
    assert bit_identical(row), row
    # the case is exercised: the profile stores negative zeros
    from ssmquant.engines.emulation import engine_step
    from ssmquant.replay.naive import Emulation

    runner = Emulation(inp, [v], "state", engine_step)
    neg_zero = 0
    for t in range(inp.steps):
        runner.s_ref, _ = runner.physics.advance(runner.s_ref, t)
        s, _ = runner.variant_step(0, t)
        held = runner.engine[0].codes if "replay" in spec else s
        neg_zero += int(((held == 0) & torch.signbit(held)).sum())
    assert neg_zero > 0, "no negative zero stored: the test would not see the difference"



def _twin_ptx_script():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("twin_ptx", Path(__file__).resolve().parents[2] / "lab" / "bench" / "twin_ptx.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_ptx_scan_finds_each_hazard():
    scan = _twin_ptx_script().float_hazards
    ptx = "mov.b32 %r1, 0f00000000;\n sub.rn.f32 %r2, %r1, %r3;\n neg.f32 %r4, %r5;\n fma.rn.f32 %r6, %r7, %r8, %r9;\n"
    assert scan(ptx + " cvt.rmi.ftz.f32.f32 %r10, %r2;\n sub.rn.f32 %r2, %r6, %r3;") == {"negations": 2, "fma": 1, "ftz": 1}


@pytest.mark.parametrize("spec", ["fp16:sr@conventional", pytest.param("int8:sr@replay16", marks=pytest.mark.slow)])
def test_the_compiled_twin_negates_no_float_contracts_nothing_flushes_nothing(spec):
    """On the GPU the twin must compute what the interpreter computes: checked on its sm_90a PTX, compiled without a
    GPU in a process of its own (the tests run the interpreter). The first H200 run's kernel (Triton 3.6) held 32
    negations `0 - x` in the fp16 SR store alone, and int8 SR's tl.floor was cvt.rmi.ftz before enable_reflect_ftz=False."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia.compiler")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, str(root / "lab" / "bench" / "twin_ptx.py"), "--variants", spec, "--json"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.stdout.strip(), run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {spec: {"negations": 0, "fma": 0, "ftz": 0}}, run.stderr[-500:]


def test_a_variants_process_gets_the_parents_command_line_for_its_part():
    from pathlib import Path

    from lab.engines.twin import child_argv

    argv = ["timing", "--out", "t.json", "--device", "cuda", "--steps", "256", "--timing-variants=int8@replay16,fp16",
            "--jobs", "3", "--reps", "3", "--real", "int8"]  # fmt: skip
    assert child_argv("warm", argv, "timing", "int8@replay16", Path("t.warm0.json")) == [
        "warm", "--device", "cuda", "--steps", "256", "--reps", "3", "--real", "int8", "--timing-variants",
        "int8@replay16", "--jobs", "1", "--out", "t.warm0.json",
    ]  # fmt: skip
    argv = ["--device", "cpu", "compare", "--variants", "a,b", "--jobs", "5", "--out", "c.json"]
    assert child_argv("compare", argv, "compare", "b", Path("c.compare1.json")) == [
        "compare", "--device", "cpu", "--variants", "b", "--jobs", "1", "--out", "c.compare1.json",
    ]  # fmt: skip
