#!/usr/bin/env bash
# Issue #11: the `flashinfer` profile's Triton twin (ssmquant/kernels/mamba2_engine.py) on the GPU, inside $BUDGET
# (default 100) s of wall time, in two calls (the stages they run: STAGES, comma-separated):
#
#   STAGES=compare,timing BUNDLE=.stage-engines/bundle OUT=/tmp/out bash lab/gpu/engine_twin.sh
#   STAGES=calibrate,recipes OUT=/tmp/out bash lab/gpu/engine_twin.sh     (modelopt on the caller's PYTHONPATH)
#
# (from the repository root; the caller's PYTHONPATH is kept after the repository's.)
# 1. compare: the twin and the torch profile (engines/emulation.py) on the synthetic Nemotron-3-Nano layer
#    (batch 8 x 1024 steps x 64 heads x 64 x 128, 8 groups; x, B, C in bf16), every step: fingerprints of the
#    metric state, the checkpoint codes and the decode scales (must be identical), outputs and metrics
#    (identical fraction, largest relative difference) -> $OUT/compare.json (`python -m lab.engines.twin`);
#    one process per variant (their compiles run in parallel).
# 2. timing: the twin as analyses run it (no probe) against the ideal fused kernel (emulate_triton end to end, CUDA
#    events, median of REPS) and FlashInfer's real checkpointing_ssu (bundle on PYTHONPATH, FLASHINFER_DISABLE_JIT=1:
#    its ahead-of-time modules), over TIMING_STEPS steps; the first calls (compiles) run first in one process per
#    variant and are recorded apart -> $OUT/timing.json. Needs the bundle; without it the real kernel is skipped.
# 3. calibrate: `ssmquant calibrate --engine flashinfer` on the shipped tiny-nemotron with --backend triton and
#    --backend torch at once (needs modelopt; no FlashInfer: the profile is ssmquant's own arithmetic);
# 4. recipes: the two recipes compared (choices equal, errors within the twin's tolerances) -> $OUT/recipes.json.
#    The recipes themselves go into the logs.
# Sizes: BATCH, STEPS (compare), TIMING_STEPS, HEADS, VARIANTS, JOBS (compare processes), TIMING_VARIANTS, REPS,
# CAL_HORIZON, CAL_BATCH, CAL_LAYERS. Each stage has its own time limit (COMPARE_S, TIMING_S, CAL_S; cut to what the
# budget leaves); compare.json / timing.json are rewritten after every variant, so a stage stopped by its limit
# still returns what it measured. Exits non-zero when a stage fails. CPU test (Triton interpreter, minutes):
#   OUT=/tmp/t DEVICE=cpu TRITON_INTERPRET=1 BUDGET=1500 BATCH=1 STEPS=6 TIMING_STEPS=6 HEADS=8 VARIANTS=int8@replay4 \
#   TIMING_VARIANTS=int8@replay4 REPS=1 CAL_HORIZON=8 CAL_BATCH=1 CAL_LAYERS=0 COMPARE_S=400 TIMING_S=300 CAL_S=600 \
#   STAGES=compare,timing bash lab/gpu/engine_twin.sh      (then STAGES=calibrate,recipes, same variables)
set -uo pipefail
# shellcheck source=lab/gpu/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ALL_STAGES=compare,timing,calibrate,recipes
STAGES=${STAGES:-$ALL_STAGES}
for s in ${STAGES//,/ }; do
    case ",$ALL_STAGES," in *",$s,"*) ;; *)
        echo "engine_twin.sh: unknown stage '$s' in STAGES=$STAGES; accepted: $ALL_STAGES" >&2
        exit 2
        ;;
    esac
