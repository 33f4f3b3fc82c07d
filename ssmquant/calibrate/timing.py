"""How long a calibration takes, measured on this machine, and how its CPU emulation runs.

- ``emulation_threads`` (``analysis.devices``): on a CPU the emulation runs with one torch intra-op thread.
- ``probe_layer``: the whole per-layer pipeline (statistics, static scales with a few MSE samples, one chunk of
  the candidates) on random inputs of the run's exact shapes and batch for a few steps, timed; a ``Costs`` model
  scales it to the horizon.
- ``RunClock``: the time left of a run (calibration and verification), re-estimated from every finished layer,
  with a range where the machine is busy: what the emulation thread got of a core (its CPU time over its wall
  time) says how much faster the rest would go if the machine freed up.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from ..sizing import format_seconds, random_inputs
from .scales import DEFAULT_MSE_SAMPLES, MSE_FROM, calibrate_scales
from .stats import collect_stats

# the emulation thread got less than this share of a core while measured: the machine is busy, say so with a range
BUSY_SHARE = 0.8
PROBE_CHUNK = 16  # candidates simulated by the probe (one simulate call of the run holds up to 16)
PROBE_MSE_SAMPLES = 4
# until the verification's settings are known: the decision, the global setting and one more engine pick per layer
VERIFY_SETTINGS_GUESS = 3


def mse_samples_at(steps: int, samples: int = DEFAULT_MSE_SAMPLES) -> int:
    """States the MSE scale search quantizes over ``steps`` decode steps (``scales.calibrate_scales``)."""
    first = int(steps * MSE_FROM)
    every = max(1, (steps - first) // max(1, samples))
    return steps // every - first // every


@dataclass
class LayerCost:
    """What one layer's calibration took: wall and thread-CPU seconds of the whole layer and of its parts, the
    settings it simulated in how many simulate calls, over how many steps (``steps``) at which batch. decode_s: one
    FP32 reference decode alone (the probe measures it; 0 when not measured); mse_samples: the states the MSE scale
    search quantized (0 without MSE)."""

    wall_s: float
    cpu_s: float
    stats_s: float
    scales_s: float
    eval_s: float
    simulated: int
    calls: int
    steps: int
    batch: int
    decode_s: float = 0.0
    mse_samples: int = 0

    @property
    def unit_s(self) -> float:
        """Seconds of one setting simulated over ``steps`` (a simulate call's FP32 reference counted as one)."""
        return self.eval_s / max(1, self.simulated + self.calls)

    @property
    def share(self) -> float:
        """Share of a core the emulation thread got (CPU time over wall time)."""
        return min(1.0, self.cpu_s / self.wall_s) if self.wall_s > 0 else 1.0


@dataclass
class Costs:
    """Seconds per layer of a run at its horizon: one calibration layer (``layer_s``), one verification layer
    (``verify_s``); ``share``: the emulation thread's share of a core while measured (None: not a CPU run)."""

    layer_s: float
    verify_s: float
    share: float | None

    @classmethod
    def from_probe(cls, c: LayerCost, *, steps: int, settings: int, calls: int, mse_samples: int,
                   verify_settings: int, heldout_ratio: float, cpu: bool) -> Costs:  # fmt: skip
        """Scale a probe of ``c.steps`` steps to a layer of ``steps`` steps with ``settings`` simulated in ``calls``
        calls and ``mse_samples`` MSE states; a verification layer simulates ``verify_settings`` settings in one
        call on ``heldout_ratio`` times the batch."""
        f = steps / max(1, c.steps)
        unit = c.unit_s * f
        scales = c.scales_s * f  # no MSE: the scales are read off the statistics
        if c.mse_samples:
            per_sample = max(0.0, c.scales_s - c.decode_s) / c.mse_samples
            scales = c.decode_s * f + per_sample * mse_samples
        layer = c.stats_s * f + scales + unit * (settings + calls)
        return cls(layer, unit * (verify_settings + 1) * heldout_ratio, c.share if cpu else None)

    @classmethod
    def from_layers(cls, done: list[LayerCost], *, verify_settings: int, heldout_ratio: float, cpu: bool) -> Costs:
        """From the calibration layers measured so far: the mean of all but the first once there are two or more
        (the first carries one-time costs: kernel compiles on a GPU)."""
        use = done[1:] if len(done) > 1 else done
        layer = sum(c.wall_s for c in use) / len(use)
        unit = sum(c.unit_s * c.wall_s / max(c.stats_s + c.scales_s + c.eval_s, 1e-9) for c in use) / len(use)
        share = sum(c.cpu_s for c in use) / max(sum(c.wall_s for c in use), 1e-9)
        return cls(layer, unit * (verify_settings + 1) * heldout_ratio, min(1.0, share) if cpu else None)


@dataclass
class TimeLeft:
    """seconds: at the pace measured; low: if the machine frees up (None where it is not busy); calibrate_s and
    verify_s: the parts of seconds."""

    seconds: float
    low: float | None
    calibrate_s: float
    verify_s: float
    share: float | None

    def text(self, more: bool = False) -> str:
        """'about 3.1 min [more]' or 'about 3.1 min [more] at this load (1.4 min if the machine frees up: ...)'."""
        head = f"about {format_seconds(self.seconds)}" + (" more" if more else "")
        if self.low is None:
            return head
        return (
            f"{head} at this load ({format_seconds(self.low)} if the machine frees up: the emulation got "
            f"{self.share:.0%} of a core while measured; longer if it gets busier)"
        )

    def short(self) -> str:
        """For a progress bar: '3.1 min left' or '1.4-3.1 min left'."""
        hi = format_seconds(self.seconds)
        if self.low is None or format_seconds(self.low) == hi:
            return f"{hi} left"
        lo = format_seconds(self.low)
        unit = hi.split()[-1]
        if lo.split()[-1] == unit:
            lo = lo.split()[0]
        return f"{lo}-{hi} left"


def _busy(share: float | None) -> bool:
    return share is not None and share < BUSY_SHARE


class TimedItems:
    """An iterator of (layer, inputs) that adds up the seconds spent waiting for each item (a capture running
    beside the emulation); ``take_wait()`` returns the wait since the last call."""

    def __init__(self, items):
        self.items, self._wait, self._lock = iter(items), 0.0, threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.items)
        finally:
            with self._lock:
                self._wait += time.perf_counter() - t0

    def close(self) -> None:
        close = getattr(self.items, "close", None)
        if close is not None:
            close()

    def take_wait(self) -> float:
        with self._lock:
            w, self._wait = self._wait, 0.0
        return w


