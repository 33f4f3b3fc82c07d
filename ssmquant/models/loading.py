"""Loading real checkpoints with transformers: resolve what the user named, detect the architecture, load.

What a user may name (``resolve_model``):
- a preset name (``nemotron-3-nano``): its Hugging Face repository;
- a shipped tiny model (a name in ``SHIPPED_MODELS``: an HF checkpoint inside the package);
- a local checkpoint directory (must hold ``config.json``);
- a hub id ``owner/name`` (works where the hub is reachable; offline gives an error that suggests a
  local path or ``--synthetic``).

Device and dtype policy (``load_model``): on a CUDA machine the weights load in bf16 (the models'
published dtype) with ``device_map="auto"`` when accelerate is installed, so a model larger than one GPU
spreads over all GPUs (and CPU); without accelerate the model goes to the one GPU. On CPU the weights
load in fp32: CPU bf16 matmuls are slow on most hosts, and fp32 makes the captured inputs exact (the
tests rely on it). Either can be overridden. ``trust_remote_code`` is never set: capture hooks the
native transformers mixers (NemotronH's checkpoints carry an ``auto_map`` to remote code, which is
ignored on purpose).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import kinds
from ..errors import SsmquantError
from ..sizing import AttentionDims
from .compat import warn_if_untested_transformers
from .mixers import known_layer_kinds
from .placement import DEFAULT_HEADROOM_GIB, balanced_plan, device_room, model_units
from .presets import Preset, PresetError, get_preset, list_presets
from .text import ByteTokenizer
from .torch_path import quiet_cpu_fallback_notices, use_torch_path_on_cpu

# name -> checkpoint directory relative to the ``ssmquant`` package (e.g. "assets/tiny-nemotron-h").
# Entries whose directory is absent are not offered (see ``available_shipped_models``).
SHIPPED_MODELS: dict[str, str] = {
    # trained by studies/tiny_models/train.py (model cards in each directory)
    "tiny-nemotron": "assets/tiny-nemotron",
    "tiny-qwen": "assets/tiny-qwen",
    "tiny-kda": "assets/tiny-kda",
}

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelLoadError(SsmquantError, RuntimeError):
    """A model could not be resolved or loaded; the message says why and what to do instead."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not one ssmquant can capture from."""


@dataclass(frozen=True)
class ArchInfo:
    """What ``detect_architecture`` found: the class name, model_type, family and SSM layer kind."""

    architecture: str
    model_type: str
    family: str  # a `kinds.TransformersFamily` name ("nemotron_h", "qwen3_5", ...)
    layer_kind: str  # a registered layer kind's name


