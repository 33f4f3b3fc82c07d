#!/usr/bin/env bash
# Issue 15: where the wall time of the full synthetic nemotron-3-nano analysis goes on one H200
# (`ssmquant analyze --model nemotron-3-nano --synthetic --formats fp8_e4m3,int8,nvfp4 --schemes
# conventional,replay --steps 4096 --batch 8 --device cuda --out DIR -q`). From the repo root, about 70 s:
#
#   OUT=/tmp/o bash benchmarks/gpu/nano_profile.sh
#
# Writes to $OUT (8 files):
#   profile.log          everything printed, nvidia-smi -q, versions, each step's wall and exit times
#   cuda_init.json       python start, import torch, torch.cuda.init(), first kernel, import triton (fresh process)
#   importtime.log       `python3 -X importtime -m ssmquant analyze ...` stderr (the plain CLI run; the first run,
#                        so it may compile the kernels into a fresh Triton cache)
#   timeline_warm.json   benchmarks/gpu/nano_profile.py spans, host view (no extra syncs), warm Triton cache
#   timeline_sync.json   the same with torch.cuda.synchronize() at every span's end (per-stage GPU cost)
#   torch_trace.json.gz  torch.profiler Chrome trace of layers 0,2,4 (CPU + CUDA), torch_trace_ops.txt its top ops
# CPU check of the script (tiny sizes): OUT=/tmp/o KIND=cpu bash benchmarks/gpu/nano_profile.sh
set -euo pipefail
: "${OUT:?set OUT to the results directory}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/nano-profile-triton-cache}
DEV=(--device cuda)
ARGS=()
if [ "${KIND:-gpu}" = cpu ]; then
  DEV=(--device cpu)
  ARGS=(--steps 32 --batch 1 --layers 0,2)
fi
log=$OUT/profile.log
now() { date +%s.%N; }
step() { echo "== $(date -u +%FT%TZ) $*"; }

main() {
  local rc=0 t0 t1 tmp
  step "machine"
  nvidia-smi -q 2>/dev/null | head -80 || echo "no nvidia-smi"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,power.draw \
    --format=csv 2>/dev/null || true
  nproc; python3 --version
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  step "CUDA start-up in a fresh process"
  timeout 30 python3 - "$OUT/cuda_init.json" <<'EOF' || rc=$?
import time
t = [("python started", time.perf_counter())]
import json, sys
import torch
t.append(("import torch", time.perf_counter()))
ok = torch.cuda.is_available()
t.append(("torch.cuda.is_available", time.perf_counter()))
if ok:
    torch.cuda.init(); t.append(("torch.cuda.init", time.perf_counter()))
    x = torch.ones(1, device="cuda"); t.append(("first tensor on GPU", time.perf_counter()))
    x.add_(1).item(); t.append(("first kernel + sync", time.perf_counter()))
    torch.randn(8, 4096, 64, 64, device="cuda").sum().item(); t.append(("randn 134M + sum + sync", time.perf_counter()))
import triton
t.append(("import triton", time.perf_counter()))
import pandas
t.append(("import pandas", time.perf_counter()))
rows = [{"step": n, "at_s": round(v - t[0][1], 4), "dt_s": round(v - t[i - 1][1], 4) if i else 0.0} for i, (n, v) in enumerate(t)]
for r in rows: print(f"  {r['step']:<28} +{r['dt_s']:.3f} s  (at {r['at_s']:.3f} s)")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
EOF
  tmp=$(mktemp -d)
  step "plain CLI run with -X importtime (first run of this Triton cache: $TRITON_CACHE_DIR)"
  t0=$(now)
  timeout 60 python3 -X importtime -m ssmquant analyze --model nemotron-3-nano --synthetic \
    --formats fp8_e4m3,int8,nvfp4 --schemes conventional,replay --steps 4096 --batch 8 "${DEV[@]}" \
    --out "$tmp/cli" -q "${ARGS[@]}" 2>"$OUT/importtime.log" || rc=$?
  t1=$(now)
  echo "  wall $(python3 -c "print(round($t1 - $t0, 3))") s; report.json stages:"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('  elapsed_s', r['elapsed_s'], r['stages'])" \
    "$tmp/cli/report.json" || rc=$?
  echo "  top imports by cumulative time (us):"
  grep '^import time:' "$OUT/importtime.log" | sort -t'|' -k2 -n -r | head -25 || true
  for mode in warm sync; do
    step "instrumented run ($mode)"
    local flag=()
    [ "$mode" = sync ] && flag=(--sync)
    t0=$(now)
    T0=$t0 timeout 60 python3 benchmarks/gpu/nano_profile.py --json "$OUT/timeline_$mode.json" "${flag[@]}" -- \
      "${DEV[@]}" "${ARGS[@]}" > "$tmp/$mode.out" 2>&1 || rc=$?
    t1=$(now)
    cat "$tmp/$mode.out"
    local mark
    mark=$(grep -o 'EXIT_MARK [0-9.]*' "$tmp/$mode.out" | cut -d' ' -f2 || true)
    [ -n "$mark" ] && echo "  process wall $(python3 -c "print(round($t1 - $t0, 3))") s, exit after the last line \
$(python3 -c "print(round($t1 - $mark, 3))") s"
  done
  step "torch.profiler over layers 0,2,4"
  local parg=("${DEV[@]}" --layers 0,2,4)
  [ "${KIND:-gpu}" = cpu ] && parg=("${DEV[@]}" --steps 32 --batch 1 --layers 0,2)
  timeout 60 python3 benchmarks/gpu/nano_profile.py --json "$tmp/prof_timeline.json" \
    --torch-profile "$OUT/torch_trace.json.gz" -- "${parg[@]}" || rc=$?
  rm -rf "$tmp"
  step "done, status $rc"
  return "$rc"
}
timeout "${PROFILE_TIMEOUT:-88}" bash -c "$(declare -f now step main); DEV=(${DEV[*]}); ARGS=(${ARGS[*]}); OUT=$OUT; main" \
  2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
