"""Everything of a full-size `ssmquant analyze` but the emulation, on a CPU: start-up, tables, writing, plots.

    python benchmarks/startup_cpu.py                 # nemotron-3-nano, 4096 steps x batch 8, 23 layers x 6 variants
    python -X importtime benchmarks/startup_cpu.py   # and where the imports go
    DEVICE_WAIT_S=6 python benchmarks/startup_cpu.py  # the stand-in emulation waits 6 s in all, as for a GPU

The emulation of 23 layers x 6 variants x 4096 steps x batch 8 takes hours on 2 CPU cores, so this runs the
real `ssmquant analyze` command line in this process with two stand-ins: the synthetic source yields
placeholder inputs, and `simulate` returns a Trace of the real run's shape (23 layers, 6 variants, 256
windows of 16 steps, batch 8, 64 heads) filled with smooth random errors; the memory check, sized for the
torch backend, is skipped. What remains is what issue 15 asks to make fast outside the kernels: the
imports, analyze()'s tables, parquet/CSV/JSON and the three plots. Prints the wall clock and report.json's
stages. DEVICE_WAIT_S: seconds the stand-in emulation sleeps, spread over the layers (the main thread of a
GPU run waits for the device, which lets other threads run); 0 by default. The numbers are this machine's,
for before/after comparisons; they are not a GPU run's.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402

STEPS, BATCH, HEADS, LAYERS = 4096, 8, 64, 23


class _Placeholder:
    """Stands for a layer's inputs: analyze() only moves it and labels it."""

    def __init__(self, layer: int):
        self.meta = {"layer": layer}

    def to(self, device):
        return self


def _stub_simulate(inputs, variants, backend, record_every):
    import torch

    from ssmquant.replay.simulate import PendingTrace
    from ssmquant.replay.trace import POOLINGS, window_ends

    time.sleep(float(os.environ.get("DEVICE_WAIT_S", 0)) / LAYERS)
    ends = window_ends(STEPS, record_every)
    rng = np.random.default_rng(inputs.meta["layer"])
    growth = (ends / STEPS)[None, :, None, None]
    mean = np.empty((len(variants), len(ends), BATCH, HEADS, 4))
    mean[..., 1::2] = 1.0
    mean[..., 0::2] = (1e-4 * growth * rng.uniform(0.5, 2, (len(variants), 1, BATCH, HEADS)))[..., None] ** 2
    peak = {
        p: rng.uniform(1e-3, 2e-3, (len(variants), len(ends), *((BATCH,) if b else ()), *((HEADS,) if h else ()), 2))
        for p, (b, h) in POOLINGS.items()
    }
    t = torch.from_numpy
    stats = [{"mean": t(mean[i]), "last": t(mean[i].copy()), "max": {p: t(v[i]) for p, v in peak.items()}}
             for i in range(len(variants))]  # fmt: skip
    return PendingTrace([v.name for v in variants], ends, stats, {})


def main():
    import ssmquant.analysis.run as run
    import ssmquant.analysis.sources as sources
    from ssmquant.cli import main as cli
    from ssmquant.models import get_preset

    def placeholders(preset, *, batch, steps, seed=0, layers=None, **kwargs):
        for layer in get_preset(preset).ssm_layers if layers is None else layers:
            yield layer, _Placeholder(layer)

    run.start_simulation = _stub_simulate
    run.plan_layers = lambda *args, **kwargs: None
    sources.synthetic_layers = placeholders
    out = pathlib.Path(tempfile.mkdtemp()) / "run"
    argv = ["analyze", "--model", "nemotron-3-nano", "--synthetic", "--steps", str(STEPS), "--batch", str(BATCH),
            "--device", "cpu", "--out", str(out), "-q", *sys.argv[1:]]  # fmt: skip
    try:
        cli(argv, standalone_mode=False)
    finally:
        wall = time.perf_counter() - T_START
    report = json.loads((out / "report.json").read_text())
    print(f"wall clock (emulation stubbed) {wall:.2f} s; inside analyze() {report['elapsed_s']:.2f} s; stages:")
    print(json.dumps(report["stages"]))


if __name__ == "__main__":
    main()
