#!/usr/bin/env bash
# The CPU parts of the studies, and a CPU-sized variant of the whole study set.
#
#   bash studies/cpu_run.sh                 # the CPU parts the pages use (about 13 min on 2 cores, 1 thread each)
#   SCALE=small DATA=/tmp/ssmquant_small bash studies/cpu_run.sh all   # every study at CPU size (GPU not needed)
#   SCALE=smoke DATA=/tmp/ssmquant_smoke bash studies/cpu_run.sh all   # seconds-long check of the pipeline
#   python studies/make_pages.py [--data DATA --out PAGES]              # then build the pages from DATA
#
# PART=cpu (default) runs what the GPU run (studies/gpu_run.sh) does not provide:
#   - conv_vs_replay/tiny-qwen-cpu: the tiny-qwen run of study 1 (on the GPU it hit its time limit), at
#     4096 steps x 2 sequences instead of 32768 x 4;
#   - conv_vs_replay/tiny-qwen-cpu-bufdtype: the same inputs, replay16 with a bf16 vs an FP32 input buffer;
#   - fragile_heads/decays_tiny-qwen-cpu.csv: the per-head decays of those same inputs;
#   - e2e/{tiny-nemotron,tiny-qwen}: `ssmquant eval`, end-to-end KL / top-1 / delta bits-per-byte;
#   - calibrate/tiny-nemotron: `ssmquant calibrate` (dynamic vs static max / percentile / mse scales, per row
#     and per head, nvfp4 second-level scale per row vs per head; the per-layer recipe vs the global setting).
# PART=all also runs the GPU commands of studies/gpu_run.sh at the SCALE's size (into DATA, not studies/data).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
PY="${PYTHON:-python3}"
PART="${1:-cpu}"
SCALE="${SCALE:-full}"
D="${DATA:-studies/data}"
case "$SCALE" in
  full)  TQ="--steps 4096 --batch 2"; E2E="--steps 1024 --batch 2"; CAL="--horizon 512 --batch 2"
         LONG="--steps 32768 --batch 4"; MID="--steps 8192 --batch 4"; NANO_L="0,14,30,50"; QWEN_L="0,10,20,30" ;;
  small) TQ="--steps 1024 --batch 1"; E2E="--steps 256 --batch 1"; CAL="--horizon 256 --batch 1"
         LONG="--steps 1024 --batch 1"; MID="--steps 512 --batch 1"; NANO_L="0"; QWEN_L="0" ;;
  smoke) TQ="--steps 64 --batch 1"; E2E="--steps 32 --batch 1"; CAL="--horizon 32 --batch 1"
         LONG="--steps 64 --batch 1"; MID="--steps 48 --batch 1"; NANO_L="0"; QWEN_L="0" ;;
  *) echo "SCALE must be full, small or smoke" >&2; exit 2 ;;
esac
case "$PART" in cpu|all) ;; *) echo "PART must be cpu or all" >&2; exit 2 ;; esac
mkdir -p "$D"
SQ() { "$PY" -m ssmquant.cli "$@" || echo "FAILED: $*"; }
A() { SQ analyze -q --force --no-plots --device cpu "$@"; }
ALL="fp8_e4m3,int8,nvfp4,bf16,fp16"
E2E_V="fp8_e4m3@conventional,fp8_e4m3@replay16,int8@conventional,int8@replay16,nvfp4@conventional,nvfp4@replay16,bf16@conventional,bf16@replay16"
# steps and batch of the tiny-qwen run, for the decays of the same inputs
read -r _ TQ_STEPS _ TQ_BATCH <<<"$TQ"

