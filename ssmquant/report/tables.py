"""Plain-text and pandas tables for the terminal."""

from __future__ import annotations

import math

import pandas as pd

from ..analysis.fit import DIVERGED, MIN_FORECAST_R2
from ..analysis.run import verdict_note, verdicts
from ..formats import Encoding, StateFormat, parse, standard_formats
from ..models import get_preset, list_presets, shipped_layouts


def scale_note(encoding: Encoding) -> str:
    """How an encoding's elements are scaled, read from its spec: 'FP32 per row, amax/448', 'none', ..."""
    spec = encoding.spec
    if spec.scale_layout == "group":
        return f"FP32 per row, amax/{spec.max_code:g}"
    if spec.scale_layout == "two-level":
        return f"E4M3 per {spec.block} elements x FP32 per row"
    if spec.grid is None and spec.pattern_bits is None:
        return "none (reference)"
    return "none (saturating cast)" if spec.grid is not None and spec.grid.saturating else "none"


def parse_shape(text: str) -> tuple[int, ...]:
    """'64,64,128' -> (64, 64, 128); at least rows,state_dim, all positive."""
    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        raise ValueError(f"shape must be comma-separated positive integers such as 64,64,128, got {text!r}") from None
    if len(shape) < 2 or any(s < 1 for s in shape):
        raise ValueError(f"shape must be [..., rows, state_dim] with positive sizes, got {text!r}")
    return shape


def formats_frame(shape: tuple[int, ...], formats: list[StateFormat | str] | None = None) -> pd.DataFrame:
    """Footprint of each format for one state of `shape` ([..., rows, state_dim])."""
    rows = []
    for fmt in formats or standard_formats():
        fmt = parse(fmt)
        nbytes = fmt.bytes_per_state(shape)
        rows.append(
            {
                "format": fmt.name,
                "element bits": fmt.encoding.bits,
                "bits/element (with scales)": round(fmt.bits_per_element(shape), 3),
                "bytes per state": nbytes,
                "capacity vs fp32": round(fmt.capacity_factor(shape), 3),
                "scales": scale_note(fmt.encoding),
            }
        )
    return pd.DataFrame(rows)


def formats_table(shape: tuple[int, ...]) -> str:
    """The `ssmquant formats` table as text."""
    df = formats_frame(shape)
    title = f"State storage formats for a state of shape {'x'.join(map(str, shape))} ({math.prod(shape):,} elements)"
    return title + "\n" + df.to_string(index=False)


def forecast_text(value: float, status: str) -> str:
    """A forecast cell: the number when its fit is reliable, else why it is withheld."""
    if status == "ok":
        return f"{value:.2e}"
    return {"diverged": "diverged", ">=1": ">=1 (forecast)"}.get(status, status)


def summary_table(summary: pd.DataFrame, max_rows: int = 60) -> str:
    """The per layer x variant summary for the terminal: errors at the horizon, the growth fit with its r^2
    and its forecasts, withheld where the fit is unreliable or the error diverges (``analysis.fit``)."""
    cols = {
        "layer": "layer",
        "variant": "variant",
        "out_rel_err": "out err",
        "state_rel_err": "state err",
        "worst_head": "worst head",
        "worst_head_out_rel_err": "its out err",
        "growth_b_out": "growth b",
        "fit_r2_out": "fit r2",
    }
    df = summary[list(cols)].rename(columns=cols)
    for k in ("32k", "128k"):
        df[f"out err @{k.upper()} (forecast)"] = [
            forecast_text(v, st) for v, st in zip(summary[f"forecast_out_{k}"], summary[f"forecast_out_{k}_status"])
        ]
    horizon = int(summary["horizon"].max()) if len(summary) else 0
    fmt = {c: (lambda v: f"{v:.2e}") for c in ("out err", "state err", "its out err")}
    fmt["growth b"] = lambda v: f"{v:+.2f}"
    fmt["fit r2"] = lambda v: f"{v:.2f}"
    text = df.head(max_rows).to_string(index=False, formatters=fmt, na_rep="—")
    more = f"\n... {len(df) - max_rows} more rows in summary.csv" if len(df) > max_rows else ""
    verdict = verdict_text(summary)
    return (
        f"Relative errors at step {horizon} (output and state), worst head, growth exponent b of err ~ a t^b "
        f"fitted past the first flush with its r2, and the fit's forecasts (withheld as 'diverged' where the measured "
        f"error reached {DIVERGED:g}, 'no fit', 'unreliable' where r2 < {MIN_FORECAST_R2}, '>=1 (forecast)' where the "
        f"forecast reaches {DIVERGED:g}):\n{text}{more}" + (f"\n\n{verdict}" if verdict else "")
    )


