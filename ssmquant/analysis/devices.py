"""Emulating layers on several devices at once: which device emulates which layer, and the workers.

Each layer's emulation is independent of the others (analysis/run.py), so the layers of one run can be
spread over GPUs. ``assign_layers`` decides where each runs: on the GPU that holds the layer's weights when
the model itself is spread over the emulation devices (its captured inputs are produced there, and while
the prefill works on one GPU's layers the other GPU emulates the layers it already passed), else
round-robin in layer order. ``run_on_devices`` runs worker threads ("lanes", ``lanes`` per device, each
GPU lane on a CUDA stream of its own) fed through one queue of one layer per device: Triton and torch
launches are asynchronous per stream, so while one thread waits for its stream the others launch on theirs,
and a GPU never waits for the host between layers. A layer's inputs move to its device inside the worker
(the host holds at most one queued layer per device); the per-device busy time and the time spent waiting
for capture come back with the results.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..errors import SsmquantError


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for the block, restored after it (nothing changes when it is already
    ``n``). The CPU emulation of small layers runs on one: each step is dozens of small ops that a second thread
    does not speed up, while libgomp's barrier after every op spins (calibrate/timing.py, evaluate/run.py)."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


CPU_EMULATION_THREADS = 1


@contextlib.contextmanager
def emulation_threads(devices):
    """One torch intra-op thread while the emulation runs on a CPU; restored afterwards. Nothing changes when any
    emulation device is a GPU.

    A layer's tensors are small (one step of tiny-nemotron is 4 x 8 x 64 x 128 elements) and each step is dozens of
    small ops, so a second intra-op thread gains little, while the speed of libgomp's barrier after every op depends
    on what else runs: it spins at full speed only while the process has no more OpenMP threads than the machine
    has cores, which a capture thread with an OpenMP pool of its own breaks. With two threads per pool the same
    layer ran 4-5x slower while a capture thread lived beside it than after it ended; with one it runs at one speed.
    """
    if not devices or any(torch.device(d).type != "cpu" for d in devices):
        yield
        return
    with torch_threads(CPU_EMULATION_THREADS):
        yield


class DeviceError(SsmquantError, ValueError):
    """Bad emulation devices; the message names the entry and the accepted forms."""


def parse_emulation_devices(
    spec: str | list[str] | None, default: torch.device, *, cuda_count: int | None = None
) -> list[torch.device]:
    """The emulation devices of a run: None -> [default]; "all" -> every visible GPU; "cuda:0,cuda:1" or a
    list -> those devices (distinct, all CUDA or one CPU). ``cuda_count``: visible GPUs (default: torch's
    count; tests pass a number)."""
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if spec is None:
        return [torch.device(default)]
    if isinstance(spec, str):
        if spec.strip() == "all":
            if count == 0:
                raise DeviceError("--devices all asks for every GPU but none is visible; use --devices cpu")
            return [torch.device("cuda", i) for i in range(count)]
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    out: list[torch.device] = []
    for s in spec:
        try:
            dev = torch.device(s)
        except RuntimeError:
            raise DeviceError(f"unknown device {s!r}; accepted: cpu, cuda:N (comma-separated), or all") from None
        if dev.type == "cuda":
            dev = torch.device("cuda", 0 if dev.index is None else dev.index)
            if dev.index >= count:
                raise DeviceError(f"device {dev} does not exist here: {count} GPU(s) visible")
        elif dev.type != "cpu":
            raise DeviceError(f"unknown device {s!r}; accepted: cpu, cuda:N (comma-separated), or all")
        if dev in out:
            raise DeviceError(f"device {dev} is listed twice")
        out.append(dev)
    if not out:
        raise DeviceError("no emulation device given; accepted: cpu, cuda:N (comma-separated), or all")
    if len(out) > 1 and any(d.type != "cuda" for d in out):
        raise DeviceError(f"several emulation devices must all be GPUs, got {', '.join(map(str, out))}")
    return out


def assign_layers(
    layers: list[int], devices: list[torch.device], holders: dict[int, torch.device] | None = None
) -> dict[int, torch.device]:
    """{layer: emulation device}. The device holding the layer's weights (``holders``) when every selected
    layer is held by one of ``devices`` and the held layers span more than one of them; otherwise
    round-robin over ``devices`` in layer order (a model on one GPU, or on GPUs not emulating)."""
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise DeviceError("no emulation device")
    if holders:
        held = {i: torch.device(holders[i]) for i in layers if i in holders}
        if len(held) == len(layers) and all(d in devices for d in held.values()) and len(set(held.values())) > 1:
            return held
    return {layer: devices[n % len(devices)] for n, layer in enumerate(layers)}


@dataclass
class DeviceRun:
    """What ``run_on_devices`` measured: seconds waiting for the next item (capture), busy seconds per
    device, and the wall time from the first item requested to the last result."""

    wait_s: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)
    layers: dict[str, list[int]] = field(default_factory=dict)
    wall_s: float = 0.0


_DONE = object()


def _pipeline(next_item, assignment, work, complete, record) -> None:
    """One device, in this thread: item k+1's device work is queued before item k is completed (its host
    work: waiting for its results and reducing them). The next item itself is read first (a synthetic
    layer's inputs are made on the device, behind item k's kernels), then item k is completed while the
    device runs item k+1. Each item's seconds: its work plus its completion (the wait for the device
    included). The device is made current as ``one`` does."""
    pending = None  # (key, started, device, seconds so far)
    while True:
        item = next_item()
        if item is not _DONE:
            key, payload = item
            del item
            dev = assignment[key]
            t0 = time.perf_counter()
            with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                started = work(key, payload, dev)
            del payload
            current = (key, started, dev, time.perf_counter() - t0)
        else:
            current = None
        if pending is not None:
            key, started, dev, dt = pending
            pending = None
            t0 = time.perf_counter()
            with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                res = complete(key, started)
            del started
            record(key, res, dev, dt + time.perf_counter() - t0)
        if current is None:
            return
        pending = current


def run_on_devices(
    items: Iterable[tuple[int, object]],
    assignment: dict[int, torch.device],
    work: Callable[[int, object, torch.device], object],
    *,
    on_result: Callable[[int, object, float], None] | None = None,
    lanes: int = 1,
    complete: Callable[[int, object], object] | None = None,
) -> tuple[dict[int, object], DeviceRun]:
    """Run ``work(key, item, device)`` for each (key, item) of ``items`` on ``assignment[key]``.

    ``complete(key, started)``, when given, turns what ``work`` returned into the result: ``work`` queues the
    device work, ``complete`` waits for it and does the host work. One device and one lane: inline, in this
    thread, pipelined: item k's ``complete`` runs after item k+1's ``work``, so the host reduces one item
    while the device computes the next (one stream, the order of the device work unchanged). Otherwise one worker thread per lane, ``lanes`` per
    device (its CUDA device current in that thread and, on a GPU, a CUDA stream of its own), the lanes of a
    device fed by one queue of one item; this thread reads ``items`` (e.g. a capture stream or synthetic
    inputs, made on its own stream) and blocks while the target device's queue is full, which holds the
    producer back. Several lanes on a GPU overlap one layer's host work (its tables, the next layer's
    inputs, the host syncs of a launch) with another layer's kernels: a host sync waits only for its own
    lane's stream. This thread synchronizes the producer's stream of the device before it queues an item, and a
    lane its own stream before it drops one, so neither reads memory early nor frees it for reuse too soon.
    A device's other lanes join once its first item is done (the first launches compile the kernels).
    ``on_result(key, result, seconds)`` is called as each finishes (from the worker threads, under one
    lock). The first error stops the other workers and is raised here. Returns ({key: result}, DeviceRun).
    """
    stats = DeviceRun()
    results: dict[int, object] = {}
    lock = threading.Lock()
    devices = list(dict.fromkeys(assignment.values()))
    t_start = time.perf_counter()

    def one(key, item, dev, stream=None):
        t0 = time.perf_counter()
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                res = work(key, item, dev)
                if complete is not None:
                    res = complete(key, res)
            if stream is not None:
                stream.synchronize()  # the item may be freed (and its memory reused by the producer) after this
        record(key, res, dev, time.perf_counter() - t0)

    def record(key, res, dev, dt):
        with lock:
            results[key] = res
            stats.busy_s[str(dev)] = stats.busy_s.get(str(dev), 0.0) + dt
            stats.layers.setdefault(str(dev), []).append(key)
            if on_result is not None:
                on_result(key, res, dt)

    iterator: Iterator = iter(items)

    def next_item():
        t0 = time.perf_counter()
        item = next(iterator, _DONE)
        stats.wait_s += time.perf_counter() - t0
        return item

    if len(devices) <= 1 and lanes <= 1:
        try:
            if complete is None:
                while (item := next_item()) is not _DONE:
                    key, payload = item
                    one(key, payload, assignment[key])
                    del item, payload
            else:
                _pipeline(next_item, assignment, work, complete, record)
        finally:
            if hasattr(iterator, "close"):
                iterator.close()  # stops a producer still running after an error (capture, inputs made ahead)
        stats.wall_s = time.perf_counter() - t_start
        return results, stats

    queues = {d: queue.Queue(maxsize=1) for d in devices}
    failed = threading.Event()
    errors: list[tuple[int, BaseException]] = []

    def worker(dev, lane):
        q = queues[dev]
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" and stream_lanes else None
        if lane:
            warmed[dev].wait()
        while True:
            got = q.get()
            if got is _DONE:
                warmed[dev].set()
                return
            if failed.is_set():
                continue  # drain without working
            key, payload = got
            del got
            try:
                one(key, payload, dev, stream)
            except BaseException as exc:  # raised in the caller's thread
                with lock:
                    errors.append((key, exc))
                failed.set()
            finally:
                warmed[dev].set()
            del payload

    per_device = max(1, lanes)
    stream_lanes = lanes > 1 and all(d.type == "cuda" for d in devices)
    # a device's other lanes start after its first item is done: the first launches compile or load the
    # kernels (Triton's JIT and its cache), once, in one thread
    warmed = {d: threading.Event() for d in devices}
    threads = [
        threading.Thread(
            target=worker, args=(d, k), name=f"ssmquant-emulate-{d}" + (f"-lane{k}" if k else ""), daemon=True
        )
        for d in devices
        for k in range(per_device)
    ]
    for t in threads:
        t.start()
    try:
        while not failed.is_set() and (item := next_item()) is not _DONE:
            key = item[0]
            dev = assignment[key]
            if stream_lanes and torch.cuda.is_initialized():
                # the item was made on this thread's stream of the device (the lanes run on streams of
                # their own, which do not wait for it): this waits for the item's work alone
                torch.cuda.current_stream(dev).synchronize()
            q = queues[dev]
            while not failed.is_set():
                try:
                    q.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            del item
    finally:
        for d in devices:
            for _ in range(per_device):
                queues[d].put(_DONE)
        for t in threads:
            t.join()
        if hasattr(iterator, "close"):
            iterator.close()  # stops a capture still running after an error
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    stats.wall_s = time.perf_counter() - t_start
    return results, stats


__all__ = ["DeviceError", "DeviceRun", "assign_layers", "parse_emulation_devices", "run_on_devices"]
