"""Tabulate the GPU's MUFU.RCP and MUFU.EX2 on a CUDA GPU, and compact the tables into the data the library ships.

    python -m lab.engines.mufu_tabulate --out TABLES.npz          # on a CUDA GPU (Triton inline PTX)
    python -m lab.engines.mufu_tabulate --compact TABLES.npz      # (CPU) write ssmquant/engines/mufu_sm90.safetensors

What is measured and how the library uses it: `ssmquant/engines/mufu.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from ssmquant.engines.mufu import (
    EX2_ARG_BITS,
    EX2_FRAC_BITS,
    RCP_BITS,
    SM90_DATA,
    _ex2_base,
    _pack2,
    _sha,
    cr_ex2,
    cr_rcp,
    sm90,
    table_on,
)


def _ulps(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int32).long() - ref.view(torch.int32).long()


ASM = {"rcp": "rcp.approx.ftz.f32 $0, $1;", "ex2": "ex2.approx.ftz.f32 $0, $1;"}


@triton.jit
def _approx_kernel(x_ptr, y_ptr, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = off < n
    v = tl.load(x_ptr + off, mask=m, other=1.0)
    y = tl.inline_asm_elementwise(ASM, "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(y_ptr + off, y, mask=m)


def _launch(fn: str, x: torch.Tensor) -> torch.Tensor:
    """One PTX approximate instruction over FP32 x on the GPU: 'rcp' (rcp.approx.ftz.f32) or 'ex2' (ex2.approx.ftz.f32)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    block = 1024
    _approx_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), ASM=ASM[fn], BLOCK=block)
    return y


def _quantize(x: torch.Tensor, bits: int, mode: str) -> torch.Tensor:
    """x in (-1, 0] rounded to a multiple of 2^-bits (exact in FP32 for bits <= 24)."""
    s = x.double() * 2.0**bits
    q = {"floor": torch.floor, "ceil": torch.ceil, "nearest": torch.round}[mode](s)
    return (q / 2.0**bits).float()


