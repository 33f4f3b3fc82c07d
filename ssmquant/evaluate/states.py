"""The SSM states in transformers' cache: find them, check them, and store them in a variant's format.

transformers 5.x (checked against 5.24) keeps every SSM layer's recurrent state in the cache object that
the model's forward fills (a ``DynamicCache`` whose SSM layers are ``LinearAttentionLayer``s). The public
API this module uses:

- ``cache.get_recurrent_state(layer_idx)``: the tensor that the next decode step reads, updates and stores
  back (NemotronH's Mamba-2 mixer updates it in place; the GDN mixers of Qwen3.5 / Qwen3-Next and the KDA
  mixers of GLM-5.3-Flash / Kimi-Linear pass it as ``initial_state`` and write the result back with
  ``update_recurrent_state``);
- ``cache.update_recurrent_state(state, layer_idx)``: copies ``state`` into that tensor (in place).

transformers >= 5.24 (the floor in pyproject.toml) has both; ``graphs`` reads ``get_conv_state`` as well.

Layouts: Mamba-2 ``[B, H, P, N]`` (head_dim rows, state columns: already ssmquant's
``[..., rows, state_dim]``); GDN and KDA ``[B, H, Dk, Dv]``, transposed here to ``[B, H, Dv, Dk]`` so that a
row is a value channel reduced over the key dim, as the formats expect (ARCHITECTURE.md, "Formats").

Nothing else of the cache is touched: the conv states (the last ``conv_kernel`` inputs of each SSM
layer) and the attention layers' KV cache stay exactly as the model wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kinds
from ..errors import SsmquantError
from ..formats import Rounding
from ..formats.codec import element_index, encode
from ..formats.random import MASK32, keyed_bits, stream_key, uniform_from_bits
from ..models import find_ssm_mixers
from ..replay.naive import INITIAL_STREAM
from ..replay.variants import Variant


class EvalError(SsmquantError, ValueError):
    """Bad evaluation settings or a model / cache the evaluation cannot use; the message says which."""


# Per-layer stochastic-rounding seed: the variant's seed mixed with the layer index (a large odd
# multiplier, then the counter hash in `formats.random` spreads it), so that layers do not share random
# words at the same element index and step.
_LAYER_SEED_MUL = 0x9E3779B1


def layer_seed(seed: int, layer: int) -> int:
    """The stochastic-rounding seed of decoder layer ``layer`` for a variant seeded ``seed`` (layer 0: ``seed``)."""
    return (int(seed) + _LAYER_SEED_MUL * int(layer)) & MASK32


@dataclass(frozen=True)
class SSMLayer:
    """One SSM layer: decoder-layer index and the name of its registered layer kind."""

    index: int
    kind: str


def ssm_layers(net: torch.nn.Module) -> list[SSMLayer]:
    """The model's SSM layers in order (Mamba-2 / Gated DeltaNet mixers, by decoder-layer index)."""
    layers = [SSMLayer(i, m.kind) for i, m in find_ssm_mixers(net).items()]
    if not layers:
        raise EvalError(
            f"{type(net).__name__} has no Mamba-2 or Gated DeltaNet mixer (is it a NemotronH / Qwen3.5 / Qwen3-Next "
            "model?)"
        )
    return layers


def to_rows(state: torch.Tensor, kind: str) -> torch.Tensor:
    """Cached state -> ssmquant's [B, H, rows, state_dim] (a view): as is, or transposed where the kind's
    transformers cache keeps [state_dim, rows] (GDN / KDA [B, H, Dk, Dv], ``LayerKind.cache_transposed``)."""
    return state.transpose(-1, -2) if kinds.get(kind).cache_transposed else state


def get_state(cache, layer: SSMLayer, step: int) -> torch.Tensor:
    """The cached recurrent state of ``layer`` after decode step ``step`` (0-based); an error if there is none."""
    try:
        state = cache.get_recurrent_state(layer.index)
    except (AttributeError, ValueError, IndexError, KeyError) as exc:
        raise EvalError(
            f"layer {layer.index}: cannot read its recurrent state from the cache ({type(cache).__name__}: {exc}); "
            "this transformers version's cache API is not supported (checked: 5.24)"
        ) from exc
    if state is None:
        raise EvalError(f"layer {layer.index}: the cache holds no recurrent state after decode step {step}")
    return state


