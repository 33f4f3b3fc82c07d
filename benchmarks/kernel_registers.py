"""Registers and spills of the emulation kernels at the tilings `plan_launches` picks, without a GPU.

Compiles each kernel ahead of time for an H100/H200 (sm_90a) with the installed Triton and runs its
bundled ptxas with -v, which prints registers per thread and spill bytes. It checks the register-budget
rule of `ssmquant.kernels.plan_blocks` (NV + 1 states x 128 / (NV + 1) elements per thread) and the tiling
one size up, which should spill. Triton and ptxas versions change the numbers; the GPU machine's may differ.

    python benchmarks/kernel_registers.py [--kinds mamba2,gdn,kda]
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ssmquant.kernels import plan_launches  # noqa: E402
from ssmquant.kernels.common import slot_spec  # noqa: E402
from ssmquant.kernels.delta_rule import _delta_rule_emulate_kernel  # noqa: E402
from ssmquant.kernels.mamba2 import _mamba2_emulate_kernel  # noqa: E402
from ssmquant.kernels.rounding import FMT_FP8, FMT_INT8, FMT_NVFP4  # noqa: E402
from ssmquant.replay import parse_variants  # noqa: E402

# the six default variants: fp8_e4m3, int8, nvfp4 x conventional (fp32 buffer code 0), replay16 (bf16 ring, 1)
SPECS = [slot_spec(f, 1, False, False, buf) for f in (FMT_FP8, FMT_INT8, FMT_NVFP4) for buf in (0, 1)]
SHAPES = {"mamba2": (64, 128), "gdn": (128, 128), "kda": (128, 128)}  # rows, state dim (Nano, Qwen3.5, GLM)


def compile_and_count(kind: str, nv: int, block_p: int, num_warps: int) -> str:
    specs = (SPECS[:nv] + [0] * 6)[:6]
    if kind == "mamba2":
        fn = _mamba2_emulate_kernel
        ptrs = dict.fromkeys(["dt_ptr", "a_ptr", "d_ptr", "s0_ptr", "scale_ptr", "metrics_ptr"], "*fp32")
        ptrs.update(x_ptr="*bf16", bm_ptr="*bf16", cm_ptr="*bf16", write_ptr="*i8", seed_ptr="*i64")
        const = dict(BLOCK_P=block_p, BLOCK_N=128, HAS_S0=False, NV=nv, KMAJOR=True)
    else:
        fn = _delta_rule_emulate_kernel
        ptrs = dict.fromkeys(["q_ptr", "k_ptr", "alpha_ptr", "beta_ptr", "s0_ptr", "scale_ptr", "metrics_ptr"], "*fp32")
        ptrs.update(v_ptr="*bf16", write_ptr="*i8", seed_ptr="*i64")
        const = dict(BLOCK_P=block_p, BLOCK_N=128, VEC_DECAY=kind == "kda", HAS_S0=False, NV=nv, FAST_ROUND=True,
                     FP_FUSION=True, PREFETCH=False, ROW_BLOCKS_FIRST=False)  # the grid order changes no register
    const.update({f"SPEC{i}": s for i, s in enumerate(specs)})
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    # the launchers' options: both contract multiply-adds (mamba2_launch keeps its state update mul.rn / add.rn)
    fusion = dict(enable_fp_fusion=True, enable_reflect_ftz=False) if kind == "mamba2" else dict(enable_fp_fusion=True, enable_reflect_ftz=False)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **fusion})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = pathlib.Path(tmp) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        out = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(pathlib.Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    lines = [ln.split("info    :")[-1].strip() for ln in (out.stdout + out.stderr).splitlines() if "Used" in ln or "spill" in ln]
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return "; ".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="mamba2,gdn,kda")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, ptxas {get_ptxas(90).version}, target sm_90a")
    for kind in args.kinds.split(","):
        rows, sdim = SHAPES[kind]
        for nv in (1, 2, 6):
            variants = parse_variants(["fp8_e4m3", "fp8_e4m3@replay16", "int8", "int8@replay16", "nvfp4", "nvfp4@replay16"][:nv])
            ((_, (block_p, warps)),) = plan_launches(variants, rows, sdim)
            for bp, w, label in ((block_p, warps, "planned"), (2 * block_p, warps, "2x rows")):
                print(f"{kind} NV={nv} BLOCK_P={bp:3d} warps={w} ({label}): {compile_and_count(kind, nv, bp, w)}", flush=True)


if __name__ == "__main__":
    main()
