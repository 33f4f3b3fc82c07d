#!/usr/bin/env bash
# `evaluate` speed on a full-size random-weight model (issue 15: >= 20 decode steps/s at batch 8 on an H200, with
# progress and an ETA). benchmarks/gpu/eval_speed.py builds nemotron-h-8b in memory (models.build.build_random_model,
# transformers' initialisation, bf16) and runs, in one process after a 4-step warm-up:
#   default       the loop `ssmquant eval` runs (one forward per slice; CUDA graphs of the Mamba-2/MLP segments;
#                 fused Triton state writes), STEPS steps, with the ETA and progress lines evaluate prints
#   folded        fold=True (the reference and the variants in one batch of 4 x BATCH), STEPS steps
#   short, eager  the default loop with and without CUDA graphs on COMPARE_STEPS steps: the same metrics bit for bit
#   folded_short, folded_eager   the same with fold=True
# CLI=1 also builds a checkpoint on disk and times the CLI on it (the user's path: load, eval, write; + ~80 s).
#
#   OUT=/tmp/o bash benchmarks/gpu/eval_speed.sh             # from the repo root, GPU 0 only, < 160 s
#   OUT=/tmp/o MODEL=tiny-nemotron DEVICE=cpu STEPS=24 COMPARE_STEPS=8 bash benchmarks/gpu/eval_speed.sh   # CPU check
#
# Writes $OUT/eval_speed.json (every run's timing, summaries, notes; the comparisons), $OUT/eval_cli.json (CLI=1)
# and $OUT/logs.tar.gz.
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
MODEL=${MODEL:-nemotron-h-8b}            # a preset (built in memory), a shipped model or a checkpoint dir
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-256}
COMPARE_STEPS=${COMPARE_STEPS:-64}
BATCH=${BATCH:-8}
RUNS=${RUNS:-eager,short,default,folded,folded_short,folded_eager}
VARIANTS=${VARIANTS:-fp8_e4m3@conventional,nvfp4@conventional,int8@replay16}
CLI=${CLI:-0}
mkdir -p "$OUT"
logs=$(mktemp -d)
trap 'tar -czf "$OUT/logs.tar.gz" -C "$logs" . || true' EXIT
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee "$logs/versions.txt"

echo "== evaluate: $MODEL, batch $BATCH, $STEPS steps (comparisons $COMPARE_STEPS), runs $RUNS, variants $VARIANTS"
timeout 150 python3 benchmarks/gpu/eval_speed.py "$MODEL" "$OUT/eval_speed.json" --steps "$STEPS" \
  --compare-steps "$COMPARE_STEPS" --batch "$BATCH" --device "$DEVICE" --variants "$VARIANTS" --runs "$RUNS" \
  2>&1 | tee "$logs/eval_speed.log"

if [ "$CLI" = 1 ]; then
  ckpt=/tmp/eval_speed_ckpt_$MODEL
  if [ ! -f "$ckpt/config.json" ]; then
    echo "== build $MODEL into $ckpt ($DEVICE)"
    timeout 70 python3 -m ssmquant.models.build "$MODEL" "$ckpt" --device "$DEVICE" 2>&1 | tee "$logs/build.log"
  fi
  echo "== CLI eval on the checkpoint: $STEPS steps x batch $BATCH"
  s=$(date +%s.%N)
  timeout 70 python3 -m ssmquant.cli eval --model "$ckpt" --variants "$VARIANTS" --steps "$STEPS" --batch "$BATCH" \
    --device "$DEVICE" --out "$logs/eval_cli" --force --no-plots 2>&1 | tee "$logs/eval_cli.log"
  echo "CLI wall $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s"
  cp "$logs/eval_cli/eval.json" "$OUT/eval_cli.json"
fi
