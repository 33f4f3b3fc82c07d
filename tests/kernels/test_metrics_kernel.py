"""The fused teacher-forced metrics (`kernels.metrics.pair_metrics_triton`) against their torch definition
(`evaluate.metrics.reference_step` / `compare_step`, float64).

Both compute the same float64 expressions from exactly converted logits; only the order of the vocabulary sums
differs, so kl, nll and delta nll agree to float64 rounding: |kernel - torch| <= 1e-12 + 1e-9 |torch| (the KL of
two nearby distributions is a sum of terms up to |log p| apart whose result is ~1e-8 of them, hence the relative
slack), and top-1 agreement exactly (first index of the maximum, ties included). Tiny shapes in Triton's CPU
interpreter; the same on a GPU.
"""

import pytest
import torch

from ssmquant.evaluate.metrics import compare_step, reference_step
from ssmquant.simulate import triton_interpreting

from .test_multi_variant import DEVICE, GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU and not triton_interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")]  # fmt: skip

ATOL, RTOL = 1e-12, 1e-9


def _torch_metrics(p, q, target):
    ref = reference_step(p.float(), target)
    return compare_step(ref, q.float(), target), ref.nll


def _assert_close(got, want):
    assert torch.all((got - want).abs() <= ATOL + RTOL * want.abs()), (got - want).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1000, 5000])
@pytest.mark.parametrize("noise", [1e-3, 1.0])
def test_pair_metrics_match_the_float64_definition(dtype, vocab, noise):
    from ssmquant.kernels.metrics import pair_metrics_triton

    g = torch.Generator().manual_seed(vocab)
    p = (4 * torch.randn(24, vocab, generator=g)).to(dtype)
    q = (p.float() + noise * torch.randn(24, vocab, generator=g)).to(dtype)
    q[3] = p[3]  # identical rows: KL exactly 0, agreement 1, delta nll 0
    target = torch.randint(0, vocab, (24,), generator=g)
    got, flags = pair_metrics_triton(p.to(DEVICE), q.to(DEVICE), target.to(DEVICE))
    want, nll = _torch_metrics(p, q, target)
    assert flags.eq(0).all()
    got = got.cpu()
    _assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    _assert_close(got[2], want[2])
    _assert_close(got[3], nll)
    assert got[0, 3] == 0 and got[1, 3] == 1 and got[2, 3] == 0
    assert (got[0] >= 0).all()


def test_top1_ties_take_the_first_index_as_torch_does():
    from ssmquant.kernels.metrics import pair_metrics_triton

    vocab = 5000
    p = torch.zeros(4, vocab)
    q = torch.zeros(4, vocab)
    p[0, [10, 4000]] = 3.0  # tie in the reference: argmax 10
    q[0, 4000] = 3.0  # the variant's single max at the reference's second: disagree
    p[1, [2049, 2050]] = 1.0  # tie across one block's lanes, q tied at the same places: agree
    q[1, [2049, 2050]] = 1.0
    p[2, [5, 2053]] = 2.0  # the same lane of two blocks: the first block's
    q[2, 5] = 2.0
    p[3, vocab - 1] = 1.0  # in the last, partial block
    q[3, vocab - 1] = 1.0
    target = torch.tensor([0, 1, 2, 3])
    got, _ = pair_metrics_triton(p.to(DEVICE), q.to(DEVICE), target.to(DEVICE))
    want, _ = _torch_metrics(p, q, target)
    assert want[1].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert torch.equal(got[1].cpu(), want[1])


def test_non_finite_rows_are_flagged_and_others_measured():
    from ssmquant.kernels.metrics import REFERENCE_NONFINITE, VARIANT_NONFINITE, pair_metrics_triton

    g = torch.Generator().manual_seed(1)
    p, q = torch.randn(5, 300, generator=g), torch.randn(5, 300, generator=g)
    q[1, 7] = float("nan")
    q[2, 299] = float("inf")
    p[3, 0] = float("-inf")
    target = torch.zeros(5, dtype=torch.long)
    got, flags = pair_metrics_triton(p.to(DEVICE), q.to(DEVICE), target.to(DEVICE))
    assert flags.tolist() == [0, VARIANT_NONFINITE, VARIANT_NONFINITE, REFERENCE_NONFINITE, 0]
    want, nll = _torch_metrics(p, q, target)
    for r in (0, 4):
        _assert_close(got[:3, r].cpu(), want[:, r])
        _assert_close(got[3, r].cpu(), nll[r])


def test_bad_shapes_are_refused():
    from ssmquant.kernels.metrics import pair_metrics_triton

    with pytest.raises(ValueError, match=r"\[R, V\]"):
        pair_metrics_triton(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        pair_metrics_triton(torch.zeros(3, 2).t(), torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
