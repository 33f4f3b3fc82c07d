"""Candidate settings: expansion, names, serialisation, bytes, and errors that name the accepted values."""

import pytest

from ssmquant.calibrate import CalibrateError, Setting, build_settings, parse_method, setting_bytes
from ssmquant.calibrate.settings import buffer_bytes, expand_schemes
from ssmquant.formats import parse
from ssmquant.kinds import LayerDims
from ssmquant.replay import parse_scheme

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:transformers .* is not tested")


def test_build_settings_expands_formats_modes_methods_and_schemes():
    s = build_settings(["int8", "fp16"], ["replay", "conventional"], [4, 16], ["rne"], ["max", "mse"], ["row", "head"])
    names = [x.name for x in s]
    # int8: (dynamic + 2 methods x 2 granularities) x 3 schemes; fp16: 3 schemes
    assert len(names) == len(set(names)) == 5 * 3 + 3
    assert "int8@replay4" in names and "int8:static[mse:head]@conventional" in names
    assert "fp16@replay16" in names and not any(n.startswith("fp16:static") for n in names)


def test_explicit_modifiers_restrict_the_expansion():
    s = build_settings(["int8:static:sr"], ["conventional"], [], ["rne", "sr"], ["percentile:99.9"], ["row"])
    assert [x.name for x in s] == ["int8:static:sr[percentile99.9]@conventional"]
    assert [x.name for x in build_settings(["fp8_e4m3:dynamic"], ["replay8"], [], ["rne"], ["max"], ["row"])] == [
        "fp8_e4m3@replay8"
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(roundings=["rtz"]), "unknown rounding 'rtz'; accepted: rne, sr"),
        (dict(calibrations=["kl"]), "unknown calibration method 'kl'; accepted: max"),
        (dict(granularities=["tensor"]), "unknown calibration granularity 'tensor'; accepted: row, head"),
        (dict(candidates=["int4"]), "unknown format 'int4'"),
        (dict(schemes=["replay"], buffer_lens=[0]), "buffer lengths must be integers >= 1"),
        (dict(schemes=["streaming"]), "unknown scheme"),
    ],
)
def test_bad_options_name_the_problem(kwargs, match):
    args = dict(
        candidates=["int8"],
        schemes=["conventional"],
        buffer_lens=[16],
        roundings=["rne"],
        calibrations=["max"],
        granularities=["row"],
    )
    args.update(kwargs)
    with pytest.raises(CalibrateError, match=match):
        build_settings(**args)


def test_percentile_method_range():
    assert parse_method("p99.9").label == "percentile99.9"
    assert parse_method("percentile").percentile == 99.99
    with pytest.raises(CalibrateError, match=r"\[50, 100\]"):
        parse_method("percentile:20")


@pytest.mark.parametrize(
    "name", ["int8:static[mse:head]@replay8", "fp8_e4m3:sr@spec16x4:p0.8", "nvfp4:static[percentile99.9]@conventional"]
)
def test_setting_name_and_dict_round_trip(name):
    s = Setting.parse(name)
    assert s.name == name
    assert Setting.from_dict(s.to_dict()) == s


def test_setting_from_dict_refuses_inconsistent_fields():
    d = Setting.parse("int8@replay16").to_dict()
    d["name"] = "int8@replay8"
    with pytest.raises(CalibrateError, match="does not match its fields"):
        Setting.from_dict(d)
    with pytest.raises(CalibrateError, match="needs a calibration method"):
        Setting(parse("int8:static"), parse_scheme("conventional"))


def test_bytes_per_sequence_state_and_replay_ring():
    dims = LayerDims("mamba2", heads=64, rows=64, state_dim=128, groups=8)
    fp8 = setting_bytes(Setting.parse("fp8_e4m3@replay16"), dims)
    assert fp8["state"] == 64 * 64 * 128 + 4 * 64 * 64  # elements + one FP32 scale per row
    # ring of L + 1 rows: x [H, P] and B [G, N] in bf16, dt [H] in fp32
    assert fp8["buffer"] == 17 * ((64 * 64 + 8 * 128) * 2 + 64 * 4)
    assert fp8["total"] == fp8["state"] + fp8["buffer"]
    assert setting_bytes(Setting.parse("fp8_e4m3@replay16"), dims, count_buffer=False)["total"] == fp8["state"]
    assert buffer_bytes(parse_scheme("conventional"), dims) == 0
    assert buffer_bytes(parse_scheme("spec16x4"), dims) == 21 * ((64 * 64 + 8 * 128) * 2 + 64 * 4)
    static = setting_bytes(Setting.parse("fp8_e4m3:static[max]@replay16"), dims)
    assert static == fp8  # static scales counted like dynamic ones


def test_expand_schemes_deduplicates():
    names = [s.name for s in expand_schemes(["replay", "replay16", "conventional"], [8, 16])]
    assert names == ["replay8", "replay16", "conventional"]
