"""Naive torch references that emulate stored-state formats under decoding schemes, for any layer kind.

Two forms, equal in exact arithmetic (tests prove they agree in FP32):

- state form (`form="state"`, the default and what the fused kernels mirror op for op): the variant keeps its
  effective state S~ and advances it every step with the buffered (buffer-dtype rounded) inputs (the kind's
  ``Physics.advance``); at a write step S~ is replaced by its stored (rounded) value.
- literal form (`form="literal"`): the engines' checkpoint-plus-buffer computation (the kind's
  ``LiteralReplay``: Mamba-2's output-only form; the delta rules rebuild the state from the checkpoint and the
  buffered (u_j, k_j, g_j) at every step). The checkpoint is rewritten (and rounded) at write steps from the
  rebuilt state.

A layer's initial state (the state a prompt leaves, ``kinds.after_prompt``, or one given with the inputs) is the
reference's state before step 0; each variant starts from it stored once in its format (`stored_initial_states`:
conventional decoding keeps that stored state, replay holds it as its first checkpoint), as an engine writes the
prefill's final state into its cache.

Conventional decoding is the state form with a write after every step and no buffer rounding. The output at
step t is computed from the unrounded new state (a decode kernel computes y from the state in registers, then
stores the state): rounding at step t affects outputs from step t+1 on.

At every step, per (batch, head), four metrics are kept (``kinds.step_metrics``): squared error and squared
reference norm of the state (Frobenius over [rows, state_dim]) and of the output (over rows). `simulate`
reduces them into window statistics (`trace.py`); nothing is sampled.

Engine profiles (``ssmquant.engines``) compute some variants differently; their step objects come in through
``engine_steps`` (a function of (runner, variant index) giving a step object or None), so that this loop,
below the engines, never imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kinds
from ..formats import Encoding, Rounding, StateFormat
from ..formats.codec import element_index, encode
from ..formats.prompt_store import parse_prompt_store
from ..formats.random import keyed_bits, stream_key, uniform_from_bits
from ..kinds import LayerInputs, is_validated, step_metrics
from .variants import Variant, VariantError

FORMS = ("state", "literal")


class StateStore:
    """Fake-quantizes a variant's state at write steps, with trusted inputs and no host syncs.

    For a state [B, H, rows, state_dim] this returns the FP32 values the format would store; the
    stochastic-rounding stream of the write after step t is t, its counter the flat element index.
    """

    def __init__(self, fmt: StateFormat, shape: tuple[int, ...], device, seed: int, static_scale=None):
        self.fmt = fmt
        self.seed = seed
        self.static = None
        if static_scale is not None:
            group = (*shape[:-2], shape[-2] // fmt.granularity.group_rows(shape[-2]))
            static_scale = static_scale.to(device=device, dtype=torch.float32)
            self.static = static_scale.expand(group)
        self.index = element_index(shape, device) if fmt.rounding is Rounding.SR else None

    def key(self, stream: int) -> torch.Tensor:
        """The stream key of the write after step `stream`, as a 0-d int64 tensor (compile-friendly)."""
        return torch.tensor(stream_key(self.seed, stream), dtype=torch.int64)

    def __call__(self, x: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
        """Stored FP32 values of x [B, H, rows, state_dim]; key: this write's `stream_key`."""
        if self.fmt.encoding is Encoding.FP32:
            return x
        bits = uniform = None
        if self.index is not None:
            bits = keyed_bits(key, self.index)
            uniform = uniform_from_bits(bits)
        return encode(self.fmt, x, static_scale=self.static, uniform=uniform, bits=bits).decode(self.fmt)


# the stochastic-rounding stream of the store of the initial state, before step 0 (the write after step t is t):
# the last stream, which no decode step of a run shorter than 2^32 - 1 steps draws
INITIAL_STREAM = 0xFFFFFFFF


