#!/usr/bin/env bash
# Issue #11, exact MUFU (helper fimufu, 2026-12-01): the checkpointing / selective_state_update / fla oracle re-run
# with the profile's MUFU.RCP / MUFU.EX2 now computed from the H200's own tables (ssmquant.engines.mufu.rcp_sm90 /
# ex2_sm90). On the kernel dump every decode scale, code and FP32 state word is then bit-identical; this checks
# the oracle's own cases (256 steps; the "long" L=16 runs also at 256 steps to stay inside the time limit).
#
# Exact command, from the repository root on the GPU machine (carry .stage-engines/bundle):
#   BUNDLE=.stage-engines/bundle OUT=/path/to/out bash benchmarks/gpu/fi_mufu_check.sh
# Writes $OUT/oracle/results.json (after every case, so a timeout keeps what ran) and $OUT/oracle.log.
# About 40 s on an H200 (r4: 2-4 s a case); stopped at ORACLE_LIMIT (55 s).
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
BUNDLE=${BUNDLE:-$PWD/.stage-engines/bundle}
export PYTHONPATH="$PWD:$BUNDLE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASHINFER_DISABLE_JIT=${FLASHINFER_DISABLE_JIT:-1}
mkdir -p "$OUT/oracle"
echo "[fi_mufu_check] $(date -u +%H:%M:%S) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
timeout "${ORACLE_LIMIT:-55}" python3 -m ssmquant.engines.oracle --out "$OUT/oracle" --no-timing --long-steps 256 2>&1 \
  | tee "$OUT/oracle.log"
rc=${PIPESTATUS[0]}
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); n=len(r['cases']); print(f'[fi_mufu_check] {n} cases, {len(r[\"skipped\"])} skipped'); sys.exit(n == 0)" \
  "$OUT/oracle/results.json" || { echo "[fi_mufu_check] FAILED: no case ran"; exit 1; }
[ "$rc" -eq 0 ] || echo "[fi_mufu_check] oracle stopped with $rc (124: the time limit; the cases above were saved)"
echo "[fi_mufu_check] $(date -u +%H:%M:%S) done"
