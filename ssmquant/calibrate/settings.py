"""Candidate settings of one layer's stored state, and what each costs in bytes per sequence.

A setting is a storage format (encoding, scale granularity, scale mode, rounding) under a decoding scheme
(conventional, replay(L), spec(L, T)); a static format also names the calibration method that produced its
scales. Its canonical name is the variant name with the calibration in brackets:

    fp8_e4m3@replay16                  dynamic per-row scales, as engines do today
    int8:static[mse]@replay8           static per-row scales, MSE-optimal clipping per row
    int8:static[percentile99.99:head]@conventional   one percentile-calibrated scale per head

Bytes per sequence and layer (what `calibrate` minimises, see README.md "Objective"):

- state: `StateFormat.bytes_per_state` for [H, rows, state_dim], scales included, as `ssmquant formats`
  reports it. The scales of a static format are counted too although an engine could share them across
  sequences (4 bytes per row, ~3% of an fp8 state with N = 128): static scales saturate on data louder than
  the calibration data, so a static setting should win on accuracy, not on this small saving;
- buffer: the replay ring an engine keeps per sequence, L + T rows (T = tokens per decode call, 1 + draft
  tokens) of the buffered inputs in the buffer dtype (Mamba-2: x [H, P] and B [G, N]; GDN and KDA: u [Hv, Dv]
  and k [Hk, Dk]) plus the gate in FP32: one scalar per head (dt or g), KDA's g one per key channel [Hv, Dk]
  (vLLM's GLM-5.3-Flash RecoverSSM record keeps exp(g) in FP32; Kimi-K3's keeps the raw gate in the
  activation dtype). Conventional decoding keeps no ring.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass

import numpy as np

from .. import kinds
from ..errors import SsmquantError
from ..formats import Encoding, FormatError, Rounding, ScaleMode, StateFormat, parse
from ..formats.prompt_store import parse_prompt_store
from ..kinds import LayerDims
from ..replay.schemes import BUFFER_DTYPES, Scheme, SchemeError, SchemeKind, parse_scheme
from ..replay.trace import cycle_window
from ..replay.variants import PROMPT_STORE_LIVE_FORMATS, StorageFacts, Variant, VariantError

# the cycle mean (RMS over the horizon window's steps) and the cycle max (its worst step) of each quantity
METRICS = ("out_rel_err", "state_rel_err", "out_rel_err_max", "state_rel_err_max")
# the horizon window is the last of this many windows of whole flush cycles (e.g. the last 64 of 4096 steps)
HORIZON_WINDOWS = 64
ROUNDINGS = ("rne", "sr")
# what calibrate chooses among (--choose-among): "engines": the settings that one of the engines checked
# (--engine-version, --gpu; by default each engine's newest release on the local GPU, else sm90) runs as measured on
# the layers' sizes, float fallbacks included; "research": every candidate, what no engine runs yet included
CHOICES = ("engines", "research")
CALIBRATION_GRANULARITIES = ("row", "head")
DEFAULT_PERCENTILE = 99.99
_BUFFER_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_NAME_RE = re.compile(r"^(?P<fmt>[^@\[]+)(?:\[(?P<cal>[^\]]+)\])?@(?P<scheme>[^+]+)(?:\+(?P<store>.+))?$")


class CalibrateError(SsmquantError, ValueError):
    """Bad calibrate settings or inputs; the message names the problem and the accepted values."""


def metric_quantity(metric: str) -> str:
    """'out_rel_err[_max]' -> 'out', 'state_rel_err[_max]' -> 'state' (the Trace quantity)."""
    if metric not in METRICS:
        raise CalibrateError(f"unknown metric {metric!r}; accepted: {', '.join(METRICS)}")
    return metric.split("_", 1)[0]


def other_metric(metric: str) -> str:
    """The same statistic of the other quantity: out_rel_err <-> state_rel_err (and the _max pair)."""
    q = metric_quantity(metric)
    return metric.replace(q, "state" if q == "out" else "out", 1)


def horizon_window(variants: list[Variant], steps: int) -> int:
    """Window length for budget checks: whole flush cycles of every variant, ~steps / HORIZON_WINDOWS."""
    return cycle_window([v.scheme.buffer_len for v in variants], steps, HORIZON_WINDOWS)


def horizon_errors(trace, per_head: bool = False) -> dict[str, np.ndarray]:
    """{metric: [V] (or [V, H] per head)} over the trace's horizon window, for every name in METRICS."""
    h = trace.horizon_index
    return {
        m: trace.rel_err(metric_quantity(m), stat="max" if m.endswith("_max") else "mean", per_head=per_head)[:, h]
        for m in METRICS
    }


