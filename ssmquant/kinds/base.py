"""What every layer kind provides, the checks its inputs share, and the registry of kinds.

A layer kind (Mamba-2, Gated DeltaNet, Kimi Delta Attention, ...) is one module of this package holding:

- its **inputs** (a dataclass deriving from `LayerInputs`): the decode inputs of one layer for a batch of
  sequences over T steps, time second, validated once by ``validate()``;
- its **state layout**: a per-head state [rows, state_dim] (rows carry one scale each; the scale reduction
  runs over state_dim) and, for the bytes a run or an engine holds, `LayerDims`;
- its **FP32 recurrence**: the decays, one decode step of the state and the output (`Physics`), and the
  checkpoint-plus-buffer computation of replay (`LiteralReplay`);
- what the **sizing** needs: bytes of the inputs and of the torch emulation per token, of a replay ring row,
  of a prefill; random inputs of a given shape for timing;
- its **transformers facts** as data: the model families that have it (`TransformersFamily`: architectures,
  model_types), how their config maps to its state layout, the mixer classes it matches (`is_mixer`).

`register` makes a kind known by name (``kinds.get("gdn")``); everything above this package dispatches
through the kind object (``kinds.of(inputs)``), never on the kind's name. ARCHITECTURE.md says how to add a kind.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import SsmquantError

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP32_BYTES = 4


class InputError(SsmquantError, ValueError):
    """A decode-input tensor has the wrong shape, dtype, device or contains NaN/Inf."""


class KindError(SsmquantError, ValueError):
    """An unknown layer kind, or a kind registered twice."""


def raise_input_error(message: str):
    raise InputError(message)


def _meta_problem(name: str, t, shape: tuple[int, ...], device: torch.device) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.dtype not in _FLOAT_DTYPES:
        return f"{name} must be float32, bfloat16 or float16, got {t.dtype}"
    if tuple(t.shape) != tuple(shape):
        return f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}"
    if t.device != device:
        return f"{name} is on {t.device}, expected {device} (all inputs on one device)"
    return None


class Checks:
    """The checks of one ``validate``, in order, with one read-back of the device's answers.

    Shapes, dtypes and devices are checked at once; the value checks (NaN/Inf, a sign rule) are queued as
    0-d flags on the tensors' device and read back together (one wait for the device instead of one per
    check: the wait also holds back the host while the device still runs earlier work). ``run`` raises the
    error the checks one by one would have raised first: value checks before the first bad shape / dtype /
    device, which stops the collection (later tensors are not looked at)."""

    def __init__(self):
        self.items: list[tuple] = []  # (flag or None, raise-function)
        self.stopped = False

    def tensor(self, name: str, t, shape: tuple[int, ...], device: torch.device, time_major: bool = True) -> None:
        if self.stopped:
            return
        problem = _meta_problem(name, t, shape, device)
        if problem is not None:
            self.stopped = True
            self.items.append((None, lambda: raise_input_error(problem)))
            return

        def nonfinite():
            idx = tuple(int(i) for i in (~torch.isfinite(t)).nonzero()[0])
            where = f"batch {idx[0]}, step {idx[1]}" if time_major and len(idx) >= 2 else f"index {idx}"
            raise InputError(f"{name} contains NaN/Inf (first at {where})")

        self.items.append(((~torch.isfinite(t)).any(), nonfinite))

    def rule(self, flag, fail) -> None:
        """``flag()``: a 0-d bool tensor, true when the rule is broken; ``fail()`` raises its error."""
        if not self.stopped:
            self.items.append((flag(), fail))

    def run(self) -> None:
        flags = [f for f, _ in self.items if f is not None]
        values = iter(torch.stack(flags).tolist() if flags else [])
        for flag, fail in self.items:
            if flag is None or next(values):
                fail()


def _tensors(inputs) -> tuple:
    """(field name, tensor, in-place version counter) of each tensor field of an inputs container."""
    return tuple(
        (f.name, t, t._version)
        for f in dataclasses.fields(inputs)
        if isinstance(t := getattr(inputs, f.name), torch.Tensor)
    )


def remember_valid(inputs) -> None:
    """Record that ``validate()`` passed on exactly these tensors, with their version counters. The record
    holds weak references: it must not keep a tensor alive after the container dropped it (a field replaced,
    or a host copy that ``to()`` moved to the GPU), which would hold memory the run believes freed."""
    inputs._valid_as = tuple((name, weakref.ref(t), version) for name, t, version in _tensors(inputs))


def _carry_valid(src, dst):
    """``dst``, made from ``src`` by ``to()``: it keeps src's record, which still holds where ``to`` returned
    the same tensors (already on the device), and not where it copied them."""
    if getattr(src, "_valid_as", None) is not None:
        dst._valid_as = src._valid_as
    return dst


def is_validated(inputs) -> bool:
    """Whether ``inputs.validate()`` has passed on the very tensors the container holds now, none of them
    replaced or changed in place since (the same objects, the same ``Tensor._version``). Lets a consumer skip a
    second validation of inputs validated where they were made: on a GPU its read-back waits for all the
    work queued on the stream."""
    seen = getattr(inputs, "_valid_as", None)
    if seen is None:
        return False
    now = _tensors(inputs)
    return len(now) == len(seen) and all(
        a[0] == b[0] and a[1] is b[1]() and a[2] == b[2] for a, b in zip(now, seen, strict=True)
    )


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, T, G, N] -> [B, T, H, N]: head h reads group h // (H // G) (transformers' repeat_interleave)."""
    return t.repeat_interleave(num_heads // t.shape[2], dim=2)


class LayerInputs:
    """Base of every kind's inputs dataclass: the fields it names in SEQUENCE_FIELDS are time-major
    [B, T, ...] tensors, the others are per-layer parameters; every kind has ``initial_state`` (optional
    [B, H, rows, state_dim]) and ``meta`` (a dict that travels with the results).

    A subclass sets ``kind`` (the name its LayerKind is registered under), SEQUENCE_FIELDS, ACTIVATION_FIELD (the
    sequence field a model hands over in its activation dtype, the dtype a capture is verified by), the properties
    ``batch``, ``steps``, ``num_heads``, ``rows``, ``state_dim``, ``num_groups`` and ``device``, and ``validate``
    (which ends with ``remember_valid(self)`` and returns self)."""

    kind: ClassVar[str]
    SEQUENCE_FIELDS: ClassVar[tuple[str, ...]]
    ACTIVATION_FIELD: ClassVar[str]

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """[B, H, rows, state_dim]: the state of one layer for the batch."""
        return (self.batch, self.num_heads, self.rows, self.state_dim)

    def slice_steps(self, start: int, stop: int):
        """Inputs of steps [start, stop) (same initial state)."""
        return dataclasses.replace(self, **{f: getattr(self, f)[:, start:stop] for f in self.SEQUENCE_FIELDS})

    def slice_batch(self, start: int, stop: int):
        """The sequences [start, stop) (parameters shared); meta records them."""
        fields = {f: getattr(self, f)[start:stop] for f in self.SEQUENCE_FIELDS}
        init = self.initial_state
        return dataclasses.replace(
            self,
            **fields,
            initial_state=None if init is None else init[start:stop],
            meta={**self.meta, "sequences": [start, stop]},
        )

    def to(self, device: torch.device | str):
        """The same inputs on ``device`` (tensors already there are not copied)."""
        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(self)
            if f.name != "meta"
        }
        return _carry_valid(self, dataclasses.replace(self, **moved))


