#!/usr/bin/env bash
# Issue #11, bit-exact FlashInfer (helper fiscale, 2026-12-01): the H200's approximate reciprocal and exp2
# tabulated (lab.engines.mufu_tabulate: MUFU.RCP over every FP32 significand, MUFU.EX2 over (-1, 0] at 2^-24,
# raw samples and the checks of how arguments are reduced), then the checkpointing oracle re-run with the
# SR slot-offset fix (f6e0958) and the fitted flush model (HMMA alignment, FFMA, __expf, rcp), including
# the 4096-step int8 and fp8_e4m3 L=16 runs.
#
# Exact command, from the repository root on the GPU machine (bundle with the ahead-of-time modules):
#   BUNDLE=.stage-engines/bundle OUT=/path/to/out bash lab/gpu/fi_exact.sh
# Writes $OUT/mufu_sm90.npz (~4-8 MiB), $OUT/oracle/results.json, $OUT/fi_exact_logs.tgz. About 15 s for the
# tables and 70-90 s for the oracle on an H200 (each part stopped by its own timeout; 140 s at most).
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
BUNDLE=${BUNDLE:-$PWD/.stage-engines/bundle}
export PYTHONPATH="$PWD:$BUNDLE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASHINFER_DISABLE_JIT=${FLASHINFER_DISABLE_JIT:-1}
mkdir -p "$OUT/oracle" "$OUT/logs"
failed=()
echo "[fi_exact] $(date -u +%H:%M:%S) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
timeout "${MUFU_LIMIT:-30}" python3 -m lab.engines.mufu_tabulate --out "$OUT/mufu_sm90.npz" 2>&1 | tee "$OUT/logs/mufu.log" \
  || failed+=(mufu)
echo "[fi_exact] $(date -u +%H:%M:%S) oracle"
timeout "${ORACLE_LIMIT:-110}" python3 -m lab.engines.oracle --out "$OUT/oracle" --no-timing 2>&1 \
  | tee "$OUT/logs/oracle.log" || failed+=(oracle)
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); n=len(r['cases']); print(f'[fi_exact] oracle: {n} cases, {len(r[\"skipped\"])} skipped'); sys.exit(n == 0)" \
  "$OUT/oracle/results.json" || failed+=(oracle-empty)
tar czf "$OUT/fi_exact_logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
ls -la "$OUT" "$OUT/oracle"
if [ ${#failed[@]} -gt 0 ]; then echo "[fi_exact] FAILED: ${failed[*]}"; exit 1; fi
echo "[fi_exact] $(date -u +%H:%M:%S) done"
