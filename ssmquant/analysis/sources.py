"""Where a run's per-layer decode inputs come from, and a description of it that travels with every output.

- a shipped tiny model (real trained weights, the shipped public-domain text): kind "shipped";
- a real checkpoint (local directory or hub id) on calibration text: kind "checkpoint";
- a preset's shapes with synthetic inputs (`--synthetic`): kind "synthetic", with its dynamics profile
  (`--synthetic-profile`: the init law, or a labelled stress profile, `ssmquant.models.synthetic`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..formats import FormatError
from ..models import (
    ModelLoadError,
    available_shipped_models,
    capture_text_batch,
    get_preset,
    iter_capture,
    list_presets,
    load_model,
    ssm_layout,
    synthetic_layers,
)
from ..models.synthetic import PROFILES
from ..replay.inputs import LayerInputs


class SourceError(ValueError):
    """The requested model / data combination cannot be used; the message says what to pass instead."""


@dataclass
class LayerSource:
    """A model's SSM layers and a way to get their inputs, one layer at a time.

    kind: "shipped" | "checkpoint" | "synthetic"; name: the model's name; layers: the decoder-layer
    indices of its SSM layers; layer_kind: "mamba2" | "gdn"; state_shape: (heads, rows, state_dim);
    describe: the provenance dict written into report.json.
    """

    kind: str
    name: str
    layers: list[int]
    layer_kind: str
    state_shape: tuple[int, int, int]
    describe: dict = field(default_factory=dict)
    _iterate: object = None

    def iter_layers(self, layers: list[int]) -> Iterator[tuple[int, LayerInputs]]:
        """Yield (layer index, inputs) for the requested layers, streaming (one layer alive at a time)."""
        return self._iterate(layers)

    def check_formats(self, formats) -> None:
        """Refuse formats that cannot store this model's state (nvfp4 blocks, row groups), naming why."""
        for fmt in formats:
            try:
                fmt.bytes_per_state(self.state_shape)
            except FormatError as err:
                raise SourceError(f"{fmt.name} cannot store {self.name}'s state {self.state_shape}: {err}") from None

    def select(self, layers: list[int] | None) -> list[int]:
        """Validate a layer selection (decoder-layer indices) against this model's SSM layers."""
        if layers is None:
            return list(self.layers)
        bad = [i for i in layers if i not in self.layers]
        if bad:
            raise SourceError(
                f"layers {bad} are not SSM layers of {self.name}; its {self.layer_kind} layers are {self.layers}"
            )
        if len(set(layers)) != len(layers):
            raise SourceError(f"layers {layers} lists a layer twice")
        return sorted(layers)


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error naming the problem."""
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise SourceError(f"unknown device {device!r}; accepted: auto, cpu, cuda, cuda:N")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SourceError("--device cuda was requested but no CUDA GPU is available; use --device cpu or auto")
    return torch.device(device)


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
) -> LayerSource:
    """Resolve `model` into a LayerSource. Loading a checkpoint happens here; capture is lazy, per layer.

    synthetic_profile: the dynamics profile of synthetic inputs (a name in `ssmquant.models.PROFILES`);
    anything but "init" needs `synthetic`.
    """
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
            "synthetic", preset.name, list(preset.ssm_layers), preset.layer_kind, preset.state_shape, describe, iterate
        )

    try:
        loaded = load_model(model, device=device)
    except ModelLoadError as err:
        raise SourceError(str(err)) from None
    layout = ssm_layout(loaded.model.config)
    ids, text_meta = capture_text_batch(loaded, batch=batch, steps=steps, seed=seed, split=split, text_path=text_path)
    shipped = loaded.source.kind == "shipped"
    describe = {
        "kind": "shipped" if shipped else "checkpoint",
        "model": loaded.source.name,
        "location": loaded.source.location,
        "architecture": loaded.arch.architecture,
        "weights_dtype": str(loaded.dtype).replace("torch.", ""),
        **text_meta,
        "note": (
            "a tiny hybrid model trained for ssmquant (real trained weights) on held-out public-domain text"
            if shipped
            else "inputs captured from the checkpoint's prefill over calibration text"
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
    )


def default_model() -> str:
    """The default --model: a shipped trained tiny model when installed, else a preset (with --synthetic)."""
    shipped = available_shipped_models()
    return "tiny-nemotron" if "tiny-nemotron" in shipped else next(iter(shipped), "nemotron-3-nano")
