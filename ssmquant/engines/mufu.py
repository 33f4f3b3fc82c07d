"""The GPU's approximate special functions (MUFU.RCP, MUFU.EX2): tabulated on the GPU, emulated in torch.

    python -m ssmquant.engines.mufu --out TABLES.npz      # on a CUDA GPU (Triton inline PTX)

FlashInfer builds its Mamba kernels with `-use_fast_math`, so in `checkpointing_ssu` (0.7.2.post1,
`kernel_checkpointing_ssu_8bit.cuh`) `QUANT_MAX / a` and `1.f / encode` compile to `rcp.approx.ftz.f32`
(SASS `MUFU.RCP`, then an `FMUL` by QUANT_MAX) and `__expf(v)` to `ex2.approx.ftz.f32(v * log2e)` (`FMUL`,
`MUFU.EX2`). Both are within about one ulp of the exact result but not correctly rounded, and NVIDIA does
not publish them bit for bit. Measured on FlashInfer's own dump (`fit.py`): with everything else of the
flush modelled exactly, every stored decode scale is reached by a +-1 ulp change of one of the two
reciprocals, and every FP32 replayed state by a change of at most a few ulps of `__expf(total)`.

So the instructions are tabulated where they run:
  - `rcp_delta[j]`: rcp.approx.ftz.f32(1 + j 2^-23) minus the correctly rounded 1 / x, in ulps (int8), for
    every significand j < 2^23; for normal inputs and results the reciprocal of m 2^e is the table's
    value for m times 2^-e (checked on random inputs of every exponent, `checks`);
  - `ex2_delta[j]`: ex2.approx.ftz.f32(-j 2^-24) minus the correctly rounded 2^x, in ulps, for j < 2^24
    (x in (-1, 0], where every decay argument of the kernels lies modulo an integer);
  - `ex2_x`, `ex2_y` / `rcp_x`, `rcp_y`: raw input / output bits of random arguments, for offline checks
    of how the hardware reduces arguments (`checks` reports the candidate rules on them).
The correctly rounded references are FP64 results rounded once to FP32, here and on the GPU.

The exact model shipped with the package (`rcp_sm90`, `ex2_sm90`, data `mufu_sm90.safetensors`, 0.26 MB;
`python -m ssmquant.engines.mufu --compact TABLES.npz` writes it), measured on an H200 (sm_90, driver
580.159.04, 2026-12-01, 2^23 significands and 2^24 + 2^20 random arguments):
  - MUFU.RCP of m 2^e is RCP(m) 2^-e for every exponent (1,048,576 random arguments of exponents -60..60:
    all identical), and RCP(m) = RN(1 / m) + d[m] with d in {-1, 0, +1} (87% 0, 9% +1, 4% -1);
  - MUFU.EX2 first truncates its argument toward zero to a multiple of 2^-23 (all random arguments in
    (-1, 0) match this, 1-85% the other roundings at 2^-22..2^-24), then splits q = -x 2^23 into
    k = q >> 23 and j = q & (2^23 - 1): EX2(x) = E(j) 2^-k with E(j) = RN(2^(-j 2^-23)) + d[j], d in
    {-2, -1, 0, +1} (the split is checked on every random argument <= -1; for x > 0 it is the same integer
    arithmetic but unmeasured: the kernels' positive arguments are masked out).
Both deltas are 2-bit codes, lzma-compressed (the hardware's error is smooth, so they compress 16x).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import lzma
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

RCP_BITS = 23
EX2_FRAC_BITS = 24
EX2_ARG_BITS = 23  # MUFU.EX2 truncates its argument toward zero to a multiple of 2^-23 (measured, see above)
SM90_DATA = Path(__file__).with_name("mufu_sm90.safetensors")


def cr_rcp(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 reciprocal (through FP64)."""
    return (1.0 / x.double()).float()


