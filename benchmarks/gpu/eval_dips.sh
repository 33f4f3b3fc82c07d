#!/usr/bin/env bash
# Why `evaluate`'s decode rate dips (issue 15: >= 20 decode steps/s at batch 8 over 256 steps on an H200):
# benchmarks/gpu/eval_dips.py builds nemotron-h-8b in memory (random weights, bf16), warms the default loop up (20
# steps), then runs `evaluate` (256 steps x batch 8, fp8_e4m3@conventional, nvfp4@conventional, int8@replay16) with
# every decode step timed on the host and the device and what happened in it (garbage collections, cudaMalloc /
# cudaFree, attention's host time and backend, window checks, progress lines), as an A/B in one process:
#   base (cold per-shape caches), again (warm), flash (cuDNN SDPA off: flash attention), flash_kvbuf (and the
#   preallocated KV cache), gcoff (gc.freeze + gc.disable), expandable (expandable_segments:True); in that order of
#   priority: a run that would not fit in the budget is skipped
# and, with the time left, attention alone at the decode shapes: first vs second call per KV length, per backend,
# contiguous vs a view of a larger buffer, bit for bit.
#
#   OUT=/tmp/o bash benchmarks/gpu/eval_dips.sh          # from the repo root; GPU 0; stops itself at LIMIT_S (120 s)
#   OUT=/tmp/o MODEL=tiny-nemotron DEVICE=cpu STEPS=40 BATCH=2 RUNS=base,again,gcoff,kvbuf bash benchmarks/gpu/eval_dips.sh
#
# Writes $OUT/eval_dips.json (per run: steps/s, window rates, per-step table, the slow-step correlations; the bit
# checks; the attention probe) and $OUT/logs.tar.gz (log, versions, gpu_clocks.csv). Exits 1 when a required check
# fails or a run errs. Needs transformers >= 5.24 (carry the wheel, as for eval_speed.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
MODEL=${MODEL:-nemotron-h-8b}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-256}
BATCH=${BATCH:-8}
RUNS=${RUNS:-base,again,flash,flash_kvbuf,gcoff,expandable}
VARIANTS=${VARIANTS:-fp8_e4m3@conventional,nvfp4@conventional,int8@replay16}
site=${PYTHONPATH:-}  # the lead's runner puts the carried transformers wheel there; gpu_begin resets PYTHONPATH
gpu_begin "${LIMIT_S:-120}"
export PYTHONPATH=$PWD${site:+:$site}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
gpu_versions | tee "$OUT/logs/versions.txt"
python3 -c "import transformers; print('transformers', transformers.__version__)" | tee -a "$OUT/logs/versions.txt"
smi=""
if [ "$DEVICE" != cpu ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi -i "${CUDA_VISIBLE_DEVICES%%,*}" --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu \
    --format=csv -lms 500 > "$OUT/logs/gpu_clocks.csv" 2>&1 &
  smi=$!
fi
probe=$([ "$DEVICE" != cpu ] && echo --probe)
# the Python side skips runs that would not fit in its budget; 8 s kept for start-up and the tar
STAGE_TAIL=${STAGE_TAIL:-200}
stage eval_dips "$(($(budget_left) - 2))" python3 benchmarks/gpu/eval_dips.py "$MODEL" "$OUT/eval_dips.json" \
  --steps "$STEPS" --batch "$BATCH" --device "$DEVICE" --variants "$VARIANTS" --runs "$RUNS" \
  --budget "$(($(budget_left) - 10))" $probe
[ -n "$smi" ] && kill "$smi" 2>/dev/null
gpu_end
