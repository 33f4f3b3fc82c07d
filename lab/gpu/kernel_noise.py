"""How far the fused kernels' errors stray from the torch reference's at the real models' shapes: the noise that the
kernel-vs-reference tests' slack must cover (tests/kernels/test_emulation_kernels.py, test_kda_kernel.py).

    python lab/gpu/kernel_noise.py [--out FILE.json]

For each kind, the tests' inputs and variants: per variant and metric (state, output), the largest over the steps of
|sqrt(kernel err^2) - sqrt(reference err^2)| beyond the tests' fixed allowance (1e-5 of the reference norm), as a
fraction of the reference's error, pooled over (batch, head) as the tests pool it. The kernel and the reference sum
in different orders, so a rounding can flip at a grid midpoint; a systematic error would show as a large fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssmquant.kernels import emulate_triton  # noqa: E402
from ssmquant.replay import parse_variants  # noqa: E402
from ssmquant.simulate import simulate  # noqa: E402
from tests.kernels import test_emulation_kernels as emu  # noqa: E402
from tests.kernels import test_kda_kernel as kda  # noqa: E402


def noise(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """The largest relative excess over the steps, per quantity, pooled over (batch, head): ref / got [T, B, H, 4]."""
    ref, got = ref.sum((1, 2)), got.sum((1, 2))
    out = {}
    for name, e, r in (("state", 0, 1), ("out", 2, 3)):
        dev = np.abs(np.sqrt(got[..., e]) - np.sqrt(ref[..., e])) - 1e-5 * np.sqrt(ref[..., r])
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(ref[..., e] > 0, np.maximum(dev, 0) / np.sqrt(ref[..., e]), 0.0)
        out[name] = float(frac.max())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    # kda: the Triton kernel (as test_kda_kernel.py measures it); kda-cuda: the CUDA kernel's variants on a GPU
    cases = [("mamba2", emu.small_or_full("mamba2"), emu._variants("mamba2")),
             ("gdn", emu.small_or_full("gdn"), emu._variants("gdn")),
             ("kda", kda.small_or_full(), kda._variants())]  # fmt: skip
    if torch.cuda.is_available():
        cases.append(("kda-cuda", cases[-1][1], ["fp8_e4m3@conventional", "int8@conventional", "fp8_e4m3@replay16",
                                                 "int8@replay16", "fp8_e4m3@replay16:fp32", "int8@spec8x2:p0.5"]))  # fmt: skip
    rows = []
    for kind, inp, variants in cases:
        os.environ["SSMQUANT_KDA_CUDA"] = "1" if kind == "kda-cuda" else "0"
        ref = simulate(inp, variants, backend="torch")
        got = emulate_triton(inp, parse_variants(variants)).double().cpu().numpy()
        for i, name in enumerate(variants):
            rows.append({"kind": kind, "variant": name, **noise(ref.mean[i], got[i])})
        worst = max(rows[-len(variants):], key=lambda r: max(r["state"], r["out"]))
        print(f"{kind}: shape {tuple(inp.state_shape)} x {inp.steps} steps, {len(variants)} variants; largest excess "
              f"{max(worst['state'], worst['out']):.3g} of the error ({worst['variant']})")
    print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