def stored_initial_states(inputs: LayerInputs, variants: list[Variant]) -> list[torch.Tensor] | None:
    """Each variant's state before step 0: the inputs' initial state [B, H, rows, state_dim] stored once in the
    variant's format (its StateStore: scales, rounding, stream INITIAL_STREAM), FP32 values, after its prompt store
    where it names one (the live pool's values after a prefix-cache hit); None without an initial state (every
    variant starts from zeros, which every format and prompt store keep exactly)."""
    init = inputs.initial_state
    if init is None:
        return None
    s0 = init.float()
    out = []
    for v in variants:
        store = StateStore(v.format, inputs.state_shape, inputs.device, v.seed, v.static_scale)
        start = (
            s0
            if v.prompt_store is None
            else parse_prompt_store(v.prompt_store).restore(s0, v.format.encoding.spec.storage)
        )
        out.append(store(start, store.key(INITIAL_STREAM)))
    return out


@dataclass
class EmulationResult:
    """Output of `emulate`.

    metrics: FP32 [V, T, B, H, 4] with METRIC_NAMES along the last dim, at every step;
    steps: int64 [T], the 1-based step numbers (tokens decoded);
    outputs / states: per variant [B, T, H, rows] / [B, T, H, rows, state_dim] when requested;
    final_states: per variant [B, H, rows, state_dim], the emulated state after the last step;
    ref_final_state: the FP32 reference's [B, H, rows, state_dim] after the last step;
    ref_outputs / ref_states: the FP32 reference, when requested.
    """

    metrics: torch.Tensor
    steps: torch.Tensor
    final_states: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None
    states: list[torch.Tensor] | None = None
    ref_outputs: torch.Tensor | None = None
    ref_states: torch.Tensor | None = None
    ref_final_state: torch.Tensor | None = None


def buffer_dtype(variant: Variant) -> torch.dtype:
    """The dtype a variant's buffered inputs are stored in: its scheme's buffer dtype, FP32 without a buffer."""
    return variant.scheme.buffer_torch_dtype if variant.scheme.rounds_buffer else torch.float32


