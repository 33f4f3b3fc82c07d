#!/usr/bin/env bash
# Why `evaluate`'s decode rate dips (issue 15: >= 20 decode steps/s at batch 8 over 256 steps on an H200):
# lab/gpu/eval_dips.py builds nemotron-h-8b in memory (random weights, bf16), warms the default loop up (20
# steps), then runs `evaluate` (256 steps x batch 8, fp8_e4m3@conventional, nvfp4@conventional, int8@replay16) with
# every decode step timed on the host and the device and what happened in it (garbage collections, cudaMalloc /
# cudaFree, attention's host time and backend, window checks, progress lines), as an A/B in one process:
#   base (cold per-shape caches), again (warm), flash (cuDNN SDPA off: flash attention), flash_kvbuf (and the
#   preallocated KV cache), gcoff (gc.freeze + gc.disable), expandable (expandable_segments:True); in that order of
#   priority: a run that would not fit in the budget is skipped
# and, with the time left, attention alone at the decode shapes: first vs second call per KV length, per backend,
# contiguous vs a view of a larger buffer, bit for bit.
#
#   OUT=/tmp/o bash lab/gpu/eval_dips.sh          # from the repo root; GPU 0; stops itself at LIMIT_S (120 s)
#   OUT=/tmp/o MODEL=tiny-nemotron DEVICE=cpu STEPS=40 BATCH=2 RUNS=base,again,gcoff,kvbuf bash lab/gpu/eval_dips.sh
#   CUDNN=1: the runs other than flash* with evaluate(cudnn_attention=True), as run s1 ran them (before the default
#   changed to attention without cuDNN)
#
# FINAL=1: the new default as a user meets it, over STEPS x BATCH (lab/gpu/eval_final.py): a fresh process
# with a fresh (cold) Triton cache runs `evaluate` twice in a row with its defaults (no warm-up: the first run counts),
# then a second fresh process, on the kernel cache the first filled, runs it once; every run's metrics must equal
# the first's bit for bit (in the process and across processes); decode steps/s and the 16-step windows reported.
# Writes $OUT/eval_final.json and $OUT/logs.tar.gz; ~70 s on the H200 (LIMIT_S 100 by default in this mode).
#
#   OUT=/tmp/o FINAL=1 bash lab/gpu/eval_dips.sh
#   OUT=/tmp/o FINAL=1 MODEL=tiny-nemotron DEVICE=cpu STEPS=24 BATCH=2 bash lab/gpu/eval_dips.sh
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
FINAL=${FINAL:-0}
site=${PYTHONPATH:-}  # the lead's runner puts the carried transformers wheel there; gpu_begin resets PYTHONPATH
gpu_begin "${LIMIT_S:-$([ "$FINAL" = 1 ] && echo 100 || echo 120)}"
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
if [ "$FINAL" = 1 ]; then
  work=$(mktemp -d)
  export TRITON_CACHE_DIR=$work/triton  # cold for the first process, filled by it for the second
  final=(python3 lab/gpu/eval_final.py run "$MODEL" --steps "$STEPS" --batch "$BATCH" --device "$DEVICE"
    --variants "$VARIANTS")
  STAGE_TAIL=40
  # the first process gets all but FINAL_WARM_S (28) s (the second: start-up, build, one run; more for a larger
  # model), the second all but the comparison's
  stage final_cold "$(($(budget_left) - ${FINAL_WARM_S:-28}))" "${final[@]:0:4}" "$work/cold.json" "${final[@]:4}" --runs 2
  stage final_warm "$(($(budget_left) - 4))" "${final[@]:0:4}" "$work/warm.json" "${final[@]:4}" --runs 1
  STAGE_MIN_S=1 stage final_compare 10 python3 lab/gpu/eval_final.py compare "$work/cold.json" \
    "$work/warm.json" "$OUT/eval_final.json"
  rm -rf "$work"
else
  probe=$([ "$DEVICE" != cpu ] && echo --probe)
  # the Python side skips runs that would not fit in its budget; 8 s kept for start-up and the tar
  STAGE_TAIL=200
  stage eval_dips "$(($(budget_left) - 2))" python3 lab/gpu/eval_dips.py "$MODEL" "$OUT/eval_dips.json" \
    --steps "$STEPS" --batch "$BATCH" --device "$DEVICE" --variants "$VARIANTS" --runs "$RUNS" \
    --budget "$(($(budget_left) - 10))" $probe $([ "${CUDNN:-0}" = 1 ] && echo --cudnn-attention)
fi
[ -n "$smi" ] && kill "$smi" 2>/dev/null
gpu_end
