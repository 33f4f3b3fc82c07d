"""Spec strings: parsing, canonical names, errors listing the accepted values."""

import pytest

from ssmquant import formats as F


@pytest.mark.parametrize(
    "spec,name",
    [
        ("fp8_e4m3", "fp8_e4m3"),
        ("int8", "int8"),
        ("nvfp4", "nvfp4"),
        ("int8:sr", "int8:sr"),
        ("fp8_e4m3:row", "fp8_e4m3"),
        ("int8:head", "int8:head"),
        ("INT8:SR:HEAD", "int8:head:sr"),
        ("nvfp4:static:rows8", "nvfp4:rows8:static"),
        ("bf16:sr", "bf16:sr"),
        ("fp32", "fp32"),
    ],
)
def test_parse_and_canonical_name(spec, name):
    fmt = F.parse(spec)
    assert fmt.name == name
    assert F.parse(fmt.name) == fmt


def test_parse_defaults():
    fmt = F.parse("fp8_e4m3")
    assert fmt.granularity == F.PER_ROW and fmt.scale_mode is F.ScaleMode.DYNAMIC and fmt.rounding is F.Rounding.RNE


@pytest.mark.parametrize(
    "spec,message",
    [
        ("fp4", "unknown format 'fp4'.*accepted encodings: fp32, bf16, fp16, fp8_e4m3, int8, nvfp4"),
        ("int8:fast", "unknown modifier 'fast'.*accepted modifiers"),
        ("bf16:head", "bf16 has no scale"),
        ("fp32:sr", "stochastic rounding does not apply"),
        ("int8:sr:rne", "sets the rounding twice"),
        ("", "non-empty string"),
    ],
)
def test_parse_errors(spec, message):
    with pytest.raises(F.FormatError, match=message):
        F.parse(spec)


def test_the_new_fp8_encodings_are_parsed_sized_and_scaled_from_their_specs():
    from ssmquant.formats import Encoding, parse

    e5 = parse("fp8_e5m2:head")
    assert e5.encoding is Encoding.FP8_E5M2 and e5.encoding.max_code == 57344.0 and e5.encoding.scaled
    assert parse("e5m2").encoding is Encoding.FP8_E5M2
    cast = parse("fp8_e4m3_cast:sr")
    assert not cast.encoding.scaled and cast.bytes_per_state((2, 64, 128)) == 2 * 64 * 128
    assert parse("fp8_e5m2").bytes_per_state((2, 64, 128)) == 2 * 64 * 128 + 2 * 64 * 4
