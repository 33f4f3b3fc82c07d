"""Instructions per time step of the emulation kernels, counted in their sm_90 machine code, without a GPU.

- Triton kernels (`_mamba2_emulate_kernel`, `_delta_rule_emulate_kernel` for KDA): compiled ahead of time for an
  H100/H200 (sm_90a) with the installed Triton and the launchers' options, disassembled with the cuobjdump that
  Triton ships. One iteration of the time loop (the only backward branch) is walked along the path of a step at
  which the conventional slots write and the replay slots do not: a branch on a write mask (its predicate set from a
  byte loaded by LDG.E.U8, in the loop or a step ahead) falls through for a conventional slot and is taken for a
  replay slot, and every other forward branch (the exact-division fallbacks, div.rn's slow paths, the nvfp4 write's
  clamp of quotients above 7, needed only where a block scale saturates) is taken.
  Mamba-2 at Nemotron-3-Nano's head (P 64, N 128) for fp8 and nvfp4 alone (BLOCK_P 16) and the six default variants
  in one launch (BLOCK_P 4); KDA at GLM-5.3-Flash's head (Dk = Dv = 128), one conventional variant at BLOCK_P 16, one
  warp, for each arithmetic path of `delta_rule_launch`: the default (fast_round and fp_fusion on), the default with
  the next step's loads ahead (prefetch) and the previous default (both off); GDN at Qwen3.5-9B's head (Dk = Dv =
  128, one decay per head), the same launch, default path. Mamba-2, GDN and KDA also count fp8_e4m3 and nvfp4 with
  stochastic rounding (:sr; the delta-rule kernel: default path), and both with per-head scales, RNE and SR, at the
  whole-head tilings `plan_launches` picks (Mamba-2 64 rows over 4 warps, GDN / KDA 128 over 8: 64 elements of a
  state per thread), with the launch's register cap and per-step offsets.
- The KDA CUDA kernel (`ssmquant/kernels/kda_cuda.py`): compiled for sm_90 by NVRTC (the nvidia-cuda-nvrtc wheel,
  a dev dependency), disassembled with Triton's nvdisasm; the time loop is the longest backward branch, walked
  along its common path (`nvdisasm_loop`): the division slow paths (not taken for normal operands) and NVFP4's
  exact-division fallback (a branch on a warp vote, taken only for states far outside the usual range) are not
  counted. Conventional (every step writes, no write-mask branch), fp32 q / k, bf16 v; fp8_e4m3, int8 and nvfp4.

Per element-step = per step / the elements of one state a thread holds (BLOCK_P x 128 / (32 lanes x warps); the
CUDA kernel: 64). A static count of one thread's work, not a timing; the GPU machine's Triton may compile other code.

    python benchmarks/run.py sass [--parts mamba2,gdn,kda,kda-cuda] [--quick] [--update-results]
"""

from __future__ import annotations

import collections
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from benchmarks.common import Result, Section, markdown_table

PARTS = ("mamba2", "gdn", "kda", "kda-cuda")
INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"^(@!?P\d)\s+BRA\s+(?:!?P\d, )?0x([0-9a-f]+)")
TOP = 8  # opcodes named per row


