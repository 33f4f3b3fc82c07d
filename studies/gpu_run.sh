#!/usr/bin/env bash
# The GPU parts of the studies (and the two benchmarks), in one call on one H200:
#
#   bash studies/gpu_run.sh            # full size (about 8 minutes on an H200)
#   SCALE=tiny bash studies/gpu_run.sh # a seconds-long smoke run of the same commands (CPU works too)
#
# Each study's raw output is an `ssmquant analyze` directory under studies/data/<study>/<run>/
# (git-ignored: regenerate with this script). The study pages are then built on any machine with
#   python studies/make_pages.py
# When $OUT is set (the device tool), the raw outputs are packed into $OUT/studies_data.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
SCALE="${SCALE:-full}"
if [ "$SCALE" = tiny ]; then
  LONG="--steps 64 --batch 1"; MID="--steps 48 --batch 1"; DEV="--device cpu"
  NANO_L="0"; QWEN_L="0"; TINY_L="0"
else
  LONG="--steps 32768 --batch 4"; MID="--steps 8192 --batch 4"; DEV="--device auto"
  NANO_L="0,14,30,50"; QWEN_L="0,10,20,30"; TINY_L=""
fi
D=studies/data
mkdir -p $D
# every command has its own time limit, so that the whole run stays inside one 10-minute device call
# After each run the raw outputs so far are packed into $OUT, so a run cut short still returns its data.
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/studies_data.tar.gz" studies/data benchmarks/results 2>/dev/null; true; }
A() { timeout "${T_A:-60}" "$PY" -m ssmquant.cli analyze -q --force --no-plots $DEV "$@" || echo "FAILED: analyze $*"; pack; }

if [ "$SCALE" != tiny ]; then
  timeout 150 "$PY" benchmarks/bench_emulation.py 2>&1 | tail -18
  timeout 90 "$PY" benchmarks/bench_analyze.py gpu --cold-cache 2>&1 | tail -6
  pack
fi

ALL="fp8_e4m3,int8,nvfp4,bf16,fp16"
# 1. conventional vs replay, per format, up to 32K steps
A --model nemotron-3-nano --synthetic --layers "$NANO_L" --formats $ALL --rounding rne,sr --schemes conventional,replay16 $LONG --out $D/conv_vs_replay/nemotron-3-nano
A --model qwen3.5-9b --synthetic --layers "$QWEN_L" --formats $ALL --rounding rne,sr --schemes conventional,replay16 $LONG --out $D/conv_vs_replay/qwen3.5-9b
TL=(); [ -n "$TINY_L" ] && TL=(--layers "$TINY_L")
A --model tiny-nemotron "${TL[@]}" --formats $ALL --rounding rne,sr --schemes conventional,replay16 $LONG --out $D/conv_vs_replay/tiny-nemotron
A --model tiny-qwen "${TL[@]}" --formats $ALL --rounding rne,sr --schemes conventional,replay16 $LONG --out $D/conv_vs_replay/tiny-qwen
# 2. buffer length
A --model nemotron-3-nano --synthetic --layers "$NANO_L" --formats fp8_e4m3,int8,nvfp4 --schemes replay1,replay2,replay4,replay8,replay16,replay32 $MID --out $D/buffer_length/nemotron-3-nano
A --model tiny-nemotron "${TL[@]}" --formats fp8_e4m3,int8,nvfp4 --schemes replay1,replay2,replay4,replay8,replay16,replay32 $MID --out $D/buffer_length/tiny-nemotron
# 3. scale granularity (dynamic scales; calibrated static scales are in the CPU part of the study)
A --model nemotron-3-nano --synthetic --layers "$NANO_L" --formats fp8_e4m3,fp8_e4m3:rows8,fp8_e4m3:head,int8,int8:rows8,int8:head,nvfp4,nvfp4:rows8,nvfp4:head --schemes conventional,replay16 $MID --out $D/granularity/nemotron-3-nano
# 5. speculative decoding
SPEC="replay16"; for t in 2 4 6; do for p in 1.0 0.8 0.5; do SPEC="$SPEC,spec16x$t:p$p"; done; done
A --model nemotron-3-nano --synthetic --layers "$NANO_L" --formats fp8_e4m3,int8 --schemes "$SPEC" $MID --out $D/speculative/nemotron-3-nano
A --model tiny-nemotron "${TL[@]}" --formats fp8_e4m3,int8 --schemes "$SPEC" $MID --out $D/speculative/tiny-nemotron
# 4. per-head decays of the study-1 layers (same seeds and device as the synthetic inputs above)
timeout 60 "$PY" studies/head_decays.py --out $D/fragile_heads/decays.csv $([ "$SCALE" = tiny ] && echo "--steps 64 --batch 1 --device cpu --layers-nano 0 --layers-qwen 0") || echo "FAILED: head_decays"

pack
echo "done"
