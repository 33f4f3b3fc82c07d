#!/usr/bin/env bash
# Issue 15: the full synthetic nemotron-3-nano analysis (23 layers x 6 variants x 4096 steps x batch 8) on one
# GPU, by stage, cold (fresh Triton cache) then warm twice; then whether a second process recompiles the
# kernels and what a warm first launch costs; last, that emulating two layers at once (analysis.run.GPU_LANES, one
# CUDA stream each) changes no output (benchmarks/gpu/lanes_check.py). From the repo root, at most ~140 s:
#
#   OUT=/tmp/o bash benchmarks/gpu/analyze_nano.sh
#
# Writes $OUT/analyze_nano.{json,md} (stage table), $OUT/triton_cache.json, $OUT/analyze_nano.log (all output).
# CPU check of the script itself (tiny sizes, Triton's interpreter for the cache probe):
#   OUT=/tmp/o KIND=cpu BENCH_ARGS="--steps 16 --batch 1 --layers 0" PROBE_ARGS="--device cpu --steps 2 --batch 1" \
#     LANES_ARGS="--device cpu --steps 16 --batch 1 --layers 0,2" \
#     TRITON_INTERPRET=1 BENCH_TIMEOUT=600 PROBE_TIMEOUT=600 bash benchmarks/gpu/analyze_nano.sh
set -euo pipefail
: "${OUT:?set OUT to the results directory}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/analyze_nano.log
run() {
  local rc=0
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader 2>/dev/null || echo 'no GPU')"
  python3 -c "import torch, triton, matplotlib; print('torch', torch.__version__, 'triton', triton.__version__, 'matplotlib', matplotlib.__version__)"
  echo "== analyze: cold, warm, warm"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-80}" python3 benchmarks/bench_analyze.py "${KIND:-gpu}" --runs cold,warm,warm \
    --json "$OUT/analyze_nano.json" --results "$OUT/analyze_nano.md" ${BENCH_ARGS:-} || rc=$?
  echo "== Triton cache: two processes, one cache"
  # shellcheck disable=SC2086
  timeout "${PROBE_TIMEOUT:-30}" python3 benchmarks/triton_cache.py --json "$OUT/triton_cache.json" ${PROBE_ARGS:-} || rc=$?
  echo "== GPU lanes: the same outputs with one and two layers at once"
  # shellcheck disable=SC2086
  timeout "${LANES_TIMEOUT:-40}" python3 benchmarks/gpu/lanes_check.py ${LANES_ARGS:-} || rc=$?
  echo "== done, status $rc"
  return "$rc"
}
run 2>&1 | tee "$log"
