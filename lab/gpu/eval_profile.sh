#!/usr/bin/env bash
# Profile of `evaluate`'s decode loop on a full-size random-weight model (issue 15: eval >= 20 decode steps/s at
# batch 8). Builds nemotron-h-8b in memory (models.build.build_random_model, no checkpoint on disk), then, after a
# warm-up, runs in one process (lab/gpu/eval_profile.py), in this order (the JSON is rewritten after each,
# so a timeout keeps what finished):
#   folded+probe+oldcodec   (+oldcodec: the dynamic fp8/int8 scales before the vanishing-amax fix, torch writes)
#                   the reference + 3 variants in one batch of 32, STEPS steps, per-step spans (forward, write,
#                   metrics, check; host time and CUDA-event time) and state statistics per slice / layer / step
#                   (max |x|, smallest row amax, rows below 1e-30, finite before and after each write); on a
#                   non-finite state it stops and dumps the first (step, layer) per slice and that layer's history
#   profile, profile+unfolded   torch.profiler over PROFILE_STEPS steps: GPU kernels and kernel time vs wall per step
#   folded+graphs, unfolded+graphs   CUDA graphs of the Mamba-2/MLP segments (evaluate/graphs.py), spans
#   profile+graphs  the profiler on the graphed folded loop
#   unfolded        the eager loop with spans only
#   folded+probe    the probed folded run with today's codec (rows below the fp8 edge are stored as zeros)
#
#   OUT=/tmp/o bash lab/gpu/eval_profile.sh      # from the repo root, GPU 0, < 120 s (timeout 110 s)
#   OUT=/tmp/o MODEL=tiny-nemotron DEVICE=cpu STEPS=20 BATCH=2 RUNS=folded+probe,profile,folded,unfolded \
#     bash lab/gpu/eval_profile.sh     # CPU check (no graphs on the CPU)
#
# Writes $OUT/eval_profile.json (rates, per-span ms per step, probes and NaN dumps, profiler summary),
# $OUT/profile_{folded,unfolded,folded_graphs}.txt (profiler tables), $OUT/timeline.csv (every span),
# $OUT/logs.tar.gz.
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
MODEL=${MODEL:-nemotron-h-8b}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-120}                      # the H200's folded NaN came at step 110
BATCH=${BATCH:-8}
RUNS=${RUNS:-folded+probe+oldcodec,profile,profile+unfolded,folded+graphs,unfolded+graphs,profile+graphs,unfolded,folded+probe}
PROFILE_STEPS=${PROFILE_STEPS:-5}
VARIANTS=${VARIANTS:-fp8_e4m3@conventional,nvfp4@conventional,int8@replay16}
LIMIT_S=${LIMIT_S:-110}
mkdir -p "$OUT"
logs=$(mktemp -d)
trap 'tar -czf "$OUT/logs.tar.gz" -C "$logs" . || true' EXIT
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee "$logs/versions.txt"
echo "== eval profile: $MODEL, $STEPS steps x batch $BATCH, runs $RUNS, variants $VARIANTS (timeout $LIMIT_S s)"
timeout "$LIMIT_S" python3 lab/gpu/eval_profile.py "$MODEL" "$OUT" --device "$DEVICE" --steps "$STEPS" \
  --batch "$BATCH" --runs "$RUNS" --variants "$VARIANTS" --profile-steps "$PROFILE_STEPS" 2>&1 | tee "$logs/eval_profile.log"
