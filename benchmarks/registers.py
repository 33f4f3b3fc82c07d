"""Registers and spills of the emulation kernels at the tilings `plan_launches` picks, without a GPU.

Compiles each Triton kernel ahead of time for an H100/H200 (sm_90a) with the installed Triton and runs its bundled
ptxas with -v, which prints registers per thread and spill bytes. It checks the register-budget rule of
`ssmquant.kernels.plan_blocks` (NV + 1 states x 128 / (NV + 1) elements per thread) at 1, 2 and 6 variants, and the
tiling one size up (twice the rows), which should spill; and per-head SR (fp8_e4m3:head:sr, nvfp4:head:sr), a whole
head per program, at its planned tiling. Triton and ptxas versions change the numbers; the GPU machine's may differ.

    python benchmarks/run.py registers [--kinds mamba2,gdn,kda] [--variants 1,2,6] [--update-results]
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile

from benchmarks.common import Result, Section, markdown_table

SHAPES = {"mamba2": (64, 128), "gdn": (128, 128), "kda": (128, 128)}  # rows, state dim (Nano, Qwen3.5, GLM-5.3-Flash)
SIX = ["fp8_e4m3", "fp8_e4m3@replay16", "int8", "int8@replay16", "nvfp4", "nvfp4@replay16"]


def ptxas_counts(text: str) -> dict:
    """Registers, stack frame and spill bytes from `ptxas -v` output (the last function reported)."""
    out = {}
    for key, pattern in (("registers", r"Used (\d+) registers"), ("stack frame B", r"(\d+) bytes stack frame"),
                         ("spill stores B", r"(\d+) bytes spill stores"),
                         ("spill loads B", r"(\d+) bytes spill loads")):  # fmt: skip
        found = re.findall(pattern, text)
        out[key] = int(found[-1]) if found else None
    return out


def compile_and_count(kind: str, carried: list[str], block_p: int, num_warps: int) -> dict:
    """ptxas -v of `kind`'s kernel carrying the variants `carried` (names) at (block_p, num_warps), their slot specs
    as the launch builds them."""
    from triton.backends.nvidia.compiler import get_ptxas

    from benchmarks.sass import DELTA_RULE_POINTERS, MAMBA2_POINTERS, compile_ahead, delta_rule_build, mamba2_build
    from ssmquant.kernels import variant_slot_spec
    from ssmquant.kernels.delta_rule import _delta_rule_emulate_kernel
    from ssmquant.kernels.mamba2 import _mamba2_emulate_kernel
    from ssmquant.replay import parse_variants

    specs = [variant_slot_spec(v, SHAPES[kind][0], block_p) for v in parse_variants(carried)]
    if kind == "mamba2":
        fn, ptrs = _mamba2_emulate_kernel, MAMBA2_POINTERS
        const, options = mamba2_build(specs, block_p, num_warps)
    else:
        fn, ptrs = _delta_rule_emulate_kernel, DELTA_RULE_POINTERS
        const, options = delta_rule_build(specs, block_p, num_warps, vec_decay=kind == "kda")
    k = compile_ahead(fn, ptrs, const, options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = pathlib.Path(tmp) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        out = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(pathlib.Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return ptxas_counts(out.stdout + out.stderr)


def add_arguments(ap) -> None:
    ap.add_argument("--kinds", default="mamba2,gdn,kda", help="comma-separated among mamba2, gdn, kda")
    ap.add_argument("--variants", default="1,2,6", help="numbers of variants per launch (the first of the six)")


def run(args) -> Result:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("registers compiles machine code: run it without TRITON_INTERPRET=1")
    from triton.backends.nvidia.compiler import get_ptxas

    from ssmquant.kernels import plan_launches
    from ssmquant.replay import parse_variants

    kind_names = [k for k in args.kinds.split(",") if k]
    if not kind_names or set(kind_names) - set(SHAPES):
        sys.exit(f"--kinds takes a comma-separated subset of {', '.join(SHAPES)}, got {args.kinds!r}")
    counts = [int(n) for n in args.variants.split(",") if n]
    if not counts or any(not 1 <= n <= 6 for n in counts):
        sys.exit(f"--variants takes numbers 1..6, got {args.variants!r}")
    # launches: the first nv of the six; one variant alone also as nvfp4, whose write holds more live values; and
    # per-head SR, a whole head per program (the delta-rule kinds: 128 rows over 8 warps), at its planned tiling only
    launches = [SIX[:nv] for nv in counts] + ([["nvfp4"]] if 1 in counts else [])
    per_head = [["fp8_e4m3:head:sr"], ["nvfp4:head:sr"]] if 1 in counts else []
    rows = []
    for kind in kind_names:
        rows_dim, sdim = SHAPES[kind]
        for carried in launches + per_head:
            ((_, (block_p, warps)),) = plan_launches(parse_variants(carried), rows_dim, sdim, None, kind)
            tilings = ((block_p, "planned"),) if carried in per_head else ((block_p, "planned"), (2 * block_p, "2x rows"))
            for bp, label in tilings:
                row = {"kind": kind, "variants": carried[0] if len(carried) == 1 else f"{len(carried)} of the six",
                       "BLOCK_P": bp, "warps": warps, "tiling": label, **compile_and_count(kind, carried, bp, warps)}  # fmt: skip
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    ptxas = get_ptxas(90)
    body = (f"ptxas {ptxas.version} (Triton's) -v for sm_90a, per thread; the planned tilings of per-row variants should "
            "not spill, twice the rows should. Per-head SR holds a whole head per program and spills on the delta-rule "
            "kinds (their register cap: `kernels.common.register_cap`).\n\n" + markdown_table(rows))  # fmt: skip
    quick = kind_names != list(SHAPES) or counts != [1, 2, 6]
    return Result({"registers": Section("Registers and spills at the planned tilings (sm_90a)", body)}, {"rows": rows},
                  measurement=not quick, hardware="No GPU: compiled offline for sm_90a")  # fmt: skip
