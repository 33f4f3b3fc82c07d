#!/usr/bin/env bash
# The Mamba-2 emulation kernel (new nvfp4 write, FMA-contracted sums, k-major tile, initial-state hint) on one GPU:
# the kernel tests at full shapes, and the kernel timed at Nemotron-3-Nano shapes against main's, inside BUDGET
# (118) s of wall time.
#
#   OUT=/tmp/out bash benchmarks/gpu/kernels_nvfp4.sh       (from the repository root)
#
# 1. in parallel: the Mamba-2 kernel tests (tests/kernels without GDN and KDA, three pytest processes; on a GPU
#    they run at the real models' shapes) and one warm-up process per benchmark case and kernel build, which
#    compiles its kernels into Triton's cache (the compiles are CPU-bound; the timed runs then find them cached),
#    and benchmarks/kernel_sass.py for the new kernel and main's (instructions per step, the device's Triton);
# 2. benchmarks/bench_nvfp4.py, one process at a time on the idle GPU: the new kernel for every case (fp8 and
#    nvfp4 conventional, nvfp4 from an initial state and at four forced tilings, nvfp4 replay16, the six default
#    variants in one launch), main's (MAIN_ENV: the four knobs that restore it) and the new kernel without FMA
#    contraction (new-nofma) for the main cases, then the new kernel's main cases again (the spread between its
#    two runs is the noise to read the ratios against);
# 3. the table of all runs, each against main (bench_nvfp4.py --report).
# Writes $OUT/nvfp4_sweep.md (the table), $OUT/nvfp4_{fast,main,nofma,fast2}.json, $OUT/pytest.txt (its summary)
# and $OUT/logs.tar.gz (every stage's log). A failed or timed-out stage is reported at the end; the script then
# exits 1.
# BENCH_ARGS is appended to every bench_nvfp4.py call: a check of this script without a GPU runs it with
#   TRITON_INTERPRET=1 BENCH_ARGS="--device cpu --steps 8 --batch 1 --reps 1" TESTS=0 OUT=/tmp/o bash ...
# (TESTS=0 leaves the pytest processes out; FAST_CASES / MAIN_CASES narrow the cases).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
BUDGET=${BUDGET:-118}
mkdir -p "$OUT/logs"
start=$(date +%s)
failed=()

left() { echo $((BUDGET - ($(date +%s) - start))); }

