"""Errors after a prompt (issue 26): `analyze` on the shipped tiny models with no prompt and a 2048-token prompt.

For each shipped model (tiny-nemotron, tiny-qwen, tiny-kda), prompt length (0, 2048), every default variant
(fp8_e4m3, int8, nvfp4 x conventional, replay16; KDA also bf16@conventional): the relative output and state errors
in the window that ends at decode step 64 and at decode step 4096 (windows of 16 steps, whole flush cycles; RMS over
the window's steps, and its worst step), the largest over the model's SSM layers, pooled over the batch's sequences
and heads. One seed per cell; a second seed (--seeds 0,1) gives the spread.

    PYTHONPATH=$PWD python lab/gpu/prompt_errors.py [--steps 4096] [--batch 8] [--seeds 0] [--out FILE.json]

Prints one markdown table; --out also writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from ssmquant.analysis import AnalyzeConfig, analyze

MODELS = ("tiny-nemotron", "tiny-qwen", "tiny-kda")
PROMPTS = (0, 2048)
AT = (64, 4096)


def errors_at(traces, steps: tuple[int, ...]) -> dict:
    """{variant: {step: {metric: the largest over layers}}} of the windows that end at ``steps``."""
    out: dict = {}
    for variant, d in traces.groupby("variant"):
        out[variant] = {}
        for step in steps:
            row = d[d.step == step]
            if row.empty:
                raise SystemExit(f"no window ends at step {step} (window ends: {sorted(d.step.unique())[:5]}...)")
            out[variant][step] = {
                m: float(row[m].max()) for m in ("out_rel_err", "out_rel_err_max", "state_rel_err", "state_rel_err_max")
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()
    steps = tuple(s for s in AT if s <= args.steps)
    results = []
    for model in MODELS:
        for prompt in PROMPTS:
            for seed in (int(s) for s in args.seeds.split(",")):
                cfg = AnalyzeConfig(model=model, steps=args.steps, prompt=prompt, batch=args.batch, seed=seed,
                                    record_every=16)  # fmt: skip
                r = analyze(cfg)
                results.append({"model": model, "prompt": prompt, "seed": seed, "source": r.source.get("note"),
                                "errors": errors_at(r.traces, steps)})  # fmt: skip
                print(f"{model} prompt {prompt} seed {seed}: {r.elapsed_s:.1f} s", flush=True)
    print("\n| model | variant | " + " | ".join(f"P={p}: out @{s} (worst step)" for p in PROMPTS for s in steps) + " |")
    print("|---|---|" + "---|" * (len(PROMPTS) * len(steps)))
    for model in MODELS:
        cells = [r for r in results if r["model"] == model]
        for variant in cells[0]["errors"]:
            row = []
            for p in PROMPTS:
                for s in steps:
                    vals = [r["errors"][variant][s] for r in cells if r["prompt"] == p]
                    mean = max(v["out_rel_err"] for v in vals)
                    worst = max(v["out_rel_err_max"] for v in vals)
                    row.append(f"{mean:.2e} ({worst:.2e})")
            print(f"| {model} | {variant} | " + " | ".join(row) + " |")
    if args.out:
        args.out.write_text(json.dumps({"steps": args.steps, "batch": args.batch, "results": results}, indent=1))


if __name__ == "__main__":
    main()
