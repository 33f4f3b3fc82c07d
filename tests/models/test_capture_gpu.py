"""The default GPU path: bf16 weights on CUDA, inputs captured to the CPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ssmquant.models import capture_all, load_model
from ssmquant.replay.reference import reference_decode

from .conftest import VOCAB, relerr
from .test_capture import CHECKPOINTS, _model_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# The model's own scan works on bf16 activations and returns bf16; ours replays the same bf16 inputs in
# fp32 (NemotronH's torch path also rounds dt to bf16 before its softplus, the kernels do not).
BF16_TOL = 2e-2


@pytest.mark.parametrize("fixture,kind,arch,steps", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_gpu_bf16_capture(request, fixture, kind, arch, steps):
    loaded = load_model(request.getfixturevalue(fixture))  # default policy: CUDA, bf16
    assert loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16
    ids = torch.randint(0, VOCAB, (2, steps))
    caps = capture_all(loaded, ids)
    outs, states = _model_reference(loaded.model, ids.to(loaded.model.get_input_embeddings().weight.device))
    for layer, inputs in caps.items():
        assert inputs.device.type == "cpu"
        act = inputs.x if kind == "mamba2" else inputs.v
        assert act.dtype == torch.bfloat16
        y, final, _ = reference_decode(inputs.to("cuda"))
        state_model = states[layer] if kind == "mamba2" else states[layer].transpose(-1, -2)
        assert relerr(y, outs[layer].reshape(y.shape)) < BF16_TOL, layer
        assert relerr(final, state_model) < BF16_TOL, layer


# Full-size random-init slices of the real models (transformers' own initialisation, bf16 on the GPU): every layer's
# capture verified against the layer's own scan output over the first VERIFY_STEPS of 512 tokens. `build` makes
# Mamba-2 and GDN models; KDA is covered at bf16 by test_gpu_bf16_capture's Kimi-Linear checkpoint.
FULL_SIZE = [
    ("nemotron-3-nano", 5),
    ("qwen3.5-9b", 4),
    ("qwen3-next-80b", 4),
]


@pytest.mark.parametrize("preset,layers", FULL_SIZE, ids=[p for p, _ in FULL_SIZE])
def test_full_size_random_init_capture_is_verified(preset, layers):
    from ssmquant.models.build import build_random_model
    from ssmquant.models.capture import VERIFY_TOLERANCE

    loaded = build_random_model(preset, devices="cuda:0", dtype="bfloat16", num_layers=layers, progress=lambda _: None)
    ids = torch.randint(0, 256, (2, 512), generator=torch.Generator().manual_seed(0))
    caps = capture_all(loaded, ids)
    assert caps
    for inputs in caps.values():
        assert inputs.meta["capture_error"] < VERIFY_TOLERANCE[torch.bfloat16], (preset, inputs.meta["layer"])