stage() { # stage NAME LIMIT_S COMMAND...: run with a timeout, keep the log, print its tail
    local name=$1 limit=$2
    shift 2
    local l
    l=$(left)
    ((limit > l)) && limit=$l
    if ((l < 8)); then
        echo "== $name: SKIPPED, only ${l} s of the budget left"
        failed+=("$name (skipped)")
        return
    fi
    echo "== $name (limit ${limit} s, $(($(date +%s) - start)) s elapsed)"
    timeout "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/logs/$name.log"
    if ((rc != 0)); then
        echo "== $name: FAILED rc=$rc$( ((rc == 124)) && echo ' (timed out)')"
        failed+=("$name (rc $rc)")
    fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

BENCH="python3 benchmarks/bench_nvfp4.py"
BENCH_ARGS=${BENCH_ARGS:-}
FAST_CASES=${FAST_CASES:-fp8_conv nvfp4_conv nvfp4_conv_s0 nvfp4_conv_8x1 nvfp4_conv_16x2 nvfp4_conv_32x2 nvfp4_conv_64x4 nvfp4_replay16 six}
MAIN_CASES=${MAIN_CASES:-fp8_conv nvfp4_conv nvfp4_conv_s0 nvfp4_replay16 six}
NOFMA_CASES="fp8_conv nvfp4_conv six"
MAIN_ENV="SSMQUANT_ROUNDING=legacy SSMQUANT_MAMBA2_FMA=0 SSMQUANT_MAMBA2_S0_HINT=0 SSMQUANT_MAMBA2_KMAJOR=0"
TESTS=${TESTS:-1}

# 1. tests and warm-up compiles, all at once (16 CPU cores); each process under its own time limit
parallel_start() {
    local limit=$1 pids=() rc=0 i=0 parts=()
    # the Mamba-2 kernel's tests (and its batch slicing, test_windows), the tile fake-quant's (every format) and the
    # engine kernel's (it shares the rounding helpers); GDN and KDA run other kernels: kernels.sh has them
    ((TESTS)) && parts=("tests/kernels/test_emulation_kernels.py" "tests/kernels/test_multi_variant.py"
        "tests/kernels/test_nvfp4_write.py tests/kernels/test_int16_tile.py tests/kernels/test_rounding_ties.py \
tests/engines/test_profiles.py tests/replay/test_windows.py")
    for part in "${parts[@]}"; do
        # shellcheck disable=SC2086
        timeout "$limit" python3 -m pytest -q -rfE -p no:cacheprovider -k "not gdn and not kda" $part \
            >"$OUT/logs/pytest_$i.log" 2>&1 &
        pids+=($!)
        i=$((i + 1))
    done
    local warm=()
    for c in $FAST_CASES; do
        timeout "$limit" $BENCH --warm --cases "$c" $BENCH_ARGS >"$OUT/logs/warm_fast_$c.log" 2>&1 &
        warm+=($!)
    done
    for c in $MAIN_CASES; do
        env $MAIN_ENV timeout "$limit" $BENCH --warm --cases "$c" $BENCH_ARGS >"$OUT/logs/warm_main_$c.log" 2>&1 &
        warm+=($!)
    done
    for c in $NOFMA_CASES; do
        SSMQUANT_MAMBA2_FMA=0 timeout "$limit" $BENCH --warm --cases "$c" $BENCH_ARGS >"$OUT/logs/warm_nofma_$c.log" 2>&1 &
        warm+=($!)
    done
    # instructions per step from the device Triton's machine code (CPU only), new kernel and main's
    env -u TRITON_INTERPRET timeout "$limit" python3 benchmarks/kernel_sass.py >"$OUT/logs/sass_new.log" 2>&1 &
    warm+=($!)
    env -u TRITON_INTERPRET $MAIN_ENV timeout "$limit" python3 benchmarks/kernel_sass.py >"$OUT/logs/sass_main.log" 2>&1 &
    warm+=($!)
    for pid in "${pids[@]+"${pids[@]}"}"; do wait "$pid" || rc=1; done
    for pid in "${warm[@]}"; do wait "$pid" || echo "a warm-up process failed (rc $?): the timed run compiles it"; done
    cat "$OUT"/logs/warm_*.log "$OUT"/logs/sass_*.log
    cat "$OUT"/logs/pytest_*.log 2>/dev/null
    return $rc
}
export -f parallel_start
export OUT BENCH BENCH_ARGS FAST_CASES MAIN_CASES NOFMA_CASES MAIN_ENV TESTS
l=$(left)
stage tests_and_warmup $((l - 43)) bash -c "parallel_start $((l - 46))"
grep -hE "passed|failed|error" "$OUT"/logs/pytest_*.log >"$OUT/pytest.txt" 2>/dev/null

# 2. timed runs, one process at a time
csv() { echo "$*" | tr ' ' ,; }
# shellcheck disable=SC2086
stage bench_fast 14 $BENCH --batch 8,16 --cases "$(csv $FAST_CASES)" --json "$OUT/nvfp4_fast.json" $BENCH_ARGS
# shellcheck disable=SC2086
stage bench_main 10 env $MAIN_ENV $BENCH --batch 8,16 --cases "$(csv $MAIN_CASES)" --json "$OUT/nvfp4_main.json" \
    $BENCH_ARGS
# shellcheck disable=SC2086
stage bench_nofma 8 env SSMQUANT_MAMBA2_FMA=0 $BENCH --batch 8,16 --cases "$(csv $NOFMA_CASES)" \
    --json "$OUT/nvfp4_nofma.json" $BENCH_ARGS
# shellcheck disable=SC2086
stage bench_fast2 7 $BENCH --batch 8,16 --cases fp8_conv,nvfp4_conv,nvfp4_replay16 --json "$OUT/nvfp4_fast2.json" \
    $BENCH_ARGS

# 3. the table
runs=$(ls "$OUT"/nvfp4_*.json 2>/dev/null)
if [[ -n $runs ]]; then
    # shellcheck disable=SC2086
    stage report 4 $BENCH --report $runs --out "$OUT/nvfp4_sweep.md"
fi

tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done in $(($(date +%s) - start)) s"
if ((${#failed[@]})); then
    echo "== FAILED stages: ${failed[*]}"
    exit 1
fi
