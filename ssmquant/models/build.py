"""Full-size checkpoints with random weights, built from a preset: no download, the normal loading path.

`build_random_checkpoint("nemotron-h-8b", "ckpt/")` writes what `--model ckpt/` loads like any published
checkpoint: a `config.json` of the preset's architecture, sharded `model*.safetensors` with weights drawn
by transformers' own initialisation of the family (`_init_weights`: A_log, dt_bias, D as at
pre-training start), and byte-level tokenizer files (token id = byte value + 3 special ids), so that
`analyze`, `eval` and `calibrate` run the real model code at the real size. It is also how a user tests a
private architecture: pass `overrides` (any config field).

The config: every field a preset fixes (layer pattern, hidden size, SSM heads, head dims, state size,
groups, conv kernel, chunk, dt range) is the published value; the fields a preset does not carry
(vocabulary, MLP / MoE widths, attention heads) take the defaults of transformers' config class for the
family, which are listed in `config_provenance` and in the `ssmquant_build` entry of config.json. The
weights are random: trained dynamics differ (decays, input statistics); the shapes, the memory and the
time are the real ones.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..errors import SsmquantError
from ..filemodes import follow_umask
from .loading import LoadedModel, ModelSource, detect_architecture
from .placement import DEFAULT_HEADROOM_GIB, balanced_plan, device_room, model_units, plan_loads
from .presets import GDNShape, Mamba2Shape, Preset, get_preset

# Published fields that a preset does not carry (it keeps the SSM shapes) but without which the model would
# not have its published size: transformers' Qwen3_5MoeConfig defaults (moe_intermediate_size 512, those of
# Qwen3.5-35B-A3B) give 63.5 B parameters for Qwen3.5-122B-A10B's 48 layers x hidden 3072 x 256 experts;
# expert and shared-expert widths of 1024 give 121.6 B, the published 122 B total (model card; transformers
# docs/source/en/model_doc/qwen3_5_moe.md, 5.24: 256 experts, 8 routed + 1 shared per token).
# Likewise Nemotron-3-Nano-30B-A3B: NemotronHConfig's defaults (8 experts of 7688, 2 per token, dense MLP 21504,
# 8 KV heads) give 10.3 B parameters; the published config.json (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16, and
# verbatim copies of it in public repositories) has 128 routed experts of 1856 (6 per token, scaled by 2.5), one
# shared expert of 3712, intermediate_size 1856, 2 KV heads and 262144 positions: 31.6 B parameters, the published
# 30B total (a build with the defaults had 10.32 B).
PUBLISHED_EXTRA_FIELDS: dict[str, dict] = {
    "qwen3.5-122b-a10b": {"moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024},
    "nemotron-3-nano": {
        "intermediate_size": 1856,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "routed_scaling_factor": 2.5,
        "num_key_value_heads": 2,
        "max_position_embeddings": 262144,
    },
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class BuildError(SsmquantError, ValueError):
    """The checkpoint cannot be built as asked; the message says why and what to pass instead."""


def preset_config(preset: Preset, *, num_layers: int | None = None, overrides: dict | None = None) -> dict:
    """The HF config dict (config.json content) of a preset's architecture.

    num_layers: keep only the first N decoder layers (for tests and dry runs; the SSM shapes stay);
    overrides: any config field, applied last (for a Qwen3.5 model, to its text_config).
    """
    pattern = preset.layer_pattern[:num_layers] if num_layers else preset.layer_pattern
    if num_layers is not None and not 1 <= num_layers <= preset.num_layers:
        raise BuildError(f"num_layers must lie in [1, {preset.num_layers}] for {preset.name}, got {num_layers}")
    shape = preset.shape
    if isinstance(shape, Mamba2Shape):
        cfg = {
            "architectures": [preset.architecture],
            "model_type": preset.model_type,
            "hybrid_override_pattern": pattern,
            "num_hidden_layers": len(pattern),
            "hidden_size": preset.hidden_size,
            "mamba_num_heads": shape.num_heads,
            "mamba_head_dim": shape.head_dim,
            "ssm_state_size": shape.state_size,
            "n_groups": shape.n_groups,
            "conv_kernel": shape.conv_kernel,
            "chunk_size": shape.chunk_size,
            "time_step_min": shape.time_step_min,
            "time_step_max": shape.time_step_max,
            "time_step_floor": shape.time_step_floor,
            "use_conv_bias": shape.use_conv_bias,
            "initializer_range": preset.initializer_range,
        }
    elif isinstance(shape, GDNShape):
        layer_types = ["linear_attention" if c == "L" else "full_attention" for c in pattern]
        cfg = {
            "hidden_size": preset.hidden_size,
            "num_hidden_layers": len(pattern),
            "layer_types": layer_types,
            "linear_num_value_heads": shape.num_value_heads,
            "linear_num_key_heads": shape.num_key_heads,
            "linear_key_head_dim": shape.key_head_dim,
            "linear_value_head_dim": shape.value_head_dim,
            "linear_conv_kernel_dim": shape.conv_kernel,
            "initializer_range": preset.initializer_range,
        }
    else:
        raise BuildError(f"{preset.name}: building random checkpoints of {preset.layer_kind} layers is not supported")
    cfg.update(PUBLISHED_EXTRA_FIELDS.get(preset.name, {}))
    cfg.update(overrides or {})
    return cfg


def _config_object(preset: Preset, cfg: dict):
    """The transformers config instance for cfg (a multimodal wrapper for Qwen3.5 checkpoints)."""
    import transformers

    arch = preset.architecture
    if arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        # the published checkpoints carry a vision tower; a small one keeps the file valid while the text
        # model (what ssmquant captures) is full size
        cls = transformers.Qwen3_5Config if arch.startswith("Qwen3_5For") else transformers.Qwen3_5MoeConfig
        vision = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}
        return cls(text_config=cfg, vision_config={**vision, "out_hidden_size": cfg["hidden_size"]})
    conf_cls = transformers.AutoConfig.for_model(preset.model_type).__class__
    return conf_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})


def config_provenance(preset: Preset, config, overrides: dict | None = None) -> dict:
    """Which config fields came from the preset (published values), which the user overrode (``overrides``, with
    their values) and which came from transformers' defaults."""
    text = getattr(config, "text_config", None) or config
    overrides = dict(overrides or {})
    fixed = set(preset_config(preset)) - set(overrides)
    defaults = {
        k: getattr(text, k)
        for k in (
            "vocab_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "n_routed_experts",
            "num_experts",
            "moe_intermediate_size",
            "num_experts_per_tok",
        )
        if hasattr(text, k) and k not in fixed and k not in overrides
    }
    return {"from_preset": sorted(fixed), "overridden": overrides, "transformers_defaults": defaults}