# -- reading machine code (pure Python) -----------------------------------------------------------------------------
def parse_cuobjdump(text: str) -> list[tuple[int, str]]:
    """(address, instruction) of each instruction line of `cuobjdump -sass` output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, text.splitlines()) if m]


def opcode(instruction: str) -> str:
    """The opcode of a SASS instruction without its predicate and modifiers ("@!P0 FFMA.FTZ R1, ..." -> "FFMA")."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def write_branches(ins: list[tuple[int, str]], head: int, end: int) -> set[int]:
    """Indices of the branches on a write mask: a byte loaded by LDG.E.U8 (in the loop, or a step ahead and carried
    into it through PRMT / MOV copies, as the KDA kernel's PREFETCH does) is tested by the first ISETP or LOP3 in
    the loop after its load that reads it (or a copy) and sets a predicate; the next branch on that predicate skips
    the slot's write. Copies: PRMT dst, src, 0x7610, MOV dst, src, and a spill (STL to a stack slot, LDL back), of
    copies too (the whole-head tilings spill the byte)."""
    copies: dict[str, set[str]] = collections.defaultdict(set)  # register -> the registers it may copy
    spilled: dict[str, set[str]] = collections.defaultdict(set)  # stack slot -> the registers stored there
    for _, t in ins:
        if m := re.match(r"STL(?:\.\w+)* \[(R1(?:\+0x[0-9a-f]+)?)\], (R\d+)", t):
            spilled[m.group(1)].add(m.group(2))
    for _, t in ins:
        if m := re.match(r"(?:PRMT (R\d+), (R\d+), 0x7610|MOV (R\d+), (R\d+)\b)", t):
            dst, src = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            copies[dst].add(src)
        elif m := re.match(r"LDL(?:\.\w+)* (R\d+), \[(R1(?:\+0x[0-9a-f]+)?)\]", t):
            copies[m.group(1)] |= spilled[m.group(2)]
    out = set()
    for j, (_, t) in enumerate(ins):
        if "LDG.E.U8" not in t:
            continue
        regs = {t.split("LDG.E.U8")[1].split(",")[0].strip()}
        while grown := {dst for dst, srcs in copies.items() if srcs & regs} - regs:  # copies of copies
            regs |= grown
        for k in list(range(max(j + 1, head), end)) + (list(range(head, j)) if head <= j < end else []):
            m = re.match(r"(?:ISETP\S*|LOP3\.LUT) (P\d), (?:PT|RZ), (R\d+)\b", ins[k][1])
            if m and m.group(2) in regs:
                pred = m.group(1)
                out.add(next(n for n in range(k + 1, end) if (b := BRANCH.match(ins[n][1])) and b.group(1).lstrip("@!") == pred))
                break
    return out


def step_path(ins: list[tuple[int, str]], conventional: list[bool]) -> collections.Counter:
    """Opcodes on one time-loop iteration's path (module docstring); conventional[k]: slot k writes this step."""
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
        count[opcode(t)] += 1
        m = BRANCH.match(t)
        if m and int(m.group(2), 16) > a:
            # a write-mask branch skips the slot's write; any other forward branch skips a fallback or slow path
            if i not in writes or not conventional[order.index(i)]:
                i = at[int(m.group(2), 16)]
                continue
        i += 1
    return count


def nvdisasm_loop(text: str, function: str) -> collections.Counter:
    """Opcodes on the common path through the longest loop (backward branch to a label) of `function` in
    `nvdisasm -c` output: rare paths are not counted. A branch on a warp vote (`VOTE.ANY Pn`) is the NVFP4 write's
    exact-division fallback: `@Pn BRA` to it is not taken, `@!Pn BRA` over it is. Another conditional forward
    branch is taken where the code it skips calls a division's slow path (`..._slowpath`, not taken for normal
    operands: `@P BRA` over it to the fast path, or `@!P BRA` past it), and falls through elsewhere; an
    unconditional forward branch is followed (the common path jumping over a rare one)."""
    lines = text.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if f".text.{function}" in line) :]
    labels = {line[:-1]: i for i, line in enumerate(body) if re.match(r"\.L_x_\d+:$", line)}
    loops = [
        (labels[m.group(1)], i)
        for i, line in enumerate(body)
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i
    ]
    if not loops:
        raise RuntimeError(f"no loop found in {function}")
    start, end = max(loops, key=lambda se: se[1] - se[0])
    ops, votes, i = collections.Counter(), set(), start
    while i <= end:
        line = body[i]
        if re.search(r"/\*[0-9a-f]{4}\*/", line):
            ops[opcode(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line))] += 1
            if m := re.search(r"VOTE\.ANY (P\d)\b", line):
                votes.add(m.group(1))
            m = re.search(r"(@!?)(P\d) BRA `\((\.L_x_\d+)\)", line)
            target = labels.get(m.group(3), -1) if m else -1
            if m and target > i:
                if m.group(2) in votes:
                    if m.group(1) == "@!":  # over the fallback: taken when no lane asks for it
                        i = target
                        continue
                elif any("slowpath" in body[j] for j in range(i + 1, target)):
                    i = target  # past a division's slow path
                    continue
            m = re.match(r"\s*/\*[0-9a-f]+\*/\s*BRA `\((\.L_x_\d+)\)", line)
            if m and labels.get(m.group(1), -1) > i:
                i = labels[m.group(1)]
                continue
        i += 1
    return ops


