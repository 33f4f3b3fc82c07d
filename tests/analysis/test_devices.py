"""Emulation over several devices (analysis.devices): parsing, the layer-to-device assignment with fake
device lists, and the per-device workers (threads over distinct CPU device objects)."""

import threading
import time

import pytest
import torch

from ssmquant.analysis.devices import DeviceError, assign_layers, parse_emulation_devices, run_on_devices
from ssmquant.analysis.sources import SourceError, resolve_run_devices
from ssmquant.sizing import GIB, SizingError, analyze_memory, check_memory, input_bytes_per_token, layer_dims

G0, G1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_parse_emulation_devices():
    cpu = torch.device("cpu")
    assert parse_emulation_devices(None, cpu, cuda_count=0) == [cpu]
    assert parse_emulation_devices("all", cpu, cuda_count=2) == [G0, G1]
    assert parse_emulation_devices("cuda:1, cuda:0", cpu, cuda_count=2) == [G1, G0]
    assert parse_emulation_devices(["cuda"], cpu, cuda_count=1) == [G0]
    for spec, msg in [
        ("all", "none is visible"),
        ("cuda:0,cuda:0", "listed twice"),
        ("cuda:3", r"cuda:3 does not exist here: 2 GPU\(s\)"),
        ("cpu,cuda:0", "must all be GPUs"),
        ("xpu", "unknown device 'xpu'; accepted: cpu, cuda:N"),
        (",", "no emulation device"),
    ]:
        with pytest.raises(DeviceError, match=msg):
            parse_emulation_devices(spec, cpu, cuda_count=0 if spec == "all" else 2)


