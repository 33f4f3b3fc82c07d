"""A/B of one of the delta-rule launch's rules on the GPU, in one process: `register_cap` (ptxas's .maxnreg for
several warps, `ssmquant.kernels.common.register_cap`, against none) or `per_step_offsets` (input and SR offsets
computed per step, `ssmquant.kernels.delta_rule.per_step_offsets`, against hoisted). Each variant alone at its
planned tiling, timed with the rule as shipped ("on") and with the alternative ("off"), alternating rep by rep so
that clock and thermal drift fall on both.

    python lab/gpu/launch_option_ab.py --option register_cap|per_step_offsets [--kinds gdn,kda]
        [--formats fp8_e4m3:head:sr,nvfp4:head:sr,fp8_e4m3:head] [--steps 1024] [--batch 16] [--reps 5] [--out FILE.json]

Prints, per kind and variant, G elem-steps/s median (slowest-fastest) on and off, and their ratio. Both rules are
the delta-rule Triton kernel's (GDN, KDA), so the KDA CUDA kernel is turned off here (SSMQUANT_KDA_CUDA=0): it would
take KDA's per-row RNE variants, and both arms would time the same code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import cuda_seconds  # noqa: E402
from benchmarks.emulation import drain, layer_inputs  # noqa: E402
from ssmquant.kernels import delta_rule, emulate_triton_steps  # noqa: E402
from ssmquant.kernels.common import register_cap  # noqa: E402

_shipped_offsets = delta_rule.per_step_offsets  # bound before the A/B patches the module's name

# the rule as shipped, and its alternative, per option
OPTIONS = {
    "register_cap": (register_cap, lambda num_warps: None),
    "per_step_offsets": (_shipped_offsets, lambda num_warps, specs: not _shipped_offsets(num_warps, specs)),
}
from ssmquant.replay import parse_variant  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--option", required=True, choices=sorted(OPTIONS))
    ap.add_argument("--kinds", default="gdn,kda")
    ap.add_argument("--formats", default="fp8_e4m3:head:sr,nvfp4:head:sr,fp8_e4m3:head")
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON of every run's rate")
    args = ap.parse_args()
    if set(args.kinds.split(",")) - {"gdn", "kda"}:
        sys.exit(f"--kinds takes gdn and / or kda (the delta-rule kernel's rules), got {args.kinds!r}")
    os.environ["SSMQUANT_KDA_CUDA"] = "0"  # every variant in the Triton kernel, whose rules are compared
    if not torch.cuda.is_available():
        sys.exit("launch_option_ab times GPU launches: no CUDA device here")
    shipped, alternative = OPTIONS[args.option]
    rules = {"on": shipped, "off": alternative}
    out = []
    for kind in args.kinds.split(","):
        inputs = layer_inputs(kind, args.batch, args.steps, "cuda")
        elems = math.prod(inputs.state_shape) * args.steps
        for fmt in args.formats.split(","):
            variants = [parse_variant(fmt)]
            rates = {name: [] for name in rules}

            def run(inputs=inputs, variants=variants) -> None:
                drain(emulate_triton_steps(inputs, variants))

            for rule in rules.values():  # warm-up (and compile) each
                setattr(delta_rule, args.option, rule)
                run()
            torch.cuda.synchronize()
            for _ in range(args.reps):
                for name, rule in rules.items():
                    setattr(delta_rule, args.option, rule)
                    rates[name].append(elems / cuda_seconds(run) / 1e9)
            setattr(delta_rule, args.option, shipped)
            med = {n: sorted(r)[len(r) // 2] for n, r in rates.items()}
            print(
                f"{kind} {fmt}: {args.option} on {med['on']:.1f} G/s ({min(rates['on']):.1f}-{max(rates['on']):.1f}), "
                f"off {med['off']:.1f} ({min(rates['off']):.1f}-{max(rates['off']):.1f}), on / off {med['on'] / med['off']:.2f}",
                flush=True,
            )
            out.append({"kind": kind, "format": fmt, "rates": rates})
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "option": args.option,
                                                      "runs": out}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