def count_row(count: collections.Counter, elements: int, **label) -> dict:
    """A table row: the label columns, instructions per step and per element-step, the top opcodes."""
    total = sum(count.values())
    top = ", ".join(f"{k} {v}" for k, v in count.most_common(TOP))
    return {**label, "per step": total, "per element-step": round(total / elements, 2), "top opcodes": top}


# -- compiling (Triton, NVRTC) --------------------------------------------------------------------------------------
def _triton_bin(tool: str) -> pathlib.Path:
    import triton

    return pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool


# Pointer arguments of the emulation kernels as their launchers pass them (mamba2_launch, delta_rule_launch); every
# other non-constexpr argument is an i32. A pointer the table misses compiles as an integer and fails: keep both in
# step with the kernels' signatures (registers.py compiles from them too).
MAMBA2_POINTERS = {
    **dict.fromkeys(
        ["dt_ptr", "a_ptr", "d_ptr", "s0_ptr", "sv0_ptr", "scale_ptr", "metrics_ptr", "out_ptr", "final_ptr"], "*fp32"
    ),
    **dict(x_ptr="*bf16", bm_ptr="*bf16", cm_ptr="*bf16", write_ptr="*i8", seed_ptr="*i64"),
}
DELTA_RULE_POINTERS = {
    **dict.fromkeys(
        ["q_ptr", "k_ptr", "alpha_ptr", "beta_ptr", "s0_ptr", "sv0_ptr", "scale_ptr", "metrics_ptr", "out_ptr"]
        + ["final_ptr"],
        "*fp32",
    ),
    **dict(v_ptr="*bf16", write_ptr="*i8", seed_ptr="*i64"),
}
# the compiled path starts from a zero state (no initial state, no per-slot stored one) and records metrics
METRICS_PATH = {"HAS_S0": False, "HAS_SV0": False, "OUTPUTS": False, "FINAL": False}


def compile_ahead(fn, ptrs: dict, const: dict, options: dict):
    """Triton kernel `fn` compiled ahead of time for sm_90a (triton's CompiledKernel: `.asm["ptx"]`, `["cubin"]`):
    ptrs maps pointer arguments to their types (other arguments i32), const the constexprs; options are
    triton.compile's (the launcher's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
    constexprs = {(names.index(k),): v for k, v in const.items()}
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options=options)


def cubin_tool(tool: str, cubin: bytes, *args: str) -> str:
    """The output of Triton's bundled CUDA binary utility `tool` (cuobjdump, nvdisasm) run on a cubin with `args`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(_triton_bin(tool)), *args, str(path)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def cubin_resources(cubin: bytes, function: str) -> dict[str, int]:
    """`function`'s resource usage in a cubin as `cuobjdump -res-usage` reads it from the machine code ({"REG": ...,
    "STACK": ..., "LOCAL": ...}: registers, stack frame bytes, which hold any spill, and local memory bytes). Read from
    the cubin rather than from NVRTC's `--ptxas-options=-v` log, which the GPU machine's NVRTC left empty on repeated
    compiles."""
    out = cubin_tool("cuobjdump", cubin, "-res-usage")
    found = re.search(rf"Function {re.escape(function)}:\s*\n\s*(.*)", out)
    if found is None:
        raise ValueError(f"no function {function!r} in the cubin's resource usage:\n{out}")
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", found.group(1))}


def sass_of(fn, ptrs: dict, const: dict, options: dict) -> list[tuple[int, str]]:
    """(address, instruction) of Triton kernel `fn` compiled ahead of time (`compile_ahead`, same arguments)."""
    return parse_cuobjdump(cubin_tool("cuobjdump", compile_ahead(fn, ptrs, const, options).asm["cubin"], "-sass"))


def mamba2_build(specs: list[int], block_p: int, num_warps: int) -> tuple[dict, dict]:
    """(constexprs, compile options) of the Mamba-2 kernel carrying slots `specs` (`common.slot_spec`) at BLOCK_P
    rows over num_warps warps, as mamba2_launch builds them."""
    const = dict(BLOCK_P=block_p, BLOCK_N=128, **METRICS_PATH, NV=len(specs), KMAJOR=True)
    const.update({f"SPEC{i}": s for i, s in enumerate((list(specs) + [0] * 6)[:6])})
    return const, {"num_warps": num_warps, "enable_fp_fusion": True, "enable_reflect_ftz": False}


