"""Decoding schemes: when the stored state is rewritten (and so rounded), and how inputs are buffered.

- conventional: the state is loaded, updated and stored every token: a write after every step.
- replay(L): checkpoint + ring buffer of the last inputs; the checkpoint is rewritten when the buffer
  holds L entries (a write after steps L, 2L, ...). Buffered vector inputs are stored in the buffer
  dtype (bf16 by default; the per-head scalars dt and g stay FP32, as engines keep gates in FP32).
- spec(L, T, accept): replay with speculative decoding. Each verify round processes T + 1 tokens (the
  last committed token's successor and T drafts); `a` drafts are accepted and one more token (the
  target's own) is committed, so a round commits a + 1 tokens. Rejected drafts are rolled back by
  moving a pointer and never reach the checkpoint. Before a round, if the buffer holds h committed
  tokens and h + T + 1 > L, the checkpoint is flushed (it summarises only committed tokens); it is
  also flushed when h reaches L. So flush intervals become irregular. This is FlashInfer's
  `checkpointing_ssu` with max_window = L and T + 1 tokens per call (its criterion `prev_k + seq_len >
  MAX_WINDOW`, kernel_checkpointing_ssu.cuh, 0.7.2.post1; ring of L + T + 1 rows). Acceptance is given as
  explicit counts per
  round, or as a per-draft acceptance probability p (each draft accepted with probability p until the
  first rejection, seeded per sequence).

A scheme turns into a write schedule: a bool mask [batch, steps] over committed tokens, True where
the state is stored after that step. Everything downstream (torch reference, Triton kernels) consumes
only this mask and the buffer dtype.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import torch

from ..errors import SsmquantError


class SchemeError(SsmquantError, ValueError):
    """A scheme spec or option is not valid."""


class SchemeKind(enum.Enum):
    CONVENTIONAL = "conventional"
    REPLAY = "replay"
    SPEC = "spec"


BUFFER_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DEFAULT_BUFFER_LEN = 16


@dataclass(frozen=True)
class Scheme:
    """A decoding scheme. Build it with `parse_scheme` or the constructors below."""

    kind: SchemeKind
    buffer_len: int = 1
    draft_tokens: int = 0
    accept_rate: float | None = None  # spec: per-draft acceptance probability
    accept: tuple[int, ...] | None = None  # spec: explicit accepted-draft counts per round (cycled)
    buffer_dtype: str = "bf16"
    accept_seed: int = 0

    def __post_init__(self):
        if self.buffer_dtype not in BUFFER_DTYPES:
            raise SchemeError(f"buffer dtype {self.buffer_dtype!r} unknown; accepted: {', '.join(BUFFER_DTYPES)}")
        if self.buffer_len < 1:
            raise SchemeError(f"buffer length must be >= 1, got {self.buffer_len}")
        if self.kind is SchemeKind.CONVENTIONAL and self.buffer_len != 1:
            raise SchemeError("conventional decoding has no buffer")
        if self.kind is SchemeKind.SPEC:
            t = self.draft_tokens
            if t < 0:
                raise SchemeError(f"draft tokens must be >= 0, got {t}")
            if self.buffer_len < t + 1:
                raise SchemeError(
                    f"speculative replay needs buffer length >= 1 + draft tokens: L={self.buffer_len}, T={t}"
                )
            if self.accept_rate is not None and not 0.0 <= self.accept_rate <= 1.0:
                raise SchemeError(f"acceptance rate must lie in [0, 1], got {self.accept_rate}")
            if self.accept is not None:
                if not self.accept or any(a < 0 or a > t for a in self.accept):
                    raise SchemeError(f"accepted counts must each lie in [0, T={t}], got {list(self.accept)}")
            if self.accept is not None and self.accept_rate is not None:
                raise SchemeError("give either accepted counts or an acceptance rate, not both")

    # -- constructors -------------------------------------------------------------------------------
    @staticmethod
    def conventional() -> Scheme:
        return Scheme(SchemeKind.CONVENTIONAL)

    @staticmethod
    def replay(buffer_len: int = DEFAULT_BUFFER_LEN, buffer_dtype: str = "bf16") -> Scheme:
        return Scheme(SchemeKind.REPLAY, buffer_len=buffer_len, buffer_dtype=buffer_dtype)

    @staticmethod
    def spec(
        buffer_len: int,
        draft_tokens: int,
        accept: float | list[int] | tuple[int, ...] = 1.0,
        buffer_dtype: str = "bf16",
        seed: int = 0,
    ) -> Scheme:
        if isinstance(accept, (list, tuple)):
            return Scheme(
                SchemeKind.SPEC, buffer_len, draft_tokens, None, tuple(int(a) for a in accept), buffer_dtype, seed
            )
        return Scheme(SchemeKind.SPEC, buffer_len, draft_tokens, float(accept), None, buffer_dtype, seed)

    # -- naming -------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Canonical spec string; `parse_scheme(s.name) == s`."""
        if self.kind is SchemeKind.CONVENTIONAL:
            return "conventional"
        base = (
            f"replay{self.buffer_len}"
            if self.kind is SchemeKind.REPLAY
            else f"spec{self.buffer_len}x{self.draft_tokens}"
        )
        if self.kind is SchemeKind.SPEC:
            if self.accept is not None:
                base += ":a" + "-".join(str(a) for a in self.accept)
            elif self.accept_rate is not None and self.accept_rate != 1.0:
                base += f":p{self.accept_rate:g}"
            if self.accept_seed:
                base += f":seed{self.accept_seed}"
        if self.buffer_dtype != "bf16":
            base += f":{self.buffer_dtype}"
        return base

    def __str__(self) -> str:
        return self.name

    @property
    def buffer_torch_dtype(self) -> torch.dtype:
        return BUFFER_DTYPES[self.buffer_dtype]

    @property
    def rounds_buffer(self) -> bool:
        """True when buffered inputs are stored in a dtype other than FP32 (replay and spec)."""
        return self.kind is not SchemeKind.CONVENTIONAL and self.buffer_dtype != "fp32"

    # -- schedule -----------------------------------------------------------------------------------
    def accepted_counts(self, batch: int, rounds: int) -> torch.Tensor:
        """Accepted drafts per verify round, int64 [batch, rounds] (spec only)."""
        t = self.draft_tokens
        if self.accept is not None:
            reps = -(-rounds // len(self.accept))
            row = torch.tensor(self.accept * reps, dtype=torch.int64)[:rounds]
            return row.expand(batch, rounds).clone()
        p = 1.0 if self.accept_rate is None else self.accept_rate
        gen = torch.Generator().manual_seed(int(self.accept_seed))
        # Each draft is accepted with probability p until the first rejection.
        ok = torch.rand(batch, rounds, max(t, 1), generator=gen) < p
        return ok[..., :t].to(torch.int64).cumprod(-1).sum(-1)

    def write_mask(self, batch: int, steps: int) -> torch.Tensor:
        """bool [batch, steps]: True where the state is stored (rounded) after that decode step."""
        if steps < 1 or batch < 1:
            raise SchemeError(f"need batch >= 1 and steps >= 1, got batch={batch}, steps={steps}")
        if self.kind is SchemeKind.CONVENTIONAL:
            return torch.ones(batch, steps, dtype=torch.bool)
        if self.kind is SchemeKind.REPLAY:
            t = torch.arange(steps)
            return ((t + 1) % self.buffer_len == 0).expand(batch, steps).clone()
        return self._spec_mask(batch, steps)

    def _spec_mask(self, batch: int, steps: int) -> torch.Tensor:
        L, T = self.buffer_len, self.draft_tokens
        accepted = self.accepted_counts(batch, steps)  # at least one token per round: <= steps rounds
        mask = torch.zeros(batch, steps, dtype=torch.bool)
        for b in range(batch):
            held, pos, r = 0, 0, 0
            acc = accepted[b].tolist()
            while pos < steps:
                if held > 0 and held + T + 1 > L:  # the round's T + 1 tokens would not fit the window
                    mask[b, pos - 1] = True
                    held = 0
                commit = min(acc[r] + 1, steps - pos)
                r += 1
                pos += commit
                held += commit
                if held >= L:  # buffer full
                    mask[b, pos - 1] = True
                    held = 0
        return mask


_REPLAY_RE = re.compile(r"^replay(?:\(?(\d+)\)?)?$")
_SPEC_RE = re.compile(r"^spec\(?(\d+)\s*[x,]\s*(\d+)\)?$")
SCHEME_HELP = (
    "conventional | replay[L] (e.g. replay16) | spec<L>x<T> (e.g. spec16x4), with optional modifiers "
    ":bf16|:fp32|:fp16 (buffer dtype), and for spec :p<rate> (e.g. :p0.8), :a<n-n-...> (accepted counts), :seed<N>"
)


def parse_scheme(spec: str | Scheme, *, default_buffer_len: int = DEFAULT_BUFFER_LEN) -> Scheme:
    """Parse "conventional", "replay", "replay16", "replay16:fp32", "spec16x4:p0.8" into a Scheme.

    A bare "replay" takes `default_buffer_len`. Unknown names raise SchemeError listing the accepted forms.
    """
    if isinstance(spec, Scheme):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise SchemeError(f"scheme must be a non-empty string; accepted: {SCHEME_HELP}")
    head, *mods = [p.strip().lower() for p in spec.strip().split(":")]
    buffer_dtype, rate, counts, seed = "bf16", None, None, 0
    for mod in mods:
        if mod in BUFFER_DTYPES:
            buffer_dtype = mod
        elif re.fullmatch(r"p\d*\.?\d+", mod):
            rate = float(mod[1:])
        elif re.fullmatch(r"a\d+(-\d+)*", mod):
            counts = [int(a) for a in mod[1:].split("-")]
        elif re.fullmatch(r"seed\d+", mod):
            seed = int(mod[4:])
        else:
            raise SchemeError(f"unknown scheme modifier {mod!r} in {spec!r}; accepted: {SCHEME_HELP}")
    if head == "conventional":
        if mods:
            raise SchemeError(f"conventional decoding takes no modifiers, got {spec!r}")
        return Scheme.conventional()
    m = _REPLAY_RE.match(head)
    if m:
        if rate is not None or counts is not None or seed:
            raise SchemeError(f"acceptance options apply to spec schemes only, got {spec!r}")
        return Scheme.replay(int(m.group(1)) if m.group(1) else default_buffer_len, buffer_dtype)
    m = _SPEC_RE.match(head)
    if m:
        accept = counts if counts is not None else (1.0 if rate is None else rate)
        if counts is not None and rate is not None:
            raise SchemeError(f"give either :p<rate> or :a<counts>, not both, in {spec!r}")
        return Scheme.spec(int(m.group(1)), int(m.group(2)), accept, buffer_dtype, seed)
    raise SchemeError(f"unknown scheme {head!r} in {spec!r}; accepted: {SCHEME_HELP}")
