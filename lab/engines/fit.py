"""Which arithmetic does the real `checkpointing_ssu` flush use? Hypotheses measured on a kernel dump.

    python -m lab.engines.fit DUMP.safetensors [--json OUT.json]

DUMP is written on a GPU by `lab.engines.dump` (lab/gpu/fi_dump.sh). Every 8-bit flush of
the dump is re-computed teacher-forced (from the kernel's own stored state before the call and the ring
it read) under each hypothesis, and the stored decode scales and codes are compared bit for bit.

What the sources and the SASS fix (FlashInfer 0.7.2.post1, module built with FlashInfer's default
`-use_fast_math`; `cuobjdump -sass` of the ahead-of-time int8 max_window=16 module):
  - replay: `HMMA.16816.F32.BF16` from a zero accumulator (`clear(frag_h)`), then the old state is added
    with one `FFMA` per element: `fma(code, decode_scale * total_decay, mma)`;
  - encode = `MUFU.RCP(amax)` times QMAX (`FMUL`), stored decode = `MUFU.RCP(encode)`: approximate
    reciprocals (rcp.approx.ftz, at most 1 ulp), not IEEE divisions;
  - `__expf(v)` = `MUFU.EX2(v * 1.442695f)`.
The hypotheses vary what the sources do not fix: how the tensor core sums the 8 or 16 products of one
output (`sum`), and model the pieces above (`add`, `enc`, `exp`), each against the previous model.
`sum=hmma` is `flashinfer.hmma` (products aligned to the largest exponent sum, truncated 25 bits below it,
the exact sum truncated to FP32), `exp=mufu` / `enc=mufu` are the H200's MUFU.EX2 / MUFU.RCP bit for bit
(`mufu.ex2_sm90` / `mufu.rcp_sm90`, the shipped exact model): `PROFILE` is what the `flashinfer` profile
computes; `PREVIOUS` the model before the tables (2^x toward zero, RN(1/x)). The 16/32-bit cases (fp32 /
bf16 state) are measured too: there the stored state is the MMA's own result (accumulator = RN(state * total_decay)).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ssmquant.engines import flashinfer as fi
from ssmquant.engines import philox
from ssmquant.formats.codec import ieee_div

from .dump import fi_bits

LOG2E_F32 = float(torch.tensor(1.4426950408889634, dtype=torch.float32))


@dataclass(frozen=True)
class Hypothesis:
    sum: str = "seq"  # seq | exact_rn | exact_rz | align_rz<e> (aligned to the largest product, e extra bits) | hmma
    add: str = "mul_add"  # mul_add (code * ts, then + mma: two roundings) | fma (one rounding)
    enc: str = "div"  # div (QMAX / amax, IEEE) | rcp (QMAX * RN(1 / amax)) | mufu (MUFU.RCP, shipped) | rcptab (--mufu)
    exp: str = "exp"  # exp | ex2 (2 ** RN(v log2e), correctly rounded) | ex2rz (toward zero) | mufu (MUFU.EX2, shipped)
    #                   | ex2tab-<floor|ceil|nearest> (--mufu tables, the argument's rounding at 2^-24)

    @property
    def name(self) -> str:
        return f"sum={self.sum} add={self.add} enc={self.enc} exp={self.exp}"


def _rz_f32(v: torch.Tensor) -> torch.Tensor:
    """FP64 -> FP32 rounded toward zero."""
    f = v.float()
    over = f.double().abs() > v.abs()
    return torch.where(over, torch.nextafter(f, torch.zeros_like(f)), f)


def mma_sum(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """sum_k a[..., P, k] * b[..., k, N] -> FP32 [..., P, N] under a tensor-core summation model.

    a, b hold bf16 values (as FP32); their products are exact in FP32 and FP64.
    """
    if mode == "hmma":
        return fi.hmma(a, b)
    if mode == "seq":
        acc = torch.zeros(a.shape[:-1] + b.shape[-1:], dtype=torch.float32)
        for k in range(a.shape[-1]):
            acc = acc + a[..., :, k, None] * b[..., k, None, :]
        return acc
    prod = a.double()[..., :, None, :] * b.double().transpose(-1, -2)[..., None, :, :]  # [..., P, N, K]
    if mode == "exact_rn":
        return prod.sum(-1).float()
    if mode == "exact_rz":
        return _rz_f32(prod.sum(-1))
    if mode.startswith("align_rz"):
        extra = int(mode[len("align_rz") :])
        mag = prod.abs().amax(-1, keepdim=True)
        e = torch.floor(torch.log2(torch.where(mag > 0, mag, 1.0)))
        ulp = torch.exp2(e - 23 - extra)
        return _rz_f32((torch.trunc(prod / ulp) * ulp).sum(-1))
    raise ValueError(f"unknown sum mode {mode!r}; accepted: seq, exact_rn, exact_rz, align_rz<bits>, hmma")


PROFILE = Hypothesis("hmma", "fma", "mufu", "mufu")  # the arithmetic of the `flashinfer` profile
PREVIOUS = Hypothesis("hmma", "fma", "rcp", "ex2rz")  # the profile before MUFU was tabulated (2026-12-01, 03:00)


def _exp(v: torch.Tensor, mode: str, mufu: dict | None = None) -> torch.Tensor:
    if mode == "exp":
        return torch.exp(v)
    if mode == "ex2rz":
        return fi.ex2_rz(v.float() * LOG2E_F32)
    if mode == "mufu":
        return fi.fast_expf(v)
    if mode.startswith("ex2tab"):
        from .mufu_tabulate import ex2_from_table

        return ex2_from_table(v.float() * LOG2E_F32, _tables(mufu)["ex2_delta"], mode.split("-")[1])
    return torch.exp2((v.float() * LOG2E_F32).double()).float()


def _tables(mufu: dict | None) -> dict:
    if mufu is None:
        raise ValueError("the hypotheses rcptab / ex2tab need MUFU tables (--mufu TABLES.npz, `python -m lab.engines.mufu`)")
    return mufu


def replay_flush(h: Hypothesis, codes, dec, xs, bs, dts, A, mufu: dict | None = None):
    """One head group's replayed FP32 state and the new decode scale per row under `h`.

    codes [H, P, N] FP32 code values; dec [H, P]; xs [H, k, P]; bs [H, k, N]; dts [H, k]; A [H].
    """
    cum = A[:, None] * fi.hs_scan(dts)
    total = cum[:, -1]
    decay = _exp(total, h.exp, mufu)
    coef = _exp(total[:, None] - cum, h.exp, mufu) * dts  # [H, k]
    a = fi.bf16(xs * coef[..., None]).transpose(-1, -2)  # [H, P, k]
    mma = mma_sum(a, bs, h.sum)
    ts = (dec * decay[:, None])[..., None]  # [H, P, 1]
    if h.add == "fma":
        rep = (codes.double() * ts.double() + mma.double()).float()
    else:
        rep = codes * ts + mma
    amax = rep.abs().amax(-1)
    return rep, amax


def replay_wide(h: Hypothesis, s0, xs, bs, dts, A, mufu: dict | None = None):
    """One head group's 16/32-bit replay under `h` (FP32, before the store): the accumulator RN(s0 * decay)
    plus x_j bf16(B_j c_j); `sum=hmma` takes the accumulator into the alignment, the others add it last."""
    cum = A[:, None] * fi.hs_scan(dts)
    total = cum[:, -1]
    decay = _exp(total, h.exp, mufu)
    coef = _exp(total[:, None] - cum, h.exp, mufu) * dts
    b = fi.bf16(bs * coef[..., None])  # [H, k, N]
    c = s0 * decay[:, None, None]
    if h.sum == "hmma":
        return fi.hmma(xs.transpose(-1, -2), b, c)
    return c + mma_sum(xs.transpose(-1, -2), b, h.sum)


def encode(h: Hypothesis, rep, amax, qmax: float, mufu: dict | None = None):
    zero = amax == 0
    safe = torch.where(zero, 1.0, amax)
    if h.enc == "rcptab":
        from .mufu_tabulate import rcp_from_table

        tab = _tables(mufu)["rcp_delta"]
        enc = torch.where(zero, 1.0, rcp_from_table(safe, tab) * qmax)
        return enc, rcp_from_table(enc, tab)
    if h.enc == "mufu":
        enc = torch.where(zero, 1.0, fi.rcp_approx(safe) * qmax)
        return enc, fi.rcp_approx(enc)
    if h.enc == "rcp":
        enc = torch.where(zero, 1.0, ieee_div(1.0, safe) * qmax)
    else:
        enc = torch.where(zero, 1.0, ieee_div(qmax, safe))
    return enc, ieee_div(1.0, enc)


def flushes(t: dict[str, torch.Tensor], case: dict):
    """Every (call, row) flush of one dumped 8-bit case: (before codes, before scale, ring rows..., after)."""
    window, tn = case["window"], case["npred"]
    ring = window + tn
    st, sc = t["init/state"], t.get("init/scale")
    calls = t["call/changed"].shape[0]
    for c in range(calls):
        if f"snap{c}/state" not in t:
            continue
        for b in range(st.shape[0]):
            if not t["call/changed"][c, b]:
                continue
            k, start = int(t["call/pnat_before"][c, b]), int(t["call/start_before"][c, b])
            rows = [(start + j) % ring for j in range(k)]
            hs = st.shape[1]
            hpg = hs // t[f"snap{c}/B_cache"].shape[1]
            yield {
                "call": c,
                "row": b,
                "codes": st[b].float(),
                "dec": None if sc is None else sc[b],
                "xs": t[f"snap{c}/x_cache"][b][:, rows].float(),
                "bs": t[f"snap{c}/B_cache"][b][:, rows].float().repeat_interleave(hpg, 0),
                "dts": t[f"snap{c}/dt_cache"][b][:, rows].float(),
                "state_after": t[f"snap{c}/state"][b],
                "scale_after": None if sc is None else t[f"snap{c}/scale"][b],
                "seed": int(t["call/seed"][c]),
            }
        st, sc = t[f"snap{c}/state"], None if sc is None else t[f"snap{c}/scale"]


def _ulp_close(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs() <= 1


def measure(cases: dict, meta: dict, hyps: list[Hypothesis], mufu: dict | None = None) -> list[dict]:
    """Bit-identical fractions of scales and codes per 8-bit case and hypothesis (teacher-forced flushes)."""
    rows = []
    for key, info in meta["cases"].items():
        case = info["case"]
        if info["kind"] != "ckpt" or key not in cases:
            continue
        if case["state"] in ("fp32", "bf16"):
            rows += _measure_wide(cases[key], key, case, hyps, mufu)
            continue
        if case["state"] not in ("int8", "fp8_e4m3"):
            continue
        t = cases[key]
        dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[case["state"]]
        qmax = fi.QMAX[dtype]
        recs = list(flushes(t, case))
        for h in hyps:
            n_sc = eq_sc = ulp_sc = n_codes = eq_codes = 0
            for r in recs:
                rep, amax = replay_flush(h, r["codes"], r["dec"], r["xs"], r["bs"], r["dts"], t["A"], mufu)
                enc, dec = encode(h, rep, amax, qmax, mufu)
                chunk = None
                if case["sr"]:
                    hs, p, n = rep.shape
                    words = philox.checkpoint_8bit_words(r["seed"], (1, meta["heads"], p, n), 10, first_slot=r["row"])
                    chunk = words[0, :hs]
                codes = fi.round_codes(rep * enc[..., None], dtype, chunk)
                eq_sc += int((dec == r["scale_after"]).sum())
                ulp_sc += int(_ulp_close(dec, r["scale_after"]).sum())
                n_sc += dec.numel()
                got = r["state_after"].view(torch.uint8) if dtype is torch.float8_e4m3fn else r["state_after"]
                mine = codes.to(dtype)
                mine = mine.view(torch.uint8) if dtype is torch.float8_e4m3fn else mine
                eq_codes += int((mine == got).sum())
                n_codes += mine.numel()
            rows.append({
                "case": key, "hypothesis": asdict(h), "name": h.name, "flushes": len(recs),
                "scales_identical": eq_sc / max(n_sc, 1), "scales_within_ulp": ulp_sc / max(n_sc, 1),
                "codes_identical": eq_codes / max(n_codes, 1),
            })  # fmt: skip
    return rows


def _measure_wide(t: dict, key: str, case: dict, hyps: list[Hypothesis], mufu: dict | None = None) -> list[dict]:
    """State words of the 16/32-bit flushes bit-identical / within one ulp, per hypothesis."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case["state"]]
    word = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    recs = list(flushes(t, case))
    rows = []
    for h in hyps:
        n = eq = ulp = 0
        for r in recs:
            mine = replay_wide(h, r["codes"], r["xs"], r["bs"], r["dts"], t["A"], mufu).to(dtype).view(word).long()
            got = r["state_after"].view(word).long()
            eq += int((mine == got).sum())
            ulp += int(((mine - got).abs() <= 1).sum())
            n += mine.numel()
        rows.append({
            "case": key, "hypothesis": asdict(h), "name": h.name, "flushes": len(recs),
            "state_identical": eq / max(n, 1), "state_within_ulp": ulp / max(n, 1),
        })  # fmt: skip
    return rows


