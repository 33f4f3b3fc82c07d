"""Schemes: parsing, write schedules, the speculative early-flush rule."""

import pytest
import torch

from ssmquant.replay import Scheme, SchemeError, parse_scheme, parse_variant, parse_variants
from ssmquant.replay.variants import VariantError


def writes(scheme, steps=40, batch=1):
    return [int(t) + 1 for t in scheme.write_mask(batch, steps)[0].nonzero()[:, 0]]


def test_conventional_writes_every_step_and_replay_every_l():
    assert writes(parse_scheme("conventional"), 5) == [1, 2, 3, 4, 5]
    assert writes(parse_scheme("replay16"), 40) == [16, 32]
    assert writes(parse_scheme("replay"), 40) == [16, 32]  # default L
    assert writes(parse_scheme("replay(4)"), 10) == [4, 8]
    assert writes(parse_scheme("replay1"), 5) == [1, 2, 3, 4, 5]


def test_spec_with_no_drafts_or_one_accepted_draft_equals_replay():
    for spec in ("spec16x0", "spec16x1"):
        assert torch.equal(parse_scheme(spec).write_mask(3, 100), parse_scheme("replay16").write_mask(3, 100))


def test_spec_early_flush_rule():
    # FlashInfer's checkpointing_ssu criterion prev_k + seq_len > max_window: L=16, T=4, every draft
    # accepted: rounds of T + 1 = 5 tokens commit 5; before a round, flush if h + 5 > 16.
    # h: 0 -> 5 -> 10 -> 15 (15 + 5 > 16: flush after token 15) -> 5 -> 10 -> 15 (flush after 30) -> 5 -> 10;
    # the decode ends after token 40 with 10 tokens held and no further round, so no flush there.
    assert writes(parse_scheme("spec16x4"), 40) == [15, 30]
    # explicit accepted counts 4, 0, 2 (commit 5, 1, 3, 5, 1, ...): h 5, 6, 9, 14 (14 + 5 > 16: flush after
    # 14), 1, 4, 9, 10, 13 (13 + 5 > 16: flush after 27)
    assert writes(parse_scheme("spec16x4:a4-0-2"), 30) == [14, 27]
    # the rule before 2026-12-01 (h + 2T > L) flushed after 10, 20, 30: a third more writes for T = 4


def test_spec_with_acceptance_rate_gives_irregular_seeded_intervals():
    s = parse_scheme("spec16x4:p0.5")
    m = s.write_mask(4, 2000)
    assert torch.equal(m, s.write_mask(4, 2000))  # seeded
    assert not torch.equal(m[0], m[1])  # per-sequence acceptance
    gaps = torch.diff(m[0].nonzero()[:, 0])
    assert gaps.min() >= 1 and gaps.max() <= 16 and len(set(gaps.tolist())) > 2
    counts = s.accepted_counts(1, 10000).float()
    # each draft accepted w.p. 0.5 until the first rejection: E[a] = sum_{i=1..4} 0.5^i = 0.9375
    assert abs(float(counts.mean()) - 0.9375) < 0.03


def test_scheme_names_round_trip():
    for spec in ["conventional", "replay16", "replay8:fp32", "spec16x4", "spec16x4:p0.8", "spec8x2:a1-2:seed3:fp16"]:
        s = parse_scheme(spec)
        assert parse_scheme(s.name) == s
        assert s.name == spec


@pytest.mark.parametrize(
    "spec,message",
    [
        ("replayx", "unknown scheme"),
        ("spec4x4", "buffer length >= 1 \\+ draft tokens"),
        ("replay0", "buffer length must be >= 1"),
        ("replay16:int4", "unknown scheme modifier"),
        ("spec16x4:a5", "accepted counts must each lie in \\[0, T=4\\]"),
        ("spec16x4:p1.5", "acceptance rate must lie in \\[0, 1\\]"),
        ("conventional:fp32", "takes no modifiers"),
    ],
)
def test_scheme_errors(spec, message):
    with pytest.raises(SchemeError, match=message):
        parse_scheme(spec)


def test_variants():
    v = parse_variant("int8:sr@replay16")
    assert v.format.name == "int8:sr" and v.scheme == Scheme.replay(16) and v.name == "int8:sr@replay16"
    assert parse_variant("bf16").scheme == Scheme.conventional()
    assert [x.name for x in parse_variants("fp8_e4m3,fp8_e4m3@replay16")] == [
        "fp8_e4m3@conventional",
        "fp8_e4m3@replay16",
    ]
    with pytest.raises(VariantError, match="duplicate variants: int8@conventional"):
        parse_variants(["int8", "int8@conventional"])
    with pytest.raises(VariantError, match="unknown format 'int4'"):
        parse_variant("int4@replay16")
    with pytest.raises(VariantError, match="static format: pass static_scale"):
        parse_variant("int8:static")
