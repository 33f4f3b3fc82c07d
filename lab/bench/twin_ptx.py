"""Float hazards in the flashinfer profile's Triton twin as compiled for an H100 / H200 (sm_90a), without a GPU.

The twin (`ssmquant.kernels.mamba2_engine`) must give the torch profile's bits on the GPU as under the
interpreter. Compiling it ahead of time with the installed Triton and the launcher's options
(`COMPILE_OPTIONS`) and scanning its PTX finds what would make them differ:

- negations: a float negated (`neg.f32`, or `0 - x` from a register holding +0.0, which is how Triton 3.6
  compiles a unary minus: -(+0.0) becomes +0.0, while torch and FlashInfer keep -0.0; the first H200 run's
  fp16 / fp8 stochastic rounding lost its negative zeros this way),
- fma: multiply-adds the compiler contracted (`fma.rn.f32` / `.f64`; torch rounds every product),
- ftz: flush-to-zero instructions (libdevice with enable_reflect_ftz: `tl.floor` became `cvt.rmi.ftz`).

Each variant is compiled as the analyses launch it (no probe) at the synthetic Nemotron-3-Nano head shape
(64 x 128, the launch plan's row block and warps); a replay variant compiles in 1-3 s.

    python -m lab.bench.twin_ptx [--variants fp16:sr@conventional,fp8_e4m3:sr@replay16] [--json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT = "fp16:sr@conventional,fp8_e4m3:sr@replay16,int8:sr@replay16,fp8_e4m3@replay16,int16@conventional"


def float_hazards(ptx: str) -> dict[str, int]:
    """Counts of float negations, contracted multiply-adds and flush-to-zero instructions in PTX text."""
    lines = ptx.splitlines()
    # registers that hold +0.0 for good: set once, by a move of 0f00000000 (a loop's registers are set again)
    writes: dict[str, int] = {}
    for line in lines:
        if m := re.match(r"\s*[a-z][\w.]*\s+(%\w+),", line):
            writes[m.group(1)] = writes.get(m.group(1), 0) + 1
    zeros = {m.group(1) for ln in lines if (m := re.match(r"\s*mov\.b32\s+(%r\d+), 0f00000000;", ln))}
    zeros = {r for r in zeros if writes[r] == 1}
    out = {"negations": 0, "fma": 0, "ftz": 0}
    for line in lines:
        m = re.match(r"\s*sub\.(?:rn\.)?f32\s+%r\d+, (%r\d+|0f00000000),", line)
        out["negations"] += bool(m and (m.group(1) in zeros or m.group(1) == "0f00000000")) or "neg.f" in line
        out["fma"] += bool(re.search(r"\bfma\.rn\.f(32|64)\b", line))
        out["ftz"] += ".ftz" in line
    return out


def twin_ptx(spec: str) -> str:
    """PTX of the twin for `spec` (a flashinfer-profile variant without `~flashinfer`) on sm_90a."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("twin_ptx compiles the kernel: run it without TRITON_INTERPRET=1")
    sys.path.insert(0, str(ROOT))
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ssmquant.kernels.mamba2_engine import COMPILE_OPTIONS, _launch_plan, _mamba2_engine_kernel
    from ssmquant.kinds import Mamba2Inputs
    from ssmquant.replay import parse_variant

    v = parse_variant(spec + "~flashinfer")
    # one head of the Nano shape: the launch plan (row block, warps, codes) depends on the head shape only
    g = torch.Generator().manual_seed(0)
    inp = Mamba2Inputs(
        x=torch.randn(1, 3, 1, 64, generator=g).bfloat16(), dt=torch.rand(1, 3, 1, generator=g) * 0.1,
        B=torch.randn(1, 3, 1, 128, generator=g).bfloat16(), C=torch.randn(1, 3, 1, 128, generator=g).bfloat16(),
        A=-torch.rand(1, generator=g), D=torch.ones(1),
    ).validate()  # fmt: skip
    _, _, a_engine, kw = _launch_plan(inp, v)
    names = list(inspect.signature(_mamba2_engine_kernel.fn).parameters)
    types = {n: "*fp32" for n in names if n.endswith("_ptr")}
    types.update(x_ptr="*bf16", bm_ptr="*bf16", cm_ptr="*bf16", write_ptr="*i8", start_ptr="*i64", fcall_ptr="*i8",
                 rcp_ptr="*i8", probe_ptr="*i64", seed_hi="i64", store_seed="i64")  # fmt: skip
    const = dict(
        L=v.scheme.buffer_len if kw["replay"] else 1, BLOCK_P=kw["block_p"], BLOCK_N=128, FMT=kw["fmt_code"],
        REPLAY=kw["replay"], SR=kw["sr"], BUF=kw["buf_code"], HAS_S0=False, HAS_SV0=False, SSU=a_engine is not None,
        PROBE=False,
    )  # fmt: skip
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    src = ASTSource(_mamba2_engine_kernel, sig, constexprs={(names.index(k),): c for k, c in const.items()})
    options = {"num_warps": kw["num_warps"], **COMPILE_OPTIONS}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=DEFAULT, help="flashinfer-profile variants (comma-separated)")
    ap.add_argument("--json", action="store_true", help="print {variant: hazards} as JSON")
    args = ap.parse_args(argv)
    res = {spec: float_hazards(twin_ptx(spec)) for spec in args.variants.split(",")}
    if args.json:
        print(json.dumps(res))
    else:
        import triton

        print(f"triton {triton.__version__}, target sm_90a")
        for spec, h in res.items():
            print(f"{spec:28s} " + " ".join(f"{k} {n}" for k, n in h.items()))
    return 1 if any(any(h.values()) for h in res.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