def replay_calls(t: dict[str, torch.Tensor], case: dict) -> dict:
    """Every call of one dumped checkpointing case re-run through `flashinfer.checkpointing_ssu_reference`.

    Teacher-forced: each call starts from the kernel's stored state and scales before it, the ring and
    the host's start / pnat the kernel had (the ring the re-computation wrote is compared with the
    kernel's at every flush first). Returns the fractions of: flush decisions that agree, rings identical,
    stored codes (8-bit) or state words (16/32-bit) identical after the flushes, decode scales identical /
    within one ulp, bf16 outputs identical / within one bf16 ulp. Stochastic-rounding cases are refused:
    their Philox offsets need the full layer's heads, which a dump does not keep.
    """
    from .oracle import STATE_DTYPES

    if case["sr"]:
        raise ValueError("replay_calls: stochastic-rounding cases need the full layer's heads (Philox offsets)")
    dtype = STATE_DTYPES[case["state"]]
    window, tn = case["window"], case["npred"]
    state = t["init/state"].clone()
    scale = t["init/scale"].clone() if "init/scale" in t else None
    caches = {k: t[f"init/{k}"].clone() for k in ("x_cache", "B_cache", "dt_cache")}
    n = {k: 0 for k in ("calls", "flush_ok", "rings", "ring_ok", "el", "el_ok", "sc", "sc_ok", "sc_ulp", "y", "y_ok", "y_ulp")}
    for c in range(t["call/changed"].shape[0]):
        snap = f"snap{c}/state" in t
        if snap:  # the kernel's ring before this flushing call
            for k, v in caches.items():
                n["rings"] += 1
                n["ring_ok"] += int(torch.equal(v, t[f"snap{c}/{k}"]))
                v.copy_(t[f"snap{c}/{k}"])
        start, pnat = t["call/start_before"][c].int(), t["call/pnat_before"][c].int()
        y = fi.checkpointing_ssu_reference(
            state, scale, caches["x_cache"], caches["B_cache"], caches["dt_cache"], start, pnat.clone(),
            t["in/x"][c], t["in/dt"][c], t["A"], t["in/B"][c], t["in/C"][c], t["D"],
        )  # fmt: skip
        changed = t["call/changed"][c].bool()
        n["calls"] += changed.numel()
        n["flush_ok"] += int(((pnat + tn > window) == changed).sum())
        if snap:
            for b in torch.nonzero(changed).flatten().tolist():
                mine, got = fi_bits(state[b]).long(), fi_bits(t[f"snap{c}/state"][b]).long()
                n["el"] += mine.numel()
                n["el_ok"] += int((mine == got).sum())
                if scale is not None:
                    a, g = scale[b].view(torch.int32).long(), t[f"snap{c}/scale"][b].view(torch.int32).long()
                    n["sc"] += a.numel()
                    n["sc_ok"] += int((a == g).sum())
                    n["sc_ulp"] += int(((a - g).abs() <= 1).sum())
            state.copy_(t[f"snap{c}/state"])
            if scale is not None:
                scale.copy_(t[f"snap{c}/scale"])
        ya, yg = y.view(torch.int16).long(), t["out"][c].view(torch.int16).long()
        n["y"] += ya.numel()
        n["y_ok"] += int((ya == yg).sum())
        n["y_ulp"] += int(((ya - yg).abs() <= 1).sum())
    out = {"calls": n["calls"], "flush_decisions": n["flush_ok"] / n["calls"], "rings_identical": n["ring_ok"] / max(n["rings"], 1),
           "flush_rows": n["el"] // (state.shape[-1] * state.shape[-2] * state.shape[-3])}  # fmt: skip
    key = "codes_identical" if dtype in fi.EIGHT_BIT else "state_identical"
    out[key] = n["el_ok"] / max(n["el"], 1)
    if scale is not None:
        out["scales_identical"], out["scales_within_ulp"] = n["sc_ok"] / max(n["sc"], 1), n["sc_ulp"] / max(n["sc"], 1)
    out["outputs_identical"], out["outputs_within_ulp"] = n["y_ok"] / n["y"], n["y_ulp"] / n["y"]
    return out


def flush_rule(cases: dict, meta: dict) -> list[dict]:
    """Per checkpointing case: how often each candidate rule predicts the flushes the kernel made."""
    out = []
    rules = {
        "pnat + T > max_window (kernel source)": lambda k, w, tn: k + tn > w,
        "pnat + 2T > max_window": lambda k, w, tn: k + 2 * tn > w,
        "pnat + T >= max_window": lambda k, w, tn: k + tn >= w,
    }
    for key, info in meta["cases"].items():
        if info["kind"] != "ckpt" or key not in cases:
            continue
        t, case = cases[key], info["case"]
        got = t["call/changed"].bool()
        k = t["call/pnat_before"]
        res = {"case": key, "calls": int(got.numel()), "flushes": int(got.sum())}
        for name, rule in rules.items():
            res[name] = float((rule(k, case["window"], case["npred"]) == got).float().mean())
        out.append(res)
    return out


def default_hypotheses() -> list[Hypothesis]:
    sums = ("seq", "exact_rn", "exact_rz", "align_rz0", "align_rz1", "align_rz2", "align_rz3", "hmma")
    exps = ("exp", "ex2", "ex2rz")
    grid = [Hypothesis(s, a, e, x) for s, a, e, x in itertools.product(sums, ("mul_add", "fma"), ("div", "rcp"), exps)]
    return grid + [PROFILE]


def main(argv: list[str] | None = None) -> int:
    from .dump import HEADS, load

    ap = argparse.ArgumentParser(prog="python -m lab.engines.fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="the first model, the previous profile, the profile, and 3 other sum models")
    ap.add_argument("--mufu", type=Path, default=None,
                    help="MUFU tables (python -m lab.engines.mufu on a GPU): only the profile and its tabulated variants")
    ap.add_argument("--calls", action="store_true", help="also replay every call of the RNE cases (fit.replay_calls)")
    args = ap.parse_args(argv)
    cases, meta = load(args.dump)
    meta.setdefault("heads", HEADS)
    hyps = default_hypotheses()
    if args.quick:
        hyps = [Hypothesis(), PREVIOUS, PROFILE] + [Hypothesis(s, "fma", "mufu", "mufu") for s in ("seq", "exact_rn", "align_rz2")]
    mufu = None
    if args.mufu:
        from .mufu_tabulate import load_tables

        mufu = load_tables(args.mufu)
        print(json.dumps({"mufu_checks": mufu.pop("checks")}))
        hyps = [PREVIOUS, PROFILE] + [Hypothesis("hmma", "fma", "rcptab", f"ex2tab-{m}") for m in ("floor", "ceil", "nearest")]
    rule = flush_rule(cases, meta)
    for r in rule:
        print(json.dumps(r))
    rows = measure(cases, meta, hyps, mufu)
    calls = []
    if args.calls:
        for key, info in meta["cases"].items():
            if info["kind"] == "ckpt" and not info["case"]["sr"] and key in cases:
                calls.append({"case": key, **replay_calls(cases[key], info["case"])})
                print(json.dumps(calls[-1]))
    for r in sorted(rows, key=lambda r: (r["case"], -r.get("scales_identical", r.get("state_identical", 0)))):
        if "state_identical" in r:
            print(f"{r['case']:24s} {r['name']:55s} state {r['state_identical']:.4f} (<=1ulp {r['state_within_ulp']:.4f})")
            continue
        print(f"{r['case']:24s} {r['name']:55s} scales {r['scales_identical']:.4f} (<=1ulp {r['scales_within_ulp']:.4f}) "
              f"codes {r['codes_identical']:.5f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"flush_rule": rule, "hypotheses": rows, "calls": calls}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
