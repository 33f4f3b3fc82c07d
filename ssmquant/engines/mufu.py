"""The GPU's approximate special functions (MUFU.RCP, MUFU.EX2), emulated in torch bit for bit from tables measured
on the GPU (`lab/engines/mufu_tabulate.py` measures them and writes the shipped data).

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
`python -m lab.engines.mufu_tabulate --compact TABLES.npz` writes it), measured on an H200 (sm_90, 2^23
significands and 2^24 + 2^20 random arguments; the driver and date are in the data's metadata and RESULTS.md):
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

import functools
import hashlib
import lzma
from pathlib import Path

import torch

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


@functools.lru_cache(maxsize=1)
def sm90() -> dict[str, torch.Tensor]:
    """The shipped exact model, decompressed once: {"rcp_delta": int8 [2^23], "ex2": FP32 [2^23] (E(j))}."""
    from safetensors import safe_open

    if not SM90_DATA.exists():
        raise FileNotFoundError(f"{SM90_DATA} is missing: reinstall ssmquant (the data ships in the package)")
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