@dataclass(frozen=True)
class CalibrationMethod:
    """How static scales are derived from the FP32 reference state (README.md "Static scales").

    kind: "max" | "percentile" | "mse"; percentile: the percentile of the per-step amax (percentile only).
    """

    kind: str
    percentile: float | None = None

    @property
    def label(self) -> str:
        return f"percentile{self.percentile:g}" if self.kind == "percentile" else self.kind


CALIBRATION_HELP = "max | percentile (99.99) | percentile:<p> (e.g. percentile:99.9, p in [50, 100]) | mse | none"


def parse_method(spec: str) -> CalibrationMethod:
    """Parse "max", "percentile", "percentile:99.9", "percentile99.9", "p99.9" or "mse"."""
    s = str(spec).strip().lower()
    if s in ("max", "mse"):
        return CalibrationMethod(s)
    m = re.fullmatch(r"(?:percentile|p)(?::?(\d+(?:\.\d+)?))?", s)
    if m:
        p = float(m.group(1)) if m.group(1) else DEFAULT_PERCENTILE
        if not 50.0 <= p <= 100.0:
            raise CalibrateError(f"percentile must lie in [50, 100], got {p:g} in {spec!r}")
        return CalibrationMethod("percentile", p)
    raise CalibrateError(f"unknown calibration method {spec!r}; accepted: {CALIBRATION_HELP}")


