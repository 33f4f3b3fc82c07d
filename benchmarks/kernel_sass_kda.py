"""Instructions per element-step of the fused KDA kernel's time loop, from its sm_90a machine code, without a GPU.

Compiles `_delta_rule_emulate_kernel` (VEC_DECAY: KDA) ahead of time for an H100/H200 with the installed Triton,
at GLM-5.3-Flash's head (Dk = Dv = 128), one variant beside the FP32 reference at the planned tiling (BLOCK_P 16,
one warp: each thread holds 64 elements of each state), and walks one iteration of the time loop along the path of
a write step with `kernel_sass.step_path` (fallbacks and slow paths skipped). It prints the count per step and per
element-step (/ 64) for each arithmetic path of `delta_rule_launch`: the default (fast_round and fp_fusion on) and
the previous default (both off). A static count of one thread's work, not a timing; the device's Triton may differ.

    python benchmarks/kernel_sass_kda.py [--formats fp8_e4m3,int8,nvfp4]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import triton  # noqa: E402
from kernel_sass import sass_of, step_path  # noqa: E402

from ssmquant.kernels.common import slot_spec  # noqa: E402
from ssmquant.kernels.delta_rule import _delta_rule_emulate_kernel  # noqa: E402
from ssmquant.kernels.rounding import FMT_FP8, FMT_INT8, FMT_NVFP4  # noqa: E402

FORMATS = {"fp8_e4m3": FMT_FP8, "int8": FMT_INT8, "nvfp4": FMT_NVFP4}
BLOCK_P, ELEMENTS_PER_THREAD = 16, 128 * 16 // 32
PATHS = {"default (fast_round, fp_fusion)": (True, True, False), "prefetch (default + next step's loads ahead)": (True, True, True),
         "previous (both off)": (False, False, False)}


def compile_sass(fmt: int, fast_round: bool, fp_fusion: bool, prefetch: bool = False) -> list[tuple[int, str]]:
    """(address, instruction) of the KDA kernel, one conventional slot of format fmt, as delta_rule_launch builds it."""
    ptrs = dict.fromkeys(["q_ptr", "k_ptr", "alpha_ptr", "beta_ptr", "s0_ptr", "scale_ptr", "metrics_ptr"], "*fp32")
    ptrs.update(v_ptr="*bf16", write_ptr="*i8", seed_ptr="*i64")
    specs = [slot_spec(fmt, BLOCK_P, False, False, 0)] + [0] * 5
    const = dict(BLOCK_P=BLOCK_P, BLOCK_N=128, VEC_DECAY=True, HAS_S0=False, FAST_ROUND=fast_round, FP_FUSION=fp_fusion,
                 PREFETCH=prefetch, ROW_BLOCKS_FIRST=False,
                 NV=1, **{f"SPEC{i}": s for i, s in enumerate(specs)})
    opts = {"num_warps": 1, "enable_fp_fusion": fp_fusion, "enable_reflect_ftz": False}
    return sass_of(_delta_rule_emulate_kernel, ptrs, const, opts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90a, KDA 128 x 128, BLOCK_P {BLOCK_P}, one warp, conventional")
    for name in args.formats.split(","):
        for label, (fast, fusion, prefetch) in PATHS.items():
            count = step_path(compile_sass(FORMATS[name], fast, fusion, prefetch), [True])
            total = sum(count.values())
            top = ", ".join(f"{k} {v}" for k, v in count.most_common(8))
            print(f"{name} {label}: {total} per step, {total / ELEMENTS_PER_THREAD:.1f} per element-step ({top})", flush=True)


if __name__ == "__main__":
    main()
