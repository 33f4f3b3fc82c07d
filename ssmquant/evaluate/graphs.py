"""CUDA graphs of the decode step's recurrent segments: the runs of decoder layers between attention layers.

transformers' torch decode path of a hybrid model launches ~30 small kernels per layer (norm, in_proj, conv
update, the Mamba-2 state update, gated norm, out_proj, MLP), so a one-token forward of nemotron-h-8b's 52
layers is bound by the host launching them, not by the GPU. A *segment* is a maximal run of consecutive
decoder layers whose decode step has fixed shapes and reads only tensors that stay at fixed addresses: the
Mamba-2 mixer blocks (their conv and recurrent states are updated in place in the cache: ``copy_``) and the
MLP blocks. The attention layers (their KV cache grows by concatenation every step) run eagerly between
segments. Each segment is recorded once per (input shape, cache tensors) as a CUDA graph and replayed every
step: the same kernels on the same addresses, so the same bits as the eager step.

Protocol per segment and key: the first call runs eagerly on the capture stream (the warm-up that CUDA graph
capture needs: cuBLAS handles and workspaces); the second call records the graph (recording executes nothing,
so the cache is not advanced twice) and replays it; later calls replay. A state write of ``StateWriter`` is an
in-place copy into the cached tensors, so a replay reads what was stored. Graphs are keyed by the data
pointers of the segment's cached states: a cache re-indexed by ``reorder_cache`` (folding after step 0) or
another run's cache gets its own graphs.

Only NemotronH blocks of type ``linear_attention`` (Mamba-2) and ``mlp`` are graphed, on one CUDA device
without accelerate hooks, in decode calls (one token, no padding mask): their forwards read no other
per-step tensor (``position_ids`` is passed but only attention layers read it). Anything else runs eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

# Block types whose one-token decode step is graphed (NemotronHBlock.block_type).
GRAPHED_BLOCK_TYPES = ("linear_attention", "mlp")
# The only tensor-valued keyword a graphed block may receive: unused by these block types (attention reads it).
UNUSED_TENSOR_KWARGS = ("position_ids",)


class CudaCapture:
    """Records and replays CUDA graphs on one side stream, sharing one memory pool across the graphs.

    Sharing the pool is safe here: the graphs replay one after another on one stream, and every graph's
    output stays referenced (by its segment) for as long as the graphs live.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def warm(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run fn eagerly on the capture stream (ordered after the current stream's work, and before its next)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        out.record_stream(current)  # allocated on the side stream, used and freed on the current one
        return out

    def capture(self, fn: Callable[[], torch.Tensor], like: torch.Tensor) -> tuple[Callable[[], None], torch.Tensor]:
        """Record fn (nothing runs): (replay, output tensor that every replay rewrites). ``like``: the input,
        whose shape and dtype the output has (residual blocks); unused here."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        return graph.replay, out


def backend_for(device: torch.device) -> CudaCapture:
    """The graph backend of a model on ``device`` (a CUDA device)."""
    return CudaCapture(torch.device(device))


def decoder_blocks(net: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The decoder layers (``model.layers``) of a NemotronH causal LM, or None for any other model."""
    inner = getattr(net, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(type(b).__name__ == "NemotronHBlock" for b in layers):
        return None
    return list(layers)


def segments_of(block_types: list[str]) -> list[list[int]]:
    """Maximal runs of consecutive layer indices whose block type is graphed."""
    runs: list[list[int]] = []
    for i, kind in enumerate(block_types):
        if kind not in GRAPHED_BLOCK_TYPES:
            continue
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def graph_refusal(net: torch.nn.Module) -> str | None:
    """Why the decode step of ``net`` cannot be graphed (None: it can)."""
    blocks = decoder_blocks(net)
    if blocks is None:
        return f"{type(net).__name__} is not a NemotronH model (only NemotronH's Mamba-2 and MLP blocks are graphed)"
    devices = {p.device for p in net.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return f"the model's weights sit on {sorted(str(d) for d in devices)}, not on one CUDA device"
    if any(hasattr(m, "_hf_hook") for m in net.modules()):
        return "the model carries accelerate hooks (device_map): the hooks move tensors between devices"
    if not segments_of([b.block_type for b in blocks]):
        return "the model has no Mamba-2 or MLP block to graph"
    return None


class _Segment:
    """One run of decoder blocks; its head block's forward runs the whole run (graphed), the others pass through."""

    def __init__(self, blocks: list[torch.nn.Module], backend, stats: dict):
        self.blocks = blocks
        self.forwards = [b.forward for b in blocks]  # the bound class forwards, called without module hooks
        self.backend = backend
        self.stats = stats
        self.covered = False  # the head ran the whole segment in this forward: the followers pass through
        self.warmed: set = set()
        self.graphs: dict = {}
        self.broken: str | None = None

    def _states(self, cache) -> list[torch.Tensor] | None:
        out = []
        for b in self.blocks:
            if b.block_type != "linear_attention":
                continue
            i = b.mixer.layer_idx
            conv, rec = cache.get_conv_state(i), cache.get_recurrent_state(i)
            if conv is None or rec is None:
                return None
            out += [conv, rec]
        return out

    def _key(self, hidden_states: torch.Tensor, args, kwargs) -> tuple | None:
        if self.broken or args or hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            return None
        if kwargs.get("attention_mask") is not None:
            return None
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor) and name not in UNUSED_TENSOR_KWARGS:
                return None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        states = [] if cache is None else self._states(cache)
        if states is None or (cache is None and any(b.block_type == "linear_attention" for b in self.blocks)):
            return None
        ptrs = tuple((s.data_ptr(), tuple(s.shape), s.dtype) for s in states)
        return (tuple(hidden_states.shape), hidden_states.dtype, hidden_states.device, ptrs)

    def _eager(self, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
        for forward in self.forwards:
            hidden_states = forward(hidden_states, **kwargs)
        return hidden_states

    def head(self, hidden_states, *args, **kwargs):
        self.covered = False
        key = self._key(hidden_states, args, kwargs)
        if key is None:
            self.stats["eager_calls"] += 1
            return self.forwards[0](hidden_states, *args, **kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.warmed:
                self.warmed.add(key)
                self.covered = True
                self.stats["warm_calls"] += 1
                return self.backend.warm(lambda: self._eager(hidden_states, kwargs))
            static_in = hidden_states.clone()
            try:
                replay, out = self.backend.capture(lambda: self._eager(static_in, kwargs), static_in)
            except Exception as err:  # an op that cannot be recorded (a host sync): this segment stays eager
                self.broken = f"{type(err).__name__}: {err}"
                self.stats["eager_calls"] += 1
                return self.forwards[0](hidden_states, *args, **kwargs)
            entry = self.graphs[key] = (static_in, replay, out)
            self.stats["graphs"] += 1
        static_in, replay, out = entry
        static_in.copy_(hidden_states)
        replay()
        self.covered = True
        self.stats["replays"] += 1
        return out.clone()  # the graph rewrites `out` at its next replay

    def follower(self, index: int):
        forward = self.forwards[index]

        def run(hidden_states, *args, **kwargs):
            return hidden_states if self.covered else forward(hidden_states, *args, **kwargs)

        return run


class SegmentGraphs:
    """Installs segment graphs on a model's decoder blocks for the duration of a ``with`` block.

    ``backend``: ``CudaCapture`` (default, on the model's device), or any object with the same ``warm`` /
    ``capture`` methods (tests replay eagerly on the CPU). ``stats``: graphs recorded, replays, warm-up and
    eager calls; ``broken``: segments whose recording failed, with the error (they ran eagerly).
    """

    def __init__(self, net: torch.nn.Module, backend=None):
        blocks = decoder_blocks(net)
        if blocks is None:
            raise ValueError(graph_refusal(net))
        self.backend = backend if backend is not None else CudaCapture(next(net.parameters()).device)
        self.stats = {"graphs": 0, "replays": 0, "warm_calls": 0, "eager_calls": 0}
        self.segments = [
            _Segment([blocks[i] for i in run], self.backend, self.stats)
            for run in segments_of([b.block_type for b in blocks])
        ]

    @property
    def layers(self) -> int:
        return sum(len(s.blocks) for s in self.segments)

    @property
    def broken(self) -> list[str]:
        return [s.broken for s in self.segments if s.broken]

    def __enter__(self) -> SegmentGraphs:
        for seg in self.segments:
            seg.blocks[0].forward = seg.head
            for k, b in enumerate(seg.blocks[1:], start=1):
                b.forward = seg.follower(k)
        return self

    def __exit__(self, *exc) -> None:
        for seg in self.segments:
            for b in seg.blocks:
                with contextlib.suppress(AttributeError):
                    del b.forward  # the class's forward again
            seg.graphs.clear()
        return None


__all__ = [
    "GRAPHED_BLOCK_TYPES",
    "CudaCapture",
    "SegmentGraphs",
    "backend_for",
    "decoder_blocks",
    "graph_refusal",
    "segments_of",
]
