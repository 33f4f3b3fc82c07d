#!/usr/bin/env bash
# The Mamba-2 emulation kernel on one GPU: its tests at full shapes and the kernel timed at Nemotron-3-Nano shapes,
# inside BUDGET (118) s of wall time.
#
#   OUT=/tmp/out bash benchmarks/gpu/kernels_nvfp4.sh       (from the repository root)
#
# 1. in parallel: the Mamba-2 kernel tests (tests/kernels without GDN and KDA, four pytest processes; on a GPU
#    they run at the real models' shapes), one warm-up process per benchmark case, which compiles its kernels into
#    Triton's cache (the compiles are CPU-bound; the timed runs then find them cached), and benchmarks/kernel_sass.py
#    (instructions per step in the device Triton's machine code);
# 2. benchmarks/bench_nvfp4.py, one process at a time on the idle GPU: every case (fp8 and nvfp4 conventional,
#    nvfp4 from an initial state and at four forced tilings, nvfp4 replay16, the six default variants in one
#    launch), then the main cases again (the spread between the two runs is the noise to read differences against);
# 3. the table of both runs (bench_nvfp4.py --report).
# The kernel before the rewrite of 2026-12-01 was timed beside this one then (benchmarks/results/emulation_mamba2.md);
# the environment switches that selected it are gone.
# Writes $OUT/nvfp4_sweep.md (the table), $OUT/nvfp4_{run1,run2}.json, $OUT/pytest.txt (its summary) and
# $OUT/logs.tar.gz (every stage's log). A failed or timed-out stage is reported at the end; the script then exits 1.
# BENCH_ARGS is appended to every bench_nvfp4.py call: a check of this script without a GPU runs it with
#   TRITON_INTERPRET=1 BENCH_ARGS="--device cpu --steps 8 --batch 1 --reps 1" TESTS=0 OUT=/tmp/o bash ...
# (TESTS=0 leaves the pytest processes out; CASES / AGAIN_CASES narrow the cases).
set -uo pipefail
# shellcheck source=benchmarks/gpu/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
gpu_begin 118
gpu_versions

BENCH="python3 benchmarks/bench_nvfp4.py"
BENCH_ARGS=${BENCH_ARGS:-}
CASES=${CASES:-fp8_conv nvfp4_conv nvfp4_conv_s0 nvfp4_conv_8x1 nvfp4_conv_16x2 nvfp4_conv_32x2 nvfp4_conv_64x4 nvfp4_replay16 six}
AGAIN_CASES=${AGAIN_CASES:-fp8_conv nvfp4_conv nvfp4_replay16 six}
TESTS=${TESTS:-1}

# 1. tests and warm-up compiles, all at once (16 CPU cores); each process under its own time limit
# shellcheck disable=SC2329 # run by `stage ... bash -c` (export -f)
parallel_start() {
    local limit=$1 pids=() rc=0 i=0 parts=()
    # the Mamba-2 kernel's tests (and its batch slicing, test_windows), the tile fake-quant's (every format) and the
    # engine kernel's (it shares the rounding helpers); GDN and KDA run other kernels: kernels.sh has them
    ((TESTS)) && parts=("tests/kernels/test_emulation_kernels.py" "tests/kernels/test_multi_variant.py"
        "tests/kernels/test_nvfp4_write.py tests/kernels/test_int16_tile.py tests/kernels/test_rounding_ties.py"
        "tests/engines/test_profiles.py tests/replay/test_windows.py")
    for part in "${parts[@]}"; do
        # shellcheck disable=SC2086
        timeout "$limit" python3 -m pytest -q -rfE -p no:cacheprovider -k "not gdn and not kda" $part \
            >"$OUT/logs/pytest_$i.log" 2>&1 &
        pids+=($!)
        i=$((i + 1))
    done
    local warm=()
    for c in $CASES; do
        # shellcheck disable=SC2086
        timeout "$limit" $BENCH --warm --cases "$c" $BENCH_ARGS >"$OUT/logs/warm_$c.log" 2>&1 &
        warm+=($!)
    done
    # instructions per step from the device Triton's machine code (compiled on the CPU)
    env -u TRITON_INTERPRET timeout "$limit" python3 benchmarks/kernel_sass.py >"$OUT/logs/sass.log" 2>&1 &
    warm+=($!)
    for pid in "${pids[@]+"${pids[@]}"}"; do wait "$pid" || rc=1; done
    for pid in "${warm[@]}"; do wait "$pid" || echo "a warm-up process failed (rc $?): the timed run compiles it"; done
    cat "$OUT"/logs/warm_*.log "$OUT"/logs/sass.log
    cat "$OUT"/logs/pytest_*.log 2>/dev/null
    return "$rc"
}
export -f parallel_start
export OUT BENCH BENCH_ARGS CASES TESTS
# the timed runs below need 16 + 10 + 5 s; the tests and warm-ups get the rest
l=$(budget_left)
stage tests_and_warmup $((l - 31)) bash -c "parallel_start $((l - 34))"
grep -hE "passed|failed|error" "$OUT"/logs/pytest_*.log >"$OUT/pytest.txt" 2>/dev/null

# 2. timed runs, one process at a time
csv() { echo "$*" | tr ' ' ,; }
# shellcheck disable=SC2086
stage bench_run1 16 $BENCH --batch 8,16 --cases "$(csv $CASES)" --json "$OUT/nvfp4_run1.json" $BENCH_ARGS
# shellcheck disable=SC2086
stage bench_run2 10 $BENCH --batch 8,16 --cases "$(csv $AGAIN_CASES)" --json "$OUT/nvfp4_run2.json" $BENCH_ARGS

# 3. the table
runs=$(ls "$OUT"/nvfp4_run*.json 2>/dev/null)
if [[ -n $runs ]]; then
    # shellcheck disable=SC2086
    stage report 5 $BENCH --report $runs --out "$OUT/nvfp4_sweep.md"
fi
gpu_end