def verdict_text(summary: pd.DataFrame) -> str:
    """The budget verdict for the terminal: what it compares, then one line per variant (``analysis.verdicts``);
    empty for a summary without the verdict columns (an output of an earlier version)."""
    lines = verdicts(summary)
    if not lines:
        return ""
    return f"Verdict ({verdict_note(lines[0]['budget'])}):\n" + "\n".join(f"  {v['text']}" for v in lines)


def memory_text(memory: pd.DataFrame) -> str:
    """The memory table for the terminal: per format, then the MiB each engine reserves per sequence (columns
    <engine>_bytes_per_sequence of an analysis since they exist; what they assume is in memory.csv's note)."""
    df = memory.copy()
    df["MiB_per_sequence"] = df["MiB_per_sequence"].map(lambda v: f"{v:.2f}")
    df["bits_per_element"] = df["bits_per_element"].map(lambda v: f"{v:.2f}")
    df["capacity_vs_fp32"] = df["capacity_vs_fp32"].map(lambda v: f"{v:.2f}x")
    engines = [
        c[: -len("_bytes_per_sequence")]
        for c in df.columns
        if c.endswith("_bytes_per_sequence") and c != "bytes_per_sequence"
    ]
    for e in engines:
        copies = df.pop(f"{e}_state_copies") if f"{e}_state_copies" in df else None
        col = df.pop(f"{e}_bytes_per_sequence")
        df[f"{e} MiB"] = [
            "-" if b is None or b != b else f"{b / 2**20:.2f}" + ("" if copies is None else f" ({int(copies[i])}x)")
            for i, b in enumerate(col)
        ]
    head = "SSM state per sequence, all SSM layers"
    if engines:
        head += (
            " (engine columns: reserved by each engine's newest release read on sm90, conventional decoding, no "
            "drafts, its defaults; (Nx): state copies per sequence)"
        )
    return head + ":\n" + df.to_string(index=False)


def presets_table() -> str:
    """`ssmquant presets`: each preset's and each shipped model's SSM layers and state bytes per sequence per
    format."""

    def row(name, kind, ssm_layers, num_layers, shape):
        out = {"model": name, "kind": kind, "SSM layers": f"{ssm_layers}/{num_layers}",
               "heads x rows x state": "x".join(map(str, shape))}  # fmt: skip
        for fmt in standard_formats():
            out[f"{fmt.name} MiB/seq"] = round(fmt.bytes_per_state(shape) * ssm_layers / 2**20, 2)
        return out

    presets = [row(n, (p := get_preset(n)).layer_kind, p.num_ssm_layers, p.num_layers, p.state_shape)
               for n in list_presets()]  # fmt: skip
    shipped = [row(n, lay["layer_kind"], len(lay["ssm_layers"]), lay["num_layers"], tuple(lay["state_shape"]))
               for n, lay in shipped_layouts().items()]  # fmt: skip
    text = "SSM state per sequence (all SSM layers; conv state excluded)\n\npresets (hub checkpoints; --synthetic takes their shapes, no download):\n"
    text += pd.DataFrame(presets).to_string(index=False)
    if shipped:
        text += "\n\nshipped models (trained tiny checkpoints inside the package, --model NAME; no download):\n"
        text += pd.DataFrame(shipped).to_string(index=False)
    return text