def after_prompt(inputs: LayerInputs, prompt: int, state: torch.Tensor | None = None) -> LayerInputs:
    """The decode inputs that follow a prompt of ``prompt`` steps, as an engine serves them.

    An engine prefills the prompt (its chunked scan, full precision) and decodes from the state it leaves. Here the
    prompt's steps [0, prompt) are run in the kind's FP32 recurrence (``reference_states``) from the inputs'
    initial state, and the returned inputs hold steps [prompt, T) with that state [B, H, rows, state_dim] fp32 as
    their ``initial_state`` (which each variant stores once in its format before it decodes: ``replay.naive``) and
    ``meta["prompt"] = prompt``. prompt 0 returns ``inputs`` unchanged. Inputs not validated yet (``is_validated``)
    are validated here first, the prompt's steps with the rest (a NaN there would otherwise surface as a NaN
    state); ValueError unless 0 <= prompt < T. state: the prompt's FP32 final state where the caller computed it
    already (the fused kernels' output mode), taken as is."""
    if isinstance(prompt, bool) or not isinstance(prompt, int) or not 0 <= prompt < inputs.steps:
        raise ValueError(
            f"the prompt must be a whole number of steps in [0, {inputs.steps}) (the captured steps, of which at "
            f"least one is decoded), got {prompt!r}"
        )
    if prompt == 0:
        return inputs
    if not is_validated(inputs):
        inputs.validate()
    if state is None:
        for _, s in of(inputs).reference_states(inputs.slice_steps(0, prompt), every=prompt):
            state = s.clone()
    decode = inputs.slice_steps(prompt, inputs.steps)
    return dataclasses.replace(decode, initial_state=state, meta={**decode.meta, "prompt": prompt})


