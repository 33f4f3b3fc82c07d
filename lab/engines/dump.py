"""Dump what the real FlashInfer Mamba-2 decode kernels compute, call by call, for offline re-computation.

    python -m lab.engines.dump --out FILE.safetensors [--calls 50] [--heads-saved 16]

Needs a CUDA GPU and FlashInfer 0.7.2.post1 (the engine bundle, `lab.engines.bundle`; with the
ahead-of-time modules of `lab.engines.aot` it runs with FLASHINFER_DISABLE_JIT=1). Every case uses
one of the module configurations `aot.py` builds (listed in `CKPT_CASES` / `SSU_CASES`).

For every case the kernel runs `calls` times on a synthetic Nemotron-3-Nano layer (batch 2, 64 heads x
64 x 128, 8 groups) from a random, non-zero initial cache. Saved (heads 0..heads_saved-1 and their groups
only: heads are independent in both kernels, so this is everything needed to re-compute those heads):

  {case}/init/{state,scale,x_cache,B_cache,dt_cache,start,pnat}   the cache before the first call
  {case}/in/{x,dt,B,C}            [calls, batch, T, ...] the inputs of every call (dt already softplus'ed:
                                  the kernel's dt_softplus is off, no dt_bias, no z)
  {case}/A, {case}/D              [heads] fp32
  {case}/call/{seed,accept,pnat_before,start_before,pnat_after,start_after,changed}  [calls(, batch)] int64
  {case}/out                      [calls, batch, T, heads_saved, P] the kernel's output (bf16)
  {case}/snap{c}/{state,scale,x_cache,B_cache,dt_cache}   for every call c that changed the stored state
                                  of some batch row: the ring before call c and the state after it

`changed[c, b]` is 1 where call c rewrote row b's checkpoint (codes or scale differ): the flush the kernel
actually made, against which the flush rule is checked. The host bookkeeping follows the kernel's
checkpointing_ssu docstring (flashinfer/mamba/checkpointing_ssu.py): after a flushing call the ring start
moves by prev_k and pnat becomes the accepted count, otherwise pnat grows by it.

selective_state_update cases ("ssu ...") save the state after every call (heads 0..ssu_heads_saved-1).
The file's metadata holds the case list and the settings as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ssmquant.engines.philox import engine_seed
from ssmquant.kinds import Mamba2Inputs

from .oracle import STATE_DTYPES, CkptCase, SsuCase, _Cache, ckpt_module_args, nano_layer, ssu_module_args

HEADS, GROUPS, P, N = 64, 8, 64, 128

# Each configuration is one of the 14 modules `lab.engines.aot` prebuilds (bundle/flashinfer/data/aot):
#   checkpointing_ssu_s_{i8,e4m3}_..._np_1_mw_{4,16}_hpg_8_ng_8_sc_f32, ..._mw_16_..._sc_f32_pr_10 (SR),
#   checkpointing_ssu_s_i8_..._np_4_mw_12_..._sc_f32 (drafts), checkpointing_ssu_s_{f32,bf16}_..._mw_16_...,
#   selective_state_update_s_{f32,bf16,i16,f16 pr_10}_..._sm90.
CKPT_CASES = (
    CkptCase("int8", 4),
    CkptCase("int8", 16),
    CkptCase("fp8_e4m3", 4),
    CkptCase("fp8_e4m3", 16),
    CkptCase("int8", 16, sr=True),
    CkptCase("fp8_e4m3", 16, sr=True),
    CkptCase("int8", 12, npred=4),
    CkptCase("fp32", 16),
    CkptCase("bf16", 16),
)
SSU_CASES = (SsuCase("fp32"), SsuCase("fp16", sr=True), SsuCase("bf16"), SsuCase("int16"))


@dataclass(frozen=True)
class DumpSettings:
    calls: int = 50
    ssu_calls: int = 12
    batch: int = 2
    heads_saved: int = 16
    ssu_heads_saved: int = 4
    seed: int = 1
    input_seed: int = 0


def case_key(case) -> str:
    """A safetensors-safe key for a case: 'ckpt_int8_L16', 'ckpt_int8_sr_L16', 'ckpt_int8_L12_T4', 'ssu_fp16_sr'."""
    if isinstance(case, CkptCase):
        return f"ckpt_{case.state}{'_sr' if case.sr else ''}_L{case.window}" + (f"_T{case.npred}" if case.npred > 1 else "")
    return f"ssu_{case.state}{'_sr' if case.sr else ''}"


def accept_counts(case: CkptCase, calls: int, batch: int) -> torch.Tensor:
    """[calls, batch] accepted tokens per call and row: all T without drafts, seeded 1..T per row with them."""
    if case.npred == 1:
        return torch.ones(calls, batch, dtype=torch.int64)
    g = torch.Generator().manual_seed(1000 + case.accept_seed)
    return torch.randint(1, case.npred + 1, (calls, batch), generator=g)


def initial_cache(case: CkptCase, batch: int, device, gen: torch.Generator) -> _Cache:
    """A non-zero cache: random codes and scales (8-bit) or values (16/32-bit); an empty ring."""
    sd = STATE_DTYPES[case.state]
    c = _Cache(sd, batch, HEADS, GROUPS, P, N, case.window + case.npred, device)
    v = torch.randn(batch, HEADS, P, N, generator=gen)
    if sd is torch.int8:
        c.state.copy_((v * 40).round().clamp(-127, 127).to(sd))
    elif sd is torch.float8_e4m3fn:
        c.state.copy_((v * 100).clamp(-448, 448).to(sd))
    else:
        c.state.copy_((v * 0.5).to(sd))
    if c.scale is not None:
        c.scale.copy_(torch.rand(batch, HEADS, P, generator=gen) * 0.02 + 1e-3)
    return c


def _cache_tensors(c: _Cache, hs: int) -> dict[str, torch.Tensor]:
    gs = max(1, hs * GROUPS // HEADS)
    out = {"state": c.state[:, :hs], "x_cache": c.x[:, :hs], "B_cache": c.b[:, :gs], "dt_cache": c.dt[:, :hs]}
    if c.scale is not None:
        out["scale"] = c.scale[:, :hs]
    return out


def _cpu(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # float8 is stored as its bytes (uint8 view): safetensors handles F8_E4M3, but a byte view reads anywhere
    return {k: (v.view(torch.uint8) if v.dtype is torch.float8_e4m3fn else v).detach().cpu().contiguous() for k, v in d.items()}


def dump_checkpointing(
    case: CkptCase, s: DumpSettings, device, inp: Mamba2Inputs | None = None, zero_init: bool = False
) -> dict[str, torch.Tensor]:
    """Run the real `checkpointing_ssu` `s.calls` times; the tensors to save (keys without the case prefix).

    inp: the layer's inputs (a synthetic Nemotron-3-Nano layer of just enough steps when None; given ones
    need s.batch rows, the 64 x 64 x 128 heads and enough steps). zero_init: start from the oracle's cache
    (codes 0, decode scales 1, `oracle.run_checkpointing`) instead of a random non-zero one.
    """
    from flashinfer.mamba import checkpointing_ssu

    bsz, tn, hs = s.batch, case.npred, s.heads_saved
    gs = hs * GROUPS // HEADS
    ring = case.window + tn
    acc = accept_counts(case, s.calls, bsz)
    need = int(acc.sum(0).max()) + tn + 1
    if inp is None:
        inp = nano_layer(bsz, need, device, seed=s.input_seed)
    elif (inp.batch, inp.num_heads, inp.rows, inp.state_dim) != (bsz, HEADS, P, N) or inp.steps < need:
        raise ValueError(
            f"dump_checkpointing needs inputs of batch {bsz}, {HEADS} heads x {P} x {N} and >= {need} steps, "
            f"got batch {inp.batch}, {inp.num_heads} x {inp.rows} x {inp.state_dim}, {inp.steps} steps"
        )
    if zero_init:
        c = _Cache(STATE_DTYPES[case.state], bsz, HEADS, GROUPS, P, N, ring, device)
    else:
        c = initial_cache(case, bsz, device, torch.Generator().manual_seed(7 + case.window + 100 * tn))
    out_t: dict[str, torch.Tensor] = {f"init/{k}": v.clone() for k, v in _cache_tensors(c, hs).items()}
    out_t["init/start"], out_t["init/pnat"] = c.start.clone(), c.pnat.clone()
    A3 = inp.A.float()[:, None, None].expand(HEADS, P, N)
    D2 = inp.D.float()[:, None].expand(HEADS, P)
    pos = [0] * bsz
    xs, dts, bs, cs, outs, seeds, changed, pb, sb, pa, sa = ([] for _ in range(11))
    for call in range(s.calls):
        x = torch.stack([inp.x[b, pos[b] : pos[b] + tn] for b in range(bsz)]).contiguous()
        dt = torch.stack([inp.dt[b, pos[b] : pos[b] + tn] for b in range(bsz)]).contiguous()
        bm = torch.stack([inp.B[b, pos[b] : pos[b] + tn] for b in range(bsz)]).contiguous()
        cm = torch.stack([inp.C[b, pos[b] : pos[b] + tn] for b in range(bsz)]).contiguous()
        rs = engine_seed(s.seed, call) if case.sr else None
        seed_t = torch.tensor([rs], dtype=torch.int64, device=device) if case.sr else None
        before = {k: v.clone() for k, v in _cache_tensors(c, hs).items()}
        st0, sc0 = c.state.clone(), None if c.scale is None else c.scale.clone()
        pb.append(c.pnat.clone())
        sb.append(c.start.clone())
        out = torch.empty_like(x)
        checkpointing_ssu(
            c.state, c.x, c.b, c.dt, c.start, c.pnat, x, dt[..., None].expand(bsz, tn, HEADS, P),
            A3, bm, cm, out, D=D2, state_scale=c.scale, rand_seed=seed_t, algorithm="monolith",
        )  # fmt: skip
        pa.append(c.pnat.clone())
        sa.append(c.start.clone())
        ch = (fi_bits(c.state) != fi_bits(st0)).flatten(1).any(1)
        if sc0 is not None:
            ch |= (c.scale != sc0).flatten(1).any(1)
        changed.append(ch)
        if bool(ch.any()):
            for k in ("x_cache", "B_cache", "dt_cache"):
                out_t[f"snap{call}/{k}"] = before[k]
            out_t[f"snap{call}/state"] = c.state[:, :hs].clone()
            if c.scale is not None:
                out_t[f"snap{call}/scale"] = c.scale[:, :hs].clone()
        xs.append(x[:, :, :hs])
        dts.append(dt[:, :, :hs])
        bs.append(bm[:, :, :gs])
        cs.append(cm[:, :, :gs])
        outs.append(out[:, :, :hs])
        seeds.append(rs if rs is not None else -1)
        # host bookkeeping (flashinfer/mamba/checkpointing_ssu.py docstring), driven by the kernel's own flush
        for b in range(bsz):
            k_prev, a = int(c.pnat[b]), int(acc[call, b])
            if bool(ch[b]):
                c.start[b] = (int(c.start[b]) + k_prev) % ring
                c.pnat[b] = a
            else:
                c.pnat[b] = k_prev + a
            pos[b] += a
    out_t.update({
        "in/x": torch.stack(xs), "in/dt": torch.stack(dts), "in/B": torch.stack(bs), "in/C": torch.stack(cs),
        "A": inp.A.float()[:hs].clone(), "D": inp.D.float()[:hs].clone(), "out": torch.stack(outs),
        "call/seed": torch.tensor(seeds, dtype=torch.int64), "call/accept": acc,
        "call/changed": torch.stack(changed).long(), "call/pnat_before": torch.stack(pb).long(),
        "call/start_before": torch.stack(sb).long(), "call/pnat_after": torch.stack(pa).long(),
        "call/start_after": torch.stack(sa).long(),
    })  # fmt: skip
    return _cpu(out_t)


def fi_bits(t: torch.Tensor) -> torch.Tensor:
    """A bit view of a state tensor (float8 / 16 / 32-bit floats as integers) for change detection."""
    if not t.dtype.is_floating_point:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def dump_ssu(case: SsuCase, s: DumpSettings, device) -> dict[str, torch.Tensor]:
    """Run the real `selective_state_update` (simple algorithm) `s.ssu_calls` times; the tensors to save."""
    from flashinfer.mamba import selective_state_update

    bsz, hs = s.batch, s.ssu_heads_saved
    gs = max(1, hs * GROUPS // HEADS)
    inp = nano_layer(bsz, s.ssu_calls, device, seed=s.input_seed)
    sd = STATE_DTYPES[case.state]
    gen = torch.Generator().manual_seed(11)
    v = torch.randn(bsz, HEADS, P, N, generator=gen)
    scale = None
    if sd is torch.int16:
        state = (v * 8000).round().clamp(-32767, 32767).to(sd).to(device)
        scale = (torch.rand(bsz, HEADS, P, generator=gen) * 1e-4 + 1e-6).to(device)
    else:
        state = (v * 0.5).to(sd).to(device)
    out_t: dict[str, torch.Tensor] = {"init/state": state[:, :hs].clone()}
    if scale is not None:
        out_t["init/scale"] = scale[:, :hs].clone()
    A3 = inp.A.float()[:, None, None].expand(HEADS, P, N)
    D2 = inp.D.float()[:, None].expand(HEADS, P)
    seeds, outs, states, scales = [], [], [], []
    for t in range(s.ssu_calls):
        x, dt = inp.x[:, t].contiguous(), inp.dt[:, t].contiguous()
        bm, cm = inp.B[:, t].contiguous(), inp.C[:, t].contiguous()
        rs = engine_seed(s.seed, t) if case.sr else None
        seed_t = torch.tensor([rs], dtype=torch.int64, device=device) if case.sr else None
        out = selective_state_update(
            state, x, dt[..., None].expand(bsz, HEADS, P), A3, bm, cm, D2,
            state_scale=scale, rand_seed=seed_t, algorithm="simple",
        )  # fmt: skip
        seeds.append(rs if rs is not None else -1)
        outs.append(out[:, :hs])
        states.append(state[:, :hs].clone())
        if scale is not None:
            scales.append(scale[:, :hs].clone())
    out_t.update({
        "in/x": inp.x[:, : s.ssu_calls, :hs].transpose(0, 1), "in/dt": inp.dt[:, : s.ssu_calls, :hs].transpose(0, 1),
        "in/B": inp.B[:, : s.ssu_calls, :gs].transpose(0, 1), "in/C": inp.C[:, : s.ssu_calls, :gs].transpose(0, 1),
        "A": inp.A.float()[:hs].clone(), "D": inp.D.float()[:hs].clone(),
        "out": torch.stack(outs), "state": torch.stack(states), "call/seed": torch.tensor(seeds, dtype=torch.int64),
    })  # fmt: skip
    if scales:
        out_t["scale"] = torch.stack(scales)
    return _cpu(out_t)


def require_gpu_flashinfer() -> str:
    """The FlashInfer version, or SystemExit with one line naming what is missing."""
    from .env import engine_status

    st = engine_status("flashinfer")
    if not st.ok:
        raise SystemExit(f"[fi_dump] {st.reason}")
    if not torch.cuda.is_available():
        raise SystemExit("[fi_dump] needs a CUDA GPU (torch.cuda.is_available() is False)")
    return st.version or "?"


def run(out: Path, s: DumpSettings, device, cases=None, ssu_cases=None, version: str = "?") -> dict:
    """Dump every case into one safetensors file; returns the metadata (also stored in the file)."""
    from safetensors.torch import save_file

    cases = CKPT_CASES if cases is None else cases
    ssu_cases = SSU_CASES if ssu_cases is None else ssu_cases
    flat: dict[str, torch.Tensor] = {}
    meta: dict = {"settings": asdict(s), "flashinfer": version, "cases": {}, "failed": {}}
    if torch.cuda.is_available() and torch.device(device).type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    for case in list(cases) + list(ssu_cases):
        key = case_key(case)
        t0 = time.perf_counter()
        try:
            fn = dump_checkpointing if isinstance(case, CkptCase) else dump_ssu
            tensors = fn(case, s, device)
        except Exception as err:  # noqa: BLE001 - one failed case is reported, the others still dumped
            msg = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err) else ''}"
            meta["failed"][key] = msg
            print(f"[fi_dump] FAILED {key}: {msg}", flush=True)
            continue
        flat.update({f"{key}/{k}": v for k, v in tensors.items()})
        info = {"case": asdict(case), "kind": "ckpt" if isinstance(case, CkptCase) else "ssu"}
        if isinstance(case, CkptCase):
            info["module_args"] = [str(a) for a in ckpt_module_args(case, HEADS, GROUPS)]
            info["flushes"] = int(tensors["call/changed"].sum())
        else:
            info["module_args"] = [str(a) for a in ssu_module_args(case, device)]
        meta["cases"][key] = info
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
        print(f"[fi_dump] {key}: {time.perf_counter() - t0:.1f} s, {nbytes / 2**20:.2f} MiB, {info.get('flushes', '')}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(flat, str(out), metadata={"fi_dump": json.dumps(meta)})
    return meta


def load(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """({case_key: {name: tensor}}, metadata) of a dump; float8 states come back as torch.float8_e4m3fn."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["fi_dump"])
    flat = load_file(str(path))
    cases: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        key, name = k.split("/", 1)
        if key.startswith("ckpt_fp8") and name.endswith(("state", "/state")) and v.dtype is torch.uint8:
            v = v.view(torch.float8_e4m3fn)
        cases.setdefault(key, {})[name] = v
    return cases, meta


