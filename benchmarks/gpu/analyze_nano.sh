#!/usr/bin/env bash
# Issue 15: the full synthetic nemotron-3-nano analysis (23 layers x 6 variants x 4096 steps x batch 8) on one
# GPU, by stage (start-up, imports, inputs, emulation, tables, write, plots, exit): cold (fresh Triton cache),
# then warm runs of this tree alternating with warm runs of the previous code path (`base`:
# benchmarks/analyze_baseline.py, this tree with branch nanostart's changes undone), all runs' output files
# byte-identical (bench_analyze.py exits 1 otherwise); then that the speed changes leave the outputs alone
# (benchmarks/gpu/nano_outputs_check.py); then where the time goes, per stage and per layer, with CUDA events
# (benchmarks/gpu/nano_profile.py --events, this tree and the base) and a cProfile of the first kernel launch;
# what `import torch` costs on this machine. With SYNC_PROFILE=1 also the span timeline with a device sync
# at each span's end; with LANES=1 whether two lanes per GPU give the same outputs as one. From the repo root,
# about 100 s (at most 147 s):
#
#   OUT=/tmp/o bash benchmarks/gpu/analyze_nano.sh
#
# Writes $OUT/analyze_nano.{json,md} (stage table, cold + warm + base), $OUT/timeline_events.json and
# $OUT/timeline_events_base.json (spans, stages, per-layer CUDA events, first-launch cProfile),
# $OUT/importtime_torch.log and $OUT/analyze_nano.log (all output).
# CPU check of the script itself (tiny sizes; the Triton interpreter is too slow for Nano's shapes):
#   OUT=/tmp/o KIND=cpu BENCH_ARGS="--steps 16 --batch 1 --layers 0" \
#     CHECK_ARGS="--device cpu --steps 16 --batch 1 --layers 0,2" \
#     PROFILE_ARGS="--device cpu --steps 8 --batch 1 --layers 0,2" \
#     BENCH_TIMEOUT=900 CHECK_TIMEOUT=900 PROFILE_TIMEOUT=900 bash benchmarks/gpu/analyze_nano.sh
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
  echo "== analyze: cold, then warm runs of this tree and of the previous code path (base), alternating"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-75}" python3 benchmarks/bench_analyze.py "${KIND:-gpu}" --runs "${RUNS:-cold,warm,base,warm,base}" \
    --cache-dir "$cache" --json "$OUT/analyze_nano.json" --results "$OUT/analyze_nano.md" ${BENCH_ARGS:-} || rc=$?
  echo "== outputs: this tree twice, main's loop and window sums twice (4 layers, warm cache)"
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR=$cache timeout "${CHECK_TIMEOUT:-20}" python3 benchmarks/gpu/nano_outputs_check.py ${CHECK_ARGS:-} || rc=$?
  for which in events events_base; do
    local flags=(--events --cprofile-first-launch 40)
    [ "$which" = events_base ] && flags+=(--baseline)
    echo "== where the time goes ($which): stages, per-layer CUDA events, the first launch (benchmarks/gpu/nano_profile.py ${flags[*]})"
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$cache timeout "${PROFILE_TIMEOUT:-18}" python3 benchmarks/gpu/nano_profile.py "${flags[@]}" \
      --json "$OUT/timeline_$which.json" -- ${PROFILE_ARGS:-} || echo "(profile $which: status $?, informative only)"
  done
  if [ -n "${SYNC_PROFILE:-}" ]; then
    echo "== per-stage GPU cost: a device sync at the end of every span (benchmarks/gpu/nano_profile.py --sync)"
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$cache timeout "${PROFILE_TIMEOUT:-20}" python3 benchmarks/gpu/nano_profile.py --sync \
      --json "$OUT/timeline_sync.json" -- ${PROFILE_ARGS:-} || echo "(profile: status $?, informative only)"
  fi
  echo "== import torch on this machine (-X importtime, top 25 cumulative; .pyc files present?)"
  timeout 8 python3 -X importtime -c "import torch" 2> "$OUT/importtime_torch.log" || true
  grep '^import time:' "$OUT/importtime_torch.log" | sort -t'|' -k2 -n -r | head -25 || true
  timeout 8 python3 - <<'EOF' || true
import pathlib, sys, time
t = time.perf_counter()
import torch
print(f"import torch (second, warm page cache) {time.perf_counter() - t:.3f} s; python {sys.version.split()[0]}")
root = pathlib.Path(torch.__file__).parent
py = sum(1 for _ in root.rglob("*.py"))
pyc = sum(1 for _ in root.rglob("__pycache__/*.pyc"))
print(f"torch package: {py} .py files, {pyc} cached .pyc; writable: {__import__('os').access(root, __import__('os').W_OK)}")
EOF
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
