"""Does a variant's metrics in a launch shared with other variants equal its launch alone, bit for bit, on a GPU?
And if not, which metric, from which step, and does it depend on FMA contraction (fp_fusion) or the fast 8-bit
rounding (fast_round)?

    python lab/gpu/shared_launch.py [--out FILE.json]

The shapes and variants of tests/kernels/test_multi_variant.py (12 rows, tiling 16 x 1). Prints one line per
(kind, path, variant) that differs, and writes everything to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssmquant import formats, kinds  # noqa: E402
from ssmquant.formats import Rounding, ScaleMode  # noqa: E402
from ssmquant.kernels.common import BUFFER_CODES, slot_spec  # noqa: E402
from ssmquant.kernels.delta_rule import delta_rule_launch  # noqa: E402
from ssmquant.kernels.quantize import group_rows_for_kernel  # noqa: E402
from ssmquant.kernels.rounding import FORMAT_CODES  # noqa: E402
from ssmquant.replay import Variant, parse_variants, reference_decode  # noqa: E402
from tests.replay.helpers import gdn_inputs, kda_inputs  # noqa: E402

VARIANTS = ["fp8_e4m3@conventional", "int8:sr@replay4", "nvfp4@conventional", "nvfp4:sr@spec8x2:p0.5",
            "int16@replay4", "fp16:sr@conventional", "bf16@replay4:fp32", "fp8_e4m3:rows4:sr@replay4",
            "int8:head@conventional", "fp32@conventional"]  # fmt: skip


def variants_of(inp):
    _, _, states = reference_decode(inp, return_states=True)
    amax = states.abs().amax(dim=(0, 1, 4))
    static = Variant(formats.parse("int8:static"), static_scale=amax * 0.5 / 127, seed=4)
    vs = parse_variants(VARIANTS)
    return vs[:3] + [static] + vs[3:]


def launch(inp, group, block_p, **options):
    """metrics [NV, T, B, H, 4] of one launch carrying `group`."""
    rows = inp.rows
    specs = tuple(
        slot_spec(FORMAT_CODES[v.format.encoding],
                  block_p if v.format.granularity.rows is None else group_rows_for_kernel(v.format, rows, block_p),
                  v.format.scale_mode is ScaleMode.STATIC, v.format.rounding is Rounding.SR,
                  BUFFER_CODES[v.scheme.buffer_dtype] if v.scheme.rounds_buffer else 0)  # fmt: skip
        for v in group
    )
    dev = inp.device
    write = torch.stack([v.scheme.write_mask(inp.batch, inp.steps).to(dev, torch.int8) for v in group])
    seeds = torch.tensor([v.seed for v in group], dtype=torch.int64, device=dev)
    static = None
    if any(v.format.scale_mode is ScaleMode.STATIC for v in group):
        static = torch.ones(len(group), inp.batch, inp.num_heads, rows, device=dev)
        for j, v in enumerate(group):
            if v.static_scale is not None:
                g = v.format.granularity.group_rows(rows)
                static[j] = v.static_scale.float().to(dev).expand(inp.batch, inp.num_heads, rows // g).repeat_interleave(g, -1)
    alpha = kinds.of(inp).decays(inp).contiguous()
    s0 = None if inp.initial_state is None else inp.initial_state.float().contiguous()
    m = delta_rule_launch(inp.q.contiguous(), inp.k.contiguous(), inp.v.contiguous(), alpha,
                          inp.beta.float().contiguous(), s0, write, seeds, static, specs=specs, block_p=block_p,
                          num_warps=1, **options)  # fmt: skip
    return m.sum(4)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> dict | None:
    """Where two metric tensors [T, B, H, 4] differ in their bits: the metrics, the first step, the largest
    relative difference."""
    diff = a.view(torch.int32) != b.view(torch.int32)
    if not bool(diff.any()):
        return None
    steps = diff.any(dim=(1, 2, 3)).nonzero().flatten().tolist()
    rel = ((a - b).abs() / b.abs().clamp(min=1e-30)).amax().item()
    return {"metrics": diff.any(dim=(0, 1, 2)).nonzero().flatten().tolist(), "first_step": steps[0],
            "steps_differing": len(steps), "max_rel": rel}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu: TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    results = []
    for kind, make in (("gdn", gdn_inputs), ("kda", kda_inputs)):
        inp = make(batch=2, steps=9, key_heads=1, value_heads=2, dk=48, dv=12, device=args.device)
        inp.initial_state = torch.randn(inp.state_shape, device=inp.device) * 0.1
        vs = variants_of(inp)[:6]  # the first shared launch of the test
        block_p = 16
        for path in ({"fp_fusion": True, "fast_round": True}, {"fp_fusion": False, "fast_round": True},
                     {"fp_fusion": True, "fast_round": False}, {"fp_fusion": False, "fast_round": False}):  # fmt: skip
            shared = launch(inp, vs, block_p, **path)
            for i, v in enumerate(vs):
                alone = launch(inp, [v], block_p, **path)[0]
                d = first_difference(shared[i], alone)
                row = {"kind": kind, **path, "variant": v.name, "identical": d is None, **(d or {})}
                results.append(row)
                if d is not None:
                    print(json.dumps(row))
    same = sum(r["identical"] for r in results)
    print(f"shared == alone, bit for bit: {same} of {len(results)} (kind x path x variant); "
          f"{torch.cuda.get_device_name() if args.device != 'cpu' else 'cpu (Triton interpreter)'}, "
          f"torch {torch.__version__}, triton {triton.__version__}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
