"""Where a run's per-layer decode inputs come from, and a description of it that travels with every output.

- a shipped tiny model (real trained weights, the shipped public-domain text): kind "shipped";
- a real checkpoint (local directory or hub id) on calibration text: kind "checkpoint";
- a preset's shapes with synthetic inputs (`--synthetic`): kind "synthetic", with its dynamics profile
  (`--synthetic-profile`: the init law, or a labelled stress profile, `ssmquant.models.synthetic`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..errors import SsmquantError
from ..formats import FormatError
from ..kinds import LayerInputs
from ..models import (
    LoadedModel,
    ModelLoadError,
    attention_dims,
    available_shipped_models,
    capture_text_batch,
    get_preset,
    iter_capture,
    list_presets,
    load_model,
    read_config,
    resolve_model,
    ssm_layout,
    synthetic_layers,
)
from ..models.loading import checkpoint_plan
from ..models.placement import ssm_mixer_devices
from ..models.synthetic import PROFILES, profiles_refusal, supports_profiles
from ..models.text import TextError, load_text, split_bounds, text_origin, text_phrase
from ..simulate import BACKENDS, triton_interpreting
from ..sizing import AttentionDims, analyze_memory, check_memory, layer_dims, probe_step_seconds
from .devices import DeviceError, parse_emulation_devices


class SourceError(SsmquantError, ValueError):
    """The requested model / data combination cannot be used; the message says what to pass instead."""


@dataclass
class LayerSource:
    """A model's SSM layers and a way to get their inputs, one layer at a time.

    kind: "shipped" | "checkpoint" | "synthetic"; name: the model's name; layers: the decoder-layer
    indices of its SSM layers; layer_kind: a registered layer kind's name; state_shape: (heads, rows, state_dim);
    describe: the provenance dict written into report.json; groups: Mamba-2 B/C groups, GDN key heads or
    KDA heads (None: unknown, taken as heads by the estimates); prefill: the checkpoint's config when capture
    runs a prefill (for the memory estimate), None for synthetic inputs; layer_devices: the device holding
    each SSM layer of a loaded model (None for synthetic inputs); attention: the attention layers that prefill runs
    (``models.attention_dims``, for the memory estimate; None for synthetic inputs).
    """

    kind: str
    name: str
    layers: list[int]
    layer_kind: str
    state_shape: tuple[int, int, int]
    describe: dict = field(default_factory=dict)
    _iterate: object = None
    groups: int | None = None
    prefill: dict | None = None
    layer_devices: dict[int, torch.device] | None = None  # where each SSM layer's weights are (captured models)
    attention: AttentionDims | None = None
    _device: torch.device | None = None  # where synthetic inputs are drawn

    def iter_layers(self, layers: list[int], *, ahead: bool = False) -> Iterator[tuple[int, LayerInputs]]:
        """Yield (layer index, inputs) for the requested layers, streaming (one layer alive at a time).
        ahead: synthetic inputs on a GPU are made one layer ahead, on a stream of their own (``made_ahead``;
        ``can_make_ahead`` says when; the memory estimate counts it with ``plan_layers(ahead=True)``)."""
        if ahead and self.can_make_ahead:
            return made_ahead(lambda: self._iterate(layers), self._device)
        return self._iterate(layers)

    @property
    def can_make_ahead(self) -> bool:
        """Whether ``iter_layers(ahead=True)`` makes the inputs ahead: synthetic inputs drawn on a GPU."""
        return self.kind == "synthetic" and self._device is not None and self._device.type == "cuda"

    def check_formats(self, formats) -> None:
        """Refuse formats that cannot store this model's state (nvfp4 blocks, row groups), naming why."""
        for fmt in formats:
            try:
                fmt.bytes_per_state(self.state_shape)
            except FormatError as err:
                raise SourceError(f"{fmt.name} cannot store {self.name}'s state {self.state_shape}: {err}") from None

    @property
    def dims(self):
        """The layer sizes (``calibrate.settings.LayerDims``) the memory and time estimates read."""
        heads, rows, state_dim = self.state_shape
        return layer_dims(self.layer_kind, heads, rows, state_dim, self.groups or heads)

    def select(self, layers: list[int] | None) -> list[int]:
        """Validate a layer selection (decoder-layer indices) against this model's SSM layers."""
        return select_layers(layers, self.layers, self.name, self.layer_kind)


