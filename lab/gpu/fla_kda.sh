#!/usr/bin/env bash
# Issue #11 point 2 on one GPU, inside BUDGET (default 55) s: only the fla cases of the engine oracle
# (fused_recurrent_gated_delta_rule on synthetic Qwen3.5-9B layer 0, fused_recurrent_kda on synthetic GLM-5.3-Flash
# layer 0, each with an fp32 and a bf16 state, 256 decode steps, batch 2) and the fla GPU tests.
#
#   OUT=/tmp/out BUNDLE=$PWD/.stage-engines/bundle [CAPTURED=FILE] bash lab/gpu/fla_kda.sh
#
# CAPTURED (optional): captured layer inputs (`lab.engines.oracle.save_captured`, e.g. a trained tiny-kda KDA
# layer over 4096 steps); each captured GDN / KDA layer then also runs through its fla kernel with an fp32 and a bf16
# state over all of its steps (raise BUDGET: 4096 teacher-forced steps take about 20 s per case).
#
# 1. oracle (limit 30 s): python -m lab.engines.oracle --only fla -> $OUT/oracle/results.json
#    check: all four fla cases ran, none skipped (else the script fails)
# 2. pytest (the rest, at most 25 s): tests/engines/test_engines_gpu.py -k fla -> the fla GDN / KDA tests
# Logs of both stages: $OUT/logs.tar.gz. A failed or timed-out stage makes the script exit non-zero.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
gpu_begin 55
BUNDLE=${BUNDLE:-$PWD/.stage-engines/bundle}
[ -d "$BUNDLE/fla" ] || { echo "[fla_kda] no fla in BUNDLE=$BUNDLE"; exit 1; }
export PYTHONPATH="$PWD:$BUNDLE" FLASHINFER_DISABLE_JIT=1
mkdir -p "$OUT/oracle"
gpu_versions
cap=() ncap=0
if [ -n "${CAPTURED:-}" ]; then
    [ -f "$CAPTURED" ] || { echo "[fla_kda] CAPTURED=$CAPTURED: no such file"; exit 1; }
    cap=(--captured "$CAPTURED")
    ncap=2  # fp32 and bf16 state per captured layer; the check below wants at least the synthetic four plus these
fi
stage oracle $((30 + 60 * ncap)) python3 -m lab.engines.oracle --only fla --no-timing --out "$OUT/oracle" "${cap[@]}"
# fail loudly when fla could not run (the oracle then writes 0 cases and exits 0): all cases must be there
stage check 10 python3 -c "import json, sys
r = json.load(open('$OUT/oracle/results.json'))
names = [c['case'] for c in r['cases']]
print(r['engines']['fla'], names, r['skipped'])
sys.exit(0 if sum('fla' in n for n in names) >= 4 + $ncap and not r['skipped'] else 'fla cases missing or skipped')"
stage pytest 25 python3 -m pytest -q -rA -p no:cacheprovider tests/engines/test_engines_gpu.py -k fla
gpu_end
