#!/usr/bin/env bash
# Full-size end to end on one GPU: build a random-weight checkpoint of a preset at its real size
# (python -m ssmquant build), then run analyze and eval through the normal checkpoint path, timing
# each command and recording peak GPU memory. Writes $OUT_DIR/fullsize_<preset>.json and the runs' report.json.
#
#   OUT_DIR=/tmp/fs bash lab/gpu/fullsize.sh nemotron-h-8b [analyze steps] [eval steps]
set -euo pipefail
preset=${1:-nemotron-h-8b}
steps=${2:-2048}
eval_steps=${3:-256}
out=${OUT_DIR:-/tmp/ssmquant-fullsize}
ckpt=${CKPT_DIR:-/tmp/ckpt-$preset}
mkdir -p "$out"
rm -rf "$ckpt"
t() { local s=$(date +%s.%N); "$@"; python3 -c "print(f'{$(date +%s.%N) - $s:.1f}')"; }
echo "== build $preset"
build_s=$(t python3 -m ssmquant build "$preset" "$ckpt" --device cuda | tail -n 1)
echo "== analyze ($steps steps x batch 8, 6 variants)"
analyze_s=$(t python3 -m ssmquant analyze --model "$ckpt" --steps "$steps" --batch 8 \
  --formats fp8_e4m3,int8,nvfp4 --schemes conventional,replay --out "$out/analyze-$preset" --force -q | tail -n 1)
echo "== eval ($eval_steps steps x batch 8, 3 variants)"
eval_s=$(t python3 -m ssmquant eval --model "$ckpt" --steps "$eval_steps" --batch 8 \
  --variants fp8_e4m3@conventional,fp8_e4m3@replay16,int8@replay16 --out "$out/eval-$preset" --force -q | tail -n 1)
python3 - "$out" "$preset" "$ckpt" "$build_s" "$analyze_s" "$eval_s" "$steps" "$eval_steps" <<'EOF'
import json, sys, pathlib, torch
out, preset, ckpt, build_s, analyze_s, eval_s, steps, eval_steps = sys.argv[1:]
out = pathlib.Path(out)
an = json.loads((out / f"analyze-{preset}" / "report.json").read_text())
ev_path = out / f"eval-{preset}" / "eval.json"
ev = json.loads(ev_path.read_text()) if ev_path.exists() else {}
build = json.loads((pathlib.Path(ckpt) / "ssmquant_build.json").read_text())
res = {
    "preset": preset, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
    "parameters": build["parameters"], "checkpoint_GiB": build["safetensors_bytes"] / 2**30,
    "build_wall_s": float(build_s), "analyze_wall_s": float(analyze_s), "eval_wall_s": float(eval_s),
    "analyze_steps": int(steps), "eval_steps": int(eval_steps), "analyze_stages": an.get("stages"),
    "analyze_elapsed_s": an.get("elapsed_s"), "eval_elapsed_s": ev.get("elapsed_s"),
    # eval decodes the reference and each of the 3 variants token by token: 4 forwards of batch 8 per step
    "eval_forwards_per_s": (4 * int(eval_steps) / ev["elapsed_s"]) if ev.get("elapsed_s") else None,
}
(out / f"fullsize_{preset}.json").write_text(json.dumps(res, indent=2))
print(json.dumps(res, indent=2))
EOF