def select_layers(layers: list[int] | None, ssm_layers, name: str, layer_kind: str) -> list[int]:
    """``layers`` (decoder-layer indices; None: all) checked against a model's SSM layers, sorted. Raises
    SourceError naming the model's SSM layers."""
    ssm_layers = list(ssm_layers)
    if layers is None:
        return ssm_layers
    if not layers:
        raise SourceError(f"--layers is empty; give SSM layers of {name} (its {layer_kind} layers are {ssm_layers})")
    bad = [i for i in layers if i not in ssm_layers]
    if bad:
        raise SourceError(f"layers {bad} are not SSM layers of {name}; its {layer_kind} layers are {ssm_layers}")
    if len(set(layers)) != len(layers):
        raise SourceError(f"layers {layers} lists a layer twice")
    return sorted(layers)


def check_layers_before_loading(model: str, layers: list[int] | None) -> None:
    """Refuse a ``layers`` selection that names a layer that is not an SSM layer of checkpoint ``model`` (or none)
    from its config.json alone, before the weights load (minutes for a large model, a download for a hub id). A
    model whose config cannot be read or derived here is left to the load, which reports it."""
    if layers is None:
        return
    try:
        source = resolve_model(model)
        layout = ssm_layout(read_config(source))
    except Exception:  # noqa: BLE001 - the load that follows names the problem (see the docstring)
        return
    select_layers(layers, layout["ssm_layers"], source.name, layout["layer_kind"])


class _Closed(Exception):
    """The consumer of ``made_ahead`` went away."""


