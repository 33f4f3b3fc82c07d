#!/usr/bin/env bash
# eval --mode layer on one CUDA GPU, in stages that each fit one device call (the machine is kept warm between them):
#
#   bash lab/gpu/layer_mode.sh tiling      # output-mode tilings (lab/bench/output_tiling.py)
#   MODELS=tiny-nemotron,tiny-qwen,tiny-kda bash lab/gpu/layer_mode.sh bench   # benchmarks/run.py eval, both modes
#   MODELS=nemotron-3-nano SECTION=nano LIMIT=560 bash lab/gpu/layer_mode.sh bench
#                                          # full Nano in a call of its own (RESULTS.md key eval-cuda-nano)
#   bash lab/gpu/layer_mode.sh nano32k     # Nano x 8 x 3 variants x 32K steps, layer mode alone
#   bash lab/gpu/layer_mode.sh study RUN,RUN,...   # e2e_horizon at the GPU scale (32K steps, 16 sequences)
#   DTYPE=float32 DATA=/tmp/fp32 bash lab/gpu/layer_mode.sh study RUN,...   # the same in float32 weights, its data
#                                          # apart (bfloat16's floor: studies/e2e_horizon's page)
#   bash lab/gpu/layer_mode.sh profile     # where Nano's layer mode spends its time (lab/bench/layer_profile.py)
#   bash lab/gpu/layer_mode.sh metrics     # the metrics' fused kernel against their torch path (lab/bench/metrics_paths.py)
#   bash lab/gpu/layer_mode.sh tests       # the GPU test command (README); TESTS="FILE ..." runs those files' only
#
# Needs the wheels of a fresh install beside the checkout (lab/gpu/test_wheels.sh; carry .whl/common and .whl/tf525)
# and studies/tiny_models/data/heldout.txt (carried). Everything a stage makes goes to $OUT as it is made.
set -uo pipefail
cd "$(dirname "$0")/../.."
# once per machine and set of wheels: a stamp of the carried wheels' digests, written after a complete install
STAMP=$(sha256sum .whl/common/*.whl .whl/tf525/*.whl | sha256sum | cut -c1-16)
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$STAMP" ]; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/common/*.whl .whl/tf525/*.whl && echo "$STAMP" > /tmp/site/.wheels
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
VARIANTS=fp8_e4m3@conventional,int8@replay16,nvfp4@conventional
case "${1:?stage}" in
  tiling)
    timeout "${LIMIT:-150}" python3 lab/bench/output_tiling.py \
      --shapes mamba2:8:64:128:2,gdn:4:64:64:2,mamba2:64:64:128:8 \
      --variants fp32@conventional,fp8_e4m3@conventional,nvfp4@conventional \
      --tilings 16x1,16x2,8x1,8x2,4x2,2x1,32x1,64x8 --reps 3 2>&1 | grep -v Warn | tee "$OUT/tiling.txt"
    ;;
  bench)
    timeout "${LIMIT:-420}" python3 benchmarks/run.py eval --device cuda \
      --models "${MODELS:-tiny-nemotron,tiny-qwen,tiny-kda,nemotron-3-nano}" --steps 2048 --batch 8 \
      --reps "${REPS:-1}" --variants "$VARIANTS" ${SECTION:+--section "$SECTION"} > "$OUT/bench.txt" 2>&1
    echo "rc=$?" >> "$OUT/bench.txt"
    cp benchmarks/results/eval-*.json "$OUT/" 2>/dev/null
    tail -12 "$OUT/bench.txt"
    ;;
  nano32k)
    timeout "${LIMIT:-400}" python3 benchmarks/run.py eval --device cuda --models nemotron-3-nano --modes layer \
      --steps 32768 --batch 8 --reps 1 --variants fp8_e4m3,int8@replay16,nvfp4 \
      --text studies/tiny_models/data/heldout.txt --text-split all > "$OUT/nano32k.txt" 2>&1
    echo "rc=$?" >> "$OUT/nano32k.txt"
    cp benchmarks/results/eval-*.json "$OUT/" 2>/dev/null
    tail -12 "$OUT/nano32k.txt"
    ;;
  study)
    for run in ${2//,/ }; do
      timeout "${LIMIT:-280}" python3 -m studies.run --scale gpu --device cuda --only e2e_horizon --runs "$run" \
        ${DTYPE:+--dtype "$DTYPE"} --data "${DATA:-studies}" > "$OUT/study-$run.txt" 2>&1
      echo "$run rc=$?" | tee -a "$OUT/study.txt"
      tail -3 "$OUT/study-$run.txt"
      tar czf "$OUT/e2e_horizon_data.tar.gz" "${DATA:-studies}/e2e_horizon/data"
    done
    ;;
  profile)
    timeout "${LIMIT:-150}" python3 lab/bench/layer_profile.py --model "${MODELS:-nemotron-3-nano}" --steps 2048 \
      --batch 8 --device cuda --by-module --sync-sites > "$OUT/profile.txt" 2>&1
    echo "rc=$?" >> "$OUT/profile.txt"
    tail -75 "$OUT/profile.txt"
    ;;
  metrics)
    timeout "${LIMIT:-120}" python3 lab/bench/metrics_paths.py --device cuda > "$OUT/metrics.txt" 2>&1
    echo "rc=$?" >> "$OUT/metrics.txt"
    tail -8 "$OUT/metrics.txt"
    ;;
  tests)
    timeout "${LIMIT:-300}" python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider ${TESTS:-} > "$OUT/tests.txt" 2>&1
    echo "rc=$?" >> "$OUT/tests.txt"
    tail -15 "$OUT/tests.txt"
    ;;
  *) echo "unknown stage $1"; exit 2 ;;
esac