def tabulate(
    device: torch.device, samples: int = 1 << 20, seed: int = 0, rcp_bits: int = RCP_BITS, ex2_bits: int = EX2_FRAC_BITS
) -> tuple[dict, dict]:
    """Tables and raw samples of MUFU.RCP / MUFU.EX2 on `device` (CUDA), and the checks on the samples.

    Returns (arrays, checks): arrays as numpy (int8 deltas [2^rcp_bits] / [2^ex2_bits], int32 raw bits
    [samples]), checks as fractions. Smaller `rcp_bits` / `ex2_bits` tabulate a coarser grid (tests).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    arrays: dict = {}
    checks: dict = {}
    # reciprocal: every significand of [1, 2)
    j = torch.arange(1 << rcp_bits, dtype=torch.int32) << (RCP_BITS - rcp_bits)
    x = (j + (127 << 23)).view(torch.float32).to(device)
    d = _ulps(_launch("rcp", x), cr_rcp(x))
    checks["rcp_delta_counts"] = {int(k): int(v) for k, v in zip(*torch.unique(d, return_counts=True))}
    arrays["rcp_delta"] = d.clamp(-128, 127).to(torch.int8).cpu()
    # random arguments of every exponent: the table's value scaled by the exponent?
    e = torch.randint(-60, 61, (samples,), generator=g)
    m = torch.randint(0, 1 << rcp_bits, (samples,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (samples,), generator=g, dtype=torch.int32) << 31
    xr = (((e + 127) << 23).int() | (m << (RCP_BITS - rcp_bits)) | sign).view(torch.float32).to(device)
    yr = _launch("rcp", xr)
    xm = ((m << (RCP_BITS - rcp_bits)) + (127 << 23)).view(torch.float32).to(device)  # the significand in [1, 2)
    ym = (cr_rcp(xm).view(torch.int32) + d[m.long().to(device)].int()).view(torch.float32)
    pred = torch.sign(xr) * torch.ldexp(ym, -e.to(device).float())
    checks["rcp_scale_invariant"] = float((pred.view(torch.int32) == yr.view(torch.int32)).float().mean())
    arrays["rcp_x"], arrays["rcp_y"] = xr.view(torch.int32).cpu(), yr.view(torch.int32).cpu()
    # ex2 on (-1, 0] at 2^-24
    j = torch.arange(1 << ex2_bits, dtype=torch.float64)
    x = (-j / 2.0**ex2_bits).float().to(device)
    d = _ulps(_launch("ex2", x), cr_ex2(x))
    checks["ex2_delta_counts"] = {int(k): int(v) for k, v in zip(*torch.unique(d, return_counts=True))}
    arrays["ex2_delta"] = d.clamp(-128, 127).to(torch.int8).cpu()
    # random arguments: magnitudes log-uniform in [2^-40, 64], negative (decay arguments)
    mag = torch.exp2(torch.rand(samples, generator=g, dtype=torch.float64) * 46 - 40)
    xr = (-mag).float().to(device)
    yr = _launch("ex2", xr)
    arrays["ex2_x"], arrays["ex2_y"] = xr.view(torch.int32).cpu(), yr.view(torch.int32).cpu()
    frac = xr.double() - torch.floor(xr.double())  # in [0, 1)
    small = (xr > -1) & (xr < 0)
    for bits in (22, 23, 24):
        for mode in ("floor", "ceil", "nearest"):
            q = _quantize(xr[small], bits, mode)
            checks[f"ex2_small_args_as_{mode}_{bits}"] = float((_launch("ex2", q) == yr[small]).float().mean())
    # integer part: 2^x = 2^floor(x) * ex2(x - floor(x) - 1) * 2 for x <= -1 with an exact fraction
    big = xr <= -1
    fr = (frac[big] - 1.0).float()  # in [-1, 0), exact when x's ulp >= 2^-24
    pred = torch.ldexp(_launch("ex2", fr), (torch.floor(xr[big].double()) + 1).float())
    checks["ex2_integer_part_split"] = float((pred == yr[big]).float().mean())
    return {k: v.numpy() for k, v in arrays.items()}, checks

def load_tables(path: Path) -> dict[str, torch.Tensor]:
    """The tables written by `main` ({"rcp_delta": int8 [2^23], "ex2_delta": int8 [2^24], ...}) as torch tensors."""
    import numpy as np

    with np.load(path) as z:
        missing = {"rcp_delta", "ex2_delta"} - set(z.files)
        if missing:
            raise ValueError(f"{path} is not a MUFU table file (written by `python -m lab.engines.mufu_tabulate --out`): lacks {sorted(missing)}")
        out = {k: torch.from_numpy(z[k].copy()) for k in z.files if k != "checks"}
        out["checks"] = json.loads(bytes(z["checks"]).decode()) if "checks" in z.files else {}
    return out

def rcp_from_table(x: torch.Tensor, rcp_delta: torch.Tensor) -> torch.Tensor:
    """rcp.approx.ftz.f32 of FP32 x from the tabulated significands (normal x and results; subnormal results -> 0)."""
    bits = x.view(torch.int32)
    mant = bits & 0x7FFFFF
    xm = (mant | (127 << 23)).view(torch.float32)  # the significand in [1, 2)
    ym = (cr_rcp(xm).view(torch.int32) + rcp_delta.to(x.device)[mant.long()].int()).view(torch.float32)
    e = ((bits >> 23) & 0xFF) - 127
    y = torch.sign(x) * torch.ldexp(ym, -e.float())
    return torch.where(y.abs() < 2.0**-126, torch.zeros_like(y), y)


def ex2_from_table(x: torch.Tensor, ex2_delta: torch.Tensor, small: str = "nearest") -> torch.Tensor:
    """ex2.approx.ftz.f32 of FP32 x <= 0 from the table on (-1, 0] at 2^-24.

    x <= -1 is split as 2^(floor(x) + 1) * ex2(frac(x) - 1) (exact: frac(x) has at most 23 fraction bits
    there); x in (-1, 0] reads the table at -x 2^24 rounded by `small` ("floor" | "ceil" | "nearest"; the
    GPU's `checks` say which rule the hardware follows). Results below 2^-126 flush to zero.
    """
    if bool((x > 0).any()):
        raise ValueError("ex2_from_table: the table covers arguments <= 0 (decay arguments) only")
    bits = EX2_FRAC_BITS
    xd = x.double()
    n = torch.floor(xd)
    frac = xd - n  # [0, 1)
    big = xd <= -1
    arg = torch.where(big, torch.where(frac == 0, 0.0, frac - 1.0), xd)  # in (-1, 0]
    scale = torch.where(big & (frac != 0), n + 1, torch.where(big, n, 0.0))
    rnd = {"floor": torch.floor, "ceil": torch.ceil, "nearest": torch.round}[small]
    j = torch.where(big, -arg * 2.0**bits, rnd(-arg * 2.0**bits)).long()  # exact for big
    j = j.clamp(max=(1 << bits) - 1)  # 2^-24 below 0 rounds to the last entry
    base = cr_ex2((-j.double() / 2.0**bits).float())
    t = (base.view(torch.int32) + ex2_delta.to(x.device)[j].int()).view(torch.float32)
    y = torch.ldexp(t, scale.float())
    return torch.where(y < 2.0**-126, torch.zeros_like(y), y)

def compact(tables: dict[str, torch.Tensor], path: Path = SM90_DATA) -> dict:
    """Write the exact model's data from GPU tables (`load_tables`): 2-bit RCP and EX2 deltas, lzma.

    The EX2 table at 2^-24 is first checked to be constant on pairs (the argument truncation to 2^-23),
    then re-based on RN(2^x) of the truncated argument. Returns the delta counts; raises if the tables
    do not follow the rules the model relies on.
    """
    from safetensors.torch import save_file

    rd = tables["rcp_delta"].to(torch.int16)
    ed24 = tables["ex2_delta"]
    j24 = torch.arange(1 << EX2_FRAC_BITS, dtype=torch.float64)
    y24 = (cr_ex2((-j24 / 2.0**EX2_FRAC_BITS).float()).view(torch.int32) + ed24.int()).view(torch.float32)
    if not torch.equal(y24[1::2], y24[0::2]):
        raise ValueError("compact: EX2 differs within a 2^-23 step, so its argument is not truncated to 2^-23")
    e = y24[0::2]
    ed = e.view(torch.int32) - _ex2_base(torch.arange(1 << EX2_ARG_BITS)).view(torch.int32)
    if rd.min() < -1 or rd.max() > 2 or ed.min() < -2 or ed.max() > 1:
        raise ValueError(f"compact: deltas outside the 2-bit ranges (rcp {rd.min()}..{rd.max()}, ex2 {ed.min()}..{ed.max()})")
    meta = {"rcp": "delta + 1 vs RN(1/m), m = 1 + j 2^-23", "ex2": "delta + 2 vs RN(2^(-j 2^-23))",
            "ex2_sha": _sha(e.view(torch.int32)), "source": "H200 sm_90, mufu.tabulate, 2026-12-01"}  # fmt: skip
    blobs = {"rcp": _pack2(rd + 1), "ex2": _pack2(ed + 2)}
    save_file({k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in blobs.items()}, str(path), metadata=meta)
    count = {k: {int(a): int(b) for a, b in zip(*torch.unique(v, return_counts=True))} for k, v in (("rcp", rd), ("ex2", ed))}
    return {"bytes": path.stat().st_size, "deltas": count}

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.engines.mufu_tabulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="the .npz file to write (~15 MiB)")
    ap.add_argument("--samples", type=int, default=1 << 20)
    ap.add_argument("--compact", type=Path, default=None, metavar="TABLES.npz",
                    help="(CPU) write the shipped exact model from tables written by --out")  # fmt: skip
    args = ap.parse_args(argv)
    if args.compact:
        print(json.dumps(compact(load_tables(args.compact))))
        sm90.cache_clear()
        table_on.cache_clear()
        return 0
    if args.out is None:
        ap.error("one of --out (GPU) or --compact (CPU) is needed")
    if not torch.cuda.is_available():
        raise SystemExit("mufu: tabulating MUFU.RCP / MUFU.EX2 needs a CUDA GPU (none found)")
    import numpy as np

    t0 = time.perf_counter()
    arrays, checks = tabulate(torch.device("cuda"), args.samples)
    checks["gpu"] = torch.cuda.get_device_name()
    checks["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    checks["seconds"] = round(time.perf_counter() - t0, 1)
    np.savez_compressed(args.out, **arrays, checks=np.frombuffer(json.dumps(checks).encode(), dtype=np.uint8))
    print(json.dumps(checks, indent=1))
    print(f"[mufu] wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


if __name__ == "__main__":
    raise SystemExit(main())
