"""The FlashInfer export, executed: the exported allocation and kernel arguments drive the real kernels, and the
recipe's measured error is re-measured through them.

The recipes are committed fixtures (`flashinfer_recipes.py`: calibrated on a CPU, one setting each, on layer 0
of a synthetic Nemotron-3-Nano: 64 heads x head_dim 64 x d_state 128, 8 groups, 2 sequences x 128 steps), so
this test needs no nvidia-modelopt. For each recipe, `export(..., "flashinfer")` writes `flashinfer_alloc.py`;
the test runs it (the state, scales and ring on the GPU) and its `kernel_args` feed
`flashinfer.mamba.checkpointing_ssu` (replay) or `selective_state_update` (conventional):

- one decode call from a zero state: the stored state equals a float32 torch reference within the kernel's
  arithmetic (bf16 tensor-core operands) plus the storage rounding; 8-bit decode scales have the exported
  layout (float32 (cache, nheads, head_dim), row amax / QMAX) and untouched slots stay untouched;
- the whole calibration run (same inputs, regenerated on the CPU from the recipe's seed) decoded token by
  token through the exported arguments, the host advancing the ring as vLLM does. The recipe's metrics are
  re-measured on the kernel's outputs (bf16, as the kernel returns them) and on its stored state (the
  checkpoint, dequantized, advanced in float32 through the ring's tokens: the state ssmquant's emulation
  measures), over the recipe's horizon window, and reported beside ssmquant's numbers: the recipe's
  (CPU emulation), the same emulation re-run here, the `flashinfer` engine profile, and the bf16 floor
  (the error of the FP32 reference output rounded to bf16, which every kernel output carries).

Run on a machine with a CUDA GPU and flashinfer-python 0.7.x (SSMQUANT_RESULTS_DIR: where to write
export_flashinfer_gpu.json with every number):

    SSMQUANT_RESULTS_DIR=$OUT python -m pytest -s tests/export/test_export_flashinfer_gpu.py
"""

import json
import math
import os
import pathlib
import runpy
import shutil

import pytest
import torch
import torch.nn.functional as F

from ssmquant.calibrate import CONFIG_NAME, load_recipe
from ssmquant.calibrate.settings import METRICS
from ssmquant.export import export

from .flashinfer_recipes import CASES, case_name, fixture_dir
from .flashinfer_run import RecomputedKernels, measure, reset, summary_line

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested"),
]
# SSMQUANT_FI_DRY_RUN=1: this file on the CPU, FlashInfer's kernels re-computed in torch (a check of the test
# itself before a GPU run; tests/export/test_flashinfer_run.py measures the same loop on the CPU)
DRY_RUN = os.environ.get("SSMQUANT_FI_DRY_RUN") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"
if DRY_RUN:
    flashinfer_mamba = RecomputedKernels()
else:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (FlashInfer's kernels)", allow_module_level=True)
    flashinfer_mamba = pytest.importorskip(
        "flashinfer.mamba", reason="needs flashinfer-python 0.7.x (flashinfer.mamba.checkpointing_ssu)"
    )

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SLOTS = [1, 3]  # the batch's state slots, of a 4-slot cache: slots 0 and 2 must stay untouched
CACHE = 4
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module", params=CASES, ids=[case_name(*c) for c in CASES])
def exported(request, tmp_path_factory):
    """(export result, namespace of the executed flashinfer_alloc.py) for one committed recipe."""
    fmt, scheme = request.param
    rec = tmp_path_factory.mktemp("fi") / "recipe"
    rec.mkdir()
    shutil.copy(fixture_dir(fmt, scheme) / CONFIG_NAME, rec / CONFIG_NAME)
    major, minor = (9, 0) if DRY_RUN else torch.cuda.get_device_capability()
    res = export(rec, "flashinfer", gpu=f"sm{major}{minor}")
    assert res.plan.setting.name == f"{fmt}@{scheme}"
    mp = pytest.MonkeyPatch()
    mp.setenv("SSMQUANT_DEVICE", DEVICE)
    mp.setenv("SSMQUANT_CACHE", str(CACHE))
    ns = runpy.run_path(str(res.out_dir / "flashinfer_alloc.py"))
    mp.undo()
    return res, ns


def _kernel(ns):
    return getattr(flashinfer_mamba, ns["FUNCTION"].rsplit(".", 1)[1])


def _decode_once(ns, seed=0):
    """One decode call through the exported kernel_args, from a zero state.

    Replay: the ring holds L old tokens (rows 0..L-1, ring_start 0, prev_num_accepted_tokens L), so the call
    must write a checkpoint, which is the state after replaying those tokens (the new token goes to the ring):
    S = sum_i exp(A sum_{j>i} dt_j) dt_i x_i B_i^T with dt_cache holding processed dt. Conventional: the
    state after the new token, softplus(dt_raw + dt_bias) x B^T. Returns (reference S, sum of |terms| for
    the tolerance, out), S [len(SLOTS), H, P, N] in float32.
    """
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    H, P, N, G = ns["NHEADS"], ns["HEAD_DIM"], ns["DSTATE"], ns["NGROUPS"]
    b, dev, inp = len(SLOTS), DEVICE, ns["INPUT_DTYPE"]
    reset(ns)
    lead = (b, ns["TOKENS_PER_CALL"]) if ns["REPLAY"] else (b,)
    x = torch.randn(*lead, H, P, generator=g, device=dev).to(inp)
    dt_raw = torch.randn(*lead, H, generator=g, device=dev) * 0.5 - 1.0
    B = torch.randn(*lead, G, N, generator=g, device=dev).to(inp)
    C = torch.randn(*lead, G, N, generator=g, device=dev).to(inp)
    A = -torch.rand(H, generator=g, device=dev) - 0.5
    D, dt_bias = torch.ones(H, device=dev), torch.zeros(H, device=dev)
    out = torch.zeros_like(x)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=dev)
    if ns["REPLAY"]:
        L = ns["BUFFER_LEN"]
        xo = torch.randn(b, H, L, P, generator=g, device=dev).to(inp)  # old tokens, ring rows 0..L-1
        Bo = torch.randn(b, G, L, N, generator=g, device=dev).to(inp)
        dto = torch.rand(b, H, L, generator=g, device=dev) * 0.09 + 0.01  # processed dt
        ns["x_cache"][slots, :, :L] = xo
        ns["B_cache"][slots, :, :L] = Bo
        ns["dt_cache"][slots, :, :L] = dto
        ns["prev_num_accepted_tokens"][slots] = L  # the ring is full: this call writes a checkpoint
        cum = (A[None, :, None] * dto).flip(-1).cumsum(-1).flip(-1) - A[None, :, None] * dto  # sum over j > i
        coef = torch.exp(cum) * dto  # [b, H, L]
        Bh = Bo.float().repeat_interleave(H // G, dim=1)  # [b, H, L, N]
        terms = coef[..., None, None] * xo.float()[..., :, None] * Bh[..., None, :]  # [b, H, L, P, N]
    else:
        Bh = B.float().repeat_interleave(H // G, dim=1)  # [b, H, N]
        dt = F.softplus(dt_raw + dt_bias)
        terms = (dt[..., None, None] * x.float()[..., :, None] * Bh[..., None, :])[:, :, None]  # [b, H, 1, P, N]
    _kernel(ns)(**ns["kernel_args"](x, dt_raw, A, B, C, out, D, dt_bias, slots))
    if not DRY_RUN:
        torch.cuda.synchronize()
    return terms.sum(2), terms.abs().sum(2), out


def test_exported_call_runs_and_writes_the_new_state(exported):
    res, ns = exported
    ref, mag, out = _decode_once(ns)
    assert torch.isfinite(out.float()).all()
    state = ns["state"]
    slots = torch.tensor(SLOTS, device=DEVICE)
    others = torch.tensor([i for i in range(state.shape[0]) if i not in SLOTS], device=DEVICE)
    assert (state[others].float() == 0).all()  # only the batch's slots are written
    # kernel arithmetic: bf16 MMA operands, so 2^-6 of the summed term magnitudes; plus the storage rounding
    tol = 2.0**-6 * mag + 1e-6
    if state.dtype in QMAX:
        scale = ns["kwargs"]["state_scale"][slots][..., None]
        deq = state[slots].float() * scale
        tol = tol + (0.5 * scale if state.dtype == torch.int8 else 0.125 * ref.abs() + scale * 2.0**-9)
    else:
        deq = state[slots].float()
        tol = tol + (2.0**-7 if state.dtype == torch.bfloat16 else 2.0**-10) * ref.abs()
        if state.dtype == torch.float16:
            # stochastic rounding below SM 100 is a software conversion that flushes |x| < 2^-14 to zero
            # (cvt_rs_f16_sw: "f32_exp < 113 → underflow to zero"; flashinfer-python 0.7.2.post1 wheel,
            # flashinfer/data/include/flashinfer/mamba/conversion.cuh)
            tol = tol + 2.0**-14
    bad = (deq - ref).abs() > tol
    assert not bad.any(), f"{bad.sum().item()} of {bad.numel()} state elements off; max err {(deq - ref).abs().max()}"


def test_state_scale_has_the_exported_layout(exported):
    res, ns = exported
    state = ns["state"]
    if state.dtype not in QMAX:
        assert "state_scale" not in ns["kwargs"] and json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())[
            "state_scale"] is None  # fmt: skip
        pytest.skip(f"{state.dtype} state has no scales")
    ref, _, _ = _decode_once(ns, seed=1)
    scale = ns["kwargs"]["state_scale"]
    kw = json.loads((res.out_dir / "flashinfer_kwargs.json").read_text())["state_scale"]
    H, P = ns["NHEADS"], ns["HEAD_DIM"]
    assert list(scale.shape) == [state.shape[0], H, P] and list(scale.stride()) == kw["strides"] == [H * P, P, 1]
    assert scale.dtype == torch.float32 and kw["dtype"] == "torch.float32"
    untouched = [i for i in range(state.shape[0]) if i not in SLOTS]
    assert (scale[untouched] == 1.0).all()  # the kernel writes only the checkpointed slots
    slots = torch.tensor(SLOTS, device=DEVICE)
    qmax = QMAX[state.dtype]
    # one decode scale per (slot, head, row): row amax / QMAX, and the row's largest code is QMAX
    expected = ref.abs().amax(-1) / qmax
    torch.testing.assert_close(scale[slots], expected, rtol=5e-2, atol=0.0)
    top = state[slots].float().abs().amax(-1)
    assert (top >= (qmax if state.dtype == torch.int8 else 0.875 * qmax)).all()


def test_recipe_error_through_the_kernel(exported):
    """Both numbers: the recipe's error (ssmquant's emulation) and the same metric through the real kernel."""
    res, ns = exported
    row = measure(_kernel(ns), ns, load_recipe(res.out_dir.parent), SLOTS)
    RESULTS[row["setting"]] = row
    _save()
    print(f"\n[export-gpu] {summary_line(row)}", flush=True)
    recipe, here, profile, kernel = (
        row[k] for k in ("recipe_emulation", "emulation_here", "flashinfer_profile", "kernel_through_export")
    )
    # the emulation reproduces the recipe on this machine (same inputs; torch on another device and version)
    for m in METRICS:
        assert math.isclose(here[m], recipe[m], rel_tol=1e-2), (m, here[m], recipe[m])
    # the kernel stores the recipe's format: its state error is the emulation's with the kernel's arithmetic
    # (the flashinfer profile: bf16 operands, the flush one call late), stated as within 25% of it
    k, p = kernel["state_rel_err"], profile["state_rel_err"]
    assert abs(k - p) <= 0.25 * p + 1e-7, f"state error: kernel {k:.4g} vs flashinfer profile {p:.4g}"
    # outputs: the profile's error plus the bf16 rounding of the returned output, in quadrature (independent)
    k, p = kernel["out_rel_err"], math.hypot(profile["out_rel_err"], row["bf16_output_floor"])
    assert abs(k - p) <= 0.25 * p, f"output error: kernel {k:.4g} vs hypot(profile, bf16 floor) {p:.4g}"
    assert (ns["state"][[i for i in range(CACHE) if i not in SLOTS]].float() == 0).all()


def _save() -> None:
    out = os.environ.get("SSMQUANT_RESULTS_DIR")
    if out:
        p = pathlib.Path(out) / "export_flashinfer_gpu.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(RESULTS, indent=1) + "\n")
