"""Does `checkpointing_ssu_reference` compute the same bits on CUDA as on the CPU? And where do its decode
scales part from the real kernel's? A diagnostic for the GPU oracle (issue #11).

    python -m lab.engines.scale_diag --out DIR [--dump FILE ...] [--cases int8:16 fp8_e4m3:16 ...]

Replaying FlashInfer's call-by-call dump on the CPU (`fit.replay_calls`) reproduces every decode scale and
FP32 state word, but the oracle (`oracle.run_checkpointing`, the reference on CUDA tensors next to the real
kernel) saw 2-7% of the scales differ. Either the reference gives other bits on CUDA than on the CPU, or
the oracle's calls reach something the dump never did (a zero initial cache; heads 16-63, whose A = -17..-64
the dump did not save). Four parts, everything into DIR/results.json:

  primitives  every helper of the reference (`hmma`, `fast_expf`, `rcp_approx`, `bf16`, `fma_f32`, `hs_scan`,
              `encode_rows_fast`, torch.ldexp as `hmma` uses it, einsum) on seeded random inputs on the
              device and on the CPU: the fraction of bit-identical results and the first differing value.
  dumps       each RNE case of each dump replayed through `fit.replay_calls` on the device (and on the CPU).
  oracle      the real kernel run like the oracle (the synthetic layer of `oracle.main`, zero initial cache,
              all 64 heads; `dump.dump_checkpointing`), each flush re-computed teacher-forced on the device
              and on CPU copies of the same snapshot: real-vs-device, real-vs-cpu, device-vs-cpu fractions
              of codes / FP32 state words and decode scales, mismatching scales per head, and per mismatching
              scale the offset (in ulps) of the row's amax that would give the kernel's scale. The calls are
              saved in the dump format (DIR/oracle_<case>.safetensors) for `python -m lab.engines.fit`.
  bisect      for the first flush where device and CPU differ (else the first where the kernel and the
              reference differ), the call re-run on both devices with every helper and torch op the reference
              uses traced (`OpTrace`); the first op whose outputs differ, with examples in hex.

Without a GPU the "device" is the CPU again (every device-vs-cpu fraction must be 1.0); without FlashInfer
the oracle part is skipped (tests put a stand-in kernel in its place).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ssmquant.engines import flashinfer as fi
from ssmquant.engines import mufu

from . import dump as dump_mod
from . import fit
from .oracle import STATE_DTYPES, CkptCase

# the helpers of the reference traced by `OpTrace` (module, attribute): module-level functions are looked up
# at call time, so patching the attribute reaches every call made inside the reference
TRACED = [(fi, n) for n in ("hs_scan", "fast_expf", "ex2_approx", "bf16", "hmma", "_exponent", "pow2_f64", "_rz_from_f64",
                            "fma_f32", "replay_8bit", "replay_wide", "rcp_approx", "encode_rows_fast", "round_codes")]  # fmt: skip
TRACED += [(mufu, n) for n in ("ex2_sm90", "rcp_sm90", "ieee_rcp", "_pow2_f32")]
TRACED += [(torch, n) for n in ("ldexp", "trunc", "einsum")]


# --- tracing --------------------------------------------------------------------------------------------


@dataclass
class Record:
    name: str
    depth: int
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


@dataclass
class OpTrace:
    """Context manager: every call of the `targets` (module, attribute) made inside is recorded in the order
    the calls return (inner ops before the op that called them), inputs and outputs copied to the CPU."""

    targets: list = field(default_factory=lambda: list(TRACED))
    records: list[Record] = field(default_factory=list)
    _saved: list = field(default_factory=list)
    _depth: int = 0

    def _wrap(self, name, fn):
        def traced(*args, **kwargs):
            self._depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self._depth -= 1
            ins = [t.detach().cpu().clone() for t in _tensors(list(args) + list(kwargs.values()))]
            outs = [t.detach().cpu().clone() for t in _tensors(out)]
            self.records.append(Record(name, self._depth, ins, outs))
            return out

        return traced

    def __enter__(self) -> OpTrace:
        mufu.sm90()  # the MUFU tables are built (on the CPU) once, outside every trace
        for mod, attr in self.targets:
            fn = getattr(mod, attr)
            self._saved.append((mod, attr, fn))
            setattr(mod, attr, self._wrap(f"{mod.__name__.rsplit('.', 1)[-1]}.{attr}", fn))
        return self

    def __exit__(self, *exc) -> None:
        for mod, attr, fn in reversed(self._saved):
            setattr(mod, attr, fn)
        self._saved.clear()


def _word(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a tensor's bits (floats by width; integers and bools as int64)."""
    if t.dtype.is_floating_point:
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.long()