def test_resolve_run_devices_checks_device_devices_and_backend(monkeypatch):
    """analyze's and calibrate's one device check: a loaded model's device stands for "auto", the emulation
    devices default to it, and every bad value is a SourceError naming it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cpu, cpu1 = torch.device("cpu"), torch.device("cpu", 1)
    assert resolve_run_devices("auto", None, "auto") == (cpu, [cpu], "torch")
    held = type("Loaded", (), {"device": cpu1})()  # a LoadedModel, as far as the check reads it
    assert resolve_run_devices("auto", None, "torch", model=held) == (cpu1, [cpu1], "torch")
    assert resolve_run_devices("cpu", None, "auto", model=held) == (cpu, [cpu], "torch")  # --device wins
    for args, msg in [
        (("tpu", None, "auto"), "unknown device 'tpu'; accepted: auto, cpu, cuda, cuda:N"),
        (("cuda", None, "auto"), "no CUDA GPU is available"),
        (("cpu", "cuda:1", "auto"), r"cuda:1 does not exist here: 0 GPU\(s\) visible"),
        (("cpu", None, "jax"), "unknown backend 'jax'; accepted: auto, torch, triton"),
    ]:
        with pytest.raises(SourceError, match=msg):
            resolve_run_devices(*args)


def test_assign_layers_follows_the_holder_else_round_robin():
    layers = [0, 2, 4, 6, 8]
    spread = {0: G0, 2: G0, 4: G1, 6: G1, 8: G1}
    assert assign_layers(layers, [G0, G1], spread) == spread  # the GPU that holds the layer emulates it
    on_one = dict.fromkeys(layers, G0)  # a model on one GPU: round-robin over the emulation devices
    assert assign_layers(layers, [G0, G1], on_one) == {0: G0, 2: G1, 4: G0, 6: G1, 8: G0}
    assert assign_layers(layers, [G1], spread) == dict.fromkeys(layers, G1)  # holders not emulating
    assert assign_layers([4, 8], [G0, G1], None) == {4: G0, 8: G1}  # synthetic inputs: no holders
    with pytest.raises(DeviceError):
        assign_layers(layers, [], spread)


def test_workers_run_each_item_on_its_device_and_hold_the_producer_back():
    devs = [torch.device("cpu", 0), torch.device("cpu", 1)]
    keys = list(range(8))
    assignment = {k: devs[k % 2] for k in keys}
    produced, finished, lock = [], [], threading.Lock()
    outstanding = []

    def items():
        for k in keys:
            with lock:
                produced.append(k)
                outstanding.append(len(produced) - len(finished))
            yield k, torch.full((2,), float(k))

    def work(key, item, dev):
        time.sleep(0.01)
        return (key, float(item.sum()), threading.current_thread().name, dev)

    done = []
    results, run = run_on_devices(items(), assignment, work, on_result=lambda k, r, s: (done.append(k), finished.append(k)))
    assert sorted(results) == keys and sorted(done) == keys
    for k, (key, total, thread, dev) in results.items():
        assert key == k and total == 2 * k and dev == assignment[k] and thread.endswith(str(dev))
    assert {d: sorted(v) for d, v in run.layers.items()} == {"cpu:0": [0, 2, 4, 6], "cpu:1": [1, 3, 5, 7]}
    assert set(run.busy_s) == {"cpu:0", "cpu:1"} and run.wall_s > 0
    # one item running and one queued per device, one in the producer's hand: never more outstanding
    assert max(outstanding) <= 2 * len(devs) + 1


def test_workers_raise_the_first_error_and_close_the_producer():
    devs = [torch.device("cpu", 0), torch.device("cpu", 1)]
    closed = []

    def items():
        try:
            for k in range(100):
                yield k, k
        finally:
            closed.append(True)

    def work(key, item, dev):
        if key in (3, 5):
            raise ValueError(f"bad layer {key}")
        return key

    with pytest.raises(ValueError, match="bad layer 3"):
        run_on_devices(items(), {k: devs[k % 2] for k in range(100)}, work)
    assert closed == [True]


def test_one_device_runs_inline():
    results, run = run_on_devices(iter([(1, "a"), (2, "b")]), {1: torch.device("cpu"), 2: torch.device("cpu")},
                                  lambda k, x, d: (x, threading.current_thread() is threading.main_thread()))  # fmt: skip
    assert results == {1: ("a", True), 2: ("b", True)} and run.layers == {"cpu": [1, 2]}


def test_one_device_pipelines_the_completion_behind_the_next_items_work():
    cpu = torch.device("cpu")
    log = []

    def items():
        for k in (1, 2, 3):
            log.append(f"read {k}")
            yield k, k * 10

    def work(k, x, d):
        log.append(f"work {k}")
        return x + 1

    def complete(k, started):
        log.append(f"complete {k}")
        return started * 2

    results, run = run_on_devices(items(), {k: cpu for k in (1, 2, 3)}, work, complete=complete,
                                  on_result=lambda k, r, s: log.append(f"result {k}"))  # fmt: skip
    assert results == {1: 22, 2: 42, 3: 62} and run.layers == {"cpu": [1, 2, 3]}
    assert log == ["read 1", "work 1", "read 2", "work 2", "complete 1", "result 1", "read 3", "work 3",
                   "complete 2", "result 2", "complete 3", "result 3"]  # fmt: skip


def test_a_pipelined_error_stops_at_the_failing_item():
    cpu = torch.device("cpu")
    done = []

    def work(k, x, d):
        if k == 2:
            raise ValueError("bad item 2")
        return x

    closed = []

    def items():
        try:
            yield from [(1, "a"), (2, "b"), (3, "c")]
        finally:
            closed.append(True)

    with pytest.raises(ValueError, match="bad item 2"):
        run_on_devices(items(), {k: cpu for k in (1, 2, 3)}, work, complete=lambda k, s: done.append(k))
    assert done == []  # item 1 was queued, not completed, when item 2 failed: nothing after it ran
    assert closed == [True]  # the producer was closed (a thread making inputs ahead stops)


def test_lanes_work_on_one_device_at_once_and_bound_the_items_alive():
    keys = list(range(10))
    produced, finished, lock = [], [], threading.Lock()
    outstanding, running, peak = [], [0], [0]

    def items():
        for k in keys:
            with lock:
                produced.append(k)
                outstanding.append(len(produced) - len(finished))
            yield k, k

    def work(key, item, dev):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return key, threading.current_thread().name

    cpu = torch.device("cpu")
    results, run = run_on_devices(items(), dict.fromkeys(keys, cpu), work, on_result=lambda k, r, s: finished.append(k),
                                  lanes=2)  # fmt: skip
    assert {k: r[0] for k, r in results.items()} == {k: k for k in keys}
    assert {r[1] for r in results.values()} == {"ssmquant-emulate-cpu", "ssmquant-emulate-cpu-lane1"}
    assert peak[0] == 2 and sorted(run.layers["cpu"]) == keys
    assert max(outstanding) <= 2 + 1 + 1  # two working, one queued, one in the producer's hand


def test_memory_estimate_counts_every_lane():
    dims = layer_dims("mamba2", 64, 64, 128, 8)
    kw = dict(batch=8, steps=4096, variants=6, recorded=256, backend="triton", device=G1)
    one, two = analyze_memory(dims, **kw), analyze_memory(dims, lanes=2, **kw)
    inputs = 8 * 4096 * input_bytes_per_token(dims)
    assert two.total("device") == 2 * one.total("device") + inputs
    assert two.per_token["device"] == 2 * one.per_token["device"] + input_bytes_per_token(dims)


def test_memory_check_per_gpu_names_the_device_and_counts_queued_layers():
    dims = layer_dims("mamba2", 128, 64, 128, 8)
    kw = dict(batch=8, steps=2048, variants=6, recorded=128, backend="triton", prefill={"hidden_size": 4096})
    one = analyze_memory(dims, device=G1, capture_device=G1, **kw)
    two = analyze_memory(dims, device=G1, capture_device=G1, workers=2, **kw)
    assert two.total("host") == 2 * one.total("host")  # 2 + 2 queued layers instead of 2
    assert two.total("device") == one.total("device")  # a device holds one layer's emulation either way
    free = {"cuda": GIB // 8, "cpu": 1000 * GIB}
    with pytest.raises(SizingError, match=r"of GPU cuda:1 memory .* lower --steps or --batch"):
        check_memory(two, batch=8, steps=2048, free=lambda d: free[d.type])


def test_analyze_captures_from_a_model_built_in_memory():
    from ssmquant.analysis import AnalyzeConfig, analyze
    from ssmquant.models.build import build_random_model

    small = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "mamba_num_heads": 4, "mamba_head_dim": 8,
             "ssm_state_size": 16, "n_groups": 2}  # fmt: skip
    model = build_random_model("nemotron-h-8b", devices="cpu", dtype="float32", num_layers=4, overrides=small,
                               free=lambda d: 64 * GIB, progress=lambda s: None)  # fmt: skip
    cfg = AnalyzeConfig(model="nemotron-h-8b", steps=24, batch=2, formats=["fp8_e4m3"], schemes=["replay4"], device="cpu")
    res = analyze(cfg, model=model)
    assert res.source["layers"] == [0, 2] and res.source["model"] == "nemotron-h-8b"  # "M-M-": two Mamba-2 layers
    assert res.source["location"] == "memory:nemotron-h-8b"
    assert list(res.summary["layer"]) == [0, 2] and res.summary["out_rel_err"].gt(0).all()
    assert res.stages["layers_wall_s"] > 0 and "emulation_devices" not in res.stages  # one device: no split
    with pytest.raises(SourceError, match="listed twice"):
        analyze(AnalyzeConfig(**{**cfg.__dict__, "devices": "cpu,cpu"}), model=model)
    with pytest.raises(ValueError, match="must be a LoadedModel"):
        analyze(cfg, model=model.model)


def test_lanes_with_no_items_or_one_item_finish():
    cpu = torch.device("cpu")
    assert run_on_devices(iter([]), {}, lambda k, x, d: x, lanes=2)[0] == {}
    assert run_on_devices(iter([(3, "x")]), {3: cpu}, lambda k, x, d: x, lanes=3)[0] == {3: "x"}


def test_inputs_made_ahead_come_in_order_one_ahead_and_stop_on_close():
    from ssmquant.analysis.sources import made_ahead

    made, threads = [], set()

    def make():
        for k in range(5):
            made.append(k)
            threads.add(threading.current_thread().name)
            yield k, f"inputs {k}"

    it = made_ahead(make, torch.device("cpu"))
    assert next(it) == (0, "inputs 0")
    deadline = time.time() + 5
    while len(made) < 3 and time.time() < deadline:  # item 1 waits, item 2 is being made
        time.sleep(0.01)
    time.sleep(0.1)
    assert made == [0, 1, 2] and threads == {"ssmquant-inputs-ahead"}
    assert next(it) == (1, "inputs 1")
    it.close()  # stops the worker, which was waiting to hand over item 2 or 3
    assert made in ([0, 1, 2], [0, 1, 2, 3])
    assert not any(t.name == "ssmquant-inputs-ahead" for t in threading.enumerate())


def test_an_error_while_making_inputs_ahead_is_raised_to_the_consumer():
    from ssmquant.analysis.sources import made_ahead

    def make():
        yield 0, "inputs 0"
        raise ValueError("layer 2: NaN in x")

    it = made_ahead(make, torch.device("cpu"))
    assert next(it) == (0, "inputs 0")
    with pytest.raises(ValueError, match="layer 2: NaN in x"):
        next(it)


def test_memory_estimate_counts_inputs_made_ahead():
    dims = layer_dims("mamba2", 64, 64, 128, 8)
    kw = dict(batch=8, steps=4096, variants=6, recorded=256, device="cuda", backend="triton")
    plain, ahead = analyze_memory(dims, **kw), analyze_memory(dims, **kw, ahead=True)
    extra = ahead.total("device") - plain.total("device")
    assert extra >= 2 * 8 * 4096 * input_bytes_per_token(dims)


def test_memory_estimate_sizes_the_kernels_metric_buffer_as_planned():
    """The per-sequence metric buffer of a launch (sizing, without Triton) is the one the kernels plan: NV x T x H
    x row blocks x 4 fp32, the row blocks from kernels.plan_launches' tile (six variants: [4 rows, 128] per warp)."""
    pytest.importorskip("triton")
    from ssmquant.analysis import AnalyzeConfig, build_variants
    from ssmquant.kernels import plan_launches
    from ssmquant.sizing import launch_metric_bytes_per_sequence

    variants = build_variants(AnalyzeConfig())  # fp8, int8, nvfp4 x conventional, replay: six in one launch
    (idx, (block_p, _)), *rest = plan_launches(variants, 64, 128)
    assert not rest and len(idx) == 6
    planned = len(idx) * 4096 * 64 * (64 // block_p) * 4 * 4
    dims = layer_dims("mamba2", 64, 64, 128, 8)
    assert launch_metric_bytes_per_sequence(dims, 6, 4096) == planned == 384 * 2**20
    est = analyze_memory(dims, batch=8, steps=4096, variants=6, recorded=256, device="cuda", backend="triton")
    part = next(b for name, _, b in est.parts if name == "per-step metrics of one launch")
    assert part >= 2 * planned  # two sequences per launch under the 1 GiB budget
