"""Plain-text and pandas tables for the terminal."""

from __future__ import annotations

import math

import pandas as pd

from ..formats import Encoding, StateFormat, parse, standard_formats

_SCALE_NOTE = {
    Encoding.FP32: "none (reference)",
    Encoding.BF16: "none",
    Encoding.FP16: "none",
    Encoding.FP8_E4M3: "FP32 per row, amax/448",
    Encoding.INT8: "FP32 per row, amax/127",
    Encoding.NVFP4: "E4M3 per 16 elements x FP32 per row",
}


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
                "scales": _SCALE_NOTE[fmt.encoding],
            }
        )
    return pd.DataFrame(rows)


def formats_table(shape: tuple[int, ...]) -> str:
    """The `ssmquant formats` table as text."""
    df = formats_frame(shape)
    title = f"State storage formats for a state of shape {'x'.join(map(str, shape))} ({math.prod(shape):,} elements)"
    return title + "\n" + df.to_string(index=False)