@dataclass(frozen=True)
class LayerDims:
    """Sizes of one SSM layer that the bytes of its state, inputs and replay ring depend on.

    kind: the layer kind's name; heads H; rows (a per-head state is [rows, state_dim]); groups: how many
    distinct key / B vectors a step has (Mamba-2's B/C groups, the delta rules' key heads)."""

    kind: str
    heads: int
    rows: int
    state_dim: int
    groups: int

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.rows, self.state_dim)

    @property
    def state_elements(self) -> int:
        return self.heads * self.rows * self.state_dim

    @classmethod
    def of(cls, inputs: LayerInputs) -> LayerDims:
        return cls(inputs.kind, inputs.num_heads, inputs.rows, inputs.state_dim, int(inputs.num_groups))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "heads": self.heads, "rows": self.rows, "state_dim": self.state_dim,
                "groups": self.groups}  # fmt: skip


def step_metrics(s_var, s_ref, y_var, y_ref) -> torch.Tensor:
    """[B, H, 4] squared errors and reference norms of one step (FP32, summed over rows and state_dim): the
    four per-step metrics every backend keeps (``replay.trace.METRIC_NAMES``)."""
    ds, dy = s_var - s_ref, y_var - y_ref
    return torch.stack(
        [(ds * ds).sum((-1, -2)), (s_ref * s_ref).sum((-1, -2)), (dy * dy).sum(-1), (y_ref * y_ref).sum(-1)], -1
    )


class Physics:
    """One layer's inputs prepared for the FP32 recurrence (fp32 copies, decays, groups expanded to heads).

    ``advance(s, t, buffered)`` is one decode step from state s [B, H, rows, state_dim]: (new state, y
    [B, H, rows]). With ``buffered`` None it is the FP32 reference; with a variant's buffered inputs
    (``buffered(dtype)``: what a replay ring stores, rounded to the buffer dtype) it is that variant's step."""

    def buffered(self, dtype: torch.dtype):
        raise NotImplementedError

    def advance(self, s: torch.Tensor, t: int, buffered=None):
        raise NotImplementedError

    def step_args(self, t: int, buffered) -> tuple:
        """Step t's arguments of the kind's ``emulation_step`` after the two states (slices of the prepared
        tensors): the per-step function a compiled peer of the fused kernels runs."""
        raise NotImplementedError


