"""A prompt, then decoding, in the fused kernels: each slot starts from the prompt's state stored in its format
(``replay.naive.stored_initial_states``) while the shared FP32 reference starts from the state itself.

Oracle: the torch reference (`simulate(backend="torch")`) on the same inputs, with the tolerances of the kernels'
own tests (test_emulation_kernels.py, test_kda_kernel.py: errors pooled over (batch, head) within 1e-5 of the
reference norm plus the measured flip slack). On a GPU the KDA variants the CUDA kernel covers run there.
"""

import pytest
import torch

from ssmquant import kinds
from ssmquant.engines.emulation import engine_step
from ssmquant.kernels import emulate_triton, fused_kernels
from ssmquant.replay import parse_variants
from ssmquant.replay.naive import emulate
from ssmquant.simulate import simulate, triton_interpreting

from ..replay.helpers import gdn_inputs, kda_inputs, mamba2_inputs
from .test_emulation_kernels import SLACK, assert_metrics_close
from .test_kda_kernel import REF_RTOL
from .test_kda_kernel import SLACK as KDA_SLACK

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]

# bf16@conventional+int8col: the prompt's state kept in SGLang's int8 prefix cache, then decoded in bf16
VARIANTS = ["fp32", "bf16@replay4", "fp8_e4m3", "int8:sr@replay4", "nvfp4", "nvfp4:sr@replay4", "fp8_e4m3:head",
            "bf16@conventional+int8col"]  # fmt: skip


def layer(kind):
    """Small awkward shapes in the interpreter (state dimension 48: whole NVFP4 blocks); the real models' on a GPU."""
    if kind == "mamba2":
        if GPU:
            return mamba2_inputs(batch=2, steps=96, heads=64, head_dim=64, groups=8, state=128, device=DEVICE)
        return mamba2_inputs(batch=2, steps=21, heads=2, head_dim=12, groups=1, state=48)
    make = gdn_inputs if kind == "gdn" else kda_inputs
    if GPU:
        heads = (16, 32) if kind == "gdn" else (64, 64)
        return make(batch=2, steps=96, key_heads=heads[0], value_heads=heads[1], dk=128, dv=128, device=DEVICE)
    return make(batch=2, steps=21, key_heads=1, value_heads=2, dk=48, dv=12)


@pytest.mark.parametrize("kind", kinds.names())
def test_decoding_after_a_prompt_matches_the_torch_reference(kind):
    inp = layer(kind).validate()
    prompt = inp.steps // 2
    after = kinds.after_prompt(inp, prompt)
    variants = parse_variants(VARIANTS)
    ref = simulate(after, variants, backend="torch")
    got = emulate_triton(after, variants).double().cpu().numpy()
    slack, rtol = (KDA_SLACK, REF_RTOL) if kind == "kda" else (SLACK[kind], 1e-5)
    for i, name in enumerate(VARIANTS):
        try:
            assert_metrics_close(ref.mean[i], got[i], slack, pooled=True, ref_rtol=rtol)
        except AssertionError as err:
            raise AssertionError(f"{kind} {name} ({fused_kernels(after, [variants[i]])[0]}): {err}") from None
    assert (got[VARIANTS.index("fp32"), ..., 0] == 0).all()
    # the stored prompt state shows from the first decode step on
    assert (got[VARIANTS.index("fp8_e4m3"), 0, ..., 0].sum() > 0).all()
    # the int8 prefix cache adds its rounding to bf16's at the first step
    cached, plain = got[VARIANTS.index("bf16@conventional+int8col"), 0, ..., 0], got[VARIANTS.index("bf16@replay4"), 0, ..., 0]
    assert (cached.sum() > plain.sum()).all()


def test_engine_profiles_start_from_the_stored_state_too():
    """The flashinfer and vllm profiles' kernel (kernels.mamba2_engine) after a prompt, against their torch steps
    (engines.emulation): conventional stores the prompt's state in the variant's format, replay holds it as its
    first checkpoint (8-bit: the engine's own per-row encoding)."""
    inp = kinds.after_prompt(layer("mamba2").validate(), 10)
    names = ["int8@replay4~flashinfer", "bf16@replay4~flashinfer", "fp16:sr@conventional~flashinfer",
             "int16@conventional~flashinfer", "fp16@conventional~vllm"]  # fmt: skip
    variants = parse_variants(names)
    # below simulate, whose profile checks want FlashInfer's own head shapes (64 x 128) for the 8-bit checkpoint
    ref = emulate(inp, variants, engine_steps=engine_step).metrics.double().cpu().numpy()
    got = emulate_triton(inp, variants).double().cpu().numpy()
    for i, name in enumerate(names):
        try:
            assert_metrics_close(ref[i], got[i], SLACK["mamba2"], pooled=True)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
