"""`simulate`: the one entry point that runs variants over a layer's inputs on a chosen backend.

It sits above the engine profiles and the kernels and chooses between them: the torch reference
(``replay.naive``, with the engine profiles' step objects for variants that name an engine) or the fused kernels
(``ssmquant.kernels``, registered per layer kind). Both return every step's metrics, reduced here into window
statistics (``replay.trace``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from .engines.emulation import engine_step
from .engines.profiles import EngineError, check_engine, check_variant
from .errors import SsmquantError
from .kinds import LayerInputs, is_validated
from .replay.naive import emulate
from .replay.trace import Trace, WindowAccumulator, stats_to_numpy
from .replay.variants import Variant, VariantError, check_variants_fit, parse_variants

BACKENDS = ("auto", "torch", "triton")


class BackendError(SsmquantError, RuntimeError):
    """The requested backend cannot run these inputs."""


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels():
    """The fused kernels' package, imported where one may run."""
    try:
        from . import kernels  # optional Triton, imported only where a fused kernel may run (start-up skips it)
    except ModuleNotFoundError as err:
        if err.name != "triton":
            raise
        raise BackendError(
            "the fused kernels need Triton, which is not installed (a CUDA build of torch brings it; "
            "pip install 'ssmquant[gpu]'); backend='torch' runs without it"
        ) from None
    return kernels


def resolve_backend(backend: str, inputs: LayerInputs) -> str:
    """'auto' picks the fused kernels on CUDA tensors of a kind that has them, the torch reference otherwise."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    on_cuda = inputs.device.type == "cuda"
    if backend == "torch" or (backend == "auto" and not on_cuda):
        return "torch"
    if backend == "triton" and not on_cuda and not triton_interpreting():
        raise BackendError(
            f"backend='triton' needs CUDA tensors (inputs are on {inputs.device}); move them with "
            "inputs.to('cuda'), use backend='torch', or set TRITON_INTERPRET=1 to run the kernels on the CPU"
        )
    fused = _kernels().has_kernel(inputs.kind)
    if backend == "auto":
        return "triton" if fused else "torch"
    if not fused:
        raise BackendError(f"no fused kernel is registered for {inputs.kind} layers; use backend='torch' (or 'auto')")
    return backend


def with_engine(variants: list[Variant], engine: str | None) -> list[Variant]:
    """Variants that name no engine profile get `engine` (None: unchanged)."""
    if engine is None:
        return variants
    try:
        check_engine(engine)
    except EngineError as err:
        raise VariantError(str(err)) from None
    return [dataclasses.replace(v, engine=engine) if v.engine == "ideal" else v for v in variants]


def check_engines(variants: list[Variant], inputs: LayerInputs, form: str) -> None:
    """Refuse a variant its engine profile cannot emulate, quoting the engine's constraint."""
    for v in variants:
        if v.engine == "ideal":
            continue
        if form != "state":
            raise VariantError(f"variant {v.name!r}: engine profiles emulate the engine's own form; use form='state'")
        try:
            check_variant(v.engine, v.format, v.scheme, inputs.kind, inputs.state_shape)
        except EngineError as err:
            raise VariantError(f"variant {v.name!r}: {err}") from None


class PendingTrace:
    """A simulation whose device work is queued (``start_simulation``): ``result()`` waits for it and returns
    the Trace. The window statistics are copied to the host without blocking, behind an event, so the host
    is free (to reduce the previous layer's trace, to queue the next layer) while the device works."""

    def __init__(self, variants: list[str], ends, stats: list[dict], meta: dict, event=None):
        self._variants, self._ends, self._stats, self._meta, self._event = variants, ends, stats, meta, event
        self._trace: Trace | None = None

    def result(self) -> Trace:
        if self._trace is None:
            if self._event is not None:
                self._event.synchronize()  # releases the GIL while it waits
            stats = [stats_to_numpy(s) for s in self._stats]
            self._trace = Trace.from_windows(self._variants, self._ends, stats, self._meta)
            self._stats = self._event = None
        return self._trace


def _to_host(stats: dict) -> dict:
    """Non-blocking copies of finish_tensors' device tensors into pinned host memory (as ``to(non_blocking=True)``
    allocates them), in the current stream's order."""
    copy = lambda t: t.to("cpu", non_blocking=True)  # noqa: E731
    return {"mean": copy(stats["mean"]), "last": copy(stats["last"]), "max": {p: copy(t) for p, t in stats["max"].items()}}


def simulate(
    inputs: LayerInputs,
    variants: list[Variant | str] | str,
    *,
    backend: str = "torch",
    record_every: int = 1,
    form: str = "state",
    engine: str | None = None,
) -> Trace:
    """Emulate every variant's stored state over the T decode steps of one layer.

    inputs: Mamba2Inputs or GDNInputs (validated here); variants: Variant objects or strings such as
    "fp8_e4m3@conventional", "int8:sr@replay16" (a list or a comma-separated string); backend:
    "torch" (naive reference), "triton" (fused kernels) or "auto"; record_every: the window length W:
    every step is measured and each window of W consecutive steps (1..W, W+1..2W, ..., the last one
    shorter if T is not a multiple of W) keeps the mean, max and last value of the per-step errors
    (`trace.py`); form: "state" or "literal" (torch backend only; see `naive.py`); engine: the engine
    profile ("ideal" or "flashinfer", `ssmquant.engines.profiles`) of every variant that names none.

    Returns a Trace of window statistics ([V, R, B, H, 4] means and last values, per-pooling maxima)
    with `rel_err(..., stat=)` and `to_frame()` for a long pandas table.
    """
    return start_simulation(
        inputs, variants, backend=backend, record_every=record_every, form=form, engine=engine
    ).result()


