"""State statistics: streaming results equal those computed from the materialised reference states."""

import math

import pytest
import torch

from ssmquant.calibrate import CalibrateError, collect_stats, iter_reference_states
from ssmquant.replay import reference_decode

from .helpers import tiny_gdn, tiny_mamba2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")


@pytest.mark.parametrize("make", [tiny_mamba2, tiny_gdn])
def test_streamed_states_are_the_reference_states(make):
    inp = make(0, batch=2, steps=13)
    _, _, states = reference_decode(inp, return_states=True)  # [B, T, H, rows, N]
    got = {t: s.clone() for t, s in iter_reference_states(inp, every=4)}
    assert sorted(got) == [4, 8, 12]
    for t, s in got.items():
        torch.testing.assert_close(s, states[:, t - 1], atol=0, rtol=0)


def _nearest_rank(values: torch.Tensor, p: float) -> torch.Tensor:
    """Reference nearest-rank percentile along dim 0 by full sort."""
    n = values.shape[0]
    k = max(1, math.ceil(p / 100 * n - 1e-12))
    return values.sort(dim=0).values[k - 1]


@pytest.mark.parametrize("make", [tiny_mamba2, tiny_gdn])
def test_stats_match_materialised_states(make):
    inp = make(1, batch=3, steps=40)
    st = collect_stats(inp, percentiles=[60, 95, 99], chunk=7)  # chunk 7: several top-k folds
    _, _, states = reference_decode(inp, return_states=True)
    row = states.abs().amax(-1)  # [B, T, H, rows]
    samples = row.reshape(-1, *row.shape[2:])  # [B*T, H, rows]
    torch.testing.assert_close(st.row_amax, samples.amax(0), atol=0, rtol=0)
    torch.testing.assert_close(st.row_mean_amax, samples.double().mean(0).float(), rtol=1e-6, atol=0)
    for p in (60, 95, 99):
        torch.testing.assert_close(st.row_percentile(p), _nearest_rank(samples, p), atol=0, rtol=0)
    head = row.amax(-1).reshape(-1, row.shape[2])  # [B*T, H]
    torch.testing.assert_close(st.head_percentile(90), _nearest_rank(head, 90), atol=0, rtol=0)
    torch.testing.assert_close(st.amax_profile(), row.amax(-1).amax(0), atol=0, rtol=0)
    assert st.samples == 120 and st.state_shape == tuple(states.shape[2:])
    summary = st.summary()
    assert summary["samples_per_row"] == 120 and summary["amax_max"] == pytest.approx(float(samples.max()))
    names = st.tensors("layers.1")
    assert set(names) >= {"layers.1.row_amax", "layers.1.row_p99", "layers.1.amax_profile"}


def test_untracked_and_bad_percentiles_are_refused():
    inp = tiny_mamba2(0, batch=1, steps=8)
    st = collect_stats(inp, percentiles=[99])
    with pytest.raises(CalibrateError, match="percentile 95 was not tracked; tracked: 99"):
        st.row_percentile(95)
    with pytest.raises(CalibrateError, match=r"\[50, 100\]"):
        collect_stats(inp, percentiles=[10])