def emulate(
    inputs: LayerInputs,
    variants: list[Variant],
    *,
    form: str = "state",
    return_outputs: bool = False,
    return_states: bool = False,
    engine_steps=None,
) -> EmulationResult:
    """Run the FP32 reference and every variant over all T steps of one layer, in torch.

    inputs: a layer kind's inputs (validated here, unless `is_validated`); engine_steps: (runner, i) -> the step
    object of variant i under its engine profile, or None for the ideal arithmetic (``simulate`` passes the
    engines'; None: every variant is ideal). Returns an EmulationResult whose metrics hold every step
    ([V, T, B, H, 4]).
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if engine_steps is None:
        named = [v.name for v in variants if v.engine != "ideal"]
        if named:
            raise VariantError(
                f"{', '.join(named)} name(s) an engine profile: pass engine_steps=ssmquant.engines.emulation.engine_step "
                "(or run them through ssmquant.simulate), so that they step as the engine computes"
            )
    if not is_validated(inputs):  # (unchanged since it passed: not again)
        inputs.validate()
    return Emulation(inputs, variants, form, engine_steps).run(return_outputs, return_states)


class Emulation:
    """The time loop of the torch reference: the FP32 reference and each variant, one step at a time.

    Engine step objects (``engine_steps``) read: ``inputs``, ``variants``, ``physics`` (the kind's prepared
    tensors), ``buffered[i]`` (variant i's buffered inputs), ``masks[i]`` ([B, T] write schedule),
    ``stores[i]`` (its StateStore), ``s0`` (the reference's initial state) and ``s0_stored[i]`` (variant i's:
    s0 stored in its format)."""

    def __init__(self, inputs: LayerInputs, variants: list[Variant], form: str, engine_steps=None):
        self.inputs, self.variants, self.form = inputs, variants, form
        self.kind = kinds.of(inputs)
        self.shape = inputs.state_shape
        bsz, steps = inputs.batch, inputs.steps
        dev = inputs.device
        self.masks = [v.scheme.write_mask(bsz, steps).to(dev) for v in variants]
        self.any_write = [m.any(0).tolist() for m in self.masks]
        self.stores = [StateStore(v.format, self.shape, dev, v.seed, v.static_scale) for v in variants]
        init = inputs.initial_state
        self.s0 = torch.zeros(self.shape, device=dev) if init is None else init.float().clone()
        self.physics = self.kind.physics(inputs)
        self.s_ref = self.s0.clone()
        # buffered inputs as each variant stores them (rounded to its buffer dtype)
        self.buffered = [self.physics.buffered(buffer_dtype(v)) for v in variants]
        stored = stored_initial_states(inputs, variants)
        self.s0_stored = [self.s0] * len(variants) if stored is None else stored
        self.s_var = [s.clone() for s in self.s0_stored]
        self.literal = None
        if form == "literal":
            cap = max(v.scheme.buffer_len for v in variants)
            self.literal = [
                self.kind.literal(self.physics, self.buffered[i], buffer_dtype(v), cap) for i, v in enumerate(variants)
            ]
        # a variant under an engine profile other than `ideal` steps as that engine computes
        self.engine = [None if engine_steps is None else engine_steps(self, i) for i in range(len(variants))]

    def run(self, return_outputs, return_states) -> EmulationResult:
        inp = self.inputs
        bsz, steps, heads, rows = inp.batch, inp.steps, inp.num_heads, inp.rows
        dev = inp.device
        metrics = torch.full((len(self.variants), steps, bsz, heads, 4), float("nan"), device=dev)
        outs = [torch.empty(bsz, steps, heads, rows, device=dev) for _ in self.variants] if return_outputs else None
        sts = [torch.empty(bsz, steps, *self.shape[1:], device=dev) for _ in self.variants] if return_states else None
        ref_out = torch.empty(bsz, steps, heads, rows, device=dev) if return_outputs else None
        ref_st = torch.empty(bsz, steps, *self.shape[1:], device=dev) if return_states else None
        last = [None] * len(self.variants)
        for t in range(steps):
            self.s_ref, y_ref = self.physics.advance(self.s_ref, t)
            s_ref = self.s_ref
            for i in range(len(self.variants)):
                s_var, y_var = self.variant_step(i, t)
                last[i] = s_var
                metrics[i, t] = step_metrics(s_var, s_ref, y_var, y_ref)
                if outs is not None:
                    outs[i][:, t] = y_var
                if sts is not None:
                    sts[i][:, t] = s_var
            if ref_out is not None:
                ref_out[:, t] = y_ref
            if ref_st is not None:
                ref_st[:, t] = s_ref
        steps_1based = torch.arange(1, steps + 1, dtype=torch.int64)
        return EmulationResult(metrics, steps_1based, last, outs, sts, ref_out, ref_st, self.s_ref)

    def variant_step(self, i: int, t: int):
        """(the state the metrics see, y) of variant i after step t."""
        if self.engine[i] is not None:
            self.s_var[i], y = self.engine[i].step(t)
            return self.s_var[i], y
        if self.literal is not None:
            lit, s0 = self.literal[i], self.s_var[i]  # s_var holds the checkpoint
            rebuilt, y = lit.step(s0, t)
            flush = self.masks[i][:, t]
            stored = self.write(i, t, rebuilt)
            self.s_var[i] = torch.where(flush[:, None, None, None], stored, s0)
            lit.flushed(flush)
            return stored, y
        s, y = self.physics.advance(self.s_var[i], t, self.buffered[i])
        self.s_var[i] = self.write(i, t, s)
        return self.s_var[i], y

    def write(self, i: int, t: int, s: torch.Tensor) -> torch.Tensor:
        """Store s (rounded) where variant i writes after step t; unchanged elsewhere."""
        if not self.any_write[i][t]:
            return s
        stored = self.stores[i](s, stream_key(self.variants[i].seed, t))
        return torch.where(self.masks[i][:, t, None, None, None], stored, s)
