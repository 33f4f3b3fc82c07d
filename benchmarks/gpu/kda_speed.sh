#!/usr/bin/env bash
# Issue #14's KDA speed bar on one GPU, inside BUDGET (default 150) s of wall time:
#
#   OUT=/tmp/out bash benchmarks/gpu/kda_speed.sh
#   OUT=/tmp/out DEVICE=cpu bash benchmarks/gpu/kda_speed.sh     a check of the script: Triton's interpreter, tiny
#                      shapes, limits x10 (about 5 minutes on 2 CPU cores; no timing means anything; needs python3
#                      to be the project's interpreter, e.g. PATH=/work/main/.venv/bin:$PATH)
#
# 1. tiles_fp8 (limit 34 s): benchmarks/gpu/kda_tiles.py, fp8_e4m3 conventional at GLM-5.3-Flash shapes, batch 16,
#    4096 steps: 12 launch configurations (BLOCK_P x warps, prefetch, row blocks first), each the median of 5 runs
#    with its spread; prefetch / grid order must leave the metrics bit-identical -> $OUT/kda_tiles_fp8.json
# 2. tiles_int8 (limit 20 s): the same for int8 conventional, 6 configurations -> $OUT/kda_tiles_int8.json
# 3. bench (the rest, at most 92 s): benchmarks/bench_emulation.py --kinds kda, the kernel's default path per variant
#    and all six in one launch, the eager peer and the torch.compile peer in modes default and reduce-overhead for
#    EVERY variant, every time the median of 5 runs with its spread -> $OUT/emulation_kda.md (rewritten after every
#    row, so a cut keeps what ran)
# Every stage's log goes to $OUT/logs.tar.gz; a failed, timed-out or skipped stage makes the script exit 1.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
x=1  # stage limits x this factor
if [[ ${DEVICE:-cuda} == cpu ]]; then
    x=10 BUDGET=${BUDGET:-1500}
fi
gpu_begin 150

if [[ ${DEVICE:-cuda} == cpu ]]; then
    export TRITON_INTERPRET=1
    shape=(--steps 3 --batch 2 --reps 3 --device cpu)
    bench_shape=(--steps 4 --batch 1 --peer-steps 2 --reps 3 --device cpu)
else
    shape=(--steps 4096 --batch 16 --reps 5)
    bench_shape=(--steps 4096 --batch 16 --peer-steps 64 --reps 5)
fi

gpu_versions
stage tiles_fp8 $((34 * x)) python3 benchmarks/gpu/kda_tiles.py "${shape[@]}" --formats fp8_e4m3 --out "$OUT/kda_tiles_fp8.json"
stage tiles_int8 $((20 * x)) python3 benchmarks/gpu/kda_tiles.py "${shape[@]}" --formats int8 \
    --configs 16x1,16x1+pf,16x1+rb,16x1+pf+rb,8x1+pf+rb,16x2+pf+rb --out "$OUT/kda_tiles_int8.json"
stage bench $((92 * x)) python3 benchmarks/bench_emulation.py "${bench_shape[@]}" --kinds kda \
    --compile-modes default,reduce-overhead --compile-variants all --out "$OUT/emulation_kda.md"
grep -h "^BEST" "$OUT/logs/tiles_fp8.log" "$OUT/logs/tiles_int8.log" 2>/dev/null
gpu_end