class RunClock:
    """Time left of a calibration: ``layers`` calibration layers, then (``verify``) as many verification layers,
    ``parallel`` at a time. Fed with each finished layer (``calibrated``, ``verified``) and with the fraction of
    the layers in flight (``advance``); ``left()`` is the estimate. Thread-safe (several emulation devices)."""

    def __init__(self, layers: int, *, parallel: int = 1, verify: bool = True, heldout_ratio: float = 1.0,
                 cpu: bool = True, costs: Costs | None = None):  # fmt: skip
        self.layers, self.parallel, self.verify = layers, max(1, parallel), verify
        self.heldout_ratio, self.cpu, self.probe = heldout_ratio, cpu, costs
        self.verify_settings = VERIFY_SETTINGS_GUESS
        self.done: list[LayerCost] = []
        self.verify_done: list[tuple[float, float]] = []  # (wall, cpu) per verification layer
        self.in_flight: dict[int, float] = {}
        self.stage = "calibrate"
        self._lock = threading.Lock()

    # -- feeding ----------------------------------------------------------------------------------------
    def advance(self, layer: int, fraction: float) -> None:
        with self._lock:
            self.in_flight[layer] = min(max(fraction, 0.0), 1.0)

    def calibrated(self, layer: int, cost: LayerCost) -> None:
        with self._lock:
            self.in_flight.pop(layer, None)
            self.done.append(cost)

    def start_verification(self, settings: int) -> None:
        with self._lock:
            self.stage, self.verify_settings = "verify", max(1, settings)
            self.in_flight.clear()

    def verified(self, layer: int, wall_s: float, cpu_s: float) -> None:
        with self._lock:
            self.in_flight.pop(layer, None)
            self.verify_done.append((wall_s, cpu_s))

    # -- reading ----------------------------------------------------------------------------------------
    def costs(self) -> Costs | None:
        """The current cost model: measured layers where there are any, else the probe, else None."""
        with self._lock:
            return self._costs()

    def _costs(self) -> Costs | None:
        if self.done:
            c = Costs.from_layers(self.done, verify_settings=self.verify_settings, heldout_ratio=self.heldout_ratio,
                                  cpu=self.cpu)  # fmt: skip
        elif self.probe is not None:
            c = self.probe
            unit = c.verify_s / ((VERIFY_SETTINGS_GUESS + 1) * self.heldout_ratio)
            c = Costs(c.layer_s, unit * (self.verify_settings + 1) * self.heldout_ratio, c.share)
        else:
            return None
        if self.verify_done:
            use = self.verify_done[1:] if len(self.verify_done) > 1 else self.verify_done
            c = Costs(c.layer_s, sum(w for w, _ in use) / len(use), c.share)
        return c

    def in_flight_total(self) -> float:
        """The fractions of the layers under way, summed."""
        with self._lock:
            return sum(self.in_flight.values())

    def weights(self) -> tuple[float, float, float]:
        """Shares of a calibration layer's time taken by statistics, static scales and candidates (the last layer
        measured, else equal thirds), for the fraction of a layer in flight."""
        with self._lock:
            c = self.done[-1] if self.done else None
        if c is None:
            return (0.1, 0.2, 0.7)
        total = max(c.stats_s + c.scales_s + c.eval_s, 1e-9)
        return (c.stats_s / total, c.scales_s / total, c.eval_s / total)

    def left(self) -> TimeLeft | None:
        """The time left, or None before anything was measured."""
        with self._lock:
            c = self._costs()
            if c is None:
                return None
            if self.stage == "calibrate":
                todo = self.layers - len(self.done) - sum(self.in_flight.values())
                cal = max(0.0, todo) * c.layer_s / self.parallel
                ver = self.layers * c.verify_s / self.parallel if self.verify else 0.0
            else:
                cal = 0.0
                todo = self.layers - len(self.verify_done) - sum(self.in_flight.values())
                ver = max(0.0, todo) * c.verify_s / self.parallel
        total = cal + ver
        low = total * c.share if _busy(c.share) else None
        return TimeLeft(total, low, cal, ver, c.share)