done
wants() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac }
BUNDLE=${BUNDLE:-$PWD/.stage-engines/bundle}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-8}
STEPS=${STEPS:-1024}
TIMING_STEPS=${TIMING_STEPS:-256}
HEADS=${HEADS:-64}
VARIANTS=${VARIANTS:-int8@replay16,fp8_e4m3@replay16,int8:sr@replay16,fp8_e4m3:sr@replay16,bf16@replay16,fp16:sr@conventional,int16@conventional}
TIMING_VARIANTS=${TIMING_VARIANTS:-int8@replay16,fp8_e4m3@replay16,fp16:sr@conventional}
CAL_HORIZON=${CAL_HORIZON:-256}
CAL_BATCH=${CAL_BATCH:-4}
CAL_LAYERS=${CAL_LAYERS:-}
REPS=${REPS:-3}
JOBS=${JOBS:-7}
# stage limits (s); a CPU test under TRITON_INTERPRET=1 raises them
COMPARE_S=${COMPARE_S:-50}
TIMING_S=${TIMING_S:-45}
CAL_S=${CAL_S:-80}
STAGE_MIN_S=${STAGE_MIN_S:-6}
outer_path=${PYTHONPATH:-}
gpu_begin 100
export PYTHONPATH="$PWD${outer_path:+:$outer_path}" # keep the caller's site (transformers, modelopt)
export FLASHINFER_DISABLE_JIT=${FLASHINFER_DISABLE_JIT:-1}
echo "stages: $STAGES"
gpu_versions
sizes=(--device "$DEVICE" --batch "$BATCH" --heads "$HEADS")

if wants compare; then
    stage compare "$COMPARE_S" python3 -m lab.engines.twin compare --out "$OUT/compare.json" "${sizes[@]}" \
        --steps "$STEPS" --variants "$VARIANTS" --jobs "$JOBS"
fi
if wants timing; then
    [ -d "$BUNDLE" ] || echo "timing: no bundle at $BUNDLE (BUNDLE=...): the real checkpointing_ssu will not be timed"
    n_timed=$(($(tr -cd , <<<"$TIMING_VARIANTS" | wc -c) + 1))
    stage timing "$TIMING_S" env PYTHONPATH="$PYTHONPATH:$BUNDLE" python3 -m lab.engines.twin timing \
        --out "$OUT/timing.json" "${sizes[@]}" --steps "$TIMING_STEPS" --timing-variants "$TIMING_VARIANTS" \
        --reps "$REPS" --jobs "$n_timed"
fi

if wants calibrate; then
    cal=(calibrate --model tiny-nemotron --budget 0.001 --horizon "$CAL_HORIZON" --batch "$CAL_BATCH" --candidates
        int8,fp16 --schemes replay16,conventional --calibration none --engine-fallbacks none --engine flashinfer
        --device "$DEVICE" --force -q)
    [ -n "$CAL_LAYERS" ] && cal+=(--layers "$CAL_LAYERS")
    # both backends at once, each under its own limit (the torch one is host-bound, the Triton one compiles)
    # shellcheck disable=SC2329 # run by `stage ... bash -c` (export -f)
    calibrate_both() {
        local rc=0 pids=()
        for b in triton torch; do
            # shellcheck disable=SC2086 # CAL_ARGS is a word list
            timeout --kill-after=3 "$CAL_S" python3 -m ssmquant $CAL_ARGS --backend "$b" --out "$OUT/logs/recipe_$b" \
                >"$OUT/logs/calibrate_$b.log" 2>&1 &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || rc=1; done
        for b in triton torch; do echo "-- calibrate --backend $b"; tail -n 12 "$OUT/logs/calibrate_$b.log"; done
        return "$rc"
    }
    export -f calibrate_both
    export OUT CAL_S CAL_ARGS="${cal[*]}"
    python3 -c "import modelopt" 2>/dev/null ||
        echo "calibrate: modelopt is not importable (PYTHONPATH=$PYTHONPATH): calibrate needs it (its statistics)"
    stage calibrate "$((CAL_S + 5))" bash -c calibrate_both
fi
if wants recipes; then
    stage recipes 8 python3 -m lab.engines.twin recipes "$OUT/logs/recipe_triton" "$OUT/logs/recipe_torch" \
        --out "$OUT/recipes.json"
fi
gpu_end
