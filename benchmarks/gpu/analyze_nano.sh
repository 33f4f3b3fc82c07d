#!/usr/bin/env bash
# Issue 15: the full synthetic nemotron-3-nano analysis (23 layers x 6 variants x 4096 steps x batch 8) on one
# GPU, by stage (start-up, imports, inputs, emulation, tables, write, plots, exit), cold (fresh Triton cache)
# then warm twice; then that the speed changes leave the outputs alone (benchmarks/gpu/nano_outputs_check.py:
# two runs of this tree bit-identical, and equal to main's loop and window sums within float64 rounding);
# then a span timeline with a device sync at each span's end; with LANES=1 also whether two lanes per GPU give
# the same outputs as one (benchmarks/gpu/lanes_check.py, 12 s more). From the repo root, about 60 s (at most 90 s):
#
#   OUT=/tmp/o bash benchmarks/gpu/analyze_nano.sh
#
# Writes $OUT/analyze_nano.{json,md} (stage table), $OUT/timeline_sync.json (span timeline with a device sync at
# each span's end: what each stage costs the GPU) and $OUT/analyze_nano.log (all output).
# CPU check of the script itself (tiny sizes):
#   OUT=/tmp/o KIND=cpu BENCH_ARGS="--steps 16 --batch 1 --layers 0" \
#     CHECK_ARGS="--device cpu --steps 16 --batch 1 --layers 0,2" LANES=1 LANES_ARGS="--device cpu --steps 16 --batch 1 --layers 0,2" \
#     PROFILE_ARGS="--device cpu --steps 8 --batch 1 --layers 0,2" \
#     BENCH_TIMEOUT=900 CHECK_TIMEOUT=900 LANES_TIMEOUT=900 PROFILE_TIMEOUT=900 bash benchmarks/gpu/analyze_nano.sh
set -euo pipefail
: "${OUT:?set OUT to the results directory}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/analyze_nano.log
cache=$(mktemp -d /tmp/analyze-nano-triton-XXXX)
run() {
  local rc=0
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader 2>/dev/null || echo 'no GPU'), $(nproc) CPUs"
  python3 -c "import torch, triton, matplotlib; print('torch', torch.__version__, 'triton', triton.__version__, 'matplotlib', matplotlib.__version__)" || true
  echo "== analyze: cold, warm, warm"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-50}" python3 benchmarks/bench_analyze.py "${KIND:-gpu}" --runs cold,warm,warm \
    --cache-dir "$cache" --json "$OUT/analyze_nano.json" --results "$OUT/analyze_nano.md" ${BENCH_ARGS:-} || rc=$?
  echo "== outputs: this tree twice, main's loop and window sums twice (4 layers, warm cache)"
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR=$cache timeout "${CHECK_TIMEOUT:-20}" python3 benchmarks/gpu/nano_outputs_check.py ${CHECK_ARGS:-} || rc=$?
  echo "== per-stage GPU cost: the analysis with a device sync at the end of every span (benchmarks/gpu/nano_profile.py --sync)"
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR=$cache timeout "${PROFILE_TIMEOUT:-20}" python3 benchmarks/gpu/nano_profile.py --sync \
    --json "$OUT/timeline_sync.json" -- ${PROFILE_ARGS:-} || echo "(profile: status $?, informative only)"
  if [ -n "${LANES:-}" ]; then
    echo "== GPU lanes: the same outputs with one and two layers at once"
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$cache timeout "${LANES_TIMEOUT:-12}" python3 benchmarks/gpu/lanes_check.py ${LANES_ARGS:-} || echo "(lanes check: status $?, informative only)"
  fi
  echo "== done, status $rc"
  return "$rc"
}
status=0
run 2>&1 | tee "$log" || status=$?
rm -rf "$cache"
exit "$status"
