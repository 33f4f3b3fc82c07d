#!/usr/bin/env bash
# Issue #11, "decode scales mismatch on the GPU oracle runs" (helper scalefix, 2026-12-01): does FlashInfer's
# torch re-computation (`checkpointing_ssu_reference`) give other bits on CUDA than on the CPU, and where do
# its decode scales part from the real kernel's? `python -m lab.engines.scale_diag` (see its docstring):
# the reference's helpers on CUDA vs CPU, the committed dump slice (and $DUMP) replayed on CUDA, the real
# kernel run like the oracle (zero cache, all 64 heads) with every flush re-computed on CUDA and on CPU
# copies, per-head mismatches, and a bisection of the first differing call op by op.
#
# Exact command, from the repository root on the GPU machine (bundle with the ahead-of-time modules):
#   BUNDLE=.stage-engines/bundle OUT=/path/to/out [DUMP=/path/to/fi_dump.safetensors] bash lab/gpu/fi_scale_diag.sh
# Writes $OUT/results.json, $OUT/scale_diag.log and $OUT/oracle_ckpt_*.safetensors (4 files, 8-15 MB each:
# the oracle calls in the dump format, for `python -m lab.engines.fit FILE --calls` offline).
# About 60-90 s on an H200 (imports ~15 s; CPU re-computation of ~16 flushes of 64 heads); stopped at $LIMIT (110) s.
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
BUNDLE=${BUNDLE:-$PWD/.stage-engines/bundle}
export PYTHONPATH="$PWD:$BUNDLE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASHINFER_DISABLE_JIT=${FLASHINFER_DISABLE_JIT:-1}
mkdir -p "$OUT"
echo "[fi_scale_diag] $(date -u +%H:%M:%S) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
after=()
if [ -n "${DUMP:-}" ]; then
  if [ -f "$DUMP" ]; then after=(--dump-after "$DUMP"); else echo "[fi_scale_diag] DUMP=$DUMP is not a file: skipped"; fi
fi
timeout --kill-after=5 "${LIMIT:-110}" python3 -m lab.engines.scale_diag --out "$OUT" \
  --dump tests/engines/data/fi_dump_slice.safetensors --dump-cpu --legacy-ldexp int8:4:16 "${after[@]}" ${DIAG_ARGS:-} 2>&1 | tee "$OUT/scale_diag.log"
rc=${PIPESTATUS[0]}
ls -la "$OUT"
if [ "$rc" -ne 0 ]; then echo "[fi_scale_diag] FAILED rc=$rc$( [ "$rc" -eq 124 ] && echo ' (timed out: results.json holds what finished)')"; exit 1; fi
echo "[fi_scale_diag] $(date -u +%H:%M:%S) done"