def prepare_states(cache, layers: list[SSMLayer], batch: int, state_shape: tuple[int, int, int]) -> list[str]:
    """After the first decode step: check every SSM state's shape, and make it FP32 if it is not.

    ``state_shape`` is (heads, rows, state_dim) as ``models.ssm_layout`` gives it. The cache allocates each
    state on first write with the dtype of what the mixer produced; transformers' torch paths produce FP32,
    but a fused kernel might not. A non-FP32 state is replaced by its FP32 copy (so every later step keeps
    FP32: the mixers store with ``copy_`` into the cached tensor); the returned notes say where. Only that
    first state was rounded to the lower precision.
    """
    notes = []
    expected = (batch, *state_shape)
    for layer in layers:
        state = get_state(cache, layer, 0)
        got = tuple(to_rows(state, layer.kind).shape)
        if got != expected:
            raise EvalError(
                f"layer {layer.index} ({layer.kind}): the cached state has shape {tuple(state.shape)}, i.e. "
                f"{got} as [batch, heads, rows, state_dim]; the config says {expected}"
            )
        if state.dtype != torch.float32:
            try:
                cache.layers[layer.index].recurrent_states[0] = state.float()
            except (AttributeError, IndexError, KeyError, TypeError) as exc:
                raise EvalError(
                    f"layer {layer.index}: the cached state is {state.dtype}, not float32, and this cache "
                    f"({type(cache).__name__}) cannot be switched to float32: {exc}"
                ) from exc
            notes.append(f"layer {layer.index}: the cache allocated the state in {state.dtype}; switched to float32")
    return notes


# Layers whose states are stored by one set of tensor ops: a group holds at most this many state elements
# (of one variant's sequences). Bounds the temporaries of a write (stochastic rounding's int64 random words
# and the encode's FP32 intermediates: ~64 bytes per element, i.e. ~2 GiB) while cutting the op launches of
# a write from one set per layer to one set per group.
WRITE_GROUP_ELEMENTS = 2**25
WRITE_BYTES_PER_ELEMENT = 64



