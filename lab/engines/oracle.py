"""The real serving kernels as oracles: run them step by step next to ssmquant's emulations.

    python -m lab.engines.oracle --out DIR [--steps 256] [--long-steps 4096] [--captured FILE]

Needs a CUDA GPU and the engine bundle on PYTHONPATH (`lab.engines.bundle`); what is missing is
reported in one line per engine and the cases of that engine are skipped.

For every case the same inputs go to
  - the real kernel (FlashInfer `checkpointing_ssu` / `selective_state_update`, fla `fused_recurrent_*`),
  - the engine's torch re-computation (`ssmquant.engines.flashinfer`), twice: free-running on its own
    state, and teacher-forced (fed the real kernel's state before each call, which isolates the
    arithmetic of one call from the drift of a whole trajectory),
  - ssmquant's `ideal` emulation of the same storage format and scheme (`ssmquant.replay.naive`),
  - the FP32 reference recurrence.
Reported per case: the fraction of bit-identical state codes (and scales) after the 1st, 16th and
256th state write, free-running and teacher-forced; bit-identical outputs (in the engine's bf16); and
the error curves (relative error against the FP32 reference, pooled over batch and heads, as means over
windows of `window` steps) of the real kernel, the engine re-computation and the ideal emulation, with
the largest relative difference between curves. Outputs of every path are compared in bf16, the dtype
the engines return.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ssmquant.engines import flashinfer as fi
from ssmquant.engines import philox
from ssmquant.engines.philox import engine_seed
from ssmquant.formats import parse as parse_format
from ssmquant.kinds import (
    GDNInputs,
    KDAInputs,
    Mamba2Inputs,
    expand_groups,
    gdn_advance,
    gdn_decays,
    kda_advance,
    kda_decays,
    mamba2_advance,
    mamba2_decays,
)
from ssmquant.replay.naive import StateStore
from ssmquant.replay.schemes import Scheme

from .env import engine_status

STATE_DTYPES = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int16": torch.int16,
}
WRITE_MARKS = (1, 16, 256)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality of two tensors of one dtype (NaN-safe, -0 != +0)."""
    if a.dtype.is_floating_point:
        width = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[a.element_size() * 8]
        return a.contiguous().view(width) == b.contiguous().view(width)
    return a == b


def frac_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(_bits_equal(a, b).float().mean())