def made_ahead(make: Callable[[], Iterator], device: torch.device) -> Iterator:
    """The items (layer, LayerInputs) of ``make()``, made one ahead in a worker thread on a CUDA stream of its own.

    The next layer's synthetic inputs are then drawn on the GPU while the consumer's kernels of the current
    layer run on its stream, instead of after them. An item is complete when it is handed over (the worker
    waits for its own stream); its tensors are marked as used on the consumer's current stream
    (``Tensor.record_stream``), so their memory returns to the worker's pool only once the consumer's work
    queued before their release is done. One item waits at most (with the one being made and the consumer's:
    ``plan_layers(ahead=True)``). The draws are the same: each layer has its own generator. Closing the
    generator stops the worker; an error in the worker is raised here.
    """
    q: queue.Queue = queue.Queue(maxsize=1)
    closed = threading.Event()

    def put(item):
        while True:
            if closed.is_set():
                raise _Closed
            try:
                q.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    cuda = device.type == "cuda"  # (on a CPU device only the thread remains: the tests run it there)

    def worker():
        try:
            stream = torch.cuda.Stream(device) if cuda else None
            with torch.cuda.device(device) if cuda else contextlib.nullcontext(), torch.cuda.stream(stream):
                for item in make():
                    if cuda:
                        stream.synchronize()
                    put(("item", item))
                    del item
            put(("done", None))
        except _Closed:
            pass
        except BaseException as exc:  # handed to the consumer, raised there
            with contextlib.suppress(_Closed):
                put(("error", exc))

    thread = threading.Thread(target=worker, name="ssmquant-inputs-ahead", daemon=True)
    thread.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "error":
                raise item
            if kind == "done":
                return
            layer, inputs = item
            del item
            consumer = torch.cuda.current_stream(device) if cuda else None
            for f in dataclasses.fields(inputs) if cuda else ():
                value = getattr(inputs, f.name)
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(consumer)
            yield layer, inputs
            del inputs
    finally:
        closed.set()
        thread.join()


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error naming the problem."""
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise SourceError(f"unknown device {device!r}; accepted: auto, cpu, cuda, cuda:N")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SourceError("--device cuda was requested but no CUDA GPU is available; use --device cpu or auto")
    return torch.device(device)


def check_backend(backend: str, device: torch.device) -> str:
    """The backend a run on ``device`` uses ("torch" or "triton"), checked before any work starts."""
    if backend not in BACKENDS:
        raise SourceError(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not triton_interpreting():
        raise SourceError(
            f"--backend triton needs a CUDA GPU and this run is on {device}; use --backend auto or torch "
            "(or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter, slowly)"
        )
    return backend


def resolve_run_devices(
    device: str, devices: str | list[str] | None, backend: str, *, model: LoadedModel | None = None
) -> tuple[torch.device, list[torch.device], str]:
    """The devices and backend of an analyze or calibrate run, checked before any work starts.

    device: ``--device`` ("auto", "cpu", "cuda", "cuda:N"; "auto" with a loaded ``model`` is the device the
    model is on); devices: ``--devices`` (``analysis.devices.parse_emulation_devices``; None: ``device``
    alone); backend: ``--backend``, checked against the first emulation device. Returns (the device inputs
    are loaded and captured on, the emulation devices, the backend chosen: "torch" or "triton"). Raises
    SourceError naming the problem and the accepted values.
    """
    dev = model.device if model is not None and device == "auto" else resolve_device(device)
    try:
        emu_devices = parse_emulation_devices(devices, dev)
    except DeviceError as err:
        raise SourceError(str(err)) from None
    return dev, emu_devices, check_backend(backend, emu_devices[0])


def check_text(text_path: str | None, *, batch: int, length: int, split: str) -> str:
    """The text (``--text`` or the shipped corpus), checked before any model loads: it must be text and its
    ``split`` must hold ``batch`` x ``length`` bytes (a token covers at least one byte; the exact check on
    tokens follows in ``select_sequences``). Raises SourceError naming the file and the numbers."""
    try:
        text = load_text(text_path)
    except TextError as err:
        raise SourceError(str(err)) from None
    start, stop = split_bounds(len(text.encode("utf-8")), split)
    if (stop - start) // length < batch:
        name = "the shipped corpus" if text_path is None else f"text file {str(text_path)!r}"
        raise SourceError(
            f"{batch} sequences of {length} tokens need at least {batch * length} bytes in the {split} split of "
            f"{name}, which has {stop - start}; lower --steps or --batch, or pass a longer text (--text)"
        )
    return text


def open_source(
    model: str,
    *,
    synthetic: bool,
    batch: int,
    steps: int,
    seed: int,
    device: torch.device,
    text_path: str | None = None,
    split: str = "calibration",
    synthetic_profile: str = "init",
    loaded: LoadedModel | None = None,
    devices: list[torch.device] | None = None,
    layers: list[int] | None = None,
) -> LayerSource:
    """Resolve `model` into a LayerSource. Loading a checkpoint happens here; capture is lazy, per layer.

    synthetic_profile: the dynamics profile of synthetic inputs (a name in `ssmquant.models.PROFILES`);
    anything but "init" needs `synthetic`. loaded: a model already in memory (``load_model``,
    ``models.build.build_random_model``), captured instead of loading `model`. devices: the run's emulation
    devices; a checkpoint is spread over them when they are several GPUs (``load_source_model``). layers: the
    run's layer selection, checked against a checkpoint's config.json before its weights load (the caller
    selects with ``LayerSource.select``).
    """
    if loaded is not None and not isinstance(loaded, LoadedModel):
        raise SourceError(
            f"model must be a LoadedModel (from ssmquant.models.load_model or models.build.build_random_model), "
            f"got {type(loaded).__name__}"
        )
    if loaded is not None and synthetic:
        raise SourceError("an in-memory model is captured from; --synthetic uses no model: pass one or the other")
    if synthetic_profile not in PROFILES:
        raise SourceError(f"unknown synthetic profile {synthetic_profile!r}; accepted: {', '.join(PROFILES)}")
    if synthetic_profile != "init" and not synthetic:
        raise SourceError(
            f"--synthetic-profile {synthetic_profile} applies to synthetic inputs only: add --synthetic "
            "(real and shipped models have their own dynamics)"
        )
    if synthetic:
        try:
            preset = get_preset(model)
        except ValueError:
            raise SourceError(
                f"--synthetic needs a preset name, got {model!r}; presets: {', '.join(list_presets())}"
            ) from None
        if text_path is not None:
            raise SourceError("--text applies to real or shipped models; synthetic inputs use no text")
        if synthetic_profile != "init" and not supports_profiles(preset.layer_kind):
            raise SourceError(
                f"--synthetic-profile {synthetic_profile} {profiles_refusal(preset)}: use --synthetic-profile init"
            )

        def iterate(layers):
            return synthetic_layers(
                preset, batch=batch, steps=steps, seed=seed, layers=layers, device=device, profile=synthetic_profile
            )

        profile = PROFILES[synthetic_profile]
        describe = {
            "kind": "synthetic",
            "model": preset.name,
            "hf_repo": preset.hf_repo,
            "synthetic_profile": profile.name,
            "synthetic_profile_description": profile.description,
            "note": "synthetic inputs with the preset's exact shapes and the family's initialisation "
            "distributions; no trained weights, no text"
            if profile.is_init
            else f"synthetic inputs with the preset's exact shapes, the family's initialisation distributions "
            f"changed by the '{profile.name}' stress profile ({profile.description}); no trained weights, no text",
        }
        return LayerSource(
            "synthetic",
            preset.name,
            list(preset.ssm_layers),
            preset.layer_kind,
            preset.state_shape,
            describe,
            iterate,
            groups=preset.groups,
            _device=torch.device(device),
        )

    text = check_text(text_path, batch=batch, length=steps, split=split)
    if loaded is None:
        check_layers_before_loading(model, layers)
        loaded = load_source_model(model, device, devices)
    layout = ssm_layout(loaded.model.config)
    try:
        ids, text_meta = capture_text_batch(loaded, batch=batch, steps=steps, seed=seed, split=split, text=text)
    except TextError as err:
        raise SourceError(str(err)) from None
    text_meta["text"]["origin"] = text_origin(text_path)
    shipped = loaded.source.kind == "shipped"
    describe = {
        "kind": "shipped" if shipped else "checkpoint",
        "model": loaded.source.name,
        "location": loaded.source.location,
        "architecture": loaded.arch.architecture,
        "weights_dtype": str(loaded.dtype).replace("torch.", ""),
        **text_meta,
        "note": (
            ("a tiny hybrid model trained for ssmquant (real trained weights) on " + text_phrase(text_path))
            if shipped
            else f"inputs captured from the checkpoint's prefill over {text_phrase(text_path)}"
        ),
    }

    def iterate(layers):
        return iter_capture(loaded, ids.to(loaded.device), layers=layers, meta={"data_source": describe["kind"]})

    return LayerSource(
        describe["kind"],
        loaded.source.name,
        list(layout["ssm_layers"]),
        layout["layer_kind"],
        tuple(layout["state_shape"]),
        describe,
        iterate,
        groups=layout.get("groups"),
        prefill=loaded.model.config.get_text_config().to_dict(),
        layer_devices=ssm_mixer_devices(loaded.model),
        attention=attention_dims(loaded.model.config),
    )


def load_source_model(model: str, device: torch.device, devices: list[torch.device] | None = None) -> LoadedModel:
    """Load checkpoint ``model`` for capture: on ``device``, or spread over the GPUs of ``devices`` when it
    names several (``models.loading.checkpoint_plan``: contiguous runs of decoder layers, shares by free
    memory; each layer is then emulated on the GPU holding it). Raises SourceError (with what to do) when the
    checkpoint cannot be loaded, SizingError when it does not fit on those GPUs."""
    gpus = [str(d) for d in devices or [] if torch.device(d).type == "cuda"]
    try:
        if len(gpus) > 1:
            return load_model(model, device=gpus[0], device_map=checkpoint_plan(model, gpus))
        return load_model(model, device=device)
    except ModelLoadError as err:
        raise SourceError(str(err)) from None


def plan_layers(
    source: LayerSource,
    layers: list[int],
    variants,
    *,
    steps: int,
    batch: int,
    device: torch.device,
    backend: str,
    recorded: int,
    measure_time: bool = False,
    variants_at_once: int | None = None,
    workers: int = 1,
    lanes: int = 1,
    ahead: bool = False,
    steps_option: str = "--steps",
    batch_note: str = "",
    prompt: int = 0,
) -> float | None:
    """Check, before any layer runs, that emulating ``layers`` one at a time fits in memory.

    Raises SizingError with the estimate and the largest --steps that fits. ``variants_at_once``: how many
    variants one emulation call holds (default all of ``variants``); ``workers``: emulation devices working
    at once (each holds one more layer's inputs queued in host memory); ``lanes``: layers each device emulates
    at once (``analysis.devices.run_on_devices``); ``ahead``: the inputs are made ahead (``LayerSource.iter_layers``);
    ``steps_option``: the command's option for the steps, named in the refusal (calibrate's is --horizon);
    ``batch_note``: what the batch is, where it is not the user's --batch (``sizing.check_memory``); ``prompt``:
    tokens captured before the decode steps (held, not emulated).
    When ``measure_time`` and the torch
    backend runs, returns the seconds per decode step of one layer for ``variants`` measured on this
    machine (``sizing.probe_step_seconds``); else None.
    """
    dims = source.dims
    at_once = len(variants) if variants_at_once is None else variants_at_once
    def estimate(n_steps: int):
        """The run's memory at n_steps (the recorded windows scale with it): check_memory searches it."""
        return analyze_memory(
            dims, batch=batch, steps=n_steps, variants=at_once, recorded=max(1, recorded * n_steps // steps),
            device=device, backend=backend, prefill=source.prefill, capture_device=device, workers=workers,
            lanes=lanes, ahead=ahead, prompt=prompt, attention=source.attention,
        )  # fmt: skip

    lower = f"--prompt, {steps_option} or --batch" if prompt else f"{steps_option} or --batch"
    check_memory(estimate(steps), batch=batch, steps=steps, at_steps=estimate, lower=lower,
                 batch_note=batch_note)  # fmt: skip
    if not measure_time or backend != "torch" or not layers:
        return None
    return probe_step_seconds(dims, variants, batch, steps, record_every=max(1, steps // recorded), device=device)


def default_model() -> str:
    """The default --model: a shipped trained tiny model when installed, else a preset (with --synthetic)."""
    shipped = available_shipped_models()
    return "tiny-nemotron" if "tiny-nemotron" in shipped else next(iter(shipped), "nemotron-3-nano")
