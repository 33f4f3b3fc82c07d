"""The decode loop of `evaluate`: the FP32-state reference and the variants, folded into one batch.

A *slice* is ``batch`` sequences decoded under one setting: the reference (``REFERENCE``) or a variant
(its index). A *run* is one transformers cache and one forward per decode step over the slices it folds
into its batch, slice j being sequences ``j * batch .. (j + 1) * batch``. A *pass* is a set of runs in
lockstep over all decode steps. The folded plan (``evaluate``'s default on a GPU) is one pass of one run
holding every slice: one forward per step for the reference and all variants together; when that does not
fit in memory, passes of the reference plus a chunk of variants. ``fold=False`` (the CPU's default) gives one
run per slice.

Folding changes nothing but the batch the model sees: every slice reads the same token ids, and after the
forward each variant's slice of every SSM state is stored in its format (``StateWriter`` with the slice's
offset) while the reference slice is left untouched. Each slice's logits are compared to the reference
slice's of the same run. A model whose every op computes row b of a batch independently of the batch
size gives bit-identical results folded or not; GEMM kernels that pick their blocking by the batch size
(CPU and GPU alike) can change the last bits of every slice, reference included (README.md).

Per step the loop adds no host synchronisation of its own: metrics are written into device tensors, and
the finiteness checks (reference logits, stored states) are read once every ``CHECK_EVERY`` steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sizing import format_seconds, needs_revision
from .decode import TeacherForced
from .metrics import compare_step, reference_step
from .states import EvalError, SSMLayer, StateWriter, prepare_states

REFERENCE = -1
# Steps between the loop's host reads of its on-device checks (and progress lines): rare enough that the host
# stays ahead of the device, often enough that a non-finite value stops the run soon after it appears.
CHECK_EVERY = 16
# A folded run's batch on the CPU is padded to a multiple of this many rows. torch's vectorised CPU loops
# compute the last (numel mod 2 x vector width) elements of an elementwise op with a scalar loop whose exp /
# log differ in the last bits from the vector ones, so the rows at the end of a small tensor (e.g. [rows,
# heads] gates) would differ from the same sequence's rows elsewhere in the batch. 16 rows (twice AVX2's 8
# floats; AVX-512's 2 x 16 with any even number of heads) made every slice of the tested models bit-identical
# (tests/evaluate/test_fold.py). CUDA kernels compute every element with the same code, so no padding there.
CPU_ROW_MULTIPLE = 16
# A progress line with the measured rate and time left every this many seconds (after the first estimate).
REPORT_EVERY_S = 30.0


@dataclass(frozen=True)
class Pass:
    """One pass over the decode steps: ``runs`` in lockstep, each a tuple of slices (REFERENCE or a variant
    index) folded into that run's batch, in order (the first run holds the reference first). ``aliases``:
    variants in an exact format (FP32), whose run would be the reference's bit for bit: they are compared
    with the reference's logits instead of being decoded. ``row_multiple``: a folded run's batch is padded
    (with copies of the reference's sequences, whose outputs are ignored) to a multiple of this many rows."""

    runs: tuple[tuple[int, ...], ...]
    aliases: tuple[int, ...] = ()
    row_multiple: int = 1

    @property
    def variants(self) -> list[int]:
        return [s for run in self.runs for s in run if s != REFERENCE] + list(self.aliases)

    @property
    def slices(self) -> int:
        """Sequence batches this pass evaluates per step (the reference, and every variant it measures)."""
        return sum(len(run) for run in self.runs) + len(self.aliases)


def plan_passes(
    n_variants: int, fold: bool, per_pass: int | None = None, exact: frozenset[int] = frozenset(), row_multiple: int = 1
) -> list[Pass]:
    """The passes that decode the reference and ``n_variants`` variants.

    fold: one run per pass holding the reference and up to ``per_pass`` of the variants not in ``exact``
    (default: all), so ceil(decoded / per_pass) passes; the ``exact`` variants are aliases of the first
    pass's reference. Otherwise one pass of 1 + n_variants runs of one slice each (every variant decoded).
    """
    if not fold:
        return [Pass(((REFERENCE,), *((i,) for i in range(n_variants))))]
    decoded = [i for i in range(n_variants) if i not in exact]
    aliases = tuple(i for i in range(n_variants) if i in exact)
    k = max(1, len(decoded) if per_pass is None else min(per_pass, len(decoded)))
    chunks = [tuple(decoded[i : i + k]) for i in range(0, len(decoded), k)] or [()]
    return [Pass(((REFERENCE, *c),), aliases if n == 0 else (), row_multiple) for n, c in enumerate(chunks)]


class Clock:
    """Progress of the whole evaluation in decode steps (all passes), measured on the device's time."""

    def __init__(self, total_steps: int, device: torch.device, notify: Callable[[str], None] | None):
        self.total, self.device, self.notify = total_steps, device, notify
        self.done = 0
        self.t_start: float | None = None  # after the first step (the first forward allocates the caches)
        self.start_done = 0
        self.last_report = 0.0
        self.estimated = False
        # (decode steps done, time, rate) at the first estimate: revised once at a later check when the rate
        # since then differs by sizing.needs_revision's rule (the first steps carry a cold cache's compiles)
        self.first_estimate: tuple[int, float, float] | None = None
        self.revised = False
        # (decode steps done, host time) at every check: the loop has just read a device flag there, so the
        # device is idle and the host time is the device's; ``window_rates`` turns them into steps/s per window
        self.marks: list[tuple[int, float]] = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step(self, pass_no: int, passes: int, t: int, steps: int, check: bool) -> None:
        """After decode step t of a pass. ``check``: the loop synchronised anyway (a window boundary)."""
        self.done += 1
        if check:
            self.marks.append((self.done, time.perf_counter()))
        if self.notify is None:
            return
        if self.t_start is None:
            self.t_start, self.start_done = self._now(), self.done
            return
        measured = self.done - self.start_done
        if not self.estimated and measured >= 2 and self.total > 8:
            self._line(pass_no, passes, t, steps, estimate=True)
            self.estimated = True
        elif check and not self.revised and self.first_estimate is not None and self.done < self.total:
            self.revised = True
            self._revise()
        elif check and time.perf_counter() - self.last_report >= REPORT_EVERY_S:
            self._line(pass_no, passes, t, steps, estimate=False)

    def _revise(self) -> None:
        """A second estimate from the steps since the first one alone, printed when the rates differ."""
        done0, t0, rate0 = self.first_estimate
        now = self._now()
        if self.done - done0 < 2:
            return
        rate = (self.done - done0) / max(now - t0, 1e-9)
        if not needs_revision(rate0, rate):
            return
        self.last_report = time.perf_counter()
        self.notify(
            f"revised estimate: about {format_seconds((self.total - self.done) / rate)} for the "
            f"{self.total - self.done} decode steps left ({rate:.3g} steps/s over the last {self.done - done0} "
            f"steps; the first steps ran at {rate0:.3g}: kernel compiles, graph recording)"
        )

    def window_rates(self) -> list[float]:
        """Decode steps/s in each window between consecutive checks (``CHECK_EVERY`` steps, the last window of
        a pass shorter), the first window starting at the first check: a rate that falls from window to window
        is a per-step cost that grows with the position (README.md, "Speed")."""
        return [
            round((d1 - d0) / max(t1 - t0, 1e-9), 3)
            for (d0, t0), (d1, t1) in zip(self.marks, self.marks[1:])
            if d1 > d0
        ]

    def _line(self, pass_no: int, passes: int, t: int, steps: int, estimate: bool) -> None:
        now = self._now()
        rate = (self.done - self.start_done) / max(now - self.t_start, 1e-9)
        left = (self.total - self.done) / rate
        self.last_report = time.perf_counter()
        where = f"pass {pass_no + 1}/{passes}, " if passes > 1 else ""
        if estimate:
            self.first_estimate = (self.done, now, rate)
            self.notify(
                f"estimate: about {format_seconds(left)} for the {self.total - self.done} decode steps left "
                f"({rate:.3g} steps/s, {1e3 / rate:.3g} ms per step, measured on the first steps)"
            )
        else:
            self.notify(f"{where}decode step {t + 1}/{steps}: {rate:.3g} steps/s, about {format_seconds(left)} left")


def decode_pass(
    net: torch.nn.Module,
    ids: torch.Tensor,
    plan: Pass,
    writers: dict[int, StateWriter],
    layers: list[SSMLayer],
    state_shape: tuple[int, int, int],
    values: torch.Tensor,
    ref_nll: torch.Tensor | None,
    clock: Clock,
    pass_no: int = 0,
    passes: int = 1,
    progress: Callable[[], None] | None = None,
    kv_buffer: bool = False,
    prompt: int = 0,
) -> list[str]:
    """Decode ``ids`` [B, P + T + 1] through every run of ``plan``; fill ``values`` [V, 3, B, T] (kl, top-1
    agreement, delta nll in nats) for the pass's variants and, when given, ``ref_nll`` [B, T] (nats).

    ``prompt`` P > 0: the first P tokens are prefilled in one forward per run (FP32 states), after which every
    variant's slice stores each state once (its writer's column 0, the prompt's state); decode step t then feeds
    token P + t. ``writers[i]`` stores variant i's slice after every forward. ``kv_buffer``: after the first forward
    the attention layers' KV caches get room for every step (``decode.KVBuffer``: no growing concatenation; the
    same values). Returns the notes of ``prepare_states`` for the reference's cache. Raises EvalError when the
    reference's logits or a stored state are not finite.
    """
    batch, steps = ids.shape[0], ids.shape[1] - 1 - prompt
    runs = [TeacherForced(net, ids, prompt) for _ in plan.runs]
    notes: list[str] = []
    shift = 1 if prompt else 0  # the writers' column of decode step t (column 0: the prompt's state)

    def first_forward(r: int, slices: tuple[int, ...], run: TeacherForced) -> torch.Tensor | None:
        """After a run's first forward (at ``batch``, the mixers' chunked path): the states checked, the cache
        copied to every slice so that all slices start bit-identical; returns the fold index (None: one slice)."""
        found = prepare_states(run.cache, layers, batch, state_shape)
        notes.extend(found if r == 0 else [])
        index = _fold_index(batch, len(slices), plan.row_multiple, ids.device)
        if index is not None:
            run.expand(index)
        if kv_buffer:
            run.preallocate_kv()
        return index

    if prompt:
        for r, (slices, run) in enumerate(zip(plan.runs, runs)):
            run.prefill()
            first_forward(r, slices, run)
            for j, s in enumerate(slices):
                if s != REFERENCE:
                    writers[s](run.cache, 0, j * batch)  # the prompt's state, stored once
    finite = torch.ones(steps, dtype=torch.bool, device=values.device)  # the reference's logits, per step
    for t in range(steps):
        sliced: dict[int, torch.Tensor] = {}
        for r, (slices, run) in enumerate(zip(plan.runs, runs)):
            logits = run.step(t)  # [rows, vocab]; rows = batch at a first forward, the folded batch after
            if t == 0 and not prompt:
                index = first_forward(r, slices, run)
                if index is not None:
                    logits = logits[index.to(logits.device)]  # the logits may sit on another GPU (device_map)
            for j, s in enumerate(slices):
                sliced[s] = logits[j * batch : (j + 1) * batch]
                if s != REFERENCE:
                    writers[s](run.cache, t + shift, j * batch)
        for s in plan.aliases:
            sliced[s] = sliced[REFERENCE]
        ref_logits = sliced[REFERENCE]
        target = ids[:, prompt + t + 1].to(ref_logits.device)
        finite[t] = torch.isfinite(ref_logits).all()
        ref = reference_step(ref_logits, target)
        if ref_nll is not None:
            ref_nll[:, t] = ref.nll
        for s in plan.variants:
            values[s, :, :, t] = compare_step(ref, sliced[s], target)
        check = (t + 1) % CHECK_EVERY == 0 or t == steps - 1
        if check:
            _check(finite, t, [writers[s] for s in plan.variants])
        clock.step(pass_no, passes, t, steps, check)
        if progress is not None:
            progress()
    return notes


def _fold_index(batch: int, slices: int, multiple: int, device) -> torch.Tensor | None:
    """Sequence index of a folded run's rows: the batch once per slice, then padding to ``multiple`` rows
    (copies of sequence 0); None when the run is one unpadded slice."""
    rows = slices * batch
    padded = -(-rows // multiple) * multiple
    if slices == 1 and padded == rows:
        return None
    index = torch.arange(batch, device=device).repeat(slices)
    return torch.cat([index, torch.zeros(padded - rows, dtype=index.dtype, device=device)])


def _check(finite: torch.Tensor, t: int, writers: list[StateWriter]) -> None:
    """Raise EvalError on the first non-finite reference logits (up to step t) or stored state. Synchronises."""
    if not bool(finite[: t + 1].all()):
        first = int((~finite[: t + 1]).nonzero()[0, 0])
        raise EvalError(f"the FP32-state model's logits are not finite at decode step {first}")
    for w in writers:
        msg = w.first_nonfinite()
        if msg is not None:
            raise EvalError(msg)


def total_steps(plans: list[Pass], steps: int) -> int:
    """Decode steps of all passes."""
    return len(plans) * steps


def run_steps(plans: list[Pass], steps: int) -> int:
    """Slices x steps of all passes: the unit of ``evaluate``'s progress callback."""
    return sum(p.slices for p in plans) * steps


__all__ = ["CHECK_EVERY", "REFERENCE", "Clock", "Pass", "decode_pass", "plan_passes", "run_steps", "total_steps"]
