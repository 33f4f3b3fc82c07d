#!/usr/bin/env bash
# Issue 15: the full synthetic nemotron-3-nano analysis (23 layers x 6 variants x 4096 steps x batch 8) on one
# GPU, by stage (start-up, import torch, imports, inputs, emulation, tables, write, plots, exit), within BUDGET
# seconds (default 115) for the whole script:
#
#   OUT=/tmp/o bash benchmarks/gpu/analyze_nano.sh
#
# 1. benchmarks/bench_analyze.py: a cold run (fresh Triton cache), then warm runs of this tree alternating with
#    warm runs of the previous code path (`base`: benchmarks/analyze_baseline.py, this tree with branch
#    nanostart's changes undone), then `pyc` runs (warm, with a warm Python bytecode cache, which the cold run
#    fills; see bench_analyze.py); RUNS changes the list. No run is started that would end past BUDGET - 20 s
#    (--deadline); those left out are named. All runs' output files must be byte-identical (exit status 1
#    otherwise). Prints the median (min-max) wall clock of each run kind.
# 2. Why start-up varies: the bytecode settings of the machine's Python, whether torch has cached .pyc files,
#    `python -X importtime -c "import torch"` (top 25 cumulative).
# 3. Where the time goes, if at least 20 s of BUDGET are left: benchmarks/gpu/nano_profile.py --events (stages,
#    per-layer CUDA events, the first launch's cProfile) of this tree; PROFILE=0 skips it, PROFILE_BASE=1 adds
#    the base's. CHECK=1 adds nano_outputs_check.py (this tree against main's loop, 4 layers), LANES=1
#    lanes_check.py, SYNC_PROFILE=1 nano_profile.py --sync.
#
# Writes $OUT/analyze_nano.{json,md} (the stage table and medians), $OUT/timeline_events.json (and
# timeline_events_base.json with PROFILE_BASE=1), $OUT/importtime_torch.log and $OUT/analyze_nano.log (all output).
# CPU check of the script itself (tiny sizes; the Triton interpreter is too slow for Nano's shapes):
#   PATH=/work/main/.venv/bin:$PATH OUT=/tmp/o KIND=cpu BUDGET=900 RUNS=cold,warm,base,pyc BENCH_ARGS="--steps 16 --batch 1 --layers 0" \
#     PROFILE_ARGS="--device cpu --steps 8 --batch 1 --layers 0,2" bash benchmarks/gpu/analyze_nano.sh
set -euo pipefail
: "${OUT:?set OUT to the results directory}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
budget=${BUDGET:-115}
log=$OUT/analyze_nano.log
cache=$(mktemp -d /tmp/analyze-nano-triton-XXXX)
left() { echo $((budget - SECONDS)); }
run() {
  local rc=0
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader 2>/dev/null || echo 'no GPU'), $(nproc) CPUs, budget ${budget} s"
  # versions without importing torch (seconds on that machine)
  python3 - <<'EOF' || true
from importlib.metadata import PackageNotFoundError, version
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"
print(*(f"{p} {v(p)}" for p in ("torch", "triton", "matplotlib", "seaborn", "pandas")))
EOF
  echo "== analyze: cold, warm runs of this tree and of the previous code path (base) alternating, pyc runs"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-$((budget - 5))}" python3 benchmarks/bench_analyze.py "${KIND:-gpu}" \
    --runs "${RUNS:-cold,warm,base,warm,base,warm,pyc,pyc}" --deadline "$((budget - 20 - SECONDS))" \
    --cache-dir "$cache" --json "$OUT/analyze_nano.json" --results "$OUT/analyze_nano.md" ${BENCH_ARGS:-} || rc=$?
  echo "== start-up: the machine's Python and bytecode, import torch (-X importtime, top 25 cumulative) [$SECONDS s]"
  timeout 10 python3 - <<'EOF' || true
import importlib.util, os, pathlib, sys
print(f"python {sys.version.split()[0]} at {sys.executable}; sys.flags.dont_write_bytecode={sys.flags.dont_write_bytecode} "
      f"(PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE')!r}), pycache_prefix={sys.pycache_prefix!r}")
spec = importlib.util.find_spec("torch")  # found, not imported
if spec is None:
    print("torch: not installed")
else:
    root = pathlib.Path(spec.origin).parent
    py = sum(1 for _ in root.rglob("*.py"))
    pyc = sum(1 for _ in root.rglob("__pycache__/*.pyc"))
    print(f"torch package {root}: {py} .py files, {pyc} cached .pyc; writable: {os.access(root, os.W_OK)}")
EOF
  timeout 10 python3 -X importtime -c "import torch" 2> "$OUT/importtime_torch.log" || true
  grep '^import time:' "$OUT/importtime_torch.log" | sort -t'|' -k2 -n -r | head -25 || true
  if [ -n "${CHECK:-}" ]; then
    echo "== outputs: this tree twice, main's loop and window sums twice (4 layers, warm cache) [$SECONDS s]"
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$cache timeout "${CHECK_TIMEOUT:-20}" python3 benchmarks/gpu/nano_outputs_check.py ${CHECK_ARGS:-} || rc=$?
  fi
  local which
  for which in events events_base; do
    local flags=(--events --cprofile-first-launch 40)
    if [ "$which" = events_base ]; then
      [ -n "${PROFILE_BASE:-}" ] || continue
      flags+=(--baseline)
    fi
    if [ "${PROFILE:-1}" = 0 ] || [ "$(left)" -lt 20 ]; then
      echo "== where the time goes ($which): skipped ($(left) s of the budget left, PROFILE=${PROFILE:-1})"
      continue
    fi
    echo "== where the time goes ($which): stages, per-layer CUDA events, the first launch (benchmarks/gpu/nano_profile.py ${flags[*]}) [$SECONDS s]"
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$cache timeout "$(left)" python3 benchmarks/gpu/nano_profile.py "${flags[@]}" \
      --json "$OUT/timeline_$which.json" -- ${PROFILE_ARGS:-} || echo "(profile $which: status $?, informative only)"
  done
  if [ -n "${SYNC_PROFILE:-}" ]; then
    echo "== per-stage GPU cost: a device sync at the end of every span (benchmarks/gpu/nano_profile.py --sync)"
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$cache timeout "${PROFILE_TIMEOUT:-20}" python3 benchmarks/gpu/nano_profile.py --sync \
      --json "$OUT/timeline_sync.json" -- ${PROFILE_ARGS:-} || echo "(profile: status $?, informative only)"
  fi
  if [ -n "${LANES:-}" ]; then
    echo "== GPU lanes: the same outputs with one and two layers at once"
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$cache timeout "${LANES_TIMEOUT:-12}" python3 benchmarks/gpu/lanes_check.py ${LANES_ARGS:-} || echo "(lanes check: status $?, informative only)"
  fi
  echo "== summary (wall clock of each run kind; the table above has the stages) [$SECONDS s]"
  grep -E '^- |byte-identical' "$OUT/analyze_nano.md" 2>/dev/null || echo "(no bench results)"
  echo "== done, status $rc, $SECONDS s"
  return "$rc"
}
status=0
run 2>&1 | tee "$log" || status=$?
rm -rf "$cache"
exit "$status"