def _byte_level_chars() -> dict[int, str]:
    """Byte value -> the printable character byte-level BPE uses for it (GPT-2's reversible mapping:
    printable Latin-1 bytes stand for themselves, the others are shifted to code points 256 and up)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer(vocab_size: int):
    """A byte-level fast tokenizer (ids 3..258 are the bytes, 0..2 pad / bos / eos) for a vocabulary of
    ``vocab_size`` ids; what random-weight checkpoints and in-memory models are read with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 259:
        raise BuildError(f"a byte-level tokenizer needs vocab_size >= 259, the config has {vocab_size}")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: 3 + b for b, ch in _byte_level_chars().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _byte_tokenizer_files(out: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json of a byte-level tokenizer: ids 3..258 are the bytes."""
    byte_tokenizer(vocab_size).save_pretrained(out)


def build_random_checkpoint(
    preset: str | Preset,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    num_layers: int | None = None,
    overrides: dict | None = None,
    max_shard_size: str = "5GB",
    seed: int = 0,
    progress=print,
) -> dict:
    """Write a random-weight checkpoint of `preset` to out_dir (which must not exist or be empty).

    dtype: weights dtype on disk (bfloat16, float16, float32); device: where the model is materialised
    (a GPU makes a 30B build take seconds; the model must fit there). Returns a summary dict (parameters,
    bytes, seconds, config provenance), also written to out_dir/ssmquant_build.json.
    """
    import transformers

    preset = get_preset(preset) if isinstance(preset, str) else preset
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise BuildError(f"{out} is not empty; pick a new directory")
    dtypes = DTYPES
    if dtype not in dtypes:
        raise BuildError(f"unknown dtype {dtype!r}; accepted: {', '.join(dtypes)}")
    cfg = preset_config(preset, num_layers=num_layers, overrides=overrides)
    config = _config_object(preset, cfg)
    config.dtype = dtype
    t0 = time.time()
    torch.manual_seed(seed)
    model_cls = getattr(transformers, preset.architecture)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtypes[dtype])
    params = sum(p.numel() for p in model.parameters())
    t_init = time.time() - t0
    progress(f"built {preset.name}: {params / 1e9:.2f} B parameters in {t_init:.1f} s on {device}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    text = getattr(config, "text_config", None) or config
    _byte_tokenizer_files(out, int(text.vocab_size))
    nbytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    summary = {
        "preset": preset.name,
        "published_repo": preset.hf_repo,
        "architecture": preset.architecture,
        "parameters": params,
        "dtype": dtype,
        "safetensors_bytes": nbytes,
        "seconds": round(time.time() - t0, 2),
        "init_seconds": round(t_init, 2),
        "num_layers": len(cfg.get("hybrid_override_pattern") or cfg.get("layer_types")),
        "weights": "random, drawn by transformers' _init_weights of the family (no trained dynamics)",
        "tokenizer": "byte-level (ids 3..258 are bytes), written by ssmquant",
        "config_provenance": config_provenance(preset, config, overrides),
    }
    (out / "ssmquant_build.json").write_text(json.dumps(summary, indent=2) + "\n")
    follow_umask(out)  # safetensors writes 0600
    progress(f"wrote {out} ({nbytes / 2**30:.1f} GiB) in {summary['seconds']:.1f} s")
    del model
    return summary


def _meta_model(preset: Preset, config, dtype: torch.dtype | None = None):
    import transformers

    with torch.device("meta"):  # transformers skips every init on the meta device (PreTrainedModel.init_weights)
        return getattr(transformers, preset.architecture)._from_config(config, **({"dtype": dtype} if dtype else {}))


def parse_devices(devices: str | list[str] | None) -> list[str]:
    """``"cuda:0,cuda:1"`` / ``["cuda:0", "cuda:1"]`` / ``"all"`` (every visible GPU) / None (the one default
    device) -> a list of distinct device names. Raises BuildError naming a bad entry and the accepted forms."""
    if devices is None:
        return ["cuda:0" if torch.cuda.is_available() else "cpu"]
    if isinstance(devices, str):
        if devices == "all":
            n = torch.cuda.device_count()
            if n == 0:
                raise BuildError("devices 'all' asks for every GPU but none is visible; pass cpu")
            return [f"cuda:{i}" for i in range(n)]
        devices = [d.strip() for d in devices.split(",") if d.strip()]
    out = []
    for d in devices:
        try:
            dev = torch.device(d)
        except RuntimeError:
            raise BuildError(f"unknown device {d!r}; accepted: cpu, cuda:N, or 'all'") from None
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda:0")
        if dev.type not in ("cpu", "cuda"):
            raise BuildError(f"unknown device {d!r}; accepted: cpu, cuda:N, or 'all'")
        if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
            raise BuildError(f"device {d} does not exist here: {torch.cuda.device_count()} GPU(s) visible")
        if str(dev) in out:
            raise BuildError(f"device {dev} is listed twice in {devices}")
        out.append(str(dev))
    if not out:
        raise BuildError("no device given; accepted: cpu, cuda:N (comma-separated), or 'all'")
    return out


def dispatch(model: torch.nn.Module, plan: dict[str, str], *, force_hooks: bool = False) -> None:
    """Attach the hooks that move each block's inputs to its device (accelerate's ``dispatch_model``, called
    as transformers' ``from_pretrained(device_map=...)`` calls it: integrations/accelerate.py
    ``accelerate_dispatch``, 5.24); on one device no hooks are needed unless ``force_hooks`` (tests)."""
    if len(set(plan.values())) > 1 or force_hooks:
        try:
            from accelerate import dispatch_model
        except ImportError:
            raise BuildError(
                "a model placed over several devices needs accelerate (a dependency of ssmquant): pip install accelerate"
            ) from None
        skip = sorted(getattr(model, "_skip_keys_device_placement", None) or []) or None
        dispatch_model(model, device_map=plan, skip_keys=skip, force_hooks=force_hooks)
    else:
        model.hf_device_map = dict(plan)


def build_random_model(
    preset: str | Preset,
    *,
    devices: str | list[str] | None = None,
    dtype: str = "bfloat16",
    num_layers: int | None = None,
    overrides: dict | None = None,
    seed: int = 0,
    headroom_gib: float = DEFAULT_HEADROOM_GIB,
    free=None,
    progress=print,
):
    """A random-weight model of ``preset`` built in memory over ``devices`` (no checkpoint on disk), as a
    ``LoadedModel`` that ``analyze`` / ``iter_capture`` take like a loaded checkpoint.

    The model is built on the meta device (shapes only), placed with ``placement.balanced_plan`` (decoder
    layers cut into contiguous runs, each device's share proportional to its free memory less
    ``headroom_gib``), materialised block by block on its device, and initialised there by transformers'
    own ``initialize_weights`` of the family (what ``from_pretrained`` does for missing weights): the
    distributions of ``build_random_checkpoint``, and on one device bit-identical to ``initialize_weights``
    run on the same model built there directly, for a given seed.
    Over several devices accelerate's ``dispatch_model`` adds the hooks that move hidden states from one
    device to the next (as ``from_pretrained(device_map="auto")`` does). Raises SizingError before any
    allocation when the weights do not fit (estimate per device, what to lower); BuildError for bad input.
    ``free``: the free-memory reader (``memory.free_bytes``; tests pass fakes).
    """
    preset = get_preset(preset) if isinstance(preset, str) else preset
    if dtype not in DTYPES:
        raise BuildError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    devs = parse_devices(devices)
    cfg = preset_config(preset, num_layers=num_layers, overrides=overrides)
    config = _config_object(preset, cfg)
    config.dtype = dtype
    t0 = time.time()
    model = _meta_model(preset, config, DTYPES[dtype])
    units = model_units(model)
    room = device_room(devs, int(headroom_gib * 2**30), free=free)
    plan = balanced_plan(units, room, what=f"{preset.name} in {dtype}")
    loads = plan_loads(plan, units)
    progress(
        f"{preset.name}: {sum(u.nbytes for u in units) / 2**30:.1f} GiB of {dtype} weights over "
        + ", ".join(f"{d} {loads.get(d, 0) / 2**30:.1f} GiB" for d in devs)
    )
    for name, dev in plan.items():
        model.get_submodule(name).to_empty(device=dev)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise BuildError(f"{preset.name}: tensors {left[:3]} belong to no placed block; cannot materialise them")
    torch.manual_seed(seed)  # seeds every device's generator
    model.initialize_weights()  # the family's _init_weights, rotary tables included
    model.tie_weights()
    used = sorted(set(plan.values()), key=devs.index)
    dispatch(model, plan)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    text = getattr(config, "text_config", None) or config
    progress(
        f"built {preset.name} in memory: {params / 1e9:.2f} B parameters in {time.time() - t0:.1f} s on {', '.join(used)}"
    )
    full = config.to_dict()
    source = ModelSource("memory", f"memory:{preset.name}", preset.name, preset)
    notes = [
        "random weights drawn by transformers' _init_weights of the family, built in memory (no trained dynamics)",
        f"config fields: {json.dumps(config_provenance(preset, config, overrides))}",
    ]
    return LoadedModel(
        model, byte_tokenizer(int(text.vocab_size)), full, detect_architecture(full), source,
        torch.device(used[0]), DTYPES[dtype], notes,
    )  # fmt: skip


def estimate_parameters(preset: str | Preset, *, num_layers: int | None = None, overrides: dict | None = None) -> int:
    """Parameter count of the checkpoint `build_random_checkpoint` would write with these arguments (built on the
    meta device)."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    config = _config_object(preset, preset_config(preset, num_layers=num_layers, overrides=overrides))
    return sum(p.numel() for p in _meta_model(preset, config).parameters())


__all__ = [
    "BuildError",
    "build_random_checkpoint",
    "build_random_model",
    "byte_tokenizer",
    "config_provenance",
    "dispatch",
    "device_room",
    "estimate_parameters",
    "parse_devices",
    "preset_config",
]
