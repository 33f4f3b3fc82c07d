"""Oracle: vLLM's and TensorRT-LLM's own Triton Mamba-2 decode kernels, step by step, next to the profile.

For each engine (vllm, trtllm) and state dtype (fp32, bf16, fp16), one synthetic Nemotron-like layer
(dt in [0.001, 0.1], A in [-1.1, -0.1], bf16 x / B / C) is decoded for T steps three ways from the same
initial state: the engine's kernel (`lab.engines.vendored`, state stored in its dtype after every
call), the profile's re-computation (`ssmquant.engines.triton_ssu`: the engine's decay bits, its FMA, a
round-to-nearest store), and the ideal emulation (exp(dt A), a S + (dt x) B^T, the same store). Reported:
the fraction of bit-identical state elements real vs profile and real vs ideal after 1, 16, 256, ... steps,
and the relative state error against an FP32 run of the ideal recurrence, per step, for all three (the
error curves), with the largest relative gap between the real kernel's curve and each emulation's.

    python -m lab.engines.oracle_ssu --out DIR [--steps 256] [--device cuda]

On a GPU the kernels run compiled; with TRITON_INTERPRET=1 on CPU they run in the interpreter, whose
arithmetic differs from the compiled kernels in two ways the report names: no FMA contraction (the profile
is then run unfused) and fp32 -> bf16 by truncation (Triton 3.9's interpreter), so bf16 results on CPU
are interpreter numbers, not the engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ssmquant.engines.triton_ssu import ssu_decays, ssu_output, ssu_update

from . import vendored

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINTS = (1, 16, 256, 1024, 4096)


@dataclass
class SSUCase:
    engine: str
    dtype: str
    steps: int
    shape: tuple[int, int, int, int, int]  # B, H, P, N, G
    device: str
    interpreter: bool
    identical_profile: dict[int, float] = field(default_factory=dict)
    identical_ideal: dict[int, float] = field(default_factory=dict)
    err_real: list[float] = field(default_factory=list)
    err_profile: list[float] = field(default_factory=list)
    err_ideal: list[float] = field(default_factory=list)
    out_maxrel_profile: float = 0.0
    curve_gap_profile: float = 0.0
    curve_gap_ideal: float = 0.0
    seconds: float = 0.0


def synthetic_inputs(shape, steps: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """x, B, C bf16 [T, B, H|G, P|N]; dt fp32 [T, B, H]; A, D fp32 [H]; s0 fp32 [B, H, P, N] (a warm state)."""
    bsz, h, p, n, g = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, bsz, h, p, generator=gen).to(torch.bfloat16)
    b = (torch.randn(steps, bsz, g, n, generator=gen) * 0.3).to(torch.bfloat16)
    c = (torch.randn(steps, bsz, g, n, generator=gen) * 0.3).to(torch.bfloat16)
    dt = torch.rand(steps, bsz, h, generator=gen) * 0.099 + 0.001
    a = -(torch.rand(h, generator=gen) + 0.1)
    d = torch.randn(h, generator=gen)
    s0 = torch.randn(bsz, h, p, n, generator=gen)
    return {k: v.to(device) for k, v in dict(x=x, b=b, c=c, dt=dt, A=a, D=d, s0=s0).items()}


def _real_step(engine: str, kernel, state, x, dt, a, b, c, d, out):
    """One call of the engine's kernel on state [B, H, P, N] (its dtype, in place); out [B, H, P] fp32."""
    bsz, h, p = x.shape
    n = state.shape[-1]
    dte = dt[:, :, None].expand(bsz, h, p)
    ae = a[:, None, None].expand(h, p, n)
    de = d[:, None].expand(h, p)
    dtb = torch.zeros(h, device=x.device)[:, None].expand(h, p)
    if engine == "vllm":
        kernel(state, x, dte, ae, b, c, de, dtb, out=out)
    else:
        with vendored.cpu_device_guard(state.device):
            kernel(state, x, dte, ae, b, c, de, dt_bias=dtb, out=out)


