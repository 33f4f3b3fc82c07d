#!/usr/bin/env bash
# `ssmquant eval` speed on a full-size random-weight checkpoint (issue 15: >= 20 decode steps/s at batch 8 on
# an H200). Builds nemotron-h-8b with the project's builder, times the CLI (the default loop: one forward per run
# per step), then, in one process, the folded loop (evaluate(fold=True): the reference and the variants in one
# batch; opt-in, see evaluate's docstring) and the unfolded one on fewer steps, with the largest metric difference.
#
#   OUT=/tmp/o bash benchmarks/gpu/eval_speed.sh            # from the repo root, GPU 0 only, < 200 s
#   OUT=/tmp/o MODEL=tiny-nemotron DEVICE=cpu STEPS=24 UNFOLDED_STEPS=8 bash benchmarks/gpu/eval_speed.sh   # CPU check
#   CKPT=DIR reuses a built checkpoint. Expected on an H200: build ~35 s, CLI ~45 s, comparison ~30 s; each step
#   has its own timeout (70 + 65 + 50 s).
#
# Writes $OUT/eval_speed.json (CLI timing + folded/unfolded comparison), $OUT/eval_cli.json (the CLI run's
# eval.json) and $OUT/logs.tar.gz.
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
MODEL=${MODEL:-nemotron-h-8b}            # a preset to build, or a shipped model / checkpoint dir (no build)
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-128}
BATCH=${BATCH:-8}
UNFOLDED_STEPS=${UNFOLDED_STEPS:-32}
VARIANTS=${VARIANTS:-fp8_e4m3@conventional,nvfp4@conventional,int8@replay16}
mkdir -p "$OUT"
logs=$(mktemp -d)
trap 'tar -czf "$OUT/logs.tar.gz" -C "$logs" . || true' EXIT
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee "$logs/versions.txt"

ckpt=${CKPT:-$MODEL}
if [ -z "${CKPT:-}" ] && python3 -c "import sys; from ssmquant.models.presets import get_preset; get_preset(sys.argv[1])" "$MODEL" 2>/dev/null; then
  ckpt=/tmp/eval_speed_ckpt_$MODEL
  if [ ! -f "$ckpt/config.json" ]; then
    echo "== build $MODEL into $ckpt ($DEVICE)"
    timeout 70 python3 -m ssmquant.models.build "$MODEL" "$ckpt" --device "$DEVICE" 2>&1 | tee "$logs/build.log"
  fi
fi

echo "== CLI eval, folded: $STEPS steps x batch $BATCH, FP32 reference + $VARIANTS"
s=$(date +%s.%N)
timeout 65 python3 -m ssmquant.cli eval --model "$ckpt" --variants "$VARIANTS" --steps "$STEPS" --batch "$BATCH" \
  --device "$DEVICE" --out "$logs/eval_cli" --force --no-plots 2>&1 | tee "$logs/eval_cli.log"
cli_wall=$(python3 -c "print(round($(date +%s.%N) - $s, 2))")
cp "$logs/eval_cli/eval.json" "$OUT/eval_cli.json"

echo "== folded vs unfolded in one process: $UNFOLDED_STEPS steps"
timeout 50 python3 benchmarks/gpu/eval_speed.py "$ckpt" "$logs/compare.json" --steps "$UNFOLDED_STEPS" \
  --batch "$BATCH" --device "$DEVICE" --variants "$VARIANTS" 2>&1 | tee "$logs/compare.log" || echo "comparison FAILED (see logs)"

python3 - "$OUT" "$logs" "$cli_wall" <<'PY'
import json, pathlib, sys
out, logs, cli_wall = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
ev = json.loads((out / "eval_cli.json").read_text())
cmp_path = logs / "compare.json"
res = {
    "cli": {"wall_s": cli_wall, "settings": ev["settings"], "timing": ev["timing"], "elapsed_s": ev["elapsed_s"]},
    "compare": json.loads(cmp_path.read_text()) if cmp_path.exists() else None,
}
(out / "eval_speed.json").write_text(json.dumps(res, indent=2))
t = ev["timing"]
print(f"CLI folded: {t['decode_steps_per_s']:.2f} decode steps/s at batch {ev['settings']['batch']} "
      f"({ev['settings']['steps']} steps in {t['decode_s']:.1f} s, load {t['load_s']:.1f} s, wall {cli_wall:.1f} s)")
c = res["compare"]
if c:
    print(f"{c['steps']} steps: folded {c['folded']['decode_steps_per_s']:.2f}, unfolded "
          f"{c['unfolded']['decode_steps_per_s']:.2f} decode steps/s (x{c['speedup']:.2f}); max |diff| "
          f"{c['max_abs_diff_folded_vs_unfolded']}; replay slice exact before its first flush: "
          f"{c['replay_slice_exact_before_first_flush']}")
PY