if [ "$PART" = all ]; then
  # the commands of studies/gpu_run.sh, at this SCALE, on CPU (tiny-qwen is the CPU part below)
  A --model nemotron-3-nano --synthetic --layers "$NANO_L" --formats $ALL --rounding rne,sr --schemes conventional,replay16 $LONG --out "$D/conv_vs_replay/nemotron-3-nano"
  A --model qwen3.5-9b --synthetic --layers "$QWEN_L" --formats $ALL --rounding rne,sr --schemes conventional,replay16 $LONG --out "$D/conv_vs_replay/qwen3.5-9b"
  A --model tiny-nemotron --formats $ALL --rounding rne,sr --schemes conventional,replay16 $LONG --out "$D/conv_vs_replay/tiny-nemotron"
  A --model nemotron-3-nano --synthetic --layers "$NANO_L" --formats fp8_e4m3,int8,nvfp4 --schemes replay1,replay2,replay4,replay8,replay16,replay32 $MID --out "$D/buffer_length/nemotron-3-nano"
  A --model tiny-nemotron --formats fp8_e4m3,int8,nvfp4 --schemes replay1,replay2,replay4,replay8,replay16,replay32 $MID --out "$D/buffer_length/tiny-nemotron"
  A --model nemotron-3-nano --synthetic --layers "$NANO_L" --formats fp8_e4m3,fp8_e4m3:rows8,fp8_e4m3:head,int8,int8:rows8,int8:head,nvfp4,nvfp4:rows8,nvfp4:head --schemes conventional,replay16 $MID --out "$D/granularity/nemotron-3-nano"
  SPEC="replay16"; for t in 2 4 6; do for p in 1.0 0.8 0.5; do SPEC="$SPEC,spec16x$t:p$p"; done; done
  A --model nemotron-3-nano --synthetic --layers "$NANO_L" --formats fp8_e4m3,int8 --schemes "$SPEC" $MID --out "$D/speculative/nemotron-3-nano"
  A --model tiny-nemotron --formats fp8_e4m3,int8 --schemes "$SPEC" $MID --out "$D/speculative/tiny-nemotron"
  read -r _ L_STEPS _ L_BATCH <<<"$LONG"
  "$PY" studies/head_decays.py --models nemotron-3-nano,qwen3.5-9b,tiny-nemotron --steps "$L_STEPS" --batch "$L_BATCH" \
    --device cpu --layers-nano "$NANO_L" --layers-qwen "$QWEN_L" --out "$D/fragile_heads/decays.csv" || echo "FAILED: head_decays"
fi

# 1. tiny-qwen, conventional vs replay (CPU size), and its per-head decays on the same inputs
A --model tiny-qwen --formats $ALL --rounding rne,sr --schemes conventional,replay16 $TQ --out "$D/conv_vs_replay/tiny-qwen-cpu"
# ... and replay16 with an FP32 instead of a bf16 input buffer (why replay loses to conventional for fp16 on GDN)
A --model tiny-qwen --formats fp16,bf16,int8 --schemes replay16,replay16:fp32 $TQ --out "$D/conv_vs_replay/tiny-qwen-cpu-bufdtype"
"$PY" studies/head_decays.py --models tiny-qwen --steps "$TQ_STEPS" --batch "$TQ_BATCH" --device cpu \
  --out "$D/fragile_heads/decays_tiny-qwen-cpu.csv" || echo "FAILED: head_decays tiny-qwen"
# 1. end to end: every SSM layer of the model stores its state in the format; KL vs the FP32-state model
for m in tiny-nemotron tiny-qwen; do
  SQ eval -q --force --no-plots --device cpu --model $m --variants "$E2E_V" $E2E --out "$D/e2e/$m"
done
# 3 + 4. calibration: dynamic vs static scales, and the per-layer recipe vs one global setting
SQ calibrate -q --force --device cpu --model tiny-nemotron --budget 0.01 $CAL \
  --candidates fp8_e4m3,int8,nvfp4,nvfp4:head:dynamic --schemes conventional,replay --buffer-lens 16 \
  --calibration max,percentile:99,mse --calibration-granularity row,head --out "$D/calibrate/tiny-nemotron"
echo "done"
