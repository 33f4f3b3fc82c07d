#!/usr/bin/env bash
# Issue #11, bit-exact FlashInfer: dump the real checkpointing_ssu / selective_state_update call by call
# (inputs, caches, outputs) for offline re-computation (lab.engines.dump).
#
# Exact command, from the repository root on the GPU machine (bundle with the 14 ahead-of-time modules):
#   BUNDLE=/path/to/bundle OUT=/path/to/out bash lab/gpu/fi_dump.sh
# Writes $OUT/fi_dump.safetensors (~42 MiB) and $OUT/fi_dump.log; ~10-30 s on an H200, stopped at 120 s.
# FIT=1 also runs the quick hypothesis fit on the machine's CPUs (python -m lab.engines.fit --quick, <= 90 s,
# 80 s on 2 shared cores here): $OUT/fi_fit.json and $OUT/fi_fit.log. Without FIT it runs offline on the dump.
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
BUNDLE=${BUNDLE:-$PWD/.stage-engines/bundle}
export PYTHONPATH="$PWD:$BUNDLE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASHINFER_DISABLE_JIT=${FLASHINFER_DISABLE_JIT:-1}
mkdir -p "$OUT"
echo "[fi_dump] ahead-of-time modules in $BUNDLE/flashinfer/data/aot:"
ls "$BUNDLE/flashinfer/data/aot" 2>&1 | sed 's/^/  /'
timeout 120 python3 -m lab.engines.dump --out "$OUT/fi_dump.safetensors" 2>&1 | tee "$OUT/fi_dump.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && [ "${FIT:-0}" = 1 ]; then
  timeout 90 python3 -m lab.engines.fit "$OUT/fi_dump.safetensors" --quick --json "$OUT/fi_fit.json" 2>&1 \
    | tee "$OUT/fi_fit.log" || echo "[fi_dump] the fit did not finish (the dump is complete)"
fi
ls -la "$OUT"
if [ "$rc" -ne 0 ]; then echo "[fi_dump] FAILED (rc $rc)"; exit "$rc"; fi
echo "[fi_dump] done"