def frac_within_ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements equal or one ulp apart (FP32 / 16-bit floats: adjacent bit patterns)."""
    if not a.dtype.is_floating_point or a.element_size() == 1:
        return float(((a.float() - b.float()).abs() <= 1).float().mean())
    width = {16: torch.int16, 32: torch.int32}[a.element_size() * 8]
    ia, ib = a.contiguous().view(width).long(), b.contiguous().view(width).long()
    return float(((ia - ib).abs() <= 1).float().mean())


@dataclass
class Curve:
    """Pooled relative error per step (sqrt(sum err^2 / sum ref^2) over batch and heads)."""

    steps: list[int] = field(default_factory=list)
    rel: list[float] = field(default_factory=list)

    def add(self, step: int, got: torch.Tensor, ref: torch.Tensor) -> None:
        d = (got.float() - ref.float()).pow(2).sum()
        r = ref.float().pow(2).sum()
        self.steps.append(step)
        self.rel.append(float((d / r).sqrt()) if float(r) > 0 else 0.0)

    def windows(self, width: int) -> list[tuple[int, float]]:
        """(window end step, mean relative error) over windows of `width` steps."""
        out, acc, end = [], [], width
        for s, v in zip(self.steps, self.rel):
            while s > end:
                if acc:
                    out.append((end, sum(acc) / len(acc)))
                acc, end = [], end + width
            acc.append(v)
        if acc:
            out.append((end, sum(acc) / len(acc)))
        return out


def curve_gap(a: Curve, b: Curve, width: int) -> float:
    """max over windows of |a - b| / b (b the real kernel's curve); nan when there is nothing to compare."""
    wa, wb = dict(a.windows(width)), dict(b.windows(width))
    gaps = [abs(wa[k] - wb[k]) / wb[k] for k in wb if k in wa and wb[k] > 0]
    return max(gaps) if gaps else float("nan")


def _summary(curves: dict[str, Curve], width: int) -> dict:
    real = curves["real"]
    out = {"final_window": {k: (c.windows(width)[-1][1] if c.rel else None) for k, c in curves.items()}}
    out["max_rel_gap_vs_real"] = {k: curve_gap(c, real, width) for k, c in curves.items() if k != "real"}
    return out


# --- inputs --------------------------------------------------------------------------------------------


def bf16_inputs(inp: Mamba2Inputs) -> Mamba2Inputs:
    """The layer's inputs as the engines receive them: x, B, C in bf16; dt, A, D in FP32."""
    return Mamba2Inputs(
        x=inp.x.to(torch.bfloat16),
        dt=inp.dt.float(),
        B=inp.B.to(torch.bfloat16),
        C=inp.C.to(torch.bfloat16),
        A=inp.A.float(),
        D=inp.D.float(),
        initial_state=None,
        meta=dict(inp.meta),
    ).validate()


def nano_layer(batch: int, steps: int, device, seed: int = 0) -> Mamba2Inputs:
    """A synthetic Nemotron-3-Nano Mamba-2 layer (64 heads x 64 x 128, 8 groups)."""
    from ssmquant.models.synthetic import synthetic_inputs

    return bf16_inputs(synthetic_inputs("nemotron-3-nano", 0, batch=batch, steps=steps, seed=seed, device=device))


# --- FlashInfer checkpointing_ssu ----------------------------------------------------------------------


@dataclass(frozen=True)
class CkptCase:
    state: str  # int8 | fp8_e4m3 | fp32 | bf16
    window: int  # max_window (the ring holds window + npred rows)
    npred: int = 1  # tokens per call (1 + drafts)
    sr: bool = False
    steps: int = 256
    accept_seed: int = 0

    @property
    def name(self) -> str:
        base = f"checkpointing_ssu {self.state}{':sr' if self.sr else ''} L={self.window}"
        return base + (f" T={self.npred}" if self.npred > 1 else "")


def _accept_counts(case: CkptCase, calls: int) -> list[int]:
    """Accepted tokens per call (1..npred): every token when npred == 1, else seeded uniform draws."""
    if case.npred == 1:
        return [1] * calls
    g = torch.Generator().manual_seed(case.accept_seed)
    return (torch.randint(1, case.npred + 1, (calls,), generator=g)).tolist()


def ckpt_module_args(case: CkptCase, heads: int, groups: int, dim: int = 64, dstate: int = 128) -> tuple:
    """`flashinfer.mamba.checkpointing_ssu._get_module` arguments for a case (x bf16; dt, A, D fp32)."""
    sd = STATE_DTYPES[case.state]
    scale = torch.float32 if sd in fi.EIGHT_BIT else None
    return (
        sd, torch.bfloat16, torch.float32, torch.float32, torch.float32, torch.int32, scale,
        dim, dstate, case.npred, case.window, heads // groups, groups, philox.PHILOX_ROUNDS if case.sr else 0, False,
    )  # fmt: skip


class _Cache:
    """One engine-side cache: state (+ scale) and the ring, for batch rows in slots 0..B-1."""

    def __init__(self, dtype, bsz, heads, groups, p, n, ring, device):
        self.state = torch.zeros(bsz, heads, p, n, dtype=dtype, device=device)
        self.scale = torch.ones(bsz, heads, p, device=device) if dtype in fi.EIGHT_BIT else None
        self.x = torch.zeros(bsz, heads, ring, p, dtype=torch.bfloat16, device=device)
        self.b = torch.zeros(bsz, groups, ring, n, dtype=torch.bfloat16, device=device)
        self.dt = torch.zeros(bsz, heads, ring, device=device)
        self.start = torch.zeros(bsz, dtype=torch.int32, device=device)
        self.pnat = torch.zeros(bsz, dtype=torch.int32, device=device)

    def clone(self) -> _Cache:
        c = object.__new__(_Cache)
        for k, v in vars(self).items():
            setattr(c, k, None if v is None else v.clone())
        return c

    def values(self) -> torch.Tensor:
        return fi.dequantize_state(self.state, self.scale)


def run_checkpointing(inp: Mamba2Inputs, case: CkptCase, *, seed: int = 1, window: int = 64) -> dict:
    """Real `checkpointing_ssu` against its re-computation and the ideal emulation (see module doc)."""
    from flashinfer.mamba import checkpointing_ssu

    dev = inp.device
    bsz, steps, heads, p = inp.batch, min(inp.steps, case.steps), inp.num_heads, inp.rows
    groups, n = inp.num_groups, inp.state_dim
    ring = case.window + case.npred
    sd = STATE_DTYPES[case.state]
    real = _Cache(sd, bsz, heads, groups, p, n, ring, dev)
    free = real.clone()
    a_dec = mamba2_decays(inp)
    bx = expand_groups(inp.B.float(), heads)
    cx = expand_groups(inp.C.float(), heads)
    A3 = inp.A.float()[:, None, None].expand(heads, p, n)
    D2 = inp.D.float()[:, None].expand(heads, p)
    s_ref = torch.zeros(bsz, heads, p, n, device=dev)
    # the ideal emulation: the same format under the matching ssmquant scheme
    calls_accept = _accept_counts(case, steps)
    if case.npred == 1:
        scheme = Scheme.replay(case.window)
    else:
        scheme = Scheme.spec(ring, case.npred, [a - 1 for a in calls_accept])
    fmt = parse_format(case.state + (":sr" if case.sr else ""))
    store = StateStore(fmt, (bsz, heads, p, n), dev, seed)
    mask = scheme.write_mask(bsz, steps)[0].tolist()
    s_ideal = torch.zeros_like(s_ref)
    curves_out = {k: Curve() for k in ("real", "engine_ref", "ideal")}
    curves_state = {k: Curve() for k in ("real", "engine_ref", "ideal")}
    writes, tf_codes, tf_scales, tf_scales_ulp, tf_out, free_marks = 0, [], [], [], [], {}
    pos, call = 0, 0
    t0 = time.perf_counter()
    while pos < steps:
        tn = case.npred
        if pos + tn > steps:
            break
        prev_k = int(real.pnat[0])
        must = prev_k + tn > case.window
        acc = min(calls_accept[call], steps - pos)
        sl = slice(pos, pos + tn)
        x = inp.x[:, sl].contiguous()
        dt = inp.dt[:, sl].contiguous()
        bm, cm = inp.B[:, sl].contiguous(), inp.C[:, sl].contiguous()
        rs = engine_seed(seed, call) if case.sr else None
        snap = real.clone()
        out = torch.empty_like(x)
        seed_t = torch.tensor([rs], dtype=torch.int64, device=dev) if case.sr else None
        checkpointing_ssu(
            real.state, real.x, real.b, real.dt, real.start, real.pnat, x, dt[..., None].expand(bsz, tn, heads, p),
            A3, bm, cm, out, D=D2, state_scale=real.scale, rand_seed=seed_t, algorithm="monolith",
        )  # fmt: skip
        args = (x, dt, inp.A, bm, cm, inp.D)
        out_tf = fi.checkpointing_ssu_reference(
            snap.state, snap.scale, snap.x, snap.b, snap.dt, snap.start, snap.pnat, *args, rand_seed=rs
        )
        out_free = fi.checkpointing_ssu_reference(
            free.state, free.scale, free.x, free.b, free.dt, free.start, free.pnat, *args, rand_seed=rs
        )
        tf_out.append(frac_equal(out[:, :acc], out_tf[:, :acc]))
        if must:
            writes += 1
            tf_codes.append(frac_equal(real.state, snap.state))
            if real.scale is not None:
                tf_scales.append(frac_equal(real.scale, snap.scale))
                tf_scales_ulp.append(frac_within_ulp(real.scale, snap.scale))
            if writes in WRITE_MARKS:
                free_marks[writes] = {
                    "codes": frac_equal(real.state, free.state),
                    "scales": None if real.scale is None else frac_equal(real.scale, free.scale),
                }
            # the checkpoint summarises the committed tokens before this call: s_ref is there now
            curves_state["real"].add(pos, real.values(), s_ref)
            curves_state["engine_ref"].add(pos, free.values(), s_ref)
        for c in (real, free):  # host bookkeeping (identical for both)
            if must:
                c.start.copy_((c.start + prev_k) % ring)
                c.pnat.fill_(acc)
            else:
                c.pnat.add_(acc)
        for i in range(acc):
            t = pos + i
            xt = inp.x[:, t].float()
            s_ref, y_ref = mamba2_advance(s_ref, a_dec[:, t], inp.dt[:, t], xt, bx[:, t], cx[:, t], inp.D, xt)
            s_ideal, y_ideal = mamba2_advance(s_ideal, a_dec[:, t], inp.dt[:, t], xt, bx[:, t], cx[:, t], inp.D, xt)
            if mask[t]:
                s_ideal = store(s_ideal, store.key(t))
                curves_state["ideal"].add(t + 1, s_ideal, s_ref)
            curves_out["real"].add(t + 1, out[:, i].float(), y_ref)
            curves_out["engine_ref"].add(t + 1, out_free[:, i].float(), y_ref)
            curves_out["ideal"].add(t + 1, fi.bf16(y_ideal), y_ref)
        pos += acc
        call += 1
    _sync(dev)
    res = {
        "case": case.name,
        **asdict(case),
        "calls": call,
        "writes": writes,
        "seconds": time.perf_counter() - t0,
        "teacher_forced": {
            "codes_identical_mean": _mean(tf_codes),
            "codes_identical_min": min(tf_codes) if tf_codes else None,
            "scales_identical_mean": _mean(tf_scales),
            "scales_within_ulp_mean": _mean(tf_scales_ulp),
            "out_identical_mean": _mean(tf_out),
        },
        "free_running_at_write": free_marks,
        "out_curves": _summary(curves_out, window),
        "state_curves": _summary(curves_state, max(window, case.window)),
    }
    # the ideal emulation's state is recorded at its own write steps (after step t); the engine's at the
    # flush that summarises the same tokens: both curves are keyed by the number of tokens summarised
    return res


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def _mean(v: list[float]) -> float | None:
    return sum(v) / len(v) if v else None


# --- FlashInfer selective_state_update ----------------------------------------------------------------


@dataclass(frozen=True)
class SsuCase:
    state: str  # fp32 | bf16 | fp16 | int16
    sr: bool = False
    steps: int = 256

    @property
    def name(self) -> str:
        return f"selective_state_update {self.state}{':sr' if self.sr else ''}"


def ssu_module_args(case: SsuCase, device, dim: int = 64, dstate: int = 128) -> tuple:
    """`get_selective_state_update_module` arguments (as the wrapper passes them; x bf16, dt/A/D fp32)."""
    sd = STATE_DTYPES[case.state]
    return (
        device, sd, torch.bfloat16, torch.float32, torch.float32, torch.int32, dim, dstate, 1,
        torch.int32, torch.int64, torch.float32 if sd is torch.int16 else None, philox.PHILOX_ROUNDS if case.sr else 0,
    )  # fmt: skip


def run_ssu(inp: Mamba2Inputs, case: SsuCase, *, seed: int = 1, window: int = 64) -> dict:
    """Real `selective_state_update` (simple algorithm) against its re-computation and the ideal emulation."""
    from flashinfer.mamba import selective_state_update

    dev = inp.device
    bsz, steps, heads, p, n = inp.batch, min(inp.steps, case.steps), inp.num_heads, inp.rows, inp.state_dim
    sd = STATE_DTYPES[case.state]
    state = torch.zeros(bsz, heads, p, n, dtype=sd, device=dev)
    scale = torch.ones(bsz, heads, p, device=dev) if sd is torch.int16 else None
    free_state = state.clone()
    free_scale = None if scale is None else scale.clone()
    a_dec = mamba2_decays(inp)
    bx = expand_groups(inp.B.float(), heads)
    cx = expand_groups(inp.C.float(), heads)
    A3 = inp.A.float()[:, None, None].expand(heads, p, n)
    D2 = inp.D.float()[:, None].expand(heads, p)
    fmt = parse_format(case.state + (":sr" if case.sr else ""))
    store = StateStore(fmt, (bsz, heads, p, n), dev, seed)
    s_ref = torch.zeros(bsz, heads, p, n, device=dev)
    s_ideal = torch.zeros_like(s_ref)
    curves_out = {k: Curve() for k in ("real", "engine_ref", "ideal")}
    curves_state = {k: Curve() for k in ("real", "engine_ref", "ideal")}
    tf_codes, tf_ulp, tf_out, free_marks = [], [], [], {}
    t0 = time.perf_counter()
    for t in range(steps):
        x = inp.x[:, t].contiguous()
        dt = inp.dt[:, t].contiguous()
        bm, cm = inp.B[:, t].contiguous(), inp.C[:, t].contiguous()
        rs = engine_seed(seed, t) if case.sr else None
        snap_s = state.clone()
        snap_c = None if scale is None else scale.clone()
        seed_t = torch.tensor([rs], dtype=torch.int64, device=dev) if case.sr else None
        out = selective_state_update(
            state, x, dt[..., None].expand(bsz, heads, p), A3, bm, cm, D2,
            state_scale=scale, rand_seed=seed_t, algorithm="simple",
        )  # fmt: skip
        ref_args = (x, dt, inp.A, bm, cm, inp.D)
        out_tf = fi.selective_state_update_reference(snap_s, snap_c, *ref_args, rand_seed=rs)
        out_free = fi.selective_state_update_reference(free_state, free_scale, *ref_args, rand_seed=rs)
        tf_codes.append(frac_equal(state, snap_s))
        tf_ulp.append(frac_within_ulp(state, snap_s))
        tf_out.append(frac_equal(out, out_tf))
        if t + 1 in WRITE_MARKS:
            free_marks[t + 1] = {
                "codes": frac_equal(state, free_state),
                "scales": None if scale is None else frac_equal(scale, free_scale),
            }
        xt = x.float()
        s_ref, y_ref = mamba2_advance(s_ref, a_dec[:, t], inp.dt[:, t], xt, bx[:, t], cx[:, t], inp.D, xt)
        s_ideal, y_ideal = mamba2_advance(s_ideal, a_dec[:, t], inp.dt[:, t], xt, bx[:, t], cx[:, t], inp.D, xt)
        s_ideal = store(s_ideal, store.key(t))
        curves_out["real"].add(t + 1, out.float(), y_ref)
        curves_out["engine_ref"].add(t + 1, out_free.float(), y_ref)
        curves_out["ideal"].add(t + 1, fi.bf16(y_ideal), y_ref)
        curves_state["real"].add(t + 1, fi.dequantize_state(state, scale), s_ref)
        curves_state["engine_ref"].add(t + 1, fi.dequantize_state(free_state, free_scale), s_ref)
        curves_state["ideal"].add(t + 1, s_ideal, s_ref)
    _sync(dev)
    return {
        "case": case.name,
        **asdict(case),
        "seconds": time.perf_counter() - t0,
        "teacher_forced": {
            "codes_identical_mean": _mean(tf_codes),
            "codes_identical_min": min(tf_codes),
            "codes_within_ulp_mean": _mean(tf_ulp),
            "out_identical_mean": _mean(tf_out),
        },
        "free_running_at_write": free_marks,
        "out_curves": _summary(curves_out, window),
        "state_curves": _summary(curves_state, window),
    }


# --- fla fused recurrent GDN and KDA ----------------------------------------------------------------------

FLA_OPS = {"gdn": "fused_recurrent_gated_delta_rule", "kda": "fused_recurrent_kda"}


@dataclass(frozen=True)
class FlaCase:
    state: str  # fp32 | bf16
    steps: int = 256
    op: str = "gdn"  # gdn | kda (a key of FLA_OPS)

    @property
    def name(self) -> str:
        return f"fla {FLA_OPS[self.op]} {self.state}"


def run_fla_gdn(inp: GDNInputs, case: FlaCase, *, window: int = 64) -> dict:
    """fla's fused recurrent GDN decode, one token per call, state stored in `case.state` between calls.

    The kernel keeps the state in FP32 inside a call and returns it in FP32; the engine's cache stores
    it in its own dtype (a torch cast, RNE), which is what the loop does. Inputs: q/k [B, T, Hk, Dk],
    v [B, T, Hv, Dv], g/beta [B, T, Hv]; the state is [B, Hv, Dv, Dk] (fla's state_v_first layout).
    """
    if case.op != "gdn":
        raise ValueError(f"run_fla_gdn runs FlaCase op 'gdn', got {case.op!r} (use run_fla_kda for 'kda')")
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    def kernel(sl, state):
        return fused_recurrent_gated_delta_rule(
            inp.q[:, sl].float().contiguous(), inp.k[:, sl].float().contiguous(), inp.v[:, sl].float().contiguous(),
            g=inp.g[:, sl].float().contiguous(), beta=inp.beta[:, sl].float().contiguous(), scale=1.0,
            initial_state=state, output_final_state=True, state_v_first=True,
        )  # fmt: skip

    return _run_fla(inp, case, kernel, gdn_advance, gdn_decays(inp), window)


def run_fla_kda(inp: KDAInputs, case: FlaCase, *, window: int = 64) -> dict:
    """fla's fused recurrent KDA decode (`fla.ops.kda.fused_recurrent_kda`, fla 0.6.0), one token per call,
    state stored in `case.state` between calls, against `kda_advance` (the replay's KDA step).

    Inputs: q/k [B, T, Hk, Dk], v [B, T, Hv, Dv], g [B, T, Hv, Dk] (per-key-channel log decays), beta
    [B, T, Hv]; the state is [B, Hv, Dv, Dk]. The call follows fla 0.6.0 fla/ops/kda/fused_recurrent.py:
    g is the finished log decay (use_gate_in_kernel=False), beta is post-sigmoid
    (use_beta_sigmoid_in_kernel=False), q/k arrive L2-normalised and q already scaled by 1/sqrt(Dk) (KDAInputs),
    so use_qk_l2norm_in_kernel=False and scale=1.0; state_v_first=True matches our [Dv, Dk] layout. Inside a
    call the kernel keeps the state in FP32 (b_h), decays it by exp(g) per key channel, then applies the delta
    rule and y = S q, the order of `kda_advance`; the returned FP32 state is cast to the cache dtype (RNE).
    vLLM's Kimi-Linear decode (KimiGatedDeltaNetAttention._forward, calling its vendored
    vllm.third_party.flash_linear_attention.ops.kda.fused_recurrent_kda; seen through code search, version not
    pinned) instead passes raw q/k with use_qk_l2norm_in_kernel=True and lets the kernel store the state in place
    at ssm_state_indices, so a bf16 cache is written by Triton's fp32 -> bf16 store (also RNE), not a torch cast.
    """
    if case.op != "kda":
        raise ValueError(f"run_fla_kda runs FlaCase op 'kda', got {case.op!r} (use run_fla_gdn for 'gdn')")
    if not isinstance(inp, KDAInputs):
        raise ValueError(f"run_fla_kda takes KDAInputs (g [B, T, Hv, Dk]), got {type(inp).__name__}")
    from fla.ops.kda import fused_recurrent_kda

    def kernel(sl, state):
        return fused_recurrent_kda(
            inp.q[:, sl].float().contiguous(), inp.k[:, sl].float().contiguous(), inp.v[:, sl].float().contiguous(),
            g=inp.g[:, sl].float().contiguous(), beta=inp.beta[:, sl].float().contiguous(), scale=1.0,
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False, state_v_first=True,
        )  # fmt: skip

    return _run_fla(inp, case, kernel, kda_advance, kda_decays(inp), window)


def _run_fla(inp, case: FlaCase, kernel, advance, alpha: torch.Tensor, window: int) -> dict:
    """The shared decode loop of the fla cases: `kernel(step_slice, fp32 state)` -> (o [B, 1, Hv, Dv], fp32 state)
    against `advance` (gdn_advance / kda_advance) teacher-forced from the kernel's stored state, free-running in
    FP32 (the reference) and free-running with the state stored in `case.state` (the ideal emulation).
    alpha: exp(g), [B, T, Hv] (GDN) or [B, T, Hv, Dk] (KDA)."""
    if case.state not in ("fp32", "bf16"):
        raise ValueError(f"fla state {case.state!r}: accepted fp32, bf16")
    dev = inp.device
    bsz, steps, hv, dv, dk = inp.batch, min(inp.steps, case.steps), inp.num_heads, inp.rows, inp.state_dim
    sd = STATE_DTYPES[case.state]
    state = torch.zeros(bsz, hv, dv, dk, dtype=sd, device=dev)
    fmt = parse_format(case.state)
    store = StateStore(fmt, (bsz, hv, dv, dk), dev, 0)
    q = expand_groups(inp.q.float(), hv)
    k = expand_groups(inp.k.float(), hv)
    s_ref = torch.zeros(bsz, hv, dv, dk, device=dev)
    s_ideal = torch.zeros_like(s_ref)
    curves_out = {k_: Curve() for k_ in ("real", "ideal")}
    curves_state = {k_: Curve() for k_ in ("real", "ideal")}
    tf_state, tf_out = [], []
    t0 = time.perf_counter()
    for t in range(steps):
        o, ht = kernel(slice(t, t + 1), state.float().contiguous())
        args = (alpha[:, t], k[:, t], inp.v[:, t].float(), inp.beta[:, t].float(), q[:, t])
        # the ideal emulation advanced from the kernel's previous state (teacher-forced) and on its own
        s_tf, y_tf = advance(state.float(), *args)
        state = ht.to(sd)
        tf_state.append(frac_equal(state, store(s_tf, 0).to(sd)))
        tf_out.append(frac_equal(o[:, 0], y_tf))
        s_ref, y_ref = advance(s_ref, *args)
        s_ideal, y_ideal = advance(s_ideal, *args)
        s_ideal = store(s_ideal, 0)
        curves_out["real"].add(t + 1, o[:, 0], y_ref)
        curves_out["ideal"].add(t + 1, y_ideal, y_ref)
        curves_state["real"].add(t + 1, state.float(), s_ref)
        curves_state["ideal"].add(t + 1, s_ideal, s_ref)
    _sync(dev)
    return {
        "case": case.name,
        **asdict(case),
        "seconds": time.perf_counter() - t0,
        "teacher_forced": {"state_identical_mean": _mean(tf_state), "out_identical_mean": _mean(tf_out)},
        "out_curves": _summary(curves_out, window),
        "state_curves": _summary(curves_state, window),
    }


# --- compile everything first, in parallel ---------------------------------------------------------------


def prebuild(ckpt_cases, ssu_cases, heads: int, groups: int, device, max_workers: int = 8) -> dict:
    """Compile every FlashInfer module the cases need, in parallel threads (nvcc runs in subprocesses).

    A module already in the bundle's ahead-of-time folder (`lab.engines.aot`) loads without nvcc.
    """
    import importlib
    from concurrent.futures import ThreadPoolExecutor

    ck = importlib.import_module("flashinfer.mamba.checkpointing_ssu")  # the module, not the function
    get_selective_state_update_module = importlib.import_module(
        "flashinfer.mamba.selective_state_update"
    ).get_selective_state_update_module

    jobs = {f"ckpt {c.name} h{heads}g{groups}": (ck._get_module, ckpt_module_args(c, heads, groups)) for c in ckpt_cases}
    jobs.update({f"ssu {c.name}": (get_selective_state_update_module, ssu_module_args(c, device)) for c in ssu_cases})
    errors = {}
    t0 = time.perf_counter()

    def build(item):
        name, (fn, args) = item
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - a failed module skips its cases, reported by name
            errors[name] = str(err).strip().splitlines()[-1][:300] if str(err) else type(err).__name__

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        list(pool.map(build, jobs.items()))
    return {"modules": len(jobs), "seconds": time.perf_counter() - t0, "errors": errors}


# --- timing at Nemotron-3-Nano shapes ------------------------------------------------------------------


def _ckpt_timing_call(checkpointing_ssu, c: _Cache, inp: Mamba2Inputs, flush: bool):
    """A no-argument call of one decode step (prev_k = 16: flush; 8: no flush) for do_bench."""
    bsz, heads, p, n = c.state.shape
    x, dt = inp.x[:, :1].contiguous(), inp.dt[:, :1].contiguous()
    bm, cm = inp.B[:, :1].contiguous(), inp.C[:, :1].contiguous()
    dt4 = dt[..., None].expand(bsz, 1, heads, p)
    A3 = inp.A[:, None, None].expand(heads, p, n)
    D2 = inp.D[:, None].expand(heads, p)
    out = torch.empty_like(x)

    def call():
        c.pnat.fill_(16 if flush else 8)
        checkpointing_ssu(
            c.state, c.x, c.b, c.dt, c.start, c.pnat, x, dt4, A3, bm, cm, out, D=D2, state_scale=c.scale,
            algorithm="monolith",
        )  # fmt: skip

    return call


def _ssu_timing_call(selective_state_update, state: torch.Tensor, inp: Mamba2Inputs):
    bsz, heads, p, n = state.shape
    x, dt = inp.x[:, 0].contiguous(), inp.dt[:, 0].contiguous()
    bm, cm = inp.B[:, 0].contiguous(), inp.C[:, 0].contiguous()
    dt3 = dt[..., None].expand(bsz, heads, p)
    A3 = inp.A[:, None, None].expand(heads, p, n)
    D2 = inp.D[:, None].expand(heads, p)
    return lambda: selective_state_update(state, x, dt3, A3, bm, cm, D2, algorithm="simple")


def time_kernels(batches=(16, 128), device="cuda") -> list[dict]:
    """Median time of one real decode call per layer at Nemotron-3-Nano shapes (do_bench, ms -> us)."""
    import triton.testing
    from flashinfer.mamba import checkpointing_ssu, selective_state_update

    rows = []
    for bsz in batches:
        inp = nano_layer(bsz, 64, device)
        heads, p, n, groups = 64, 64, 128, 8
        for st in ("int8", "fp8_e4m3", "bf16", "fp32"):
            for flush in (False, True):
                c = _Cache(STATE_DTYPES[st], bsz, heads, groups, p, n, 17, device)
                c.state.copy_(torch.randn(c.state.shape, device=device).clamp(-100, 100).to(c.state.dtype))
                c.x.normal_()
                c.b.normal_()
                c.dt.uniform_(0.001, 0.1)
                call = _ckpt_timing_call(checkpointing_ssu, c, inp, flush)
                ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                rows.append({"kernel": CkptCase(st, 16).name, "batch": bsz, "flush": flush, "us": ms * 1e3})
        for st in ("bf16", "fp32"):
            state = torch.randn(bsz, heads, p, n, device=device).to(STATE_DTYPES[st])
            call = _ssu_timing_call(selective_state_update, state, inp)
            ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
            rows.append({"kernel": SsuCase(st).name, "batch": bsz, "flush": None, "us": ms * 1e3})
    return rows


def time_emulation(batch: int = 16, steps: int = 1024, device="cuda") -> list[dict]:
    """Fused emulation (Triton) per decode step at Nemotron-3-Nano shapes, for the same state formats."""
    from ssmquant.kernels import emulate_triton
    from ssmquant.replay import parse_variants

    inp = nano_layer(batch, steps, device)
    rows = []
    for spec in ("int8@replay16", "fp8_e4m3@replay16", "bf16@conventional", "fp32@conventional"):
        v = parse_variants([spec])
        emulate_triton(inp, v)  # compile
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        emulate_triton(inp, v)
        torch.cuda.synchronize()
        rows.append({"variant": spec, "batch": batch, "us_per_step": (time.perf_counter() - t0) / steps * 1e6})
    return rows


# --- driver ------------------------------------------------------------------------------------------------


def default_cases(steps: int, long_steps: int):
    """The case matrix, chosen to keep the number of JIT modules (~20 s of nvcc each) small: both MMA K
    atoms of the ring (max_window <= 8 and > 8), RNE and the reproduced SR stream, drafts, the 16/32-bit
    replay path, every selective_state_update storage dtype, and fla in fp32 / bf16 state."""
    ckpt = [CkptCase(st, w, steps=steps) for st in ("int8", "fp8_e4m3") for w in (4, 16)]
    ckpt += [CkptCase(st, 16, sr=True, steps=steps) for st in ("int8", "fp8_e4m3")]
    ckpt += [CkptCase("int8", 12, npred=4, steps=steps)]
    ckpt += [CkptCase(st, 16, steps=steps) for st in ("fp32", "bf16")]
    long = [CkptCase(st, 16, steps=long_steps) for st in ("int8", "fp8_e4m3")]
    ssu = [SsuCase(st, steps=steps) for st in ("fp32", "bf16", "int16")] + [SsuCase("fp16", True, steps)]
    fla = [FlaCase(st, steps, op) for op in ("gdn", "kda") for st in ("fp32", "bf16")]
    return ckpt, long, ssu, fla


def environment() -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["cuda"] = torch.version.cuda
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.engines.oracle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json")
    ap.add_argument("--steps", type=int, default=256, help="decode steps of the matrix of cases")
    ap.add_argument("--long-steps", type=int, default=4096, help="steps of the long int8 / fp8 L=16 runs")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--captured", type=Path, default=None, help="safetensors of captured tiny-model inputs")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument(
        "--only", choices=("all", "fla"), default="all",
        help="all: every case (the default); fla: only the fla GDN / KDA cases (no FlashInfer module is built)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": environment(), "engines": {}, "cases": [], "skipped": []}
    status = {name: engine_status(name) for name in ("flashinfer", "fla")}
    for name, st in status.items():
        results["engines"][name] = {"ok": st.ok, "version": st.version, "reason": st.reason}
        if not st.ok:
            print(f"[oracle] {name}: {st.reason}", flush=True)
    dev = torch.device("cuda")
    ckpt, long, ssu, fla = default_cases(args.steps, args.long_steps)
    captured = load_captured(args.captured, dev) if args.captured else {}

    def save():
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=_json_default) + "\n")

    def attempt(fn, inp, case, label=None):
        try:
            r = fn(inp, case)
            r["source"] = label or inp.meta.get("source", "synthetic")
            r["shape"] = [inp.batch, inp.num_heads, inp.rows, inp.state_dim]
            results["cases"].append(r)
            print(f"[oracle] {r['case']} ({r['source']}): {json.dumps(_headline(r), default=_json_default)}", flush=True)
        except Exception as err:  # noqa: BLE001 - one failed case must not stop the others
            msg = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err) else ''}"
            results["skipped"].append({"case": case.name, "reason": msg})
            print(f"[oracle] FAILED {case.name}: {msg}", flush=True)
        save()

    fi_ok, fla_ok = status["flashinfer"].ok and args.only == "all", status["fla"].ok
    if fi_ok:
        results["prebuild"] = prebuild(ckpt + long, ssu, 64, 8, dev)
        save()
        print(f"[oracle] prebuild: {results['prebuild']}", flush=True)
        inp = nano_layer(args.batch, max(args.steps, args.long_steps), dev)
        inp.meta["source"] = "synthetic nemotron-3-nano layer 0"
        for case in ckpt:
            attempt(run_checkpointing, inp, case)
        for case in ssu:
            attempt(run_ssu, inp, case)
    if fla_ok:
        from ssmquant.models.synthetic import synthetic_inputs

        # each fla op on its family's synthetic layer 0, then on the captured layers of its kind
        for op, run, preset, kind in (("gdn", run_fla_gdn, "qwen3.5-9b", GDNInputs),
                                      ("kda", run_fla_kda, "glm-5.3-flash", KDAInputs)):  # fmt: skip
            sinp = synthetic_inputs(preset, 0, batch=args.batch, steps=args.steps, device=dev)
            sinp.meta["source"] = f"synthetic {preset} layer 0"
            for case in (c for c in fla if c.op == op):
                attempt(run, sinp, case)
            for name, cinp in captured.items():
                if isinstance(cinp, kind):
                    for st in ("fp32", "bf16"):
                        attempt(run, cinp, FlaCase(st, cinp.steps, op), label=name)
    if fi_ok and not args.no_timing:
        try:
            results["timing"] = time_kernels(device=dev)
            results["timing_emulation"] = time_emulation(device=dev)
            print(f"[oracle] timing: {results['timing']} {results['timing_emulation']}", flush=True)
        except Exception as err:  # noqa: BLE001
            results["skipped"].append({"case": "timing", "reason": f"{type(err).__name__}: {err}"[:300]})
        save()
    if fi_ok:
        for case in long:
            attempt(run_checkpointing, inp, case)
        for name, cinp in captured.items():
            if isinstance(cinp, Mamba2Inputs):  # other heads / groups: one more JIT module
                results[f"prebuild_{name}"] = prebuild([CkptCase("int8", 16)], [], cinp.num_heads, cinp.num_groups, dev)
                attempt(run_checkpointing, cinp, CkptCase("int8", 16, steps=cinp.steps), label=name)
    save()
    print(f"[oracle] wrote {args.out / 'results.json'}: {len(results['cases'])} cases, {len(results['skipped'])} skipped")
    return 0


