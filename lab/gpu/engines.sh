#!/usr/bin/env bash
# Issue #11 / #13 on one GPU: the engine oracle (real FlashInfer and fla kernels next to the emulation), the
# engine GPU tests and the FlashInfer export run through the real kernels.
#
# From the repository root on the GPU machine, with the bundle (`python -m lab.engines.bundle DIR`, then
# `python -m lab.engines.aot DIR/bundle` so that no FlashInfer module compiles there) at $BUNDLE (default
# .stage-engines/bundle) and captured tiny-model inputs at $CAPTURED (default .stage-engines/captured.safetensors,
# written by `lab.engines.oracle.save_captured`; skipped when absent). Writes to $OUT:
#   oracle/results.json, oracle.log, engines_gpu.log, export_flashinfer_gpu.{json,log}
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
BUNDLE=${BUNDLE:-$PWD/.stage-engines/bundle}
CAPTURED=${CAPTURED:-$PWD/.stage-engines/captured.safetensors}
ORACLE_LIMIT=${ORACLE_LIMIT:-240}
export PYTHONPATH="$PWD:$BUNDLE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT/oracle"
failed=()
aot=$(ls "$BUNDLE/flashinfer/data/aot" 2>/dev/null | wc -l)
echo "[engines] $aot ahead-of-time FlashInfer modules in the bundle; nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
cap=()
[ -f "$CAPTURED" ] && cap=(--captured "$CAPTURED")
timeout "$ORACLE_LIMIT" python3 -m lab.engines.oracle --out "$OUT/oracle" "${cap[@]}" 2>&1 | tee "$OUT/oracle.log" || failed+=(oracle)
timeout 90 python3 -m pytest -q -rA -p no:cacheprovider tests/engines/test_engines_gpu.py tests/kernels/test_int16_tile.py 2>&1 \
  | tee "$OUT/engines_gpu.log" || failed+=(engines_gpu)
LIMIT=${EXPORT_LIMIT:-150} BUNDLE="$BUNDLE" bash lab/gpu/export_flashinfer.sh || failed+=(export)
if [ ${#failed[@]} -gt 0 ]; then echo "[engines] FAILED: ${failed[*]}"; exit 1; fi
echo "[engines] all parts finished"
