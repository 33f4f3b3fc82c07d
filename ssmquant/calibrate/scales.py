"""Static scales for fp8_e4m3 / int8 (and the NVFP4 second-level scale), calibrated on the FP32 reference state.

Every method chooses a clipping amax a per row (or per head, repeated over its rows) and stores the FP32
decode scale s that the dynamic encoder would use for that amax:

    fp8_e4m3 / int8: s = 1 / (max_code / a)     (max_code 448 / 127; codes = round(clamp(x / s)))
    nvfp4:           s = a / (6 * 448)          (the second-level scale under the E4M3 block scales)

so values beyond a saturate. Methods (README.md "Static scales"):

- max: a = max over all (sequence, step) samples of the row amax (nvidia-modelopt MaxCalibrator).
- percentile p: a = the nearest-rank p-th percentile of the per-step row amax over (sequence, step), i.e.
  the row saturates at no more than (100 - p)% of the steps; per head, of the per-step head amax.
- mse: a = m * max with m in {0.25, 0.30, ..., 1.00} minimising the summed squared *relative* quantization
  error of the row (or head), sum over samples of ||Q(S) - S||^2 / ||S||^2, over up to `mse_samples` evenly
  spaced steps of every sequence, quantized exactly as stored (nvidia-modelopt MseCalibrator, with our
  bit-exact codec as its quant_func and this relative error as its error_func). Relative, because the
  budget is a relative error and the plain squared error is dominated by the largest states, i.e. by the
  outliers that clipping is meant to sacrifice. m = 1 (max) is a candidate, so on those samples mse never
  does worse than max by this measure.

Output: FP32 [H, rows] per layer and setting, the `static_scale` shape of a per-row ':static' format and
FlashInfer's state_scale layout (nheads, head_dim).
"""

from __future__ import annotations

import torch

from ..formats import Encoding, StateFormat, parse, scales_from_amax
from ..formats.codec import ieee_div
from ..kinds import LayerInputs
from .settings import CalibrateError, parse_method
from .stats import StateStats, iter_reference_states

MSE_START, MSE_STOP, MSE_STEP = 0.25, 1.0, 0.05
DEFAULT_MSE_SAMPLES = 64
MSE_FROM = 0.5  # mse samples the second half of the horizon


def decode_scale(encoding: Encoding, amax: torch.Tensor) -> torch.Tensor:
    """FP32 decode scale of a group with amax `amax`, as the dynamic encoder computes it (1 where amax = 0)."""
    layout = encoding.spec.scale_layout
    if layout == "group":
        return scales_from_amax(parse(encoding.value), amax.float())[1]
    if layout == "two-level":
        s = ieee_div(amax.float(), encoding.max_code)
        return torch.where(s == 0, torch.ones_like(s), s)
    raise CalibrateError(f"{encoding.value} has no scale; static scales apply to {_scaled_names()}")


def _scaled_names() -> str:
    return ", ".join(e.value for e in Encoding if e.scaled)


def _static_format(encoding: Encoding) -> StateFormat:
    return parse(f"{encoding.value}:static")


def _per_row(amax: torch.Tensor, rows: int) -> torch.Tensor:
    """[H] -> [H, rows] (a head's value repeated over its rows); [H, rows] unchanged."""
    return amax[:, None].expand(amax.shape[0], rows).contiguous() if amax.ndim == 1 else amax


def relative_error_row(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """Squared error per element over the squared norm of its row sample: [B, H, rows, N] -> same shape."""
    norm = (x * x).sum(-1, keepdim=True)
    return (x - xq) ** 2 / torch.where(norm > 0, norm, torch.ones_like(norm))


def relative_error_head(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """Squared error per element over the squared norm of its head sample [rows, N]."""
    norm = (x * x).sum((-2, -1), keepdim=True)
    return (x - xq) ** 2 / torch.where(norm > 0, norm, torch.ones_like(norm))


def scale_keys(settings) -> list[tuple[str, str, str]]:
    """The distinct (encoding, calibration label, granularity) static scales a list of Settings needs."""
    keys = []
    for s in settings:
        k = s.scale_key
        if k is not None and k not in keys:
            keys.append(k)
    return keys


def calibrate_scales(
    inputs: LayerInputs,
    stats: StateStats,
    keys: list[tuple[str, str, str]],
    *,
    mse_samples: int = DEFAULT_MSE_SAMPLES,
) -> dict[tuple[str, str, str], torch.Tensor]:
    """Static decode scales [H, rows] FP32 for each (encoding, method label, granularity) key.

    inputs: the layer's calibration inputs (re-decoded once if any key uses mse); stats: their StateStats
    (from `collect_stats`, with every percentile a key asks for tracked). Returns {key: scale}.
    """
    from modelopt.torch.quantization.calib import MseCalibrator

    heads, rows = stats.state_shape[0], stats.state_shape[1]
    out: dict[tuple[str, str, str], torch.Tensor] = {}
    mse: dict[tuple[str, str, str], MseCalibrator] = {}
    for key in keys:
        enc_name, label, gran = key
        enc = Encoding(enc_name)
        if not enc.scaled:
            raise CalibrateError(f"{enc_name} has no scale; static scales apply to {_scaled_names()}")
        method = parse_method(label)
        if method.kind == "max":
            amax = stats.row_amax if gran == "row" else stats.head_amax
        elif method.kind == "percentile":
            amax = (
                stats.row_percentile(method.percentile) if gran == "row" else stats.head_percentile(method.percentile)
            )
        else:
            init = stats.row_amax if gran == "row" else stats.head_amax
            fmt = _static_format(enc)

            def quant(x, a, fmt=fmt, enc=enc):
                return fmt.fake_quant(x, scale=decode_scale(enc, _per_row(a, rows)))

            mse[key] = MseCalibrator(
                amax=init.clone(),
                axis=(1, 2) if gran == "row" else 1,  # kept dims of a [B, H, rows, state_dim] state
                step_size=MSE_STEP,
                start_multiplier=MSE_START,
                stop_multiplier=MSE_STOP,
                quant_func=quant,
                error_func=relative_error_row if gran == "row" else relative_error_head,
            )
            continue
        out[key] = decode_scale(enc, _per_row(amax, rows))
    if mse:
        first = int(stats.steps * MSE_FROM)  # steps (first, T]: the state's operating range near the horizon
        every = max(1, (stats.steps - first) // max(1, mse_samples))
        for t, state in iter_reference_states(inputs, every=every):
            if t > first:
                for cal in mse.values():
                    cal.collect(state)
        for key, cal in mse.items():
            amax = cal.compute_amax()
            out[key] = decode_scale(Encoding(key[0]), _per_row(amax.reshape(heads, -1).squeeze(-1), rows))
    for key, s in out.items():
        if tuple(s.shape) != (heads, rows) or not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
            raise CalibrateError(f"static scale {key} came out invalid (shape {tuple(s.shape)}, non-finite or <= 0)")
        out[key] = s.float().contiguous()
    return out


def required_percentiles(keys) -> list[float]:
    """Percentiles (< 100) that the keys' percentile methods need tracked per row."""
    ps = []
    for _, label, _gran in keys:
        m = parse_method(label)
        if m.kind == "percentile" and m.percentile < 100.0:
            ps.append(m.percentile)
    return ps