class StateWriter:
    """Stores every SSM layer's cached state in a variant's format at the variant's write steps.

    ``write_mask``: bool [batch, steps] from ``variant.scheme.write_mask`` (True: the state is stored, and so
    rounded, after that step). Call ``writer(cache, step, offset)`` right after the model's forward of
    ``step`` (with ``prompt``: ``writer(cache, 0, offset)`` after the prompt's forward stores the prompt's state
    once, stream 2^32 - 1 = ``replay.naive.INITIAL_STREAM``, and decode step t is column t + 1): the variant's
    sequences are ``offset .. offset + batch`` of the cache's batch (a folded run keeps the reference and several variants in one batch). Where the mask is set, their cached FP32 state
    is replaced by ``format.fake_quant(state, seed=layer_seed, stream=step)`` computed on that slice alone;
    elsewhere it is left exactly as the model computed it, and the other sequences of the cache are never
    touched. The stochastic-rounding stream of the write after step t is t, as in ``replay.naive``; the seed
    is ``layer_seed(variant.seed, layer)``; the element counter is the index within the slice
    [batch, heads, rows, state_dim], so a folded run draws the same random words as a run of its own.

    Layers of equal state shape are stored together (stacked, at most ``WRITE_GROUP_ELEMENTS`` elements):
    every scale group lies inside one layer's [rows, state_dim], so this is bit-identical to storing each
    layer on its own. On a GPU each layer is stored by one fused Triton kernel instead (``kernel``: None picks
    it for CUDA states, True / False force it; the same bits); there ``in_place`` (default) stores contiguous FP32
    states with ``store_state_triton``, False with ``fake_quant_triton``, a copy back and two finiteness checks (the
    path of transposed GDN / KDA states; the same bits, ~3x the memory traffic: kept for the lab's speed
    comparison with the earlier writes, lab/gpu/eval_speed.py). No host synchronisation: ``finite`` (bool
    [steps, layers, 2], on the states' device) records whether each state was finite before and after its write,
    for the caller to check once per window
    (``first_nonfinite``) instead of once per layer and step.
    """

    def __init__(
        self,
        variant: Variant,
        layers: list[SSMLayer],
        batch: int,
        steps: int,
        kernel: bool | None = None,
        in_place: bool = True,
        prompt: bool = False,
    ):
        self.variant = variant
        self.layers = layers
        self.batch = batch
        self.mask = variant.scheme.write_mask(batch, steps)  # [B, T]
        # the SR stream of each column: the decode step, after the prompt's store (INITIAL_STREAM) when there is one
        self.streams = list(range(steps))
        self.prompt = bool(prompt)
        if self.prompt:
            self.mask = torch.cat([torch.ones(batch, 1, dtype=torch.bool), self.mask], 1)  # [B, 1 + T]
            self.streams = [INITIAL_STREAM, *self.streams]
        self.any = self.mask.any(0).tolist()
        self.all = self.mask.all(0).tolist()
        self.exact = variant.format.is_exact
        self.kernel = kernel
        self.in_place = bool(in_place)
        # [T, layers, 2] bool, allocated at the first write: the model's state, and the stored one, were finite
        self.finite: torch.Tensor | None = None
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}  # mask and SR keys per device, copied once

    def __call__(self, cache, step: int, offset: int = 0) -> None:
        if self.exact or not self.any[step]:
            return
        states = [get_state(cache, layer, step) for layer in self.layers]
        dev = states[0].device
        if self.finite is None:
            self.finite = torch.ones(self.mask.shape[1], len(self.layers), 2, dtype=torch.bool, device=dev)
        sl = slice(offset, offset + self.batch)
        rows = [to_rows(s[sl], layer.kind) for s, layer in zip(states, self.layers)]  # [B, H, rows, state_dim]
        if self._use_kernel(dev):
            self._store_kernel(rows, step)
            return
        for group in _groups(rows):
            self._store(group, rows, step)

    def _use_kernel(self, device: torch.device) -> bool:
        """The fused Triton fake-quant (``kernels.fake_quant_triton``, bit-identical to ``fmt.fake_quant`` by
        construction and test) for states on a GPU, unless ``kernel`` says otherwise; groups of rows that are
        not a power of two stay on the torch path (the kernel needs power-of-two groups)."""
        use = device.type == "cuda" if self.kernel is None else self.kernel
        g = self.variant.format.granularity.rows
        return use and (g is None or g & (g - 1) == 0)

    def _store_kernel(self, rows: list[torch.Tensor], step: int) -> None:
        """One fused read-quantize-dequantize-write per layer, where the torch path's encode makes a dozen passes
        over the state (a GPU-memory-bound cost at full size). Contiguous FP32 states (Mamba-2's cache layout) are
        stored in place by ``store_state_triton``, which also counts the non-finite elements before and after:
        one read and one write of each state and one launch per layer. Others (GDN / KDA rows are a transposed
        view) by ``fake_quant_triton`` and a copy back."""
        from ..kernels import fake_quant_triton, store_state_triton  # Triton is imported only when a GPU path needs it

        fmt = self.variant.format
        if self.in_place and all(x.is_contiguous() and x.dtype == torch.float32 for x in rows):
            dev = rows[0].device
            flags = self._flags(rows[0])  # [layers, B * H, 2]
            keep = None if self.all[step] else self._device_copy("keep", dev)[step]
            for i, (x, layer) in enumerate(zip(rows, self.layers)):
                store_state_triton(fmt, x, flags[i], keep=keep, seed=layer_seed(self.variant.seed, layer.index), stream=self.streams[step])
            self.finite[step] = (flags == 0).all(1)
            return
        self.finite[step, :, 0] = torch.stack([torch.isfinite(x).all() for x in rows])
        keep = None if self.all[step] else self._device_copy("mask", rows[0].device)[:, step][:, None, None, None]
        for x, layer in zip(rows, self.layers):
            stored = fake_quant_triton(fmt, x, seed=layer_seed(self.variant.seed, layer.index), stream=self.streams[step])
            x.copy_(stored if keep is None else torch.where(keep, stored, x))
        self.finite[step, :, 1] = torch.stack([torch.isfinite(x).all() for x in rows])

    def _store(self, group: list[int], rows: list[torch.Tensor], step: int) -> None:
        fmt = self.variant.format
        x = torch.stack([rows[i] for i in group]).float()  # [G, B, H, rows, state_dim]
        self.finite[step, group[0] : group[-1] + 1, 0] = torch.isfinite(x).flatten(1).all(1)
        bits = uniform = None
        if fmt.rounding is Rounding.SR:
            index = element_index(x.shape[1:], x.device)  # the slice's own element counter
            keys = self._device_copy("keys", x.device)[step, group[0] : group[-1] + 1]
            bits = keyed_bits(keys.view(-1, 1, 1, 1, 1), index)
            uniform = uniform_from_bits(bits)
        stored = encode(fmt, x, uniform=uniform, bits=bits).decode(fmt)
        if not self.all[step]:
            keep = self._device_copy("mask", x.device)[:, step][None, :, None, None, None]
            stored = torch.where(keep, stored, x)
        self.finite[step, group[0] : group[-1] + 1, 1] = torch.isfinite(stored).flatten(1).all(1)
        for j, i in enumerate(group):
            rows[i].copy_(stored[j])  # in place, in the cache's own tensor (a view of its slice)

    def _flags(self, like: torch.Tensor) -> torch.Tensor:
        """int32 [layers, B * H, 2] on ``like``'s device, reused at every write: ``store_state_triton``'s counts."""
        got = self._on.get(("flags", like.device))
        if got is None:
            shape = (len(self.layers), like.shape[0] * like.shape[1], 2)
            got = self._on[("flags", like.device)] = torch.zeros(shape, dtype=torch.int32, device=like.device)
        return got

    def _device_copy(self, what: str, device) -> torch.Tensor:
        """The write mask [B, T] (``keep``: transposed, int8) or the SR stream keys [T, layers] (int64:
        ``stream_key(layer_seed(seed, layer), step)``) on ``device``, copied there once: a host-to-device copy per write would wait for the
        device every step. Per device, for models spread over GPUs."""
        got = self._on.get((what, device))
        if got is None:
            if what == "mask":
                host = self.mask
            elif what == "keep":  # [T, B] int8, a contiguous row per step for the kernel
                host = self.mask.T.contiguous().to(torch.int8)
            else:
                seeds = [layer_seed(self.variant.seed, layer.index) for layer in self.layers]
                keys = [[stream_key(s, self.streams[t]) if self.any[t] else 0 for s in seeds] for t in range(len(self.any))]
                host = torch.tensor(keys, dtype=torch.int64)
            got = self._on[(what, device)] = host.to(device)
        return got

    def first_nonfinite(self) -> str | None:
        """None when every state so far was finite before and after its write, else the first that was not (step
        and layer; whether the model's state was already non-finite or the format's encode made it so).
        Synchronises."""
        if self.finite is None or bool(self.finite.all()):
            return None
        bad = ~self.finite.permute(0, 2, 1)  # [T, 2, layers]: at step t the input check comes before the stored one
        step, stored, i = (int(v) for v in bad.nonzero()[0])
        when = "the prompt's state" if self.prompt and step == 0 else f"decode step {step - int(self.prompt)}"
        where = f"variant {self.variant.name}, layer {self.layers[i].index}, {when}"
        if not stored:
            return f"{where}: cannot store the state: it contains NaN/Inf"
        return (
            f"{where}: the state was finite but its stored {self.variant.format.name} value is not (NaN/Inf made by "
            "the format's encode, e.g. a row whose amax is so small that max_code / amax overflows FP32)"
        )

def _groups(rows: list[torch.Tensor]) -> list[list[int]]:
    """Consecutive layers with equal state shape and device, at most WRITE_GROUP_ELEMENTS elements per group
    (one layer at least)."""
    groups: list[list[int]] = []
    for i, r in enumerate(rows):
        g = groups[-1] if groups else None
        first = rows[g[0]] if g else None
        if g and (first.shape, first.device) == (r.shape, r.device) and (len(g) + 1) * r.numel() <= WRITE_GROUP_ELEMENTS:
            g.append(i)
        else:
            groups.append([i])
    return groups