class LiteralReplay:
    """The engines' checkpoint-plus-buffer computation of one variant (``form="literal"``): ``step(s0, t)``
    appends step t to the buffer and returns (the state rebuilt from checkpoint s0 and the buffer, y);
    ``flushed(flush)`` empties the buffer of the sequences whose checkpoint was rewritten after the step."""

    def __init__(self, batch: int, cap: int, device):
        self.cap = cap
        self.held = torch.zeros(batch, dtype=torch.int64, device=device)
        self.buf_idx = torch.zeros(batch, cap, dtype=torch.int64, device=device)

    def step(self, s0: torch.Tensor, t: int):
        raise NotImplementedError

    def flushed(self, flush: torch.Tensor) -> None:
        self.held = torch.where(flush, 0, self.held)


@dataclass(frozen=True)
class TransformersFamily:
    """A transformers model family whose SSM layers are of one kind: name (ssmquant's family key, in outputs),
    architectures (the config's ``architectures`` class names it accepts) and model_types (config ``model_type`` ->
    the architecture assumed where ``architectures`` is absent); image_text: transformers maps its published
    checkpoint to ``AutoModelForImageTextToText`` only."""

    name: str
    architectures: tuple[str, ...]
    model_types: dict[str, str]
    image_text: bool = False


class LayerKind:
    """One layer kind: the object everything above this package dispatches through (module docstring)."""

    name: ClassVar[str]  # registry key, recorded in every output ("mamba2")
    title: ClassVar[str]  # for people ("Mamba-2", "Gated DeltaNet")
    short: ClassVar[str]  # in short messages ("Mamba-2", "GDN")
    inputs_type: ClassVar[type[LayerInputs]]
    # transformers' cache keeps this kind's per-head state as [state_dim, rows] (the delta rules' [Dk, Dv]); the
    # evaluation transposes it to [rows, state_dim]
    cache_transposed: ClassVar[bool] = False
    # variants ("format@scheme") that `analyze` measures on this kind beside its default --formats x --schemes
    # grid: the settings the engines that run the kind actually offer, where the 8-bit grid alone cannot answer
    # whether the cheapest of them is good enough
    analyze_baselines: ClassVar[tuple[str, ...]] = ()

    # -- the FP32 recurrence ------------------------------------------------------------------------------
    def decays(self, inputs) -> torch.Tensor:
        """Per-step decays, fp32 [B, T, H] (or finer, e.g. KDA's [B, T, H, Dk]); computed once and shared by
        every backend, so that all apply bit-identical decays."""
        raise NotImplementedError

    def physics(self, inputs) -> Physics:
        raise NotImplementedError

    def literal(self, physics: Physics, buffered, buffer_dtype: torch.dtype, cap: int) -> LiteralReplay:
        raise NotImplementedError

    def emulation_step(self, s_ref, s_var, *step_args_write_store_key):
        """One step of the FP32 reference and one variant, state form: (s_ref, s_var, *physics.step_args(t,
        buffered), write [B] bool, store, key) -> (s_ref, s_var, step_metrics [B, H, 4])."""
        raise NotImplementedError

    def reference_states(self, inputs, every: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (step, state) of the FP32 reference at steps every, 2 every, ...: the arithmetic of
        ``Physics.advance`` with groups expanded one step at a time, so that memory stays at the size of the
        inputs. The yielded tensor is the live state (copy it to keep it). Inputs are validated by the caller."""
        raise NotImplementedError

    # -- bytes (sizing, replay rings) ---------------------------------------------------------------------
    def input_bytes_per_token(self, dims: LayerDims, act_bytes: int = FP32_BYTES) -> int:
        """The decode inputs of one token as a model hands them over (activations in ``act_bytes``)."""
        raise NotImplementedError

    def emulation_bytes_per_token(self, dims: LayerDims, variants: int) -> int:
        """What the torch emulation (``Physics`` and each variant's buffered inputs) holds per token."""
        raise NotImplementedError

    def ring_row(self, dims: LayerDims) -> tuple[int, int]:
        """(vector elements stored in the buffer dtype, FP32 gate elements) of one replay-ring row."""
        raise NotImplementedError

    def prefill_scan_elements(self, dims: LayerDims, chunk: int) -> float:
        """Live fp32 elements per token of the kind's chunked prefill scan (the sizing of a capture)."""
        raise NotImplementedError

    def prefill_pair_elements(self, dims: LayerDims, chunk: int) -> float:
        """FP32 elements per token that transformers' torch scan of this kind holds for the pairs of a chunk's
        positions while its layer runs (KDA's per-channel decays), beyond ``prefill_scan_elements``; 0 for most
        kinds."""
        return 0

    default_chunk: ClassVar[int] = 64
    # the package whose kernels transformers runs for this kind's prefill scan on CUDA when it is installed
    # (transformers' use_kernel_func_from_hub_with_fallback: the torch scan elsewhere)
    fused_prefill_package: ClassVar[str | None] = None

    # the name transformers' kernel mapping knows this kind's chunked prefill scan by (use_kernel_forward_from_hub on
    # the function a mixer lists in use_kernelized_func): what models.scan_substitution replaces; None: none
    prefill_scan_kernel: ClassVar[str | None] = None

    def torch_prefill(self, device) -> bool:
        """Whether a prefill on ``device`` runs transformers' torch scan of this kind: everywhere but on CUDA with
        ``fused_prefill_package`` importable (None, an unknown device: True)."""
        if device is None or torch.device(device).type != "cuda" or self.fused_prefill_package is None:
            return True
        import importlib.util

        return importlib.util.find_spec(self.fused_prefill_package) is None

    def random_inputs(self, dims: LayerDims, batch: int, steps: int, *, device="cpu", seed: int = 0):
        """Random validated inputs of ``dims`` with realistic ranges (time estimates)."""
        raise NotImplementedError

    # -- transformers' models --------------------------------------------------------------------------------
    # the models that have this kind, for people ("NemotronH")
    model_names: ClassVar[str] = ""
    transformers_families: ClassVar[tuple[TransformersFamily, ...]] = ()
    # a transformers module is this kind's mixer when its class name ends in one of these and it has every one of
    # the attributes
    mixer_class_suffixes: ClassVar[tuple[str, ...]] = ()
    mixer_attributes: ClassVar[tuple[str, ...]] = ()

    def is_mixer(self, module) -> bool:
        """Whether a transformers module is a mixer of this kind (by class name and attributes)."""
        return bool(self.mixer_class_suffixes) and type(module).__name__.endswith(self.mixer_class_suffixes) and all(
            hasattr(module, a) for a in self.mixer_attributes
        )

    def config_layout(self, text_config) -> tuple[tuple[int, int, int], int]:
        """((heads, rows, state_dim) of one layer's state, groups) read from a model's transformers text config
        (``models.loading.ssm_layout``); a kind with no transformers model has none."""
        raise KindError(f"{self.title} layers have no transformers config mapping")

    def __repr__(self) -> str:
        return f"<layer kind {self.name}>"


_KINDS: dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
    """Make ``kind`` known by its name; returns it. Its inputs class must name it (``inputs_type.kind``)."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise KindError(f"layer kind {kind.name!r} is registered already")
    if kind.inputs_type.kind != kind.name:
        raise KindError(f"{kind.inputs_type.__name__}.kind is {kind.inputs_type.kind!r}, not {kind.name!r}")
    _KINDS[kind.name] = kind
    return kind


def get(name: str) -> LayerKind:
    """The kind registered under ``name``; KindError listing the known ones otherwise."""
    try:
        return _KINDS[name]
    except KeyError:
        raise KindError(f"unknown layer kind {name!r}; known: {', '.join(_KINDS)}") from None


def of(inputs: LayerInputs) -> LayerKind:
    """The kind of an inputs object."""
    return get(inputs.kind)


def names() -> tuple[str, ...]:
    """Names of the registered kinds, in registration order."""
    return tuple(_KINDS)


def registered() -> tuple[LayerKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS.values())
