#!/usr/bin/env bash
# `evaluate` speed on a full-size random-weight model (issue 15: >= 20 decode steps/s at batch 8 on an H200, with
# progress and an ETA). lab/gpu/eval_speed.py builds nemotron-h-8b in memory (models.build.build_random_model,
# transformers' initialisation, bf16) and runs, in one process after a 4-step warm-up (unfolded and folded):
#   old_short, new_short, new_long, old_long, new_long_kvcat, old_short_kvbuf_inplace, new_short_again, new_eager_short
#     new = the default loop on a GPU (fold=True: the reference and the variants in one batch of 4 x BATCH; the
#     attention KV cache preallocated; state writes in place, one Triton kernel per layer), old = the default before
#     (fold=False: one forward per run; the KV cache grown by torch.cat every step, transformers' DynamicLayer;
#     fake_quant_triton + copy + two finiteness checks per write); short / long = SHORT / LONG steps; CUDA graphs
#     unless "eager"; new_long_kvcat: the new loop with the growing KV cache; old_short_kvbuf_inplace: the old loop
#     with the KV buffer and in-place writes.
#   first: the in-place Triton state writes vs the torch path on full-size states, bit for bit.
#     Each run's steps/s, steps/s per 16-step window (a per-step cost that grows with the position shows as a
#     falling rate), the allocator's cudaMalloc / cudaFree counts during the loop, and the progress / ETA lines.
#   checks: graphed vs eager, KV buffer vs concatenation, in-place vs old writes and a run vs its repeat bit for bit;
#     new (folded) vs old (unfolded) summaries within stated tolerances.
# CLI=1 also builds a checkpoint on disk and times the CLI on it (the user's path: load, eval, write; + ~80 s).
# Needs transformers >= 5.24 (the cache API evaluate reads): carry the wheel (.whl) as the lead's runner installs it.
#
#   OUT=/tmp/o bash lab/gpu/eval_speed.sh             # from the repo root, GPU 0 only, ~105 s (timeout 140 s)
#   OUT=/tmp/o MODEL=tiny-nemotron DEVICE=cpu LONG=24 SHORT=8 BATCH=2 bash lab/gpu/eval_speed.sh   # CPU check
#
# Writes $OUT/eval_speed.json (every run's timing, summaries, notes; the checks), $OUT/eval_cli.json (CLI=1) and
# $OUT/logs.tar.gz (the log, versions, gpu_clocks.csv). Exits non-zero when a check fails or a run errs.
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
MODEL=${MODEL:-nemotron-h-8b}            # a preset (built in memory), a shipped model or a checkpoint dir
DEVICE=${DEVICE:-cuda}
LONG=${LONG:-256}
SHORT=${SHORT:-64}
BATCH=${BATCH:-8}
RUNS=${RUNS:-old_short,new_short,new_long,old_long,new_long_kvcat,old_short_kvbuf_inplace,new_short_again,new_eager_short}
VARIANTS=${VARIANTS:-fp8_e4m3@conventional,nvfp4@conventional,int8@replay16}
LIMIT_S=${LIMIT_S:-140}
CLI=${CLI:-0}
mkdir -p "$OUT"
logs=$(mktemp -d)
trap 'tar -czf "$OUT/logs.tar.gz" -C "$logs" . || true' EXIT
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee "$logs/versions.txt"

# SM / memory clocks, temperature, power and utilisation every 500 ms (a rate that falls over a long run may be
# the GPU clocking down rather than a per-step cost)
smi=""
if [ "$DEVICE" != cpu ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi -i "${CUDA_VISIBLE_DEVICES%%,*}" --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu \
    --format=csv -lms 500 > "$logs/gpu_clocks.csv" 2>&1 &
  smi=$!
fi
trap '[ -n "$smi" ] && kill "$smi" 2>/dev/null; tar -czf "$OUT/logs.tar.gz" -C "$logs" . || true' EXIT

echo "== evaluate: $MODEL, batch $BATCH, $SHORT / $LONG steps, runs $RUNS, variants $VARIANTS (timeout $LIMIT_S s)"
timeout "$LIMIT_S" python3 lab/gpu/eval_speed.py "$MODEL" "$OUT/eval_speed.json" --long "$LONG" --short "$SHORT" \
  --batch "$BATCH" --device "$DEVICE" --variants "$VARIANTS" --runs "$RUNS" 2>&1 | tee "$logs/eval_speed.log"

if [ "$CLI" = 1 ]; then
  ckpt=/tmp/eval_speed_ckpt_$MODEL
  if [ ! -f "$ckpt/config.json" ]; then
    echo "== build $MODEL into $ckpt ($DEVICE)"
    timeout 70 python3 -m ssmquant build "$MODEL" "$ckpt" --device "$DEVICE" 2>&1 | tee "$logs/build.log"
  fi
  echo "== CLI eval on the checkpoint: $LONG steps x batch $BATCH"
  s=$(date +%s.%N)
  timeout 70 python3 -m ssmquant eval --model "$ckpt" --variants "$VARIANTS" --steps "$LONG" --batch "$BATCH" \
    --device "$DEVICE" --out "$logs/eval_cli" --force --no-plots 2>&1 | tee "$logs/eval_cli.log"
  echo "CLI wall $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s"
  cp "$logs/eval_cli/eval.json" "$OUT/eval_cli.json"
fi
