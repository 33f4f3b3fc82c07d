"""Calibration text: the shipped corpus or the user's own file, tokenisation, and seeded sequence selection.

Selection (``select_sequences``) is defined on the token stream, so it does not depend on the tokenizer:

- the stream is split by position: the first ``1 - HELDOUT_FRACTION`` of the tokens are the
  *calibration* split, the rest the *held-out* split. The two never share a token, whatever the
  sequence length, batch size or seed, so a later ``calibrate`` can verify on sequences it never saw;
  the *all* split is the whole stream, for an evaluation over a text that nothing calibrated on;
- inside a split, the candidate sequences are the non-overlapping windows of ``length`` tokens starting
  at a seeded offset in [0, slack]; ``batch`` of them are drawn without replacement with a seeded
  permutation and returned in stream order. Sequences of one batch never overlap.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SsmquantError

HELDOUT_FRACTION = 0.2
# "all": the whole text, for a text the model never saw and nothing calibrates on (evaluation only)
SPLITS = ("calibration", "heldout", "all")
CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
# A text file may hold a few undecodable bytes (a stray Latin-1 character); more than this share of
# invalid UTF-8 or control characters (NUL, ESC, ... not tab / newline / form feed) means it is not text.
MAX_NON_TEXT_FRACTION = 0.01
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")


class TextError(SsmquantError, ValueError):
    """Missing text file, too little text for the request, or a bad selection argument."""


def load_text(path: str | os.PathLike | None = None) -> str:
    """The calibration text: ``path`` (the user's ``--text FILE``) or the shipped corpus when None.

    Read as UTF-8 (undecodable bytes replaced). Raises TextError when the file is missing, empty, or not
    text (``check_is_text``).
    """
    if path is None:
        if not CORPUS_PATH.is_file():
            raise TextError(
                f"the shipped calibration corpus is missing ({CORPUS_PATH}); pass your own text with --text FILE"
            )
        p = CORPUS_PATH
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise TextError(f"text file {str(p)!r} {_not_a_file(p)}; pass a UTF-8 text file")
    raw = p.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        raise TextError(f"text file {str(p)!r} is empty")
    check_is_text(raw, text, str(p))
    return text


_FILE_TYPES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_a_file(p: Path) -> str:
    """What is wrong with a path that is not a regular file, in words (read before any byte of it: /dev/zero
    would never end)."""
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "does not exist" if not p.is_symlink() else "is a broken symbolic link"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    what = next((name for test, name in _FILE_TYPES if test(mode)), None)
    return "is not a regular file" + (f" (it is {what})" if what else "")


def check_is_text(raw: bytes, text: str, name: str) -> None:
    """Raise TextError when more than MAX_NON_TEXT_FRACTION of the characters of ``raw`` (decoded as
    ``text`` with replacement) are invalid UTF-8 or control characters: a binary file, or another encoding."""
    invalid = text.count("\ufffd") - raw.count("\ufffd".encode())
    control = len(_CONTROL.findall(text))
    share = (invalid + control) / max(1, len(text))
    if share > MAX_NON_TEXT_FRACTION:
        raise TextError(
            f"text file {name!r} does not look like text: {100 * share:.0f}% of its characters are invalid UTF-8 "
            f"({invalid}) or control characters ({control}); pass a UTF-8 text file (convert another encoding "
            "with e.g. iconv -t utf-8)"
        )


def text_origin(path) -> str:
    """How outputs name the text: the user's file, or the shipped corpus."""
    return str(path) if path is not None else f"shipped:{CORPUS_PATH.name}"


def text_phrase(path) -> str:
    """The text in words, for a console header: the user's file by name, or the shipped corpus."""
    if path is None:
        return "held-out public-domain text (the shipped corpus)"
    return f"the text of {Path(str(path)).name}"


@dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokenisation for byte-level models: token id = UTF-8 byte value + ``offset``.

    ``offset`` leaves room for special tokens placed before the 256 byte ids; the vocabulary must hold
    ``offset + 256`` ids.
    """

    offset: int = 0

    @property
    def vocab_size(self) -> int:
        return self.offset + 256

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) - self.offset for i in ids).decode("utf-8", errors="replace")


def tokenize(text: str, tokenizer=None) -> torch.Tensor:
    """Token ids of ``text`` as a 1-D int64 tensor.

    ``tokenizer`` is a Hugging Face tokenizer (no special tokens are added: sequences are cut from the
    middle of a stream), a ``ByteTokenizer``, or None for plain bytes (``ByteTokenizer()``).
    """
    if tokenizer is None:
        tokenizer = ByteTokenizer()
    if isinstance(tokenizer, ByteTokenizer):
        ids = tokenizer.encode(text)
    else:
        # verbose=False: a corpus is longer than model_max_length on purpose; we cut it ourselves.
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def split_bounds(num_tokens: int, split: str) -> tuple[int, int]:
    """[start, stop) of ``split`` ("calibration", "heldout" or "all") in a stream of ``num_tokens`` tokens."""
    if split not in SPLITS:
        raise TextError(f"unknown split {split!r}; accepted: {', '.join(SPLITS)}")
    if split == "all":
        return 0, num_tokens
    cut = int(num_tokens * (1.0 - HELDOUT_FRACTION))
    return (0, cut) if split == "calibration" else (cut, num_tokens)


def select_sequences(
    tokens: torch.Tensor | list[int],
    batch: int,
    length: int,
    *,
    seed: int = 0,
    split: str = "calibration",
) -> torch.Tensor:
    """``batch`` non-overlapping sequences of ``length`` tokens from ``split`` of ``tokens``: [batch, length].

    Seeded and deterministic (module docstring). Raises TextError with the numbers when the split is too
    short: how many tokens it has, how many sequences of that length fit, and how many were asked for.
    """
    for name, v in (("batch", batch), ("length", length)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TextError(f"{name} must be a positive integer, got {v!r}")
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    start, stop = split_bounds(tokens.numel(), split)
    available = stop - start
    fit = available // length
    if fit < batch:
        raise TextError(
            f"the {split} split has {available} tokens ({tokens.numel()} in all): room for {fit} sequences "
            f"of {length} tokens, {batch} requested; use a longer text (--text), fewer or shorter sequences"
        )
    gen = torch.Generator().manual_seed(int(seed))
    slack = available - fit * length
    offset = start + int(torch.randint(0, slack + 1, (1,), generator=gen))
    chosen = torch.randperm(fit, generator=gen)[:batch].sort().values
    return torch.stack([tokens[offset + int(i) * length : offset + (int(i) + 1) * length] for i in chosen])


def calibration_batch(
    batch: int,
    length: int,
    *,
    tokenizer=None,
    text: str | None = None,
    text_path: str | os.PathLike | None = None,
    seed: int = 0,
    split: str = "calibration",
) -> torch.Tensor:
    """Token ids [batch, length] ready for a prefill: text -> tokens -> ``select_sequences``.

    The text is ``text`` if given, else the file ``text_path``, else the shipped corpus. ``tokenizer`` as
    in ``tokenize`` (None: bytes).
    """
    if text is None:
        text = load_text(text_path)
    return select_sequences(tokenize(text, tokenizer), batch, length, seed=seed, split=split)