# architecture class name -> (family, layer kind), and model_type -> (family, layer kind, the architecture
# assumed when `architectures` is absent): from the registered kinds' transformers families
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    arch: (fam.name, kind.name)
    for kind in kinds.registered()
    for fam in kind.transformers_families
    for arch in fam.architectures
}
SUPPORTED_MODEL_TYPES: dict[str, tuple[str, str, str]] = {
    model_type: (fam.name, kind.name, arch)
    for kind in kinds.registered()
    for fam in kind.transformers_families
    for model_type, arch in fam.model_types.items()
}
# families whose published checkpoint transformers maps to no AutoModelForCausalLM class
_IMAGE_TEXT_FAMILIES = {fam.name for kind in kinds.registered() for fam in kind.transformers_families if fam.image_text}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. kind: "local" | "hub" | "shipped" | "memory" (built in memory,
    ``build.build_random_model``); location: a directory, a hub id, or "memory:<preset>"."""

    kind: str
    location: str
    name: str
    preset: Preset | None = None

    @property
    def is_local(self) -> bool:
        return self.kind in ("local", "shipped")


@dataclass
class LoadedModel:
    """A loaded checkpoint: the transformers model (eval mode), its tokenizer and where it came from."""

    model: torch.nn.Module
    tokenizer: object
    config: dict
    arch: ArchInfo
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    notes: list[str] = field(default_factory=list)


# -- resolving ------------------------------------------------------------------------------------


def available_shipped_models() -> dict[str, Path]:
    """Shipped checkpoints that are present in this installation: name -> directory."""
    out = {}
    for name, rel in SHIPPED_MODELS.items():
        d = _PACKAGE_ROOT / rel
        if (d / "config.json").is_file():
            out[name] = d
    return out


def shipped_layouts() -> dict[str, dict]:
    """The SSM layout (``ssm_layout``) of each shipped model present in this installation, from its config.json:
    what ``ssmquant presets`` lists beside the presets."""
    return {name: ssm_layout(read_config(ModelSource("shipped", str(d), name)))
            for name, d in available_shipped_models().items()}  # fmt: skip


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~", ".\\"))
        or spec in (".", "..")
        or spec.count("/") > 1
        or (os.sep != "/" and os.sep in spec)
    )


def resolve_model(spec: str | os.PathLike | Preset) -> ModelSource:
    """Say where ``spec`` (a preset name, shipped model name, local directory or hub id) is to be loaded from.

    Raises ModelLoadError naming the problem: a directory without config.json, a path that does not
    exist, a shipped model whose files are missing, or a name that is none of the accepted forms.
    """
    if isinstance(spec, Preset):
        return ModelSource("hub", spec.hf_repo, spec.name, spec)
    spec_str = os.fspath(spec).strip()
    if not spec_str:
        raise ModelLoadError("empty model name; pass a preset name, a local checkpoint directory or a hub id")
    if spec_str in SHIPPED_MODELS:
        d = _PACKAGE_ROOT / SHIPPED_MODELS[spec_str]
        if not (d / "config.json").is_file():
            raise ModelLoadError(
                f"shipped model {spec_str!r} is registered but its files are missing (expected config.json in {d})"
            )
        return ModelSource("shipped", str(d), spec_str)
    path = Path(spec_str).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{spec_str!r} is a file; pass the checkpoint directory that holds config.json")
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{spec_str!r} has no config.json; a checkpoint directory must hold config.json and the weights "
                "(as written by save_pretrained)"
            )
        return ModelSource("local", str(path.resolve()), path.name)
    try:
        preset = get_preset(spec_str)
    except PresetError:
        preset = None
    if preset is not None:
        return ModelSource("hub", preset.hf_repo, preset.name, preset)
    if _looks_like_path(spec_str):
        raise ModelLoadError(f"checkpoint directory {spec_str!r} does not exist")
    if _HUB_ID.match(spec_str):
        return ModelSource("hub", spec_str, spec_str)
    shipped = ", ".join(available_shipped_models()) or "none installed"
    raise ModelLoadError(
        f"{spec_str!r} is not a preset, a shipped model, an existing directory or a hub id (owner/name); "
        f"presets: {', '.join(list_presets())}; shipped models: {shipped}"
    )


# -- config and architecture ---------------------------------------------------------------------


HUB_PROBE_TIMEOUT_S = 3.0


@functools.lru_cache(maxsize=1)
def hub_offline_reason() -> str | None:
    """Why the Hugging Face Hub cannot be used now, or None when it answers.

    ``HF_HUB_OFFLINE`` set, or one request to the endpoint (``HF_ENDPOINT``; proxies from the environment)
    that fails within HUB_PROBE_TIMEOUT_S. Checked once per process, so that an unreachable hub costs
    seconds, not huggingface_hub's retries with back-off (~25 s per file).
    """
    import requests
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        requests.head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S, allow_redirects=False)
    except requests.RequestException as exc:
        return f"{constants.ENDPOINT} does not answer ({type(exc).__name__})"
    return None


def _local_only(source: ModelSource, local_files_only: bool | None) -> bool:
    """Hub files come from the local cache only when asked, or when the hub cannot be reached."""
    if local_files_only is not None or source.is_local:
        return bool(local_files_only)
    return hub_offline_reason() is not None


def _hub_error(repo: str, exc: Exception) -> ModelLoadError:
    from huggingface_hub import errors as hf_errors

    offline = hub_offline_reason()
    if offline is not None and not isinstance(exc, (hf_errors.GatedRepoError, hf_errors.RepositoryNotFoundError)):
        why = f"the hub cannot be used ({offline}) and the checkpoint is not in the local cache"
    elif isinstance(exc, hf_errors.GatedRepoError):
        why = "the repository is gated: accept its licence on huggingface.co and log in (hf auth login)"
    elif isinstance(exc, hf_errors.RepositoryNotFoundError):
        why = "no such repository on the hub (or it is private)"
    elif isinstance(exc, (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled)):
        why = "the hub is not reachable (offline) and the file is not in the local cache"
    else:
        why = f"the hub could not be reached or refused the request ({type(exc).__name__}: {exc})"
    return ModelLoadError(
        f"cannot fetch {repo!r} from the Hugging Face Hub: {why}. Download the checkpoint where the hub is "
        f"reachable and pass its local directory, or run on synthetic inputs (--synthetic) with a preset"
    )


def read_config(source: ModelSource, *, local_files_only: bool | None = None) -> dict:
    """The checkpoint's config.json as a dict (downloaded for a hub source)."""
    if source.is_local:
        path = Path(source.location) / "config.json"
    else:
        from huggingface_hub import hf_hub_download

        local_files_only = _local_only(source, local_files_only)
        try:
            path = Path(hf_hub_download(source.location, "config.json", local_files_only=local_files_only))
        except Exception as exc:  # every hub failure becomes one clear message
            raise _hub_error(source.location, exc) from exc
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def detect_architecture(config: dict) -> ArchInfo:
    """Detect the supported architecture of a config.json dict from ``architectures`` / ``model_type``.

    Raises UnsupportedArchitectureError naming what the config declares and the supported architectures.
    """
    archs = config.get("architectures") or []
    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type") or ""
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            family, kind = SUPPORTED_ARCHITECTURES[arch]
            return ArchInfo(arch, model_type, family, kind)
    if not archs and model_type in SUPPORTED_MODEL_TYPES:
        family, kind, arch = SUPPORTED_MODEL_TYPES[model_type]
        return ArchInfo(arch, model_type, family, kind)
    text = config.get("text_config") or config
    types = text.get("layer_types") or config.get("layer_types") or []
    if "linear_attention" in types or text.get("linear_attn_config"):
        raise UnsupportedArchitectureError(
            f"{archs[0] if archs else model_type or 'this checkpoint'} has linear-attention layers of a kind ssmquant "
            f"does not know (architectures {archs or 'none'}, model_type {model_type or 'none'!r}); known kinds: "
            + "; ".join(f"{k}: {v}" for k, v in known_layer_kinds().items())
            + f"; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    raise UnsupportedArchitectureError(
        f"unsupported architecture: the config declares architectures {archs or 'none'} and model_type "
        f"{model_type or 'none'!r}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"(model_types {', '.join(SUPPORTED_MODEL_TYPES)})"
    )