def start_simulation(
    inputs: LayerInputs,
    variants: list[Variant | str] | str,
    *,
    backend: str = "torch",
    record_every: int = 1,
    form: str = "state",
    engine: str | None = None,
) -> PendingTrace:
    """``simulate`` without waiting for the device: validates, queues the kernels and the window statistics
    on CUDA inputs' current stream and returns a PendingTrace (on the CPU the work is done on return).
    Arguments as ``simulate``; invalid arguments raise here. Inputs that passed ``validate()`` unchanged since
    (``is_validated``: synthetic inputs are validated where they are drawn, on a stream of their own) are not
    validated again: on a GPU its read-back would wait for the previous layer's kernels queued on this
    stream, which the host would otherwise overlap with queueing this layer."""
    variants = with_engine(parse_variants(variants), engine)
    if not is_validated(inputs):
        inputs.validate()
    check_variants_fit(variants, inputs.state_shape)
    check_engines(variants, inputs, form)
    chosen = resolve_backend(backend, inputs)
    if record_every < 1 or record_every > inputs.steps:
        raise ValueError(f"record_every must lie in [1, steps={inputs.steps}], got {record_every}")
    meta = {
        "kind": inputs.kind,
        "state_shape": list(inputs.state_shape),
        "steps": inputs.steps,
        "backend": chosen,
        "record_every": record_every,
        "form": form,
        "engines": sorted({v.engine for v in variants}),
        **inputs.meta,
    }
    if chosen == "triton" and form != "state":
        raise BackendError("the Triton kernels implement the state form; use backend='torch' for form='literal'")
    if chosen == "triton":
        meta["kernels"] = dict(zip((v.name for v in variants), _kernels().fused_kernels(inputs, variants)))
    accs = [
        WindowAccumulator(inputs.steps, record_every, inputs.batch, inputs.num_heads, inputs.device) for _ in variants
    ]
    if chosen == "torch":
        res = emulate(inputs, variants, form=form, engine_steps=engine_step)
        for acc, m in zip(accs, res.metrics):
            acc.add(m, 0)
    else:
        for i, b0, m in _kernels().emulate_triton_steps(inputs, variants):
            accs[i].add(m, b0)
    names = [v.name for v in variants]
    if inputs.device.type != "cuda":
        return PendingTrace(names, accs[0].ends, [a.finish_tensors() for a in accs], meta)
    import torch

    stats = [_to_host(a.finish_tensors()) for a in accs]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(inputs.device))  # the copies run on the inputs' device's stream
    return PendingTrace(names, accs[0].ends, stats, meta, event)


class LayerOutputs(NamedTuple):
    """``simulate_outputs``' result: outputs [B, T, H, rows] per variant; final_state: the FP32 reference's state
    after the last step [B, H, rows, state_dim], or None; backend: "triton" (the fused kernels) or "torch"."""

    outputs: list
    final_state: object
    backend: str


def simulate_outputs(
    inputs: LayerInputs,
    variants: list[Variant | str] | str,
    *,
    backend: str = "auto",
    dtype=None,
    final_state: bool = False,
) -> LayerOutputs:
    """Each variant's per-step outputs of one layer (what the mixer's scan returns when its stored state is the
    variant's), for teacher-forced evaluation, with the reference's final state when ``final_state`` and the
    backend that ran them (``LayerOutputs``).

    backend as ``simulate`` ("auto": the fused kernels' output mode on CUDA inputs of a kind that has them, where
    every variant takes the ideal arithmetic; the torch reference otherwise). dtype: the outputs' dtype (None:
    float32). The kernels compute the outputs' dot products in their own order (tests/kernels/test_output_mode.py
    bounds the difference).
    """
    variants = parse_variants(variants)
    if not is_validated(inputs):
        inputs.validate()
    check_variants_fit(variants, inputs.state_shape)
    check_engines(variants, inputs, "state")
    chosen = resolve_backend(backend, inputs)
    if chosen == "triton" and all(k != "engine" for k in _kernels().fused_kernels(inputs, variants)):
        kw = {} if dtype is None else {"dtype": dtype}
        outs, final = _kernels().emulate_triton_outputs(inputs, variants, final_state=final_state, **kw)
        return LayerOutputs(outs, final, "triton")
    if chosen == "triton" and backend == "triton":
        raise BackendError("the fused kernels' output mode runs the ideal arithmetic only; use backend='auto'")
    res = emulate(inputs, variants, return_outputs=True, engine_steps=engine_step)
    outs = res.outputs if dtype is None else [y.to(dtype) for y in res.outputs]  # the reference's are float32
    return LayerOutputs(outs, res.ref_final_state if final_state else None, "torch")
