"""Calibration text: loading, tokenisation, seeded selection, disjoint calibration / held-out splits."""

from __future__ import annotations

import pytest
import torch

from ssmquant.models import (
    CORPUS_PATH,
    ByteTokenizer,
    TextError,
    calibration_batch,
    load_text,
    select_sequences,
    tokenize,
)
from ssmquant.models.text import HELDOUT_FRACTION, split_bounds

POSITIONS = torch.arange(10_000)  # token value == its position: overlaps are visible as shared values


def test_selection_shape_and_determinism():
    a = select_sequences(POSITIONS, 4, 100, seed=1)
    assert a.shape == (4, 100) and a.dtype == torch.long
    assert torch.equal(a, select_sequences(POSITIONS, 4, 100, seed=1))
    assert not torch.equal(a, select_sequences(POSITIONS, 4, 100, seed=2))
    # contiguous windows, in stream order, not overlapping
    assert (a[:, 1:] - a[:, :-1] == 1).all()
    starts = a[:, 0]
    assert (starts[1:] - starts[:-1] >= 100).all()


@pytest.mark.parametrize("length", [7, 64, 500])
def test_calibration_and_heldout_never_share_a_token(length):
    cut = int(POSITIONS.numel() * (1 - HELDOUT_FRACTION))
    for seed in range(5):
        cal = select_sequences(POSITIONS, 3, length, seed=seed, split="calibration")
        held = select_sequences(POSITIONS, 3, length, seed=seed, split="heldout")
        assert int(cal.max()) < cut <= int(held.min())
        assert not set(cal.flatten().tolist()) & set(held.flatten().tolist())


def test_too_little_text_names_the_numbers():
    with pytest.raises(
        TextError, match=r"heldout split has 2000 tokens.*room for 3 sequences of 600 tokens, 4 requested"
    ):
        select_sequences(POSITIONS, 4, 600, split="heldout")


def test_bad_selection_arguments():
    with pytest.raises(TextError, match="unknown split 'test'; accepted: calibration, heldout"):
        select_sequences(POSITIONS, 1, 10, split="test")
    with pytest.raises(TextError, match="length must be a positive integer"):
        select_sequences(POSITIONS, 1, 0)
    assert split_bounds(100, "heldout") == (80, 100)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — ok"
    ids = tokenize(text, tok)
    assert ids.dtype == torch.long and int(ids.max()) < 256
    assert tok.decode(ids.tolist()) == text
    assert tokenize(text).tolist() == list(text.encode("utf-8"))
    assert ByteTokenizer(offset=3).encode("A") == [65 + 3]


def test_hf_tokenizer(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    text = "the quick brown fox " * 50
    ids = tokenize(text, tok)
    assert ids.numel() < len(text)  # merges happened: not bytes
    batch = calibration_batch(2, 16, tokenizer=tok, text=text, seed=0)
    assert batch.shape == (2, 16)


def test_user_text_file(tmp_path):
    f = tmp_path / "mine.txt"
    f.write_text("All happy families are alike. " * 100, encoding="utf-8")
    assert load_text(f).startswith("All happy")
    ids = calibration_batch(3, 50, text_path=f, seed=4, split="heldout")
    assert ids.shape == (3, 50)
    with pytest.raises(TextError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(TextError, match="is empty"):
        load_text(tmp_path / "empty.txt")


def test_shipped_corpus_or_a_clear_message():
    if CORPUS_PATH.is_file():
        text = load_text()
        assert len(text) > 10_000
        assert calibration_batch(2, 256, seed=0).shape == (2, 256)
    else:
        with pytest.raises(TextError, match="corpus is missing.*--text FILE"):
            load_text()