def delta_rule_build(
    specs: list[int],
    block_p: int,
    num_warps: int,
    vec_decay: bool,
    fast_round: bool = True,
    fp_fusion: bool = True,
    prefetch: bool = False,
) -> tuple[dict, dict]:
    """(constexprs, compile options) of the delta-rule kernel (KDA's; GDN's without vec_decay, one decay per head)
    carrying slots `specs` at BLOCK_P rows over num_warps warps, as delta_rule_launch builds them: its per-step
    offsets and register cap included (the grid order changes no instruction of a thread's step)."""
    from ssmquant.kernels.common import register_cap
    from ssmquant.kernels.delta_rule import per_step_offsets

    const = dict(BLOCK_P=block_p, BLOCK_N=128, VEC_DECAY=vec_decay, **METRICS_PATH, FAST_ROUND=fast_round,
                 FP_FUSION=fp_fusion, PREFETCH=prefetch, ROW_BLOCKS_FIRST=False, KMAJOR=True,
                 PER_STEP_OFFSETS=per_step_offsets(num_warps, tuple(specs)), NV=len(specs))  # fmt: skip
    const.update({f"SPEC{i}": s for i, s in enumerate((list(specs) + [0] * 6)[:6])})
    options = {"num_warps": num_warps, "enable_fp_fusion": fp_fusion, "enable_reflect_ftz": False,
               "maxnreg": register_cap(num_warps)}  # fmt: skip
    return const, options


def mamba2_sass(
    slots: list[tuple[int, int]], block_p: int, sr: bool = False, num_warps: int = 1, group: int = 1
) -> list[tuple[int, str]]:
    """The Mamba-2 kernel for slots [(format code, buffer code)] at BLOCK_P rows over num_warps warps, as mamba2_launch
    builds it (sr: every slot rounds stochastically; group: rows per scale, 1 per row, BLOCK_P per head)."""
    from ssmquant.kernels.common import slot_spec
    from ssmquant.kernels.mamba2 import _mamba2_emulate_kernel

    const, opts = mamba2_build([slot_spec(f, group, False, sr, buf) for f, buf in slots], block_p, num_warps)
    return sass_of(_mamba2_emulate_kernel, MAMBA2_POINTERS, const, opts)


def kda_sass(
    fmt: int,
    fast_round: bool,
    fp_fusion: bool,
    prefetch: bool,
    vec_decay: bool = True,
    sr: bool = False,
    block_p: int = 16,
    num_warps: int = 1,
    group: int = 1,
) -> list[tuple[int, str]]:
    """The KDA kernel (GDN's without vec_decay: one decay per head), one conventional slot of format code fmt at
    BLOCK_P rows over num_warps warps (sr: rounding stochastically; group: rows per scale, 1 per row, BLOCK_P per
    head), as delta_rule_launch builds it."""
    from ssmquant.kernels.common import slot_spec
    from ssmquant.kernels.delta_rule import _delta_rule_emulate_kernel

    const, opts = delta_rule_build(
        [slot_spec(fmt, group, False, sr, 0)], block_p, num_warps, vec_decay, fast_round, fp_fusion, prefetch
    )
    return sass_of(_delta_rule_emulate_kernel, DELTA_RULE_POINTERS, const, opts)


def kda_cuda_nvdisasm(fmt: int, buf: int = 0, qk_dtype=None) -> str:
    """nvdisasm of the KDA CUDA kernel for format code fmt (conventional, bf16 v; buf: the buffered-k code, qk_dtype:
    q / k's dtype, fp32 by default), NVRTC for sm_90."""
    import torch

    from ssmquant.kernels import kda_cuda
    from tests.kernels.nvrtc_offline import nvrtc_compile

    qk_dtype = torch.float32 if qk_dtype is None else qk_dtype
    rc, log, cubin = nvrtc_compile(kda_cuda.kernel_source(fmt, buf, True, False, qk_dtype, torch.bfloat16),
                                   list(kda_cuda.NVRTC_OPTIONS))  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"NVRTC failed:\n{log}")
    return cubin_tool("nvdisasm", cubin, "-c")


