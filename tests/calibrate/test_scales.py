"""Static scales: shapes and layout, max reproduces the dynamic encoder, clipping beats max where it helps."""

import pytest
import torch

from ssmquant.calibrate import Setting, calibrate_scales, collect_stats, decode_scale, iter_reference_states
from ssmquant.calibrate.scales import MSE_FROM, relative_error_row
from ssmquant.formats import Encoding, parse
from ssmquant.simulate import simulate

from .helpers import HEADS, ROWS, tiny_mamba2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")

KEYS = [
    (e, m, g) for e in ("int8", "fp8_e4m3", "nvfp4") for m in ("max", "percentile90", "mse") for g in ("row", "head")
]


@pytest.fixture(scope="module")
def spiky():
    """A layer where one step of one sequence is 20x louder: a row amax that clipping should sacrifice."""
    inp = tiny_mamba2(3, batch=2, steps=64, spike=20.0)
    st = collect_stats(inp, percentiles=[90])
    return inp, st, calibrate_scales(inp, st, KEYS)


def test_scales_have_the_flashinfer_state_scale_layout(spiky):
    _, st, scales = spiky
    assert set(scales) == set(KEYS)
    for (_enc, _method, gran), s in scales.items():
        assert s.dtype == torch.float32 and tuple(s.shape) == (HEADS, ROWS)
        assert bool((s > 0).all())
        if gran == "head":  # one value per head, repeated over its rows
            assert bool((s == s[:, :1]).all())
    torch.testing.assert_close(scales[("int8", "max", "row")], decode_scale(Encoding.INT8, st.row_amax), atol=0, rtol=0)
    torch.testing.assert_close(scales[("nvfp4", "max", "row")], st.row_amax / (6 * 448), rtol=1e-7, atol=0)


@pytest.mark.parametrize("enc", ["int8", "fp8_e4m3", "nvfp4"])
def test_static_max_scale_of_one_state_reproduces_the_dynamic_encoder(enc):
    inp = tiny_mamba2(0, batch=1, steps=5)
    state = None
    for _, s in iter_reference_states(inp):
        state = s.clone()
    amax = state.abs().amax(-1)[0]  # [H, rows]
    static = parse(f"{enc}:static").fake_quant(state, scale=decode_scale(Encoding(enc), amax))
    dynamic = parse(enc).fake_quant(state)
    torch.testing.assert_close(static, dynamic, atol=0, rtol=0)


def test_clipping_beats_max_where_it_helps(spiky):
    inp, st, scales = spiky
    assert bool((scales[("int8", "percentile90", "row")] <= scales[("int8", "max", "row")]).all())
    assert bool((scales[("int8", "mse", "row")] < scales[("int8", "max", "row")]).any())

    # by construction (multiplier 1 is a candidate): mse's objective on its own samples is <= max's
    def rel_err(scale):
        fmt, first, total = (
            parse("int8:static"),
            int(inp.steps * MSE_FROM),
            torch.zeros(HEADS, ROWS, dtype=torch.float64),
        )
        for t, s in iter_reference_states(inp):
            if t > first:
                total += relative_error_row(s, fmt.fake_quant(s, scale=scale)).sum((0, 3)).double()
        return total

    assert bool((rel_err(scales[("int8", "mse", "row")]) <= rel_err(scales[("int8", "max", "row")]) * (1 + 1e-6)).all())

    # and the simulated output error at the horizon drops when the spike is clipped (int8, conventional)
    names = {k: Setting.parse(f"int8:static[{k}]@conventional") for k in ("max", "percentile90", "mse")}
    variants = [s.variant(static_scale=scales[("int8", k, "row")]) for k, s in names.items()]
    err = simulate(inp, variants, record_every=inp.steps).final("out", stat="last")  # at the last step
    assert err[names["mse"].name] < 0.5 * err[names["max"].name]
    assert err[names["percentile90"].name] < 0.5 * err[names["max"].name]
