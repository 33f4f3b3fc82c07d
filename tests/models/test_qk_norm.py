"""The q / k normalisations of captured and synthetic inputs against transformers' own, bit for bit."""

import pytest
import torch

from ssmquant.models.qk_norm import kda_l2norm, l2norm


@pytest.mark.parametrize(
    "module, ours",
    [
        ("transformers.models.qwen3_next.modeling_qwen3_next", l2norm),
        ("transformers.models.glm5_next.modeling_glm5_next", kda_l2norm),
        ("transformers.models.kimi_linear.modeling_kimi_linear", kda_l2norm),
    ],
)
def test_l2norm_is_the_models_own(module, ours):
    theirs = pytest.importorskip(module).l2norm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 60, generator=g) * torch.exp2(torch.randint(-8, 8, (2, 3, 4, 1), generator=g).float())
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(ours(x.bfloat16()), theirs(x.bfloat16().float()))  # fp32 whatever the input dtype


def test_the_two_formulas_differ_in_the_last_bit():
    """Why each family keeps its own: rsqrt-and-multiply and sqrt-and-divide round differently."""
    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(1))
    a, b = l2norm(x), kda_l2norm(x)
    assert not torch.equal(a, b) and torch.allclose(a, b, rtol=1e-6, atol=0)
