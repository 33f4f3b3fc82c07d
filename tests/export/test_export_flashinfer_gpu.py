"""The FlashInfer export, executed: the allocation snippet and kernel arguments it writes run the real kernels.

For each exported setting (calibrated on the tiny layers, relabelled with Nemotron-3-Nano's sizes: 64 heads x
head_dim 64 x d_state 128, 8 groups), `flashinfer_alloc.py` allocates the state, scales and ring on the GPU and
its `kernel_args` feeds one decode call of `flashinfer.mamba.checkpointing_ssu` (replay) or
`selective_state_update` (conventional). The state starts at zero; under replay the ring holds L old tokens and is
marked full (prev_num_accepted_tokens = L) so that the call writes a checkpoint (the state after replaying
them); conventionally the call stores the state after the new token. The stored state is checked against a
float32 torch reference, and the 8-bit state_scale must have the layout the export promises: float32
(cache, nheads, head_dim), contiguous, one decode scale per (slot, head, row) equal to the row amax / QMAX,
untouched (1.0) in the slots the call did not write.

Run on a machine with a CUDA GPU and flashinfer-python (0.7.x):

    python -m pytest tests/export/test_export_flashinfer_gpu.py
"""

import json
import runpy
import shutil

import pytest
import torch
import torch.nn.functional as F

from ssmquant.calibrate import CONFIG_NAME, write_recipe
from ssmquant.export import export

from ..calibrate.helpers import tiny_calibration

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested"),
]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (FlashInfer's kernels)", allow_module_level=True)
# the recipes are calibrated here, and calibrate's statistics use nvidia-modelopt's calibrators (a declared
# dependency that a bare GPU image may lack: seen on the H200 machine, 2026-11-30)
pytest.importorskip("modelopt", reason="needs nvidia-modelopt (calibrate's statistics): pip install nvidia-modelopt")
flashinfer_mamba = pytest.importorskip(
    "flashinfer.mamba", reason="needs flashinfer-python 0.7.x (flashinfer.mamba.checkpointing_ssu)"
)

NANO = {"heads": 64, "rows": 64, "state_dim": 128, "groups": 8}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
CASES = [
    ("int8", "replay16"),
    ("fp8_e4m3:sr", "replay16"),
    ("fp16:sr", "replay16"),
    ("bf16", "replay8"),
    ("bf16", "conventional"),
    ("fp16:sr", "conventional"),
]
SLOTS = [1, 3]  # of a 4-slot cache: slots 0 and 2 must stay untouched


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}@{s}" for f, s in CASES])
def exported(request, tmp_path_factory):
    """(export result, namespace of the executed flashinfer_alloc.py) for one setting."""
    fmt, scheme = request.param
    r = tiny_calibration(budget=1.0, candidates=[fmt], schemes=[scheme], calibration=["none"], engine_fallbacks=[])
    rec = write_recipe(r, tmp_path_factory.mktemp("fi") / "recipe")
    doc = json.loads((rec / CONFIG_NAME).read_text())
    doc["model"]["dims"].update(NANO)
    (rec / CONFIG_NAME).write_text(json.dumps(doc))
    shutil.rmtree(rec / "export-flashinfer", ignore_errors=True)
    major, minor = torch.cuda.get_device_capability()
    res = export(rec, "flashinfer", gpu=f"sm{major}{minor}")
    assert res.plan.setting.name == f"{fmt}@{scheme}"
    mp = pytest.MonkeyPatch()
    mp.setenv("SSMQUANT_DEVICE", "cuda")
    mp.setenv("SSMQUANT_CACHE", "4")
    ns = runpy.run_path(str(res.out_dir / "flashinfer_alloc.py"))
    mp.undo()
    return res, ns


def _decode_once(ns, seed=0):
    """One decode call through the exported kernel_args, from a zero state.

    Replay: the ring holds L old tokens (rows 0..L-1, ring_start 0, prev_num_accepted_tokens L), so the call
    must write a checkpoint, which is the state after replaying those tokens (the new token goes to the ring):
    S = sum_i exp(A sum_{j>i} dt_j) dt_i x_i B_i^T with dt_cache holding processed dt. Conventional: the
    state after the new token, softplus(dt_raw + dt_bias) x B^T. Returns (reference S, sum of |terms| for
    the tolerance, out), S [len(SLOTS), H, P, N] in float32.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, P, N, G = ns["NHEADS"], ns["HEAD_DIM"], ns["DSTATE"], ns["NGROUPS"]
    b, dev, inp = len(SLOTS), "cuda", ns["INPUT_DTYPE"]
    ns["state"].zero_()
    if "state_scale" in ns["kwargs"]:
        ns["kwargs"]["state_scale"].fill_(1.0)
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
        for name in ("x_cache", "B_cache", "dt_cache", "ring_start", "prev_num_accepted_tokens"):
            ns[name].zero_()
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
    fn = getattr(flashinfer_mamba, ns["FUNCTION"].rsplit(".", 1)[1])
    fn(**ns["kernel_args"](x, dt_raw, A, B, C, out, D, dt_bias, slots))
    torch.cuda.synchronize()
    return terms.sum(2), terms.abs().sum(2), out


def test_exported_call_runs_and_writes_the_new_state(exported):
    res, ns = exported
    ref, mag, out = _decode_once(ns)
    assert torch.isfinite(out.float()).all()
    state = ns["state"]
    slots = torch.tensor(SLOTS, device="cuda")
    others = torch.tensor([i for i in range(state.shape[0]) if i not in SLOTS], device="cuda")
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
    slots = torch.tensor(SLOTS, device="cuda")
    qmax = QMAX[state.dtype]
    # one decode scale per (slot, head, row): row amax / QMAX, and the row's largest code is QMAX
    expected = ref.abs().amax(-1) / qmax
    torch.testing.assert_close(scale[slots], expected, rtol=5e-2, atol=0.0)
    top = state[slots].float().abs().amax(-1)
    assert (top >= (qmax if state.dtype == torch.int8 else 0.875 * qmax)).all()
