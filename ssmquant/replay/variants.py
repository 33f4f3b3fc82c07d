"""A variant is one emulated way of keeping the state: a storage format under a decoding scheme.

String form: "<format>@<scheme>[+<prompt store>][~<engine>]", e.g. "fp8_e4m3@conventional", "int8:sr@replay16",
"nvfp4:head@spec16x4:p0.8", "int8@replay16~flashinfer", "bf16@conventional+int8col" (the prompt's state kept in
SGLang's int8 prefix cache, then decoded in bf16). A bare format means conventional decoding; no engine means the
`ideal` profile (`ssmquant.engines.profiles`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import SsmquantError
from ..formats import FormatError, Rounding, ScaleMode, StateFormat, parse
from ..formats.prompt_store import PROMPT_STORES, parse_prompt_store
from .schemes import DEFAULT_BUFFER_LEN, Scheme, SchemeError, SchemeKind, parse_scheme

# The engine profiles a variant may name (`~engine`): the arithmetic of each is `ssmquant.engines.profiles`, which
# takes its list from here (a variant is parsed below the engines); "ideal" is the emulation without an engine.
ENGINE_PROFILES = ("ideal", "flashinfer", "vllm", "trtllm", "sglang")
# the live formats a prompt store restores into (an engine's float state pool)
PROMPT_STORE_LIVE_FORMATS = ("fp32", "bf16", "fp16")


class VariantError(SsmquantError, ValueError):
    """A variant spec or option is not valid."""


class StorageFacts:
    """What the engine rules (``engines.deployments.violations``) read of a setting, derived from its ``format``
    and ``scheme``: shared by ``Variant`` and ``calibrate.Setting``."""

    format: StateFormat
    scheme: Scheme

    @property
    def encoding(self) -> str:
        return self.format.encoding.value

    @property
    def scale_mode(self) -> str:
        return self.format.scale_mode.value

    @property
    def granularity(self) -> str:
        return self.format.granularity.name

    @property
    def rounding(self) -> str:
        return self.format.rounding.value

    @property
    def scheme_kind(self) -> str:
        return self.scheme.kind.value

    @property
    def buffer_len(self) -> int:
        """Replay buffer length L (0 for conventional decoding)."""
        return 0 if self.scheme.kind is SchemeKind.CONVENTIONAL else self.scheme.buffer_len

    @property
    def draft_tokens(self) -> int:
        return self.scheme.draft_tokens if self.scheme.kind is SchemeKind.SPEC else 0


@dataclass(frozen=True)
class Variant(StorageFacts):
    """format x scheme, plus the stochastic-rounding seed and (for static formats) the decode scales.

    static_scale: FP32 decode scales for ':static' formats, shape [H, rows // group_rows] or with a
    leading batch dim (see `ssmquant.formats.quantize`); the second-level scale for nvfp4.
    engine: the engine profile whose arithmetic is emulated ("ideal" or "flashinfer"; see
    `ssmquant.engines.profiles`).
    """

    format: StateFormat
    scheme: Scheme = field(default_factory=Scheme.conventional)
    seed: int = 0
    static_scale: torch.Tensor | None = field(default=None, compare=False, repr=False)
    label: str | None = None
    engine: str = "ideal"
    # how the prompt's state is kept in the engine's prefix cache before the live format takes it over
    # (formats.prompt_store; None: the live format stores it directly)
    prompt_store: str | None = None

    def __post_init__(self):
        if self.engine not in ENGINE_PROFILES:
            raise VariantError(f"unknown engine {self.engine!r}; accepted: {', '.join(ENGINE_PROFILES)}")
        if self.prompt_store is not None:
            try:
                parse_prompt_store(self.prompt_store)
            except FormatError as err:
                raise VariantError(str(err)) from None
            if self.format.encoding.value not in PROMPT_STORE_LIVE_FORMATS:
                raise VariantError(
                    f"{self.format.name}+{self.prompt_store}: a prompt store restores into a float live state "
                    f"({', '.join(PROMPT_STORE_LIVE_FORMATS)}), not {self.format.encoding.value}"
                )
        static = self.format.scale_mode is ScaleMode.STATIC
        if static and self.static_scale is None:
            raise VariantError(f"variant {self.name!r} uses a static format: pass static_scale")
        if not static and self.static_scale is not None:
            raise VariantError(f"variant {self.name!r} has dynamic scales: static_scale does not apply")

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        base = f"{self.format.name}@{self.scheme.name}"
        if self.prompt_store is not None:
            base += f"+{self.prompt_store}"
        if self.format.rounding is Rounding.SR and self.seed:
            base += f"#seed{self.seed}"
        if self.engine != "ideal":
            base += f"~{self.engine}"
        return base

    def __str__(self) -> str:
        return self.name


def check_variants_fit(variants: list[Variant], state_shape: tuple[int, ...]) -> None:
    """Check each variant can store a state of `state_shape` [B, H, rows, state_dim]; clear errors otherwise."""
    for v in variants:
        try:
            v.format.bytes_per_state(state_shape)  # validates nvfp4 blocks and row groups
        except FormatError as err:
            raise VariantError(
                f"variant {v.name!r} cannot store a state of shape {tuple(state_shape)}: {err}"
            ) from None
        if v.static_scale is not None:
            rows = state_shape[-2]
            group = (*state_shape[:-2], rows // v.format.granularity.group_rows(rows))
            shp = tuple(v.static_scale.shape)
            if not shp or shp != group[len(group) - len(shp) :]:
                raise VariantError(
                    f"variant {v.name!r}: static_scale has shape {shp}; expected {group[1:]} (per head and "
                    f"scale group) or {group}"
                )
            if not bool(torch.isfinite(v.static_scale).all()) or bool((v.static_scale <= 0).any()):
                raise VariantError(f"variant {v.name!r}: static scales must be finite and > 0")


def parse_variant(spec: str | Variant, *, seed: int = 0, default_buffer_len: int = DEFAULT_BUFFER_LEN) -> Variant:
    """Parse "fmt@scheme" (or a bare format, meaning conventional), optionally followed by "+store" (a prompt store,
    ``formats.prompt_store``) and "~engine", into a Variant."""
    if isinstance(spec, Variant):
        return spec
    if not isinstance(spec, str):
        raise VariantError(f"variant must be a string like 'int8:sr@replay16', got {spec!r}")
    spec, _, engine = spec.partition("~")
    spec, plus, store = spec.partition("+")
    if plus and not store.strip():
        raise VariantError(
            f"invalid variant {spec + plus!r}: name a prompt store after '+' ({', '.join(PROMPT_STORES)})"
        )
    fmt_part, sep, scheme_part = spec.partition("@")
    try:
        fmt = parse(fmt_part)
        scheme = parse_scheme(scheme_part, default_buffer_len=default_buffer_len) if sep else Scheme.conventional()
    except (FormatError, SchemeError) as err:
        raise VariantError(f"invalid variant {spec!r}: {err}") from err
    return Variant(
        fmt, scheme, seed=seed, engine=engine.strip().lower() or "ideal", prompt_store=store.strip().lower() or None
    )


def parse_variants(specs, *, seed: int = 0) -> list[Variant]:
    """Parse a list (or comma-separated string) of variants; names must be unique."""
    if isinstance(specs, (str, Variant)):
        specs = [s for s in specs.split(",")] if isinstance(specs, str) else [specs]
    variants = [parse_variant(s.strip() if isinstance(s, str) else s, seed=seed) for s in specs]
    if not variants:
        raise VariantError("no variants given")
    names = [v.name for v in variants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise VariantError(f"duplicate variants: {', '.join(dupes)}")
    return variants