# -- the benchmark --------------------------------------------------------------------------------------------------
def delta_rule_per_head(kind: str, formats: dict, raw: dict) -> str:
    """The delta-rule kernel's per-head rows of `kind` (formats: name -> (format code, SR)) at the planned whole-head
    tiling (128 rows, 8 warps, 64 elements of a state per thread), kept in raw; the table's paragraph."""
    rows = []
    for name, (code, sr) in formats.items():
        sass = kda_sass(code, True, True, False, vec_decay=kind == "kda", sr=sr, block_p=128, num_warps=8, group=128)
        rows.append(count_row(step_path(sass, [True]), 128 * 128 // (32 * 8), format=name, BLOCK_P=128, warps=8))
        print(f"{kind} {name}: {rows[-1]['per element-step']} per element-step", flush=True)
    raw[f"{kind} per head"] = rows
    return (f"{kind.upper()}, per-head scales (a whole head per program, 8 warps, 64 elements of a state per thread; "
            "LDL / STL: the spills):\n\n" + markdown_table(rows))  # fmt: skip


def add_arguments(ap) -> None:
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated among {', '.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="fp8_e4m3 alone, default path (a check of the script)")


def run(args) -> Result:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("sass compiles machine code: run it without TRITON_INTERPRET=1")
    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        sys.exit(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {args.parts!r}")
    from triton.backends.nvidia.compiler import get_ptxas

    from ssmquant.kernels.rounding import FMT_FP8, FMT_INT8, FMT_NVFP4

    raw, body, notes = {}, [], []
    # per-head scales (one per head; the whole head in one program, over several warps: `plan_launches`), RNE and SR
    per_head = {"fp8_e4m3:head": (FMT_FP8, False), "nvfp4:head": (FMT_NVFP4, False),
                "fp8_e4m3:head:sr": (FMT_FP8, True), "nvfp4:head:sr": (FMT_NVFP4, True)}  # fmt: skip
    if "mamba2" in parts:
        cases = {
            "fp8_e4m3": ([(FMT_FP8, 0)], 16, False),
            "nvfp4": ([(FMT_NVFP4, 0)], 16, False),
            "fp8_e4m3:sr": ([(FMT_FP8, 0)], 16, True),
            "nvfp4:sr": ([(FMT_NVFP4, 0)], 16, True),
            "six default variants": ([(f, buf) for f in (FMT_FP8, FMT_INT8, FMT_NVFP4) for buf in (0, 1)], 4, False),
        }
        if args.quick:
            cases = {"fp8_e4m3": cases["fp8_e4m3"]}
        rows = []
        for name, (slots, block_p, sr) in cases.items():
            count = step_path(mamba2_sass(slots, block_p, sr), [buf == 0 for _, buf in slots])
            rows.append(count_row(count, block_p * 128 // 32, launch=name, NV=len(slots), BLOCK_P=block_p))
            print(f"mamba2 {name}: {rows[-1]['per step']} per step", flush=True)
        raw["mamba2"] = rows
        body.append("Mamba-2 Triton kernel (P 64, N 128, one warp; conventional slots write, replay16 slots do not; "
                    "the six-variant launch holds 16 elements of each of its 7 states per thread; :sr the stochastic "
                    "rounding path, the division's slow path not counted):\n\n"
                    + markdown_table(rows))  # fmt: skip
        if not args.quick:
            rows = []
            for name, (code, sr) in per_head.items():
                count = step_path(mamba2_sass([(code, 0)], 64, sr, num_warps=4, group=64), [True])
                rows.append(count_row(count, 64 * 128 // (32 * 4), format=name, BLOCK_P=64, warps=4))
                print(f"mamba2 {name}: {rows[-1]['per element-step']} per element-step", flush=True)
            raw["mamba2 per head"] = rows
            body.append("Mamba-2, per-head scales (a whole head per program, 4 warps, 64 elements of a state per "
                        "thread):\n\n" + markdown_table(rows))  # fmt: skip
    # (format code, SR) of the delta-rule rows: RNE for every format, SR for fp8_e4m3 and nvfp4
    delta_rule_formats = {"fp8_e4m3": (FMT_FP8, False), "int8": (FMT_INT8, False), "nvfp4": (FMT_NVFP4, False),
                          "fp8_e4m3:sr": (FMT_FP8, True), "nvfp4:sr": (FMT_NVFP4, True)}  # fmt: skip
    if "gdn" in parts:
        formats = {"fp8_e4m3": (FMT_FP8, False)} if args.quick else delta_rule_formats
        rows = []
        for name, (code, sr) in formats.items():
            rows.append(count_row(step_path(kda_sass(code, True, True, False, vec_decay=False, sr=sr), [True]),
                                  16 * 128 // 32, format=name, path="default"))  # fmt: skip
            print(f"gdn {name}: {rows[-1]['per element-step']} per element-step", flush=True)
        raw["gdn"] = rows
        body.append("GDN Triton kernel (Dk = Dv = 128, one decay per head, BLOCK_P 16, one warp, conventional; :sr "
                    "the stochastic rounding path, the division's slow path not counted):\n\n"
                    + markdown_table(rows))  # fmt: skip
        if not args.quick:
            body.append(delta_rule_per_head("gdn", per_head, raw))
    if "kda" in parts:
        formats = delta_rule_formats
        paths = {"default": (True, True, False), "default + prefetch": (True, True, True),
                 "previous (fast_round, fp_fusion off)": (False, False, False)}  # fmt: skip
        if args.quick:
            formats, paths = {"fp8_e4m3": (FMT_FP8, False)}, {"default": paths["default"]}
        rows = []
        for name, (code, sr) in formats.items():
            for label, flags in paths.items():
                if sr and label != "default":  # SR: the default path alone
                    continue
                rows.append(count_row(step_path(kda_sass(code, *flags, sr=sr), [True]), 16 * 128 // 32,
                                      format=name, path=label))  # fmt: skip
                print(f"kda {name} {label}: {rows[-1]['per element-step']} per element-step", flush=True)
        raw["kda"] = rows
        body.append("KDA Triton kernel (Dk = Dv = 128, BLOCK_P 16, one warp, conventional; :sr the stochastic rounding "
                    "path, the division's slow path not counted):\n\n" + markdown_table(rows))
        if not args.quick:
            body.append(delta_rule_per_head("kda", per_head, raw))
    if "kda-cuda" in parts:
        from tests.kernels.nvrtc_offline import nvrtc_library

        if nvrtc_library() is None:
            notes.append("KDA CUDA kernel: not counted, the nvidia-cuda-nvrtc wheel is missing (pip install -e .[dev])")
        else:
            formats = {"fp8_e4m3": FMT_FP8, "int8": FMT_INT8, "nvfp4": FMT_NVFP4}
            if args.quick:
                formats = {"fp8_e4m3": FMT_FP8}
            rows = []
            for name, code in formats.items():
                ops = nvdisasm_loop(kda_cuda_nvdisasm(code), "kda_emulate")
                rows.append(count_row(ops, 64, format=name))
                print(f"kda-cuda {name}: {rows[-1]['per element-step']} per element-step", flush=True)
            raw["kda-cuda"] = rows
            body.append("KDA CUDA kernel (NVRTC, sm_90, conventional, fp32 q / k, bf16 v; division slow paths "
                        "and NVFP4's exact-division fallback not counted):\n\n" + markdown_table(rows))  # fmt: skip
    from importlib.metadata import version

    ptxas = get_ptxas(90)
    tools = f"ptxas {ptxas.version} (Triton's)" + (
        f", NVRTC {version('nvidia-cuda-nvrtc')}" if "kda-cuda" in parts and "kda-cuda" in raw else ""
    )
    intro = (f"Instructions on one time step's path of one thread (a write step), from the machine code; per "
             f"element-step = per step / the elements of one state a thread holds. {tools}.\n\n")  # fmt: skip
    text = intro + "\n".join(body) + "".join(f"\n{n}\n" for n in notes)
    section = Section("Instructions per element-step (sm_90 machine code)", text)
    hardware = "No GPU: compiled offline for sm_90a (Triton) / sm_90 (NVRTC)"
    return Result({"sass": section}, raw, measurement=not args.quick, hardware=hardware)