def _headline(r: dict) -> dict:
    tf = r.get("teacher_forced", {})
    return {
        "tf": {k: round(v, 5) for k, v in tf.items() if isinstance(v, float)},
        "free": r.get("free_running_at_write"),
        "out_gap": r["out_curves"]["max_rel_gap_vs_real"],
        "state_gap": r["state_curves"]["max_rel_gap_vs_real"],
        "s": round(r["seconds"], 1),
    }


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


def load_captured(path: Path, device) -> dict:
    """Captured layer inputs saved by `save_captured`: {name: Mamba2Inputs | GDNInputs | KDAInputs}."""
    from safetensors.torch import load_file

    flat = load_file(str(path), device=str(device))
    out: dict = {}
    names = sorted({k.split("/")[0] for k in flat})
    for name in names:
        t = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith(name + "/")}
        if "x" in t:
            out[name] = bf16_inputs(Mamba2Inputs(x=t["x"], dt=t["dt"], B=t["B"], C=t["C"], A=t["A"], D=t["D"]))
        else:  # a gate per key channel (g [B, T, Hv, Dk]) is KDA, one per head (g [B, T, Hv]) GDN
            cls = KDAInputs if t["g"].ndim == 4 else GDNInputs
            out[name] = cls(q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"]).validate()
        out[name].meta["source"] = name
    return out


def save_captured(layers: dict, path: Path) -> None:
    """Save {name: Mamba2Inputs | GDNInputs | KDAInputs} (initial state dropped) for `load_captured`."""
    from safetensors.torch import save_file

    flat = {}
    for name, inp in layers.items():
        keys = ("x", "dt", "B", "C", "A", "D") if isinstance(inp, Mamba2Inputs) else ("q", "k", "v", "g", "beta")
        for k in keys:
            flat[f"{name}/{k}"] = getattr(inp, k).detach().cpu().contiguous()
    save_file(flat, str(path))


if __name__ == "__main__":
    raise SystemExit(main())