def hexval(t: torch.Tensor) -> str:
    """One element as 'hex bits (value)'."""
    if t.dtype.is_floating_point:
        w = t.element_size() * 2
        bits = int(_word(t.reshape(1))[0]) & ((1 << (8 * t.element_size())) - 1)
        return f"{bits:0{w}x} ({float(t):.9g})"
    return str(int(t))


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Boolean mask of elements whose bits differ (a, b of one shape and dtype)."""
    return _word(a.cpu()) != _word(b.cpu())


def _examples(a: torch.Tensor, b: torch.Tensor, ins_a: list[torch.Tensor], k: int = 4) -> list[dict]:
    idx = torch.nonzero(bits_differ(a, b))[:k]
    out = []
    for i in idx.tolist():
        at = tuple(i)
        ex = {"at": list(at), "a": hexval(a[at]), "b": hexval(b[at])}
        vals = []
        for t in ins_a:
            try:
                vals.append(hexval(torch.broadcast_to(t, a.shape)[at]))
            except RuntimeError:  # an input of another shape (a table, a scalar list): summarised elsewhere
                continue
        if vals:
            ex["inputs_a"] = vals
        out.append(ex)
    return out


def first_divergence(ta: list[Record], tb: list[Record]) -> dict | None:
    """The first record (in completion order) whose outputs differ between two traces of one computation.

    Returns None when every output of every record is bit-identical; else {index, op, depth, inputs_identical,
    differing, of, shape, dtype, examples (a / b in hex with the op's inputs of trace a at that element)}.
    `inputs_identical` False means an op outside the traced set diverged before this one.
    """
    for i, (ra, rb) in enumerate(zip(ta, tb)):
        if ra.name != rb.name or len(ra.outputs) != len(rb.outputs):
            return {"index": i, "op": ra.name, "other_op": rb.name, "structure": "the traces call different ops"}
        for j, (oa, ob) in enumerate(zip(ra.outputs, rb.outputs)):
            if oa.shape != ob.shape or oa.dtype != ob.dtype:
                return {"index": i, "op": ra.name, "output": j, "structure": f"{tuple(oa.shape)} {oa.dtype} vs {tuple(ob.shape)} {ob.dtype}"}
            d = bits_differ(oa, ob)
            if bool(d.any()):
                same_in = len(ra.inputs) == len(rb.inputs) and all(
                    x.shape == y.shape and x.dtype == y.dtype and not bool(bits_differ(x, y).any())
                    for x, y in zip(ra.inputs, rb.inputs)
                )
                return {
                    "index": i, "op": ra.name, "depth": ra.depth, "output": j, "inputs_identical": same_in,
                    "differing": int(d.sum()), "of": d.numel(), "shape": list(oa.shape), "dtype": str(oa.dtype),
                    "examples": _examples(oa, ob, ra.inputs),
                }  # fmt: skip
    if len(ta) != len(tb):
        return {"index": min(len(ta), len(tb)), "structure": f"{len(ta)} vs {len(tb)} records"}
    return None


# --- primitives ---------------------------------------------------------------------------------------------


def _bf16_values(g: torch.Generator, shape, lo: int, hi: int) -> torch.Tensor:
    """Random bf16 values (as FP32) of both signs with exponents uniform in [lo, hi]."""
    e = torch.randint(lo, hi + 1, shape, generator=g).float()
    m = 1 + torch.randint(0, 128, shape, generator=g).float() / 128
    s = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return fi.bf16(s * m * torch.exp2(e))


def primitive_inputs(seed: int = 0, size: int = 16) -> dict[str, tuple]:
    """Seeded CPU inputs for each helper: {name: (fn, args)} (2^size scalar arguments, 2^size // 8 rows of
    128 to encode); each fn returns a tensor or a tuple."""
    g = torch.Generator().manual_seed(seed)
    n = 1 << size
    wide = (torch.rand(n, generator=g) * 2 - 1) * torch.exp2(torch.randint(-140, 127, (n,), generator=g).float())
    decay_args = -torch.exp2(torch.rand(n, generator=g) * 16 - 10)  # [-64, -2^-10]: every decay argument
    out_args = torch.cat([decay_args, decay_args.abs()[: n // 8]])  # positive ones too (masked in the kernel)
    a = _bf16_values(g, (8, 64, 16), -30, 4)  # replay operands: x * coef (wide), B
    b = _bf16_values(g, (8, 16, 128), -4, 2)
    c = (torch.randn(8, 64, 128, generator=g) * torch.exp2(torch.randint(-20, 4, (8, 64, 1), generator=g).float())).float()
    rows = torch.randn(n // 8, 128, generator=g) * torch.exp2(torch.randint(-30, 10, (n // 8, 1), generator=g).float())
    exps = torch.arange(-1100, 1024, dtype=torch.float64)
    dts = torch.rand(64, 16, generator=g) * 0.7
    return {
        "torch.ldexp(1, n), n in -1100..1023 (hmma's quantum before pow2_f64)": (lambda e: torch.ldexp(torch.ones((), dtype=torch.float64, device=e.device), e), (exps,)),
        "fast_expf (MUFU.EX2 of RN(v log2e))": (fi.fast_expf, (out_args,)),
        "rcp_approx (MUFU.RCP)": (fi.rcp_approx, (wide,)),
        "bf16 (RNE, subnormals too)": (fi.bf16, (wide,)),
        "fma_f32": (fi.fma_f32, (wide, wide.flip(0), wide.roll(7))),
        "hs_scan": (fi.hs_scan, (dts,)),
        "hmma, zero accumulator": (fi.hmma, (a, b)),
        "hmma, FP32 accumulator": (fi.hmma, (a, b, c)),
        "encode_rows_fast int8": (lambda r: fi.encode_rows_fast(r, torch.int8), (rows,)),
        "encode_rows_fast fp8_e4m3": (lambda r: fi.encode_rows_fast(r, torch.float8_e4m3fn), (rows,)),
        "einsum htn,hpn->htp (output path only)": (lambda x, y: torch.einsum("htn,hpn->htp", x, y), (b, c)),
    }  # fmt: skip


def audit_primitives(device: torch.device, seed: int = 0, size: int = 16) -> list[dict]:
    """Each helper on the device and on the CPU, same inputs: fraction of bit-identical outputs, first difference."""
    rows = []
    for name, (fn, args) in primitive_inputs(seed, size).items():
        ref = _tensors(fn(*args))
        got = [t.cpu() for t in _tensors(fn(*(x.to(device) for x in args)))]
        d = [bits_differ(x, y) for x, y in zip(ref, got)]
        n_diff, n = sum(int(m.sum()) for m in d), sum(m.numel() for m in d)
        row = {"op": name, "identical": 1 - n_diff / n, "differing": n_diff, "of": n}
        for x, y, m in zip(ref, got, d):
            if bool(m.any()):
                row["examples"] = _examples(y, x, [a.to(y.device) for a in args if a.shape == x.shape])
                break
        rows.append(row)
    return rows


# --- dumps ----------------------------------------------------------------------------------------------------


def _to(t: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in t.items()}


def replay_dump(path: Path, devices: list[torch.device]) -> list[dict]:
    """`fit.replay_calls` of every RNE checkpointing case of a dump, once per device."""
    cases, meta = dump_mod.load(path)
    out = []
    for key, info in meta["cases"].items():
        if info["kind"] != "ckpt" or info["case"]["sr"] or key not in cases:
            continue
        for dev in devices:
            t0 = time.perf_counter()
            r = fit.replay_calls(_to(cases[key], dev), info["case"])
            out.append({"dump": path.name, "case": key, "device": str(dev), **r, "seconds": time.perf_counter() - t0})
    return out


# --- oracle calls -------------------------------------------------------------------------------------------


def _ref_args(t: dict[str, torch.Tensor], c: int, state, scale, device, heads: slice | None = None, rows=None):
    """Arguments of `checkpointing_ssu_reference` for call c of a dump, teacher-forced: the state before the
    call, the kernel's ring before it (`snap{c}`), the host's start / pnat; optionally a head group and rows."""
    hpg = t["init/x_cache"].shape[1] // t["init/B_cache"].shape[1]
    hs = heads or slice(None)
    gs = slice(None) if heads is None else slice(heads.start // hpg, heads.stop // hpg)
    rs = slice(None) if rows is None else rows
    g = lambda k: t[k][rs].to(device)  # noqa: E731
    st = state[rs][:, hs].clone().to(device)
    sc = None if scale is None else scale[rs][:, hs].clone().to(device)
    return (
        st, sc, g(f"snap{c}/x_cache")[:, hs].clone(), g(f"snap{c}/B_cache")[:, gs].clone(), g(f"snap{c}/dt_cache")[:, hs].clone(),
        t["call/start_before"][c][rs].int().to(device), t["call/pnat_before"][c][rs].int().to(device),
        t["in/x"][c][rs][:, :, hs].to(device), t["in/dt"][c][rs][:, :, hs].to(device), t["A"][hs].to(device),
        t["in/B"][c][rs][:, :, gs].to(device), t["in/C"][c][rs][:, :, gs].to(device), t["D"][hs].to(device),
    )  # fmt: skip


@contextlib.contextmanager
def _capture_amax(sink: list):
    """Record the row amax every `encode_rows_fast` call of the reference encodes with ([H, P] per flushed row)."""
    enc = fi.encode_rows_fast

    def capture(s, dtype, chunk=None):
        sink.append(s.abs().amax(-1).cpu())
        return enc(s, dtype, chunk)

    fi.encode_rows_fast = capture
    try:
        yield sink
    finally:
        fi.encode_rows_fast = enc


def flush_states(t: dict[str, torch.Tensor], device) -> dict[int, tuple]:
    """Every flushing call of a dumped RNE case re-computed on `device`, teacher-forced:
    {call: (state [B, H, P, N], scale [B, H, P] | None, amax [B, H, P] of the replayed rows (NaN: no flush))}."""
    out = {}
    state, scale = t["init/state"], t.get("init/scale")
    for c in range(t["call/changed"].shape[0]):
        if f"snap{c}/state" not in t:
            continue
        args = _ref_args(t, c, state, scale, device)
        flushed = [b for b in range(args[0].shape[0]) if int(args[6][b]) + args[7].shape[1] > args[2].shape[2] - args[7].shape[1]]
        with _capture_amax([]) as seen:
            fi.checkpointing_ssu_reference(*args)
        amax = torch.full(args[0].shape[:3], float("nan"))
        for b, a in zip(flushed, seen):
            amax[b] = a
        out[c] = (args[0].cpu(), None if args[1] is None else args[1].cpu(), amax)
        state, scale = t[f"snap{c}/state"], t.get(f"snap{c}/scale")
    return out


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float().view(torch.int32).long() - b.float().view(torch.int32).long()).abs()


def implied_amax_offsets(amax: torch.Tensor, scale: torch.Tensor, qmax: float, reach: int = 16) -> torch.Tensor:
    """Per row: the k of smallest |k| in -reach..reach such that the kernel's scale rule (rcp(rcp(amax) QMAX))
    applied to amax moved by k ulps gives `scale`; reach + 1 where none does. amax, scale [R] FP32 (amax > 0)."""
    best = torch.full(amax.shape, reach + 1, dtype=torch.long)
    for k in sorted(range(-reach, reach + 1), key=lambda v: (abs(v), v)):
        a = (amax.float().view(torch.int32) + k).view(torch.float32)
        s = fi.rcp_approx(fi.rcp_approx(a) * qmax)
        hit = (s.view(torch.int32) == scale.view(torch.int32)) & (best > reach)
        best = torch.where(hit, k, best)
    return best


def compare_flushes(t: dict[str, torch.Tensor], case: dict, dev_states: dict, cpu_states: dict) -> dict:
    """real-vs-device, real-vs-cpu and device-vs-cpu fractions over the flushed rows; per-head scale mismatches."""
    eight = STATE_DTYPES[case["state"]] in fi.EIGHT_BIT
    heads = t["init/state"].shape[1]
    pairs = {"real_vs_device": ("real", "dev"), "real_vs_cpu": ("real", "cpu"), "device_vs_cpu": ("dev", "cpu")}
    acc = {p: {"el": 0, "el_ok": 0, "sc": 0, "sc_ok": 0, "sc_ulp": 0} for p in pairs}
    per_head = torch.zeros(heads, dtype=torch.long)
    per_flush, offsets, first = [], [], {}
    qmax = fi.QMAX.get(STATE_DTYPES[case["state"]])
    for c in sorted(cpu_states):
        rows = torch.nonzero(t["call/changed"][c].bool()).flatten().tolist()
        v = {"real": (t[f"snap{c}/state"], t.get(f"snap{c}/scale")), "dev": dev_states[c][:2], "cpu": cpu_states[c][:2]}
        flush = {"call": c, "rows": rows}
        for p, (x, y) in pairs.items():
            for b in rows:
                d = bits_differ(v[x][0][b], v[y][0][b])
                acc[p]["el"] += d.numel()
                acc[p]["el_ok"] += int((~d).sum())
                if eight:
                    sx, sy = v[x][1][b], v[y][1][b]
                    ds = bits_differ(sx, sy)
                    acc[p]["sc"] += ds.numel()
                    acc[p]["sc_ok"] += int((~ds).sum())
                    acc[p]["sc_ulp"] += int((_ulps(sx, sy) <= 1).sum())
                    flush[f"{p}_scales_differing"] = flush.get(f"{p}_scales_differing", 0) + int(ds.sum())
                    if ds.any() and p not in first:
                        h, r = map(int, torch.nonzero(ds)[0])
                        first[p] = {"call": c, "row": b, "head": h, "d_row": r}
                    if p == "real_vs_cpu":
                        per_head += ds.sum(-1)
                        if ds.any():  # how far the row's amax would have to move to give the kernel's scale
                            offsets.append(implied_amax_offsets(cpu_states[c][2][b][ds], sx[ds], qmax))
                else:
                    flush[f"{p}_words_differing"] = flush.get(f"{p}_words_differing", 0) + int(d.sum())
                    if d.any() and p not in first:
                        h, r, col = map(int, torch.nonzero(d)[0])
                        first[p] = {"call": c, "row": b, "head": h, "d_row": r, "col": col}
                    if p == "real_vs_cpu":
                        per_head += d.flatten(1).sum(-1)
        per_flush.append(flush)
    res = {"flushes": len(per_flush), "per_flush": per_flush, "first_mismatch": first}
    for p, a in acc.items():
        res[p] = {("codes_identical" if eight else "state_identical"): a["el_ok"] / max(a["el"], 1)}
        if eight:
            res[p].update(scales_identical=a["sc_ok"] / max(a["sc"], 1), scales_within_ulp=a["sc_ulp"] / max(a["sc"], 1))
    res["real_vs_cpu_mismatches_per_head"] = per_head.tolist()
    if offsets:
        o = torch.cat(offsets)
        res["real_vs_cpu_implied_amax_offset_ulps"] = {int(k): int(n) for k, n in zip(*torch.unique(o, return_counts=True))}
    return res


def bisect_call(t: dict[str, torch.Tensor], c: int, b: int, head: int, device) -> dict:
    """Call c, row b, the head group of `head`, traced on `device` and on the CPU: the first differing op."""
    hpg = t["init/x_cache"].shape[1] // t["init/B_cache"].shape[1]
    g0 = head // hpg * hpg
    heads = slice(g0, g0 + hpg)
    prev = [k for k in range(c) if f"snap{k}/state" in t]
    state = t[f"snap{prev[-1]}/state"] if prev else t["init/state"]
    scale = (t[f"snap{prev[-1]}/scale"] if prev else t["init/scale"]) if "init/scale" in t else None
    traces = []
    for dev in (torch.device("cpu"), device):
        args = _ref_args(t, c, state, scale, dev, heads=heads, rows=slice(b, b + 1))
        with OpTrace() as tr:
            fi.checkpointing_ssu_reference(*args)
        traces.append((tr.records, args[0].cpu(), None if args[1] is None else args[1].cpu()))
    (ta, sa, ca), (tb, sb, cb) = traces
    res = {"call": c, "row": b, "heads": [heads.start, heads.stop], "device": str(device), "records": len(ta)}
    res["first_divergence"] = first_divergence(ta, tb)
    real = t[f"snap{c}/state"][b, heads]
    res["state_real_vs_cpu_differing"] = int(bits_differ(real, sa[0]).sum())
    if ca is not None:
        rs = t[f"snap{c}/scale"][b, heads]
        d = bits_differ(rs, ca[0])
        res["scales_real_vs_cpu_differing"] = int(d.sum())
        res["scale_examples"] = [
            {"head": heads.start + h, "d_row": r, "real": hexval(rs[h, r]), "cpu": hexval(ca[0][h, r]),
             "device": hexval(cb[0][h, r]), "ulps": int(_ulps(rs[h, r], ca[0][h, r]))}
            for h, r in torch.nonzero(d)[:6].tolist()
        ]  # fmt: skip
    return res


def oracle_cases(specs: list[str], calls: int = 64) -> list[tuple[CkptCase, int]]:
    """'int8:16' / 'fp8_e4m3:4:48' / 'fp32:16:40' (STATE:MAX_WINDOW[:CALLS]) -> (RNE CkptCase, calls)."""
    out = []
    for s in specs:
        parts = s.split(":")
        try:
            st, w, n = parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else calls
            if len(parts) > 3:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"a case is STATE:MAX_WINDOW[:CALLS], e.g. int8:16 or fp32:16:40; got {s!r}") from None
        if st not in ("int8", "fp8_e4m3", "fp32", "bf16"):
            raise ValueError(f"checkpointing_ssu states are int8, fp8_e4m3, fp32, bf16; got {st!r}")
        out.append((CkptCase(st, w), n))
    return out


def run_oracle_case(case: CkptCase, calls: int, inp, device, out_dir: Path | None) -> tuple[dict, dict]:
    """The real kernel (`flashinfer.mamba.checkpointing_ssu`) on the oracle's layer from a zero cache, every
    flush re-computed on `device` and on the CPU. Returns (comparison, the dump-format tensors)."""
    s = dump_mod.DumpSettings(calls=calls, batch=inp.batch, heads_saved=dump_mod.HEADS)
    t0 = time.perf_counter()
    t = dump_mod.dump_checkpointing(case, s, device, inp=inp, zero_init=True)
    key = dump_mod.case_key(case)
    if STATE_DTYPES[case.state] is torch.float8_e4m3fn:  # saved as bytes (dump._cpu); the reference takes float8
        t = {k: v.view(torch.float8_e4m3fn) if k.endswith("state") and v.dtype is torch.uint8 else v for k, v in t.items()}
    info = {"case": {**case.__dict__}, "kind": "ckpt", "flushes": int(t["call/changed"].sum())}
    if out_dir is not None:
        from safetensors.torch import save_file

        meta = {"settings": {**s.__dict__}, "cases": {key: info}, "source": "scale_diag oracle run (zero init)"}
        save_file({f"{key}/{k}": v for k, v in dump_mod._cpu(t).items()}, str(out_dir / f"oracle_{key}.safetensors"), metadata={"fi_dump": json.dumps(meta)})
    t1 = time.perf_counter()
    dev_states = flush_states(t, device)
    t2 = time.perf_counter()
    cpu_states = flush_states(t, torch.device("cpu"))
    t3 = time.perf_counter()
    res = {"case": key, **compare_flushes(t, info["case"], dev_states, cpu_states)}
    res["seconds"] = {"kernel": t1 - t0, "device_ref": t2 - t1, "cpu_ref": t3 - t2}
    return res, t


@contextlib.contextmanager
def legacy_ldexp_quantum():
    """`hmma` as it was before `pow2_f64`: its quantum from torch.ldexp (x * pow(2, e)), to show on the GPU
    whether that op was the device-dependent one (the bisection then names it)."""
    exact = fi.pow2_f64
    fi.pow2_f64 = lambda e: torch.ldexp(torch.ones((), dtype=torch.float64, device=e.device), e.double())
    try:
        yield
    finally:
        fi.pow2_f64 = exact


# --- driver ---------------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[scale_diag] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.engines.scale_diag", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dump", type=Path, nargs="*", default=[], help="dumps to replay first (dump.py format)")
    ap.add_argument("--dump-after", type=Path, nargs="*", default=[], help="dumps to replay after the oracle part")
    ap.add_argument("--dump-cpu", action="store_true", help="also replay the --dump files on the CPU (not --dump-after)")
    ap.add_argument("--cases", nargs="*", default=["int8:4:40", "int8:16", "fp8_e4m3:16", "fp32:16:33"], metavar="STATE:L[:CALLS]",
                    help="oracle cases (batch 2, one token per call); 16/32-bit snapshots are 4x larger: fewer calls")
    ap.add_argument("--calls", type=int, default=64, help="calls of a case that names none")
    ap.add_argument("--layer-steps", type=int, default=4096, help="steps of the synthetic layer (oracle.main: --long-steps)")
    ap.add_argument("--no-bisect", action="store_true")
    ap.add_argument("--legacy-ldexp", default=None, metavar="STATE:L[:CALLS]",
                    help="one more case with hmma's quantum from torch.ldexp (the reference before pow2_f64), bisected")
    args = ap.parse_args(argv)
    try:
        cases = oracle_cases(args.cases, args.calls)
    except ValueError as err:
        ap.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res: dict = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    else:
        _log("no CUDA GPU: the 'device' is the CPU (every device-vs-cpu fraction must be 1.0)")

    def save():
        (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")

    t0 = time.perf_counter()
    res["primitives"] = audit_primitives(device)
    for r in res["primitives"]:
        _log(f"primitive {r['op']}: identical {r['identical']:.6f} ({r['differing']} of {r['of']} differ) {r.get('examples', [''])[0]}")
    save()
    res["dumps"] = []

    def replay(paths, cpu_too: bool):
        for path in paths:
            devs = [device] + ([torch.device("cpu")] if cpu_too and device.type != "cpu" else [])
            for r in replay_dump(path, devs):
                res["dumps"].append(r)
                _log(f"dump {r['dump']} {r['case']} on {r['device']}: " + json.dumps({k: v for k, v in r.items() if isinstance(v, float)}))
                save()

    replay(args.dump, args.dump_cpu)
    _log(f"{time.perf_counter() - t0:.1f} s")
    try:
        import flashinfer.mamba

        if device.type != "cuda" and getattr(flashinfer.mamba, "__file__", None):  # the package, not a stand-in
            raise RuntimeError("the real kernel needs a CUDA GPU")
    except Exception as err:  # noqa: BLE001 - the oracle part needs the real kernel; the rest stands alone
        res["oracle_skipped"] = f"no oracle part: flashinfer.mamba unusable here ({type(err).__name__}: {err})"
        _log(res["oracle_skipped"])
        replay(args.dump_after, False)
        save()
        return 1 if device.type == "cuda" else 0  # on the GPU the kernel is the point: fail loudly
    from .oracle import nano_layer

    inp = nano_layer(2, args.layer_steps, device)
    res["oracle"] = []
    bisected: set[str] = set()  # at most one bisection of each kind: device vs CPU, kernel vs reference
    for case, calls in cases:
        try:
            r, t = run_oracle_case(case, calls, inp, device, args.out)
        except Exception as err:  # noqa: BLE001 - one failed case is reported, the others still run
            msg = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err) else ''}"
            res["oracle"].append({"case": case.name, "failed": msg})
            _log(f"FAILED oracle {case.name}: {msg}")
            save()
            continue
        res["oracle"].append(r)
        head = {p: r[p] for p in ("real_vs_device", "real_vs_cpu", "device_vs_cpu")}
        _log(f"oracle {r['case']}: {r['flushes']} flushes {json.dumps(head)}")
        _log(f"  real-vs-cpu mismatches per head: {r['real_vs_cpu_mismatches_per_head']}")
        _log(f"  implied amax offsets (ulps: rows): {r.get('real_vs_cpu_implied_amax_offset_ulps')} first: {r['first_mismatch']}")
        save()
        for kind in ("device_vs_cpu", "real_vs_cpu"):
            first = r["first_mismatch"].get(kind)
            if args.no_bisect or first is None or kind in bisected:
                continue
            bisected.add(kind)
            r[f"bisect_{kind}"] = b = bisect_call(t, first["call"], first["row"], first["head"], device)
            _log(f"  bisect ({kind}) {r['case']}: {json.dumps(b)[:3000]}")
            save()
        _log(f"{time.perf_counter() - t0:.1f} s")
    if args.legacy_ldexp:
        case, calls = oracle_cases([args.legacy_ldexp], args.calls)[0]
        try:
            with legacy_ldexp_quantum():
                r, t = run_oracle_case(case, calls, inp, device, None)
                first = r["first_mismatch"].get("device_vs_cpu")
                if first is not None and not args.no_bisect:
                    r["bisect_device_vs_cpu"] = bisect_call(t, first["call"], first["row"], first["head"], device)
        except Exception as err:  # noqa: BLE001
            r = {"case": case.name, "failed": f"{type(err).__name__}: {str(err)[:300]}"}
            res["oracle"].append(r)
        res["legacy_ldexp"] = r
        _log(f"legacy (torch.ldexp quantum) {r['case']}: {json.dumps(r, default=str)[:3000]}")
        save()
    replay(args.dump_after, False)
    save()
    failed = [r["case"] for r in res["oracle"] if "failed" in r]
    _log(f"wrote {args.out / 'results.json'} in {time.perf_counter() - t0:.1f} s" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