def cr_ex2(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 2^x (through FP64)."""
    return torch.exp2(x.double()).float()


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
            raise ValueError(f"{path} is not a MUFU table file (written by `python -m ssmquant.engines.mufu`): lacks {sorted(missing)}")
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


def _pack2(codes: torch.Tensor) -> bytes:
    """int codes in 0..3 [n], n % 4 == 0 -> lzma-compressed bytes, four codes a byte (low bits first)."""
    c = codes.to(torch.uint8).reshape(-1, 4)
    packed = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
    return lzma.compress(packed.numpy().tobytes(), preset=9 | lzma.PRESET_EXTREME)


def _unpack2(blob: bytes) -> torch.Tensor:
    packed = torch.frombuffer(bytearray(lzma.decompress(blob)), dtype=torch.uint8)
    return torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)


def _ex2_base(j: torch.Tensor) -> torch.Tensor:
    """RN(2^(-j 2^-23)) as FP32 for int j in [0, 2^23): the reference the EX2 deltas are taken from."""
    return cr_ex2((-j.double() / 2.0**EX2_ARG_BITS).float())


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


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


@functools.lru_cache(maxsize=1)
def sm90() -> dict[str, torch.Tensor]:
    """The shipped exact model, decompressed once: {"rcp_delta": int8 [2^23], "ex2": FP32 [2^23] (E(j))}."""
    from safetensors import safe_open

    if not SM90_DATA.exists():
        raise FileNotFoundError(f"{SM90_DATA} is missing: reinstall ssmquant or run `python -m ssmquant.engines.mufu --compact`")
    with safe_open(str(SM90_DATA), "pt") as f:
        meta = f.metadata()
        rcp = _unpack2(bytes(f.get_tensor("rcp").numpy())).to(torch.int8) - 1
        ex2d = _unpack2(bytes(f.get_tensor("ex2").numpy())).to(torch.int32) - 2
    e = (_ex2_base(torch.arange(1 << EX2_ARG_BITS)).view(torch.int32) + ex2d).view(torch.float32)
    if _sha(e.view(torch.int32)) != meta["ex2_sha"]:  # this platform's FP64 exp2 rounds a reference differently
        raise RuntimeError("mufu.sm90: the rebuilt MUFU.EX2 table does not match its checksum (FP64 exp2 of this platform)")
    return {"rcp_delta": rcp, "ex2": e}


@functools.lru_cache(maxsize=8)
def table_on(name: str, device: torch.device) -> torch.Tensor:
    """One table of `sm90()` on `device`, copied there once (the oracle calls the model thousands of times)."""
    return sm90()[name].to(device)


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2^e as FP32 from the exponent bits, for int e in [-126, 127] (e = -127 gives 0: flushed)."""
    return ((e.int() + 127).clamp(0, 254) << 23).view(torch.float32)


def rcp_sm90(x: torch.Tensor) -> torch.Tensor:
    """MUFU.RCP (rcp.approx.ftz.f32) on sm_90, bit for bit, for FP32 x of any shape.

    Normal x = +-m 2^e: +-(RN(1/m) + d[m]) 2^-e, results below 2^-126 flushed to zero; zero and subnormal
    x (flushed) give +-inf, infinities 0, NaN NaN. The Triton twin computes the same (`mamba2_engine._rcp`).
    """
    d = table_on("rcp_delta", x.device)
    bits = x.float().view(torch.int32)
    mant = bits & 0x7FFFFF
    e = ((bits >> 23) & 0xFF) - 127
    ym = (ieee_rcp((mant | (127 << 23)).view(torch.float32)).view(torch.int32) + d[mant.long()].int()).view(torch.float32)
    y = ym * _pow2_f32(-e)  # exact, or below 2^-126 (flushed next)
    y = torch.where(y < 2.0**-126, 0.0, y)
    y = torch.where(e == -127, torch.inf, torch.where(e == 128, torch.where(mant == 0, 0.0, torch.nan), y))
    return torch.where(bits < 0, -y, y)


def ieee_rcp(m: torch.Tensor) -> torch.Tensor:
    """RN(1 / m) in FP32 (an IEEE division: correctly rounded)."""
    return torch.ones_like(m) / m


def ex2_sm90(x: torch.Tensor) -> torch.Tensor:
    """MUFU.EX2 (ex2.approx.ftz.f32) on sm_90, bit for bit, for FP32 x of any shape (measured for x <= 0).

    q = trunc(-x 2^23) (x truncated toward zero to 2^-23), EX2 = E(q & (2^23 - 1)) 2^-(q >> 23); results
    below 2^-126 flush to zero, x >= 128 gives inf, NaN NaN.
    """
    e_tab = table_on("ex2", x.device)
    xf = x.float()
    big = xf.abs() >= 256.0  # keeps q in int64 range; 2^x is 0 or inf there
    q = torch.trunc(-torch.where(big, 0.0, xf) * 2.0**EX2_ARG_BITS).long()  # exact: a power-of-2 scaling
    k = q >> EX2_ARG_BITS  # floor(q / 2^23)
    y = e_tab[(q & ((1 << EX2_ARG_BITS) - 1))] * _pow2_f32(-k.clamp(-127, 127))
    y = torch.where(k >= 127, 0.0, torch.where(y < 2.0**-126, 0.0, y))
    y = torch.where(k < -127, torch.inf, y)
    y = torch.where(big, torch.where(xf > 0, torch.inf, 0.0), y)
    return torch.where(torch.isnan(xf), torch.nan, y)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssmquant.engines.mufu", description=__doc__.split("\n\n")[0])
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