def probe_layer(dims, settings, keys, *, steps: int, batch: int, percentiles, seed: int, engine: str,
                device, count_buffer: bool = True) -> LayerCost:  # fmt: skip
    """Time the per-layer pipeline on random inputs of ``dims`` at ``batch`` for a few steps (enough for a flush of
    the longest replay buffer, at most ``steps``): statistics, static scales (MSE over PROBE_MSE_SAMPLES states, plus
    one reference decode alone), and PROBE_CHUNK of ``settings`` (spread over the list) simulated in one call, after
    a warm-up that pays the one-time costs (imports, first calls) the run would pay in its first layer."""
    from .choose import evaluate_layer

    longest = max((s.buffer_len + s.draft_tokens for s in settings), default=1)
    n = max(1, min(steps, max(16, 2 * longest)))
    inputs = random_inputs(dims, batch, n, device=device, seed=1)
    stride = max(1, math.ceil(len(settings) / PROBE_CHUNK))
    part = settings[::stride][:PROBE_CHUNK]
    warm = random_inputs(dims, 1, 2, device=device, seed=2)
    warm_stats = collect_stats(warm, percentiles=percentiles)
    evaluate_layer(0, warm, part[:2], calibrate_scales(warm, warm_stats, keys, mse_samples=1), seed=seed,
                   backend="torch", engine=engine, count_buffer=count_buffer)  # fmt: skip
    c0, t0 = time.thread_time(), time.perf_counter()
    st = collect_stats(inputs, percentiles=percentiles)
    t1 = time.perf_counter()
    mse = [k for k in keys if k[1] == "mse"]
    decode = 0.0
    if mse:
        from .stats import iter_reference_states

        for _ in iter_reference_states(inputs):
            pass
        decode = time.perf_counter() - t1
    t2 = time.perf_counter()
    scales = calibrate_scales(inputs, st, keys, mse_samples=PROBE_MSE_SAMPLES)
    t3 = time.perf_counter()
    evaluate_layer(0, inputs, part, scales, seed=seed, backend="torch", engine=engine, count_buffer=count_buffer)
    t4 = time.perf_counter()
    return LayerCost(
        wall_s=t4 - t0,
        cpu_s=time.thread_time() - c0,
        stats_s=t1 - t0,
        scales_s=t3 - t2,
        eval_s=t4 - t3,
        simulated=len(part),
        calls=1,
        steps=n,
        batch=batch,
        decode_s=decode,
        mse_samples=mse_samples_at(n, PROBE_MSE_SAMPLES) if mse else 0,
    )
