"""Prompt stores (formats.prompt_store) against SGLang's int8 prefix-cache checkpoint as its source states it
(sglang 0.5.23 mem_cache/mamba_checkpoint_pool.py, Int8CheckpointStore.quantize / dequantize; fact
sglang.int8_checkpoint), written here column by column in float64 as the oracle."""

import math

import pytest
import torch

from ssmquant.formats import FormatError
from ssmquant.formats.prompt_store import parse_prompt_store
from ssmquant.replay import VariantError, parse_variant


def sglang_int8_checkpoint(state: torch.Tensor, live: torch.dtype) -> torch.Tensor:
    """One scale per (head, column), amax over the rows floored at 1e-8, scale = amax / 127 rounded to the live
    dtype, codes round-half-even of x / scale clamped to +-127, restored as code x scale cast to the live dtype."""
    x = state.to(live).double()
    out = torch.empty_like(x)
    for h in range(x.shape[0]):
        for c in range(x.shape[2]):
            col = x[h, :, c]
            amax = max(col.abs().max().item(), 1e-8)
            scale = torch.tensor(float(torch.tensor(amax, dtype=torch.float32) / 127), dtype=live).double().item()
            scale32 = float(torch.tensor(scale, dtype=torch.float32))
            if scale32 == 0:  # the scale underflows the live dtype: code x 0 whatever the code
                out[h, :, c] = 0.0
                continue
            for r in range(x.shape[1]):
                q = float(torch.tensor(col[r].item(), dtype=torch.float32) / scale32)
                code = max(-127.0, min(127.0, float(round(q))))  # Python's round: half to even
                out[h, r, c] = float(torch.tensor(code * scale32, dtype=torch.float32).to(live))
    return out.float()


@pytest.mark.parametrize("live", [torch.float32, torch.bfloat16, torch.float16])
def test_int8col_restores_what_sglangs_checkpoint_pool_restores(live):
    g = torch.Generator().manual_seed(3)
    state = torch.randn(3, 12, 20, generator=g) * torch.logspace(-3, 1, 20)  # columns of very different scale
    state[1, :, 4] = 0  # an all-zero column: amax floored at 1e-8, every code 0
    state[1, :, 5] = 1e-7  # a column whose scale underflows float16
    state[2, 5, 7] = 0.5 * state[2, :, 7].abs().max()  # a mid-grid value
    got = parse_prompt_store("int8col").restore(state, live)
    want = sglang_int8_checkpoint(state, live)
    assert torch.equal(got, want)
    assert (got[1, :, 4] == 0).all()
    # the error is that of 255 levels per column: half a step of the column's scale, plus the scale's and the
    # result's rounding to the live dtype (unit roundoff eps); a float16 scale that underflows loses the column
    eps = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}[live]
    live_state = state.to(live).float()
    amax = live_state.abs().amax(dim=1, keepdim=True)
    bound = 0.5 * amax / 127 * (1 + 2 * eps) + 2 * eps * amax
    kept = (amax / 127).to(live) > 0
    assert ((got - live_state).abs() <= bound)[kept.expand_as(got)].all()


def test_a_prompt_store_is_named_after_plus_and_restores_into_a_float_state_only():
    v = parse_variant("bf16@conventional+int8col")
    assert v.prompt_store == "int8col" and v.name == "bf16@conventional+int8col"
    assert parse_variant(v.name) == v
    assert parse_variant("fp32@replay16+int8col~flashinfer").name == "fp32@replay16+int8col~flashinfer"
    with pytest.raises(VariantError, match="restores into a float live state \\(fp32, bf16, fp16\\), not int8"):
        parse_variant("int8@conventional+int8col")
    with pytest.raises(VariantError, match="unknown prompt store 'int4'; accepted: int8col"):
        parse_variant("bf16@conventional+int4")
    with pytest.raises(VariantError, match="name a prompt store after"):
        parse_variant("bf16@conventional+")
    with pytest.raises(FormatError, match="accepted: int8col"):
        parse_prompt_store("fp8")
    assert math.isclose(parse_prompt_store("int8col").bytes_per_head(128, 128, 2), 128 * 128 + 256)
