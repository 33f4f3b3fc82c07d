"""Capture verification at full size: random-init slices of the real models (bf16 on the GPU), per layer the
relative error of the FP32 recurrence on the captured inputs against the layer's own scan output, and the time a
capture takes with and without its verification.

    PYTHONPATH=$PWD python3 lab/gpu/capture_verify.py [--tokens 2048] [--batch 4]
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from ssmquant.models import capture as capture_mod
from ssmquant.models import capture_all
from ssmquant.models.build import build_random_model

PRESETS = [("nemotron-3-nano", 5), ("qwen3.5-9b", 4), ("qwen3-next-80b", 4)]  # the kinds `build` makes


def timed(fn, *args):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"tokens {args.tokens}, batch {args.batch}, verified steps {capture_mod.VERIFY_STEPS}")
    for preset, layers in PRESETS:
        loaded = build_random_model(
            preset, devices="cuda:0", dtype="bfloat16", num_layers=layers, progress=lambda _: None
        )
        ids = torch.randint(0, 256, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
        capture_all(loaded, ids[:, :64])  # warm-up
        caps, t_verified = timed(capture_all, loaded, ids)
        verify = capture_mod._verify
        capture_mod._verify = lambda *a, **k: 0.0
        try:
            _, t_plain = timed(capture_all, loaded, ids)
        finally:
            capture_mod._verify = verify
        errs = {i: f"{x.meta['capture_error']:.2e}" for i, x in caps.items()}
        print(
            f"{preset}: layers {sorted(caps)} capture_error {errs} capture {t_verified:.2f} s "
            f"(without verification {t_plain:.2f} s)"
        )
        loaded = caps = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
