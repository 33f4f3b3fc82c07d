"""Models: presets of real hybrid models, checkpoint loading, SSM-input capture, synthetic inputs, text.

Public API (see ``ssmquant/models/README.md``):

- presets: ``get_preset``, ``list_presets``, ``presets_frame``, ``Preset``, ``Mamba2Shape``, ``GDNShape``, ``KDAShape``
- synthetic inputs: ``synthetic_inputs``, ``synthetic_layers``
- loading: ``resolve_model``, ``load_model``, ``detect_architecture``, ``read_config``, ``ssm_layout``,
  ``attention_layers``, ``attention_dims``, ``SHIPPED_MODELS``, ``available_shipped_models``, ``shipped_layouts``
- capture: ``capture_inputs`` (callback), ``iter_capture`` (generator), ``capture_all``,
  ``capture_text_batch``, ``find_ssm_mixers``
- text: ``load_text``, ``tokenize``, ``select_sequences``, ``calibration_batch``, ``ByteTokenizer``

models/ knows nothing of ssmquant.formats.
"""

from .capture import (
    CaptureError,
    capture_all,
    capture_inputs,
    capture_text_batch,
    find_ssm_mixers,
    iter_capture,
)
from .loading import (
    SHIPPED_MODELS,
    SUPPORTED_ARCHITECTURES,
    ArchInfo,
    LoadedModel,
    ModelLoadError,
    ModelSource,
    UnsupportedArchitectureError,
    attention_dims,
    attention_layers,
    available_shipped_models,
    detect_architecture,
    load_model,
    load_tokenizer,
    read_config,
    resolve_model,
    shipped_layouts,
    ssm_layout,
)
from .presets import (
    PRESETS,
    GDNShape,
    KDAShape,
    Mamba2Shape,
    Preset,
    PresetError,
    get_preset,
    list_presets,
    presets_frame,
    qwen_layer_pattern,
)
from .synthetic import synthetic_inputs, synthetic_layers
from .text import (
    CORPUS_PATH,
    ByteTokenizer,
    TextError,
    calibration_batch,
    load_text,
    select_sequences,
    tokenize,
)

__all__ = [
    "ArchInfo",
    "ByteTokenizer",
    "CORPUS_PATH",
    "CaptureError",
    "GDNShape",
    "KDAShape",
    "LoadedModel",
    "Mamba2Shape",
    "ModelLoadError",
    "ModelSource",
    "PRESETS",
    "Preset",
    "PresetError",
    "SHIPPED_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "TextError",
    "UnsupportedArchitectureError",
    "attention_dims",
    "attention_layers",
    "available_shipped_models",
    "calibration_batch",
    "capture_all",
    "capture_inputs",
    "capture_text_batch",
    "detect_architecture",
    "find_ssm_mixers",
    "get_preset",
    "iter_capture",
    "list_presets",
    "load_model",
    "load_text",
    "load_tokenizer",
    "presets_frame",
    "qwen_layer_pattern",
    "read_config",
    "resolve_model",
    "select_sequences",
    "shipped_layouts",
    "ssm_layout",
    "synthetic_inputs",
    "synthetic_layers",
    "tokenize",
]
