"""Instructions per time step of the Mamba-2 emulation kernel, from its machine code, without a GPU.

Compiles `_mamba2_emulate_kernel` ahead of time for an H100/H200 (sm_90a) with the installed Triton and
the launcher's options, disassembles it with the cuobjdump that Triton ships, and walks one iteration of
the time loop (the only backward branch) along the path of a step at which the conventional slots write
and the replay slots do not: a branch on a write mask (its predicate set from a byte loaded by LDG.E.U8)
falls through for a conventional slot and is taken for a replay slot, metrics are recorded (record_every
specialised to 1, as the launches pass it), and every other forward branch (the exact-division fallbacks,
div.rn's slow paths) is taken.
It prints the instructions on that path, in total and by opcode: a static count of one thread's work per
step (each thread holds 128 / (NV + 1) elements of each state), not a timing.

    python benchmarks/kernel_sass.py [--cases fp8,nvfp4,six]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ssmquant.kernels.common import slot_spec  # noqa: E402
from ssmquant.kernels.mamba2 import _mamba2_emulate_kernel  # noqa: E402
from ssmquant.kernels.rounding import FMT_FP8, FMT_INT8, FMT_NVFP4  # noqa: E402

# name -> ([(format code, buffer code 0 conventional / 1 replay16 with a bf16 ring)], BLOCK_P): the planned tilings
CASES = {
    "fp8": ([(FMT_FP8, 0)], 16),
    "nvfp4": ([(FMT_NVFP4, 0)], 16),
    "six": ([(f, buf) for f in (FMT_FP8, FMT_INT8, FMT_NVFP4) for buf in (0, 1)], 4),
}
INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"^(@!?P\d)\s+BRA\s+(?:!?P\d, )?0x([0-9a-f]+)")


def sass_of(fn, ptrs: dict, const: dict, options: dict) -> list[tuple[int, str]]:
    """(address, instruction) of Triton kernel `fn` compiled ahead of time for sm_90a: ptrs maps pointer
    arguments to their types (other arguments i32), const the constexprs; record_every is specialised to 1
    (metrics every step, as emulate_triton_steps launches it); options are triton.compile's (the launcher's)."""
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
    constexprs = {(names.index(k),): v for k, v in const.items()}
    constexprs[(names.index("record_every"),)] = 1
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        out = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, out.stdout.splitlines()) if m]


def compile_sass(slots, block_p: int) -> list[tuple[int, str]]:
    """(address, instruction) of the kernel compiled for sm_90a with one warp."""
    specs = ([slot_spec(f, block_p, False, False, buf) for f, buf in slots] + [0] * 6)[:6]
    ptrs = dict.fromkeys(["dt_ptr", "a_ptr", "d_ptr", "s0_ptr", "scale_ptr", "metrics_ptr"], "*fp32")
    ptrs.update(x_ptr="*bf16", bm_ptr="*bf16", cm_ptr="*bf16", write_ptr="*i8", seed_ptr="*i64")
    const = dict(BLOCK_P=block_p, BLOCK_N=128, HAS_S0=False, NV=len(slots), KMAJOR=True)  # as mamba2_launch
    const.update({f"SPEC{i}": s for i, s in enumerate(specs)})
    opts = {"num_warps": 1, "enable_fp_fusion": True, "enable_reflect_ftz": False}  # as mamba2_launch
    return sass_of(_mamba2_emulate_kernel, ptrs, const, opts)


def write_branches(ins: list[tuple[int, str]], head: int, end: int) -> set[int]:
    """Indices of the branches on a write mask: a byte loaded by LDG.E.U8 (in the loop, or a step ahead and carried
    into it through PRMT / MOV copies, as the KDA kernel's PREFETCH does) is tested by the first ISETP or LOP3 in
    the loop after its load that reads it (or a copy) and sets a predicate; the next branch on that predicate skips
    the slot's write."""
    copies: dict[str, str] = {}  # register -> the byte register it copies (PRMT dst, src, 0x7610 / MOV dst, src)
    for _, t in ins:
        m = re.match(r"(?:PRMT (R\d+), (R\d+), 0x7610|MOV (R\d+), (R\d+)\b)", t)
        if m:
            dst, src = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            copies.setdefault(dst, src)
    out = set()
    for j, (_, t) in enumerate(ins):
        if "LDG.E.U8" not in t:
            continue
        regs = {t.split("LDG.E.U8")[1].split(",")[0].strip()}
        regs |= {dst for dst, src in copies.items() if src in regs}
        for k in list(range(max(j + 1, head), end)) + (list(range(head, j)) if head <= j < end else []):
            m = re.match(r"(?:ISETP\S*|LOP3\.LUT) (P\d), (?:PT|RZ), (R\d+)\b", ins[k][1])
            if m and m.group(2) in regs:
                pred = m.group(1)
                out.add(next(n for n in range(k + 1, end) if (b := BRANCH.match(ins[n][1])) and b.group(1).lstrip("@!") == pred))
                break
    return out


def step_path(ins: list[tuple[int, str]], conventional: list[bool]) -> collections.Counter:
    """Opcodes on one loop iteration's path (see the module docstring); conventional[k]: slot k writes."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    back = [i for i, (a, t) in enumerate(ins) if re.match(r"BRA 0x[0-9a-f]+$", t) and int(t[6:], 16) < a]
    if len(back) != 1:
        raise RuntimeError(f"expected one backward branch (the time loop), found {len(back)}")
    end = back[0]
    head = at[int(ins[end][1][6:], 16)]
    writes = write_branches(ins, head, end)
    if len(writes) != len(conventional):
        raise RuntimeError(f"found {len(writes)} write-mask branches for {len(conventional)} slots")
    order = sorted(writes)
    count, i = collections.Counter(), head
    while i < end:
        a, t = ins[i]
        count[re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]] += 1
        m = BRANCH.match(t)
        if m and int(m.group(2), 16) > a:
            # a write-mask branch skips the slot's write; any other forward branch skips a fallback or slow path
            if i not in writes or not conventional[order.index(i)]:
                i = at[int(m.group(2), 16)]
                continue
        i += 1
    return count


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90a")
    for name in args.cases.split(","):
        slots, block_p = CASES[name]
        count = step_path(compile_sass(slots, block_p), [buf == 0 for _, buf in slots])
        top = ", ".join(f"{k} {v}" for k, v in count.most_common(8))
        print(f"{name} (NV={len(slots)}, BLOCK_P={block_p}): {sum(count.values())} instructions per step ({top})")


if __name__ == "__main__":
    main()