def ssm_layout(config) -> dict:
    """The SSM layout a config describes, derived by transformers' own config class.

    config: a config.json dict, or a loaded model's config object (preferred: a dict re-parsed here
    goes through transformers' strict field validation, which rejects some serialised values, e.g.
    NemotronH's default time_step_limit (0, inf) written as JSON).
    Returns {"layer_kind", "num_layers", "ssm_layers", "state_shape": (heads, rows, state_dim), "groups"}
    where ssm_layers are the layers transformers builds as "linear_attention" (Mamba-2, GDN or KDA mixers)
    and groups the Mamba-2 B/C groups, the GDN key heads, or the KDA heads (each head has its own q / k).
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        cfg = config
        arch = detect_architecture(config.to_dict())
    else:
        arch = detect_architecture(config)
        kwargs = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version", "auto_map")}
        cfg = AutoConfig.for_model(config.get("model_type") or arch.model_type, **kwargs)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    types = list(text.layer_types)
    ssm = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    shape, groups = kinds.get(arch.layer_kind).config_layout(text)
    return {
        "layer_kind": arch.layer_kind,
        "num_layers": len(types),
        "ssm_layers": ssm,
        "state_shape": shape,
        "groups": int(groups),
    }


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_layers(config) -> int:
    """How many of a model's layers are attention layers: the entries of its text config's ``layer_types`` that name
    an attention other than "linear_attention" (the SSM layers; NemotronH's also names its MLP and MoE layers)."""
    types = list(getattr(_text_config(config), "layer_types", None) or [])
    return sum(1 for t in types if "attention" in t and t != "linear_attention")


def attention_dims(config) -> AttentionDims:
    """A loaded model's attention layers for the prefill estimates (``sizing.attention_score_bytes``): their count
    (``attention_layers``), query heads (``num_attention_heads``), the implementation transformers runs
    (``_attn_implementation``), and whether the value head dim (``v_head_dim``) differs from the query / key one
    (``qk_head_dim``, or multi-head latent attention's ``qk_nope_head_dim + qk_rope_head_dim``, else ``head_dim``).
    config: the model's config object (its attention implementation is set when the model is built)."""
    text = _text_config(config)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    qk = getattr(text, "qk_head_dim", None)
    if not qk and getattr(text, "qk_nope_head_dim", None) is not None:
        qk = int(text.qk_nope_head_dim) + int(getattr(text, "qk_rope_head_dim", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    qk = qk or getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    value = getattr(text, "v_head_dim", None) or qk
    implementation = getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
    return AttentionDims(attention_layers(config), heads, implementation, int(value) != int(qk))


# -- checking a local checkpoint before its weights load ---------------------------------------------

SAFETENSORS_INDEX = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files transformers loads from a checkpoint directory: the shards its index names, else
    model.safetensors; [] when it has neither (other formats are left to transformers). Raises ModelLoadError
    when the index cannot be read or names a shard that is missing."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(
                f"{index} cannot be read ({type(exc).__name__}: {exc}); copy or download the checkpoint again"
            ) from None
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise ModelLoadError(
                f"{directory} is incomplete: {SAFETENSORS_INDEX} names {len(shards)} weight files and {shown} "
                "is missing; copy or download the checkpoint again"
            )
        return [directory / s for s in shards]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, read from its header alone, after checking that the file holds
    every byte the header promises. Raises ModelLoadError naming the file when it is truncated or not a
    safetensors file (transformers would fail inside safetensors, with a traceback)."""

    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"{path} is truncated or corrupt: {why}; copy or download the checkpoint again")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"it has {size} bytes, fewer than a safetensors header")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise bad(f"its header claims {n} bytes and the file has {size}")
            header = json.loads(f.read(n))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
        shapes = {k: tuple(int(d) for d in t["shape"]) for k, t in tensors.items()}
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise bad(f"its header is not a safetensors header ({type(exc).__name__})") from None
    if 8 + n + end > size:
        raise bad(f"its tensors end at byte {8 + n + end} and the file has {size} bytes")
    return shapes


def _by_tail(names) -> dict[str, str]:
    """Tensor names keyed by the name less its first component, where that tail is unique and still names a
    module's tensor (``backbone.layers.0.mixer.D`` -> ``layers.0.mixer.D``): checkpoints and transformers' modules
    disagree on the top-level prefix (NemotronH's ``backbone.`` is transformers' ``model.``)."""
    tails: dict[str, list[str]] = {}
    for k in names:
        if k.count(".") >= 2:
            tails.setdefault(k.split(".", 1)[1], []).append(k)
    return {t: ks[0] for t, ks in tails.items() if len(ks) == 1}


def check_local_checkpoint(source: ModelSource, config: dict, arch: ArchInfo) -> None:
    """Refuse, before any weight loads and in one message, a local checkpoint that transformers would load for
    minutes and then fail on (with a traceback, or a loading report of every tensor and a RuntimeError): a
    truncated or corrupt safetensors file, an index naming a missing shard, or a config.json whose sizes are not
    its weights' (a field missing from config.json takes transformers' default: the message names such
    fields). The model is built from config.json on the meta device (no memory) and each tensor's size
    compared with the weights' header where the names agree (transformers renames some, e.g. fused experts;
    those are left to it)."""
    directory = Path(source.location)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(directory):
        shapes.update(safetensors_shapes(path))
    if not shapes:
        return
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        cfg = AutoConfig.from_pretrained(source.location, local_files_only=True, trust_remote_code=False)
        auto = AutoModelForImageTextToText if arch.family in _IMAGE_TEXT_FAMILIES else AutoModelForCausalLM
        with torch.device("meta"):
            meta = auto.from_config(cfg)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise ModelLoadError(
            f"{directory / 'config.json'} does not describe a model transformers can build "
            f"({type(exc).__name__}: {exc}); fix config.json (save_pretrained writes a complete one)"
        ) from None
    expected = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    pairs = {k: (shapes[k], exp) for k, exp in expected.items() if k in shapes}
    ours, theirs = _by_tail(expected), _by_tail(shapes)
    pairs.update({theirs[t]: (shapes[theirs[t]], expected[ours[t]]) for t in ours.keys() & theirs.keys()
                  if ours[t] not in shapes})  # fmt: skip
    bad = [(k, got, exp) for k, (got, exp) in pairs.items() if math.prod(got) != math.prod(exp)]
    if not bad:
        return
    name, got, exp = bad[0]
    given = set(config) | set(config.get("text_config") or {})
    dims = {d for _, _, e in bad for d in e}
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    defaults = [f"{k} (transformers' default {v} was taken)" for k, v in text.to_dict().items()
                if k not in given and type(v) is int and v in dims]  # fmt: skip
    raise ModelLoadError(
        f"{directory / 'config.json'} does not match the weights beside it: {len(bad)} tensor(s) differ in size, "
        f"e.g. {name} is {list(got)} in the weights but {list(exp)} by config.json"
        + (f"; config.json lacks {', '.join(defaults)}" if defaults else "")
        + "; fix config.json (save_pretrained writes a complete one)"
    )


# -- loading ---------------------------------------------------------------------------------------

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() in _DTYPES:
        return _DTYPES[str(dtype).lower()]
    raise ModelLoadError(f"unknown dtype {dtype!r}; accepted: {', '.join(_DTYPES)}")


def _has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def load_tokenizer(source: ModelSource, config: dict, *, local_files_only: bool | None = None):
    """The checkpoint's Hugging Face tokenizer; a ``ByteTokenizer`` for byte-level checkpoints without one.

    A checkpoint without tokenizer files whose vocabulary holds 256..1023 ids is taken as byte-level
    (token id = byte value). Raises ModelLoadError otherwise.
    """
    from transformers import AutoTokenizer

    tok_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not source.is_local or any((Path(source.location) / f).is_file() for f in tok_files):
        try:
            return AutoTokenizer.from_pretrained(source.location, local_files_only=bool(local_files_only))
        except Exception as exc:
            if not source.is_local:
                raise _hub_error(source.location, exc) from exc
            raise ModelLoadError(f"cannot load the tokenizer of {source.location}: {exc}") from exc
    text = config.get("text_config") or config
    vocab = int(text.get("vocab_size") or config.get("vocab_size") or 0)
    if 256 <= vocab < 1024:
        return ByteTokenizer()
    raise ModelLoadError(
        f"{source.location} has no tokenizer files ({', '.join(tok_files)}) and its vocabulary ({vocab}) is "
        "not byte-level; add the tokenizer files of the model to the directory"
    )


def checkpoint_plan(
    spec: str | os.PathLike | Preset,
    devices: list[str],
    *,
    dtype: torch.dtype | str | None = None,
    headroom_gib: float | None = None,
    free=None,
) -> dict[str, str]:
    """A ``device_map`` that spreads checkpoint ``spec`` over ``devices`` ("cuda:0", "cuda:1", ...) for
    ``load_model(..., device_map=)``: the model is built from its config on the meta device (shapes only)
    and cut by ``placement.balanced_plan`` into contiguous runs of decoder layers, each device's share
    proportional to its free memory less ``headroom_gib`` (default ``placement.DEFAULT_HEADROOM_GIB``, kept for
    capture and emulation). Unlike ``device_map="auto"``, only ``devices`` are used and nothing spills to
    the CPU. Raises SizingError before any weight loads when the weights do not fit (the estimate per
    device, what to lower). dtype: the weights' dtype (default bf16, as ``load_model`` loads on a GPU).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    source = resolve_model(spec)
    local_files_only = _local_only(source, local_files_only=None)
    arch = detect_architecture(read_config(source, local_files_only=local_files_only))
    dt = _parse_dtype(dtype) or torch.bfloat16
    try:
        config = AutoConfig.from_pretrained(source.location, local_files_only=local_files_only, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the config of {source.location}: {exc}") from exc
    auto = AutoModelForImageTextToText if arch.family in _IMAGE_TEXT_FAMILIES else AutoModelForCausalLM
    with torch.device("meta"):
        meta = auto.from_config(config, dtype=dt)
    headroom = DEFAULT_HEADROOM_GIB if headroom_gib is None else headroom_gib
    room = device_room(list(devices), int(headroom * 2**30), free=free)
    return balanced_plan(model_units(meta), room, what=f"{source.name} in {str(dt).replace('torch.', '')}")


def load_model(
    spec: str | os.PathLike | Preset,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    device_map: str | dict | None = None,
    local_files_only: bool | None = None,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load a supported hybrid checkpoint for capture (eval mode, no gradients needed).

    ``spec``: preset name, shipped model name, local directory or hub id (``resolve_model``).
    Defaults: CUDA if available with bf16 weights and ``device_map="auto"`` (accelerate installed) or the
    single GPU; else CPU with fp32 weights. ``device_map`` overrides the placement.
    Raises ModelLoadError / UnsupportedArchitectureError with what to do instead.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    source = resolve_model(spec)
    local_files_only = _local_only(source, local_files_only)
    config = read_config(source, local_files_only=local_files_only)
    arch = detect_architecture(config)
    if source.is_local:
        check_local_checkpoint(source, config, arch)
    notes: list[str] = []
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = _parse_dtype(dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if device_map is None:
        if dev.type == "cuda":
            if _has_accelerate() and device is None:
                device_map = "auto"
            else:
                device_map = str(dev)
                if torch.cuda.device_count() > 1 and not _has_accelerate():
                    notes.append("accelerate is not installed: the model is loaded on one GPU only")
        else:
            device_map = None
    # use_kernels=False: the modelling files' own torch paths, which capture verifies against. From transformers
    # 5.25 the default kernelizes the model on a GPU with kernels downloaded from the Hub, which fails offline (the
    # kernels' publisher cannot be verified) and swaps the mixers' code for third-party code.
    kwargs = {"dtype": dt, "local_files_only": bool(local_files_only), "trust_remote_code": False, "use_kernels": False}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        auto = AutoModelForImageTextToText if arch.family in _IMAGE_TEXT_FAMILIES else AutoModelForCausalLM
        model = auto.from_pretrained(source.location, **kwargs)
    except torch.cuda.OutOfMemoryError as exc:
        raise ModelLoadError(
            f"{source.name} does not fit in GPU memory ({exc}); install accelerate so that it loads with "
            "device_map='auto' over all GPUs and the CPU, or run with --synthetic"
        ) from exc
    except (OSError, ValueError, SafetensorError) as exc:
        if not source.is_local and not isinstance(exc, SafetensorError):
            raise _hub_error(source.location, exc) from exc
        raise ModelLoadError(f"cannot load {source.location}: {type(exc).__name__}: {exc}") from exc
    except RuntimeError as exc:
        if "mismatched" not in str(exc):  # transformers' error after its loading report
            raise
        raise ModelLoadError(
            f"cannot load {source.location}: its config does not match its weights (the report above lists the "
            "tensors); fix config.json"
        ) from exc
    if device_map is None and dev.type != "cpu":
        model.to(dev)
    warn_if_untested_transformers()
    use_torch_path_on_cpu(model)  # fla & co. may be importable without a GPU: CPU tensors take the torch path
    if dev.type == "cpu":
        quiet_cpu_fallback_notices()
    model.eval()
    tokenizer = load_tokenizer(source, config, local_files_only=local_files_only) if with_tokenizer else None
    return LoadedModel(model, tokenizer, config, arch, source, dev, dt, notes)