def _rel(s: torch.Tensor, ref: torch.Tensor) -> float:
    return float((s.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def run_case(engine: str, dtype: str, steps: int, shape=(2, 8, 64, 128, 2), device="cuda", seed: int = 0) -> SSUCase:
    """Decode one synthetic layer `steps` steps with the real kernel, the profile and the ideal (see module)."""
    kernel = vendored.load_vllm_ssu() if engine == "vllm" else vendored.load_trtllm_ssu()
    dev = torch.device(device)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    fused = dev.type == "cuda" and not interp
    sd = DTYPES[dtype]
    inp = synthetic_inputs(shape, steps, dev, seed)
    hpg = shape[1] // shape[4]
    case = SSUCase(engine, dtype, steps, tuple(shape), str(dev), interp)
    t0 = time.time()
    s_real = inp["s0"].to(sd).clone()  # the kernel writes it in place: no alias with the emulations
    s_prof = s_real.float().clone()
    s_ideal = s_real.float().clone()
    s_ref = s_real.float().clone()
    da_all = ssu_decays(inp["A"], inp["dt"], engine)  # [T, B, H]
    a_ideal = torch.exp(inp["dt"] * inp["A"])
    out = torch.empty(shape[0], shape[1], shape[2], device=dev)
    worst_out = 0.0
    for t in range(steps):
        x, dt, b, c = inp["x"][t], inp["dt"][t], inp["b"][t], inp["c"][t]
        _real_step(engine, kernel, s_real, x, dt, inp["A"], b, c, inp["D"], out)
        bh, ch, xf = b.float().repeat_interleave(hpg, 1), c.float().repeat_interleave(hpg, 1), x.float()
        s_prof = ssu_update(s_prof, da_all[t], dt, xf, bh, fused)
        y_prof = ssu_output(s_prof, ch, inp["D"], xf)
        s_prof = s_prof.to(sd).float()
        s_ideal = (a_ideal[t][..., None, None] * s_ideal + (dt[..., None] * xf)[..., None] * bh[:, :, None, :]).to(sd).float()
        s_ref = a_ideal[t][..., None, None] * s_ref + (dt[..., None] * xf)[..., None] * bh[:, :, None, :]
        worst_out = max(worst_out, float(((out - y_prof).abs() / y_prof.abs().clamp_min(1e-3)).max()))
        case.err_real.append(_rel(s_real, s_ref))
        case.err_profile.append(_rel(s_prof, s_ref))
        case.err_ideal.append(_rel(s_ideal, s_ref))
        if t + 1 in CHECKPOINTS:
            sr = s_real.float()
            case.identical_profile[t + 1] = float((sr == s_prof).float().mean())
            case.identical_ideal[t + 1] = float((sr == s_ideal).float().mean())
    case.out_maxrel_profile = worst_out
    er = torch.tensor(case.err_real)
    floor = er.max().clamp_min(1e-30)
    case.curve_gap_profile = float(((torch.tensor(case.err_profile) - er).abs() / er.clamp_min(1e-3 * floor)).max())
    case.curve_gap_ideal = float(((torch.tensor(case.err_ideal) - er).abs() / er.clamp_min(1e-3 * floor)).max())
    case.seconds = time.time() - t0
    return case


def table(cases: list[SSUCase]) -> str:
    """A markdown table of the cases (bit-identical fractions and curve gaps)."""
    rows = [
        "| engine | state | steps | device | identical vs profile (1/16/256) | identical vs ideal (1/16/256) | "
        "curve gap profile | curve gap ideal | final err real / profile / ideal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        ids = lambda d: " / ".join(f"{d[k]:.4f}" for k in (1, 16, 256) if k in d)  # noqa: E731
        dev = c.device + (" (interpreter)" if c.interpreter else "")
        rows.append(
            f"| {c.engine} | {c.dtype} | {c.steps} | {dev} | {ids(c.identical_profile)} | {ids(c.identical_ideal)} | "
            f"{c.curve_gap_profile:.2e} | {c.curve_gap_ideal:.2e} | "
            f"{c.err_real[-1]:.3e} / {c.err_profile[-1]:.3e} / {c.err_ideal[-1]:.3e} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.engines.oracle_ssu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--engines", default="vllm,trtllm")
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--shape", default="2,8,64,128,2", help="B,H,P,N,G (Nemotron-3-Nano heads: P=64, N=128)")
    args = ap.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    if len(shape) != 5 or shape[1] % shape[4]:
        ap.error(f"--shape wants B,H,P,N,G with H divisible by G; got {args.shape!r}")
    try:
        ssu = vendored.find_ssu_dir()
        man = vendored.manifest(ssu)
    except vendored.VendoredError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "sources": {k: man[k]["version"] for k in ("vllm", "trtllm")}}
    cases = []
    for eng in args.engines.split(","):
        for dt in args.dtypes.split(","):
            c = run_case(eng, dt, args.steps, shape, args.device)
            print(f"{eng} {dt}: identical vs profile {c.identical_profile}, vs ideal {c.identical_ideal}, "
                  f"curve gap {c.curve_gap_profile:.2e} / ideal {c.curve_gap_ideal:.2e} ({c.seconds:.1f} s)", flush=True)  # fmt: skip
            cases.append(c)
            # written after every case, so a run stopped by a time limit keeps what it measured
            (args.out / "oracle_ssu.json").write_text(json.dumps({"meta": meta, "cases": [asdict(c) for c in cases]}, indent=1))
            (args.out / "oracle_ssu.md").write_text(f"{meta}\n\n{table(cases)}\n")
    print(table(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