@dataclass(frozen=True)
class Setting(StorageFacts):
    """format x scheme (+ the calibration of a static format's scales, + the prompt store).

    calibration: a CalibrationMethod label ("max", "percentile99.99", "mse") for ':static' formats, else None;
    calibration_granularity: "row" (one scale per row) or "head" (one value per head, repeated over its rows).
    Static scales are always stored per row, shape [H, rows] (FlashInfer's state_scale layout).
    prompt_store: how a cached prompt's state is kept before the live format takes it over
    (``formats.prompt_store``, e.g. "int8col", SGLang's int8 prefix cache), or None (the live format stores it).
    """

    format: StateFormat
    scheme: Scheme
    calibration: str | None = None
    calibration_granularity: str | None = None
    prompt_store: str | None = None

    def __post_init__(self):
        if self.prompt_store is not None:
            try:
                Variant(self.format, self.scheme, prompt_store=self.prompt_store, static_scale=None)
            except VariantError as err:
                raise CalibrateError(str(err)) from None
        static = self.format.scale_mode is ScaleMode.STATIC
        if static and self.calibration is None:
            raise CalibrateError(f"{self.format.name}: a static format needs a calibration method ({CALIBRATION_HELP})")
        if not static and self.calibration is not None:
            raise CalibrateError(f"{self.format.name} has dynamic scales: a calibration method does not apply")
        if static and self.format.granularity.rows != 1:
            raise CalibrateError(
                f"{self.format.name}: static scales are stored per row (FlashInfer's state_scale layout); "
                "calibrate per head with calibration_granularity='head' instead of a ':head' format"
            )
        if static and self.calibration_granularity not in CALIBRATION_GRANULARITIES:
            raise CalibrateError(
                f"calibration granularity must be one of {', '.join(CALIBRATION_GRANULARITIES)}, "
                f"got {self.calibration_granularity!r}"
            )

    # -- naming --------------------------------------------------------------------------------------
    @property
    def calibration_label(self) -> str | None:
        if self.calibration is None:
            return None
        return self.calibration + (":head" if self.calibration_granularity == "head" else "")

    @property
    def name(self) -> str:
        cal = f"[{self.calibration_label}]" if self.calibration else ""
        store = f"+{self.prompt_store}" if self.prompt_store else ""
        return f"{self.format.name}{cal}@{self.scheme.name}{store}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_static(self) -> bool:
        return self.format.scale_mode is ScaleMode.STATIC

    @property
    def scale_key(self) -> tuple[str, str, str] | None:
        """(encoding, calibration, granularity) of the static scales this setting needs, or None."""
        if not self.is_static:
            return None
        return (self.encoding, self.calibration, self.calibration_granularity)

    def variant(self, *, seed: int = 0, static_scale=None, engine: str = "ideal") -> Variant:
        """The replay Variant that emulates this setting (label = self.name) under an engine profile's arithmetic."""
        return Variant(
            self.format,
            self.scheme,
            seed=seed,
            static_scale=static_scale,
            label=self.name,
            engine=engine,
            prompt_store=self.prompt_store,
        )

    # -- serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Explicit JSON form (README.md "Schema"); `Setting.from_dict(s.to_dict()) == s`."""
        return {
            "name": self.name,
            "format": self.format.name,
            "encoding": self.encoding,
            "granularity": self.granularity,
            "scale_mode": self.scale_mode,
            "rounding": self.rounding,
            "calibration": self.calibration,
            "calibration_granularity": self.calibration_granularity,
            "scheme": self.scheme.name,
            "scheme_kind": self.scheme_kind,
            "buffer_len": self.buffer_len,
            "draft_tokens": self.draft_tokens,
            "buffer_dtype": self.scheme.buffer_dtype if self.buffer_len else None,
            # only where set: a setting without a prompt store serialises as before the field existed
            **({"prompt_store": self.prompt_store} if self.prompt_store else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Setting:
        """Rebuild from `to_dict` output (validates; raises CalibrateError naming the bad field).

        format and scheme (and calibration, calibration_granularity) define the setting; every other field
        present must agree with them, so that a hand-edited field can never be silently ignored.
        """
        if not isinstance(d, dict):
            raise CalibrateError(f"a setting must be an object, got {type(d).__name__}")
        for key in ("format", "scheme"):
            if not isinstance(d.get(key), str):
                raise CalibrateError(f"setting is missing the string field {key!r}: {d}")
        try:
            s = cls(
                parse(d["format"]),
                parse_scheme(d["scheme"]),
                d.get("calibration"),
                d.get("calibration_granularity"),
                d.get("prompt_store"),
            )
        except (FormatError, SchemeError) as err:
            raise CalibrateError(f"invalid setting {d.get('name', d)!r}: {err}") from None
        if "name" in d and d["name"] != s.name:
            raise CalibrateError(f"setting name {d['name']!r} does not match its fields ({s.name!r})")
        canonical = s.to_dict()
        unknown = sorted(set(d) - set(canonical))
        if unknown:
            raise CalibrateError(f"setting {s.name!r} has unknown fields {unknown}; its fields are {list(canonical)}")
        for key, want in canonical.items():
            if key in d and (d[key] != want or type(d[key]) is not type(want)):
                raise CalibrateError(
                    f"setting {s.name!r}: {key} is {d[key]!r} but its format {s.format.name!r} and scheme "
                    f"{s.scheme.name!r} give {want!r}; fix or remove the field (format and scheme decide)"
                )
        return s

    @classmethod
    def parse(cls, name: str) -> Setting:
        """Parse a canonical name such as "int8:static[mse:head]@replay8" or "bf16@conventional+int8col"."""
        m = _NAME_RE.match(name.strip()) if isinstance(name, str) else None
        if not m:
            raise CalibrateError(
                f"setting must look like '<format>[<calibration>]@<scheme>[+<prompt store>]', e.g. "
                f"'int8:static[mse]@replay16' or 'bf16@conventional+int8col', got {name!r}"
            )
        cal, gran = m.group("cal"), None
        if cal:
            cal, _, g = cal.partition(":")
            gran = g or "row"
        try:
            return cls(parse(m.group("fmt")), parse_scheme(m.group("scheme")), cal, gran, m.group("store"))
        except (FormatError, SchemeError) as err:
            raise CalibrateError(f"invalid setting {name!r}: {err}") from None


def with_prompt_stores(settings: list[Setting], stores: list[str]) -> list[Setting]:
    """``settings``, then each float one (fp32, bf16, fp16) again with each prompt store (CalibrateError for an
    unknown store)."""
    floats = [s for s in settings if s.encoding in PROMPT_STORE_LIVE_FORMATS]
    return settings + [dataclasses.replace(s, prompt_store=store) for store in stores for s in floats]


# -- bytes --------------------------------------------------------------------------------------------
def state_bytes(fmt: StateFormat, state_shape: tuple[int, ...]) -> int:
    """Per-sequence bytes of a stored state [H, rows, state_dim], scales included (module docstring)."""
    return fmt.bytes_per_state(state_shape)


def ring_rows(scheme: Scheme) -> int:
    """Rows of an engine's replay ring: L + T, T = 1 + draft tokens tokens per decode call (0 if conventional)."""
    if scheme.kind is SchemeKind.CONVENTIONAL:
        return 0
    return scheme.buffer_len + 1 + (scheme.draft_tokens if scheme.kind is SchemeKind.SPEC else 0)


def buffer_bytes(scheme: Scheme, dims: LayerDims) -> int:
    """Per-sequence bytes of the replay ring of one layer (module docstring); 0 for conventional decoding."""
    r = ring_rows(scheme)
    if r == 0:
        return 0
    e = _BUFFER_BYTES[scheme.buffer_dtype]
    vectors, gates = kinds.get(dims.kind).ring_row(dims)  # in the buffer dtype; FP32 gates
    return r * (vectors * e + gates * 4)


def cached_prompt_bytes(setting: Setting, dims: LayerDims) -> int:
    """Bytes of one cached prompt state of one layer in the engine's prefix cache: in the setting's prompt store
    (int8col: int8 codes and one live-dtype scale per key channel of each head), else as the live state."""
    if setting.prompt_store is None:
        return state_bytes(setting.format, dims.state_shape)
    heads, rows, state_dim = dims.state_shape
    scale_bytes = setting.format.encoding.spec.storage.itemsize
    return heads * parse_prompt_store(setting.prompt_store).bytes_per_head(rows, state_dim, scale_bytes)


def setting_bytes(
    setting: Setting, dims: LayerDims, *, count_buffer: bool = True, count_cached_prompt: bool = False
) -> dict[str, int]:
    """{"state", "buffer", "total"} bytes per sequence of one layer; total leaves the buffer out if not
    count_buffer. count_cached_prompt (calibrate --prompt-store): also "cached_prompt", one cached prompt state
    (``cached_prompt_bytes``), counted in the total."""
    s = state_bytes(setting.format, dims.state_shape)
    b = buffer_bytes(setting.scheme, dims)
    out = {"state": s, "buffer": b, "total": s + (b if count_buffer else 0)}
    if count_cached_prompt:
        out["cached_prompt"] = cached_prompt_bytes(setting, dims)
        out["total"] += out["cached_prompt"]
    return out


# -- candidate generation -----------------------------------------------------------------------------
def expand_schemes(schemes: list[str], buffer_lens: list[int]) -> list[Scheme]:
    """'conventional', 'replay' (one per buffer length), 'replay16', 'spec16x4:p0.8' -> Schemes (deduplicated)."""
    if not schemes:
        raise CalibrateError("give at least one scheme (conventional, replay, replay<L>, spec<L>x<T>)")
    for L in buffer_lens:
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise CalibrateError(f"buffer lengths must be integers >= 1, got {L!r}")
    out: dict[str, Scheme] = {}
    for spec in schemes:
        s = str(spec).strip().lower()
        try:
            if s == "replay" or re.fullmatch(r"replay:(" + "|".join(BUFFER_DTYPES) + ")", s):
                if not buffer_lens:
                    raise CalibrateError("'replay' needs at least one buffer length (--buffer-lens)")
                mod = s[len("replay") :]
                found = [parse_scheme(f"replay{L}{mod}") for L in buffer_lens]
            else:
                found = [parse_scheme(s)]
        except SchemeError as err:
            raise CalibrateError(str(err)) from None
        for sch in found:
            out.setdefault(sch.name, sch)
    return list(out.values())


def build_settings(
    candidates: list[str],
    schemes: list[str],
    buffer_lens: list[int],
    roundings: list[str],
    calibrations: list[str],
    granularities: list[str],
) -> list[Setting]:
    """All candidate settings: formats x roundings x (dynamic + one static per method x granularity) x schemes.

    A candidate spec with an explicit ':static' or ':dynamic' keeps only that mode, and one with ':sr' only
    stochastic rounding; float encodings (fp32, bf16, fp16) have no scales and take only the roundings.
    """
    if not candidates:
        raise CalibrateError("give at least one candidate format (e.g. fp8_e4m3,int8,nvfp4)")
    for r in roundings:
        if r not in ROUNDINGS:
            raise CalibrateError(f"unknown rounding {r!r}; accepted: {', '.join(ROUNDINGS)}")
    if not roundings:
        raise CalibrateError(f"give at least one rounding ({', '.join(ROUNDINGS)})")
    for g in granularities:
        if g not in CALIBRATION_GRANULARITIES:
            raise CalibrateError(
                f"unknown calibration granularity {g!r}; accepted: {', '.join(CALIBRATION_GRANULARITIES)}"
            )
    methods = [] if [c.strip().lower() for c in calibrations] == ["none"] else [parse_method(c) for c in calibrations]
    scheme_list = expand_schemes(schemes, buffer_lens)
    out: dict[str, Setting] = {}
    for spec in candidates:
        try:
            base = parse(spec)
        except FormatError as err:
            raise CalibrateError(str(err)) from None
        mods = set(str(spec).lower().split(":")[1:])
        rnds = [base.rounding.value] if ("sr" in mods or "rne" in mods) else roundings
        for r, scheme in itertools.product(rnds, scheme_list):
            if base.encoding is Encoding.FP32 and r == "sr":
                continue
            dyn = StateFormat(base.encoding, base.granularity, ScaleMode.DYNAMIC, Rounding(r))
            forms: list[Setting] = []
            if not base.encoding.scaled or "static" not in mods:
                forms.append(Setting(dyn, scheme))
            if base.encoding.scaled and "dynamic" not in mods:
                if base.granularity.rows != 1:
                    raise CalibrateError(
                        f"{spec!r}: static scales are stored per row; use --calibration-granularity head "
                        "for one value per head"
                    )
                st = StateFormat(base.encoding, base.granularity, ScaleMode.STATIC, Rounding(r))
                forms += [Setting(st, scheme, m.label, g) for m in methods for g in granularities]
            for s in forms:
                out.setdefault(s.name, s)
    if not out:
        raise CalibrateError("no candidate settings: give at least one format, scheme and rounding")
    return list(out.values())