# the dimension that indexes heads (or groups, for B / C) in each saved tensor of a checkpointing case
_HEAD_DIM = {"state": 1, "scale": 1, "x_cache": 1, "B_cache": 1, "dt_cache": 1, "x": 3, "dt": 3, "B": 3, "C": 3, "out": 3}


def slice_dump(src: Path, dst: Path, calls: dict[str, int], heads: int) -> dict:
    """Write the first `calls[case]` calls of some checkpointing cases of a dump, heads 0..heads-1 only.

    Heads are independent in the kernel, so the slice re-computes exactly as the whole (its groups: the first
    heads * GROUPS // HEADS, at least one). Returns the slice's metadata (the source's, with a `slice` entry).
    """
    from safetensors.torch import save_file

    cases, meta = load(src)
    unknown = sorted(set(calls) - {k for k, v in meta["cases"].items() if v["kind"] == "ckpt"})
    if unknown:
        raise ValueError(f"not checkpointing cases of {src}: {unknown}; accepted: {sorted(meta['cases'])}")
    saved = meta["settings"]["heads_saved"]
    if not 0 < heads <= saved:
        raise ValueError(f"heads must be in 1..{saved} (the heads the dump saved), got {heads}")
    gs = max(1, heads * GROUPS // HEADS)
    flat = {}
    for key, n in calls.items():
        for name, v in cases[key].items():
            prefix, _, leaf = name.rpartition("/")
            if prefix.startswith("snap") and int(prefix[4:]) >= n:
                continue
            if prefix in ("in", "call") or name == "out":
                v = v[:n]
            if leaf in _HEAD_DIM and name not in ("init/start", "init/pnat"):
                v = v.narrow(_HEAD_DIM[leaf], 0, gs if leaf in ("B_cache", "B", "C") else heads)
            elif name in ("A", "D"):
                v = v[:heads]
            flat[f"{key}/{name}"] = v.contiguous()
    out_meta = {**meta, "cases": {k: meta["cases"][k] for k in calls}}
    out_meta["settings"] = {**meta["settings"], "heads_saved": heads, "calls": max(calls.values())}
    out_meta["slice"] = {"source": src.name, "calls": calls, "heads": heads, "full_layer_heads": HEADS}
    save_file(_cpu(flat), str(dst), metadata={"fi_dump": json.dumps(out_meta)})
    return out_meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.engines.dump", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    ap.add_argument("--slice-from", type=Path, default=None,
                    help="no GPU: write a slice of this dump instead (--slice CASE=CALLS ..., --heads-saved)")
    ap.add_argument("--slice", nargs="*", default=[], metavar="CASE=CALLS")
    ap.add_argument("--calls", type=int, default=DumpSettings.calls)
    ap.add_argument("--ssu-calls", type=int, default=DumpSettings.ssu_calls)
    ap.add_argument("--heads-saved", type=int, default=DumpSettings.heads_saved, help="multiple of 8, <= 64")
    args = ap.parse_args(argv)
    if args.slice_from is not None:
        try:
            calls = {k: int(v) for k, v in (item.split("=") for item in args.slice)}
        except ValueError:
            ap.error(f"--slice takes CASE=CALLS items, e.g. ckpt_int8_L16=40; got {args.slice}")
        m = slice_dump(args.slice_from, args.out, calls, args.heads_saved)
        print(f"[fi_dump] wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB): {m['slice']}")
        return 0
    if args.heads_saved % (HEADS // GROUPS) or not 0 < args.heads_saved <= HEADS:
        ap.error(f"--heads-saved must be a multiple of {HEADS // GROUPS} in 8..{HEADS}, got {args.heads_saved}")
    version = require_gpu_flashinfer()
    s = DumpSettings(calls=args.calls, ssu_calls=args.ssu_calls, heads_saved=args.heads_saved)
    t0 = time.perf_counter()
    meta = run(args.out, s, torch.device("cuda"), version=version)
    size = args.out.stat().st_size / 2**20
    print(f"[fi_dump] wrote {args.out} ({size:.1f} MiB) in {time.perf_counter() - t0:.1f} s; failed: {meta['failed']}")
    return 1 if meta["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
