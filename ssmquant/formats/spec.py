"""State storage formats as data: element encoding x scale granularity x scale mode x rounding.

A spec string is the encoding name followed by optional ':'-separated modifiers, in any order:

    fp8_e4m3            per-row dynamic scales, round to nearest even (the defaults)
    int8:sr             stochastic rounding
    fp8_e4m3:head       one scale per head (all rows of the head's state)
    int8:rows8          one scale per group of 8 consecutive rows
    nvfp4:static        calibrated scales passed in (saturating)
    int8:head:static:sr

Baseline encodings (fp32, bf16, fp16) have no scale; they accept only the rounding modifier.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from . import codec
from .encodings import SPECS, EncodingSpec, FormatError
from .grids import Rounding


class _EncodingFacts:
    """What an `Encoding` member knows: its `EncodingSpec` (``encodings.py``) and the facts read from it."""

    @property
    def spec(self) -> EncodingSpec:
        return SPECS[self.value]

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def scaled(self) -> bool:
        """True when elements are stored with FP32 scales (fp8_e4m3, int8, int16, nvfp4)."""
        return self.spec.scaled

    @property
    def max_code(self) -> float:
        """Largest magnitude of the element grid that the per-group scale maps amax onto."""
        if self.spec.max_code is None:
            raise FormatError(f"{self.value} has no scale")
        return self.spec.max_code

    @property
    def kernel_code(self) -> int:
        """The constexpr FMT of the fused kernels."""
        return self.spec.kernel_code


# The element encodings of a stored state, one member per `EncodingSpec` (Encoding.FP8_E4M3 is "fp8_e4m3"): the
# specs are the one list of encodings, this enum their names.
Encoding = enum.Enum(
    "Encoding", [(name.upper(), name) for name in SPECS], type=_EncodingFacts, module=__name__, qualname="Encoding"
)


# Names accepted by `parse` for the encoding part.
_ENCODING_ALIASES = {alias: Encoding(s.name) for s in SPECS.values() for alias in (s.name, *s.aliases)}


class ScaleMode(enum.Enum):
    DYNAMIC = "dynamic"  # amax recomputed at every write (what engines do today)
    STATIC = "static"  # scales calibrated offline and passed in; values beyond them saturate


@dataclass(frozen=True)
class Granularity:
    """How many consecutive rows share one FP32 scale.

    `rows=1` is per row (one scale per (head, value channel), the default); `rows=None` is
    per head (all rows of the head's state); `rows=g` shares one scale among g consecutive rows.
    """

    rows: int | None = 1

    @property
    def name(self) -> str:
        if self.rows is None:
            return "head"
        return "row" if self.rows == 1 else f"rows{self.rows}"

    def group_rows(self, num_rows: int) -> int:
        """Rows per scale group for a state with `num_rows` rows (validates divisibility)."""
        g = num_rows if self.rows is None else self.rows
        if num_rows % g != 0:
            raise FormatError(f"granularity {self.name}: {num_rows} rows are not divisible into groups of {g}")
        return g


PER_ROW = Granularity(1)
PER_HEAD = Granularity(None)

NVFP4_BLOCK = SPECS["nvfp4"].block  # elements per E4M3 block scale along the state dim


@dataclass(frozen=True)
class StateFormat:
    """One storage format of the SSM state. Build it with `parse`; use its methods to (de)quantize.

    The quantize/dequantize/fake_quant methods are thin wrappers over `ssmquant.formats.codec`.
    """

    encoding: Encoding
    granularity: Granularity = PER_ROW
    scale_mode: ScaleMode = ScaleMode.DYNAMIC
    rounding: Rounding = Rounding.RNE

    def __post_init__(self):
        if not self.encoding.scaled:
            if self.granularity != PER_ROW or self.scale_mode is not ScaleMode.DYNAMIC:
                raise FormatError(f"{self.encoding.value} has no scale: granularity and static do not apply")
        if self.granularity.rows is not None and self.granularity.rows < 1:
            raise FormatError(f"rows per scale group must be >= 1, got {self.granularity.rows}")
        if self.encoding is Encoding.FP32 and self.rounding is Rounding.SR:
            raise FormatError("fp32 is the unrounded reference: stochastic rounding does not apply")

    @property
    def name(self) -> str:
        """Canonical spec string (defaults omitted); `parse(fmt.name) == fmt`."""
        parts = [self.encoding.value]
        if self.granularity != PER_ROW:
            parts.append(self.granularity.name)
        if self.scale_mode is ScaleMode.STATIC:
            parts.append("static")
        if self.rounding is Rounding.SR:
            parts.append("sr")
        return ":".join(parts)

    def __str__(self) -> str:
        return self.name

    @property
    def is_exact(self) -> bool:
        """True for fp32 (no rounding at all)."""
        return self.encoding is Encoding.FP32

    # -- footprint -----------------------------------------------------------------------------------
    def scale_groups(self, shape: tuple[int, ...]) -> int:
        """Number of FP32 scales for a state of `shape` [..., rows, state_dim]."""
        if not self.encoding.scaled:
            return 0
        rows = shape[-2]
        return math.prod(shape[:-1]) // self.granularity.group_rows(rows)

    def bytes_per_state(self, shape: tuple[int, ...]) -> int:
        """Bytes to store a state of `shape` [..., rows, state_dim]: elements plus all scales.

        nvfp4 packs two elements per byte and adds one E4M3 byte per 16-element block.
        """
        shape = tuple(int(s) for s in shape)
        if len(shape) < 2:
            raise FormatError(f"state shape must be [..., rows, state_dim], got {shape}")
        elements = math.prod(shape)
        spec = self.encoding.spec
        if spec.block is not None and shape[-1] % spec.block:
            raise FormatError(f"{spec.name} needs state_dim divisible by {spec.block}, got {shape[-1]}")
        return spec.element_bytes(elements) + 4 * self.scale_groups(shape)

    def bits_per_element(self, shape: tuple[int, ...]) -> float:
        """Average storage bits per state element, scales included."""
        return 8.0 * self.bytes_per_state(shape) / math.prod(shape)

    def capacity_factor(self, shape: tuple[int, ...]) -> float:
        """How many states fit in the memory of one FP32 state (FP32 bytes / these bytes)."""
        return 4.0 * math.prod(shape) / self.bytes_per_state(shape)

    # -- numerics (delegated) ------------------------------------------------------------------------
    def quantize(self, state, *, scale=None, seed=None, stream: int = 0):
        """Encode `state` [..., rows, state_dim] -> QuantizedState (see `codec.quantize`)."""
        return codec.quantize(self, state, scale=scale, seed=seed, stream=stream)

    def dequantize(self, q):
        """QuantizedState -> FP32 tensor of the original shape (see `codec.dequantize`)."""
        return codec.dequantize(q)

    def fake_quant(self, state, *, scale=None, seed=None, stream: int = 0):
        """dequantize(quantize(state)): FP32 tensor, same shape, values on the format's grid."""
        return codec.dequantize(codec.quantize(self, state, scale=scale, seed=seed, stream=stream))


ENCODING_NAMES = tuple(e.value for e in Encoding)
MODIFIERS_HELP = "row | head | rows<N> | dynamic | static | rne | sr"
_ROWS_RE = re.compile(r"rows(\d+)$")


def parse(spec: str | StateFormat) -> StateFormat:
    """Parse a spec string such as "fp8_e4m3", "int8:sr", "nvfp4:head:static" into a StateFormat.

    Unknown encodings or modifiers raise FormatError listing the accepted values.
    """
    if isinstance(spec, StateFormat):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise FormatError(
            f"format spec must be a non-empty string, got {spec!r}; encodings: {', '.join(ENCODING_NAMES)}"
        )
    head, *mods = [p.strip().lower() for p in spec.strip().split(":")]
    if head not in _ENCODING_ALIASES:
        raise FormatError(f"unknown format {head!r} in {spec!r}; accepted encodings: {', '.join(ENCODING_NAMES)}")
    encoding = _ENCODING_ALIASES[head]
    granularity, mode, rounding = PER_ROW, ScaleMode.DYNAMIC, Rounding.RNE
    seen: set[str] = set()
    for mod in mods:
        m = _ROWS_RE.match(mod)
        kind = (
            "granularity"
            if mod in ("row", "head") or m
            else "mode"
            if mod in ("dynamic", "static")
            else "rounding"
            if mod in ("rne", "sr")
            else None
        )
        if kind is None:
            raise FormatError(f"unknown modifier {mod!r} in {spec!r}; accepted modifiers: {MODIFIERS_HELP}")
        if kind in seen:
            raise FormatError(f"{spec!r} sets the {kind} twice")
        seen.add(kind)
        if kind == "granularity":
            if not encoding.scaled:
                raise FormatError(f"{spec!r}: {encoding.value} has no scale, so {mod!r} does not apply")
            granularity = PER_HEAD if mod == "head" else Granularity(int(m.group(1)) if m else 1)
        elif kind == "mode":
            if not encoding.scaled and mod == "static":
                raise FormatError(f"{spec!r}: {encoding.value} has no scale, so 'static' does not apply")
            mode = ScaleMode(mod)
        else:
            rounding = Rounding(mod)
    return StateFormat(encoding, granularity, mode, rounding)


def standard_formats() -> list[StateFormat]:
    """The formats listed by `ssmquant formats` (each encoding with its default settings)."""
    return [parse(name) for name in ENCODING_NAMES]
