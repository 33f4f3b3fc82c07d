#!/usr/bin/env bash
# Issue #14's KDA kernel bar on one GPU, inside BUDGET (default 120) s of wall time:
#
#   OUT=/tmp/out bash benchmarks/gpu/kernels_kda.sh            final numbers (MODE=final, the default)
#   OUT=/tmp/out MODE=sweep bash benchmarks/gpu/kernels_kda.sh  the code-path and tiling sweep
#
# final: 1. bench (65 s; its table is rewritten after every row, so a cut keeps what ran): benchmarks/bench_emulation.py --kinds kda, batch 16, 4096 steps: the kernel's default
#           path per variant and all six in one launch, the eager peer, the torch.compile peer in mode default
#           and mode reduce-overhead (the faster is the peer) -> $OUT/emulation_kda.md
#        2. paths (22 s): benchmarks/gpu/kda_paths.py --final: the default path against the previous default
#           (fast_round and fp_fusion off) for fp8 / int8 / nvfp4 conventional, fp8 replay16 and the six-variant
#           launch, and fp8 with fast_round alone off (must be bit-identical) -> $OUT/kda_paths.json
# sweep: 1. kda_paths.py: every candidate path and tiling -> $OUT/kda_paths.json
#        2. kda_paths.py --stage peers: the eager loop and both torch.compile modes -> $OUT/kda_peers.json
# both:  3. pytest (the rest of the budget, at most 60 s: ~27 s of the default 120; -x, in this order): the fast 8-bit write over all 2^32
#           FP32 inputs and the kernel's fast-path tests (test_delta_rule_paths.py), the KDA kernel against the
#           naive reference at GLM-5.3-Flash shapes (test_kda_kernel.py), the GDN kernel at Qwen3.5-9B shapes
#           -> $OUT/pytest.txt (each test's outcome, the slowest tests)
# Every stage's log goes to $OUT/logs.tar.gz; a failed or timed-out stage makes the script exit non-zero.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
BUDGET=${BUDGET:-120}
mkdir -p "$OUT/logs"
start=$(date +%s)
failed=()

stage() {  # stage NAME LIMIT_S COMMAND...: run with a timeout, keep the log, print its tail
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - 3 - ($(date +%s) - start)))
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "== $name: SKIPPED, only ${left} s of the budget left"
        failed+=("$name (skipped)")
        return
    fi
    echo "== $name (limit ${limit} s, $(($(date +%s) - start)) s elapsed)"
    timeout "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/logs/$name.log"
    if ((rc != 0)); then
        echo "== $name: FAILED rc=$rc$( ((rc == 124)) && echo ' (timed out)')"
        failed+=("$name (rc $rc)")
    fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [[ ${MODE:-final} == sweep ]]; then
    stage paths 55 python3 benchmarks/gpu/kda_paths.py --stage paths --steps 4096 --batch 16 --reps 3 \
        --out "$OUT/kda_paths.json"
    stage peers 40 python3 benchmarks/gpu/kda_paths.py --stage peers --steps 4096 --batch 16 --peer-steps 64 \
        --modes default,reduce-overhead --out "$OUT/kda_peers.json"
else
    stage bench 65 python3 benchmarks/bench_emulation.py --steps 4096 --batch 16 --peer-steps 64 --reps 3 \
        --kinds kda --compile-modes default,reduce-overhead --compile-variants fp8_e4m3@conventional --out "$OUT/emulation_kda.md"
    stage paths 22 python3 benchmarks/gpu/kda_paths.py --stage paths --final --steps 4096 --batch 16 --reps 2 \
        --out "$OUT/kda_paths.json"
fi
stage pytest 60 python3 -m pytest -v -x -rfE -p no:cacheprovider --durations=12 \
    tests/kernels/test_delta_rule_paths.py tests/kernels/test_kda_kernel.py \
    "tests/kernels/test_emulation_kernels.py::test_kernels_match_naive_reference[gdn]" \
    tests/kernels/test_emulation_kernels.py::test_gdn_initial_state_and_record_every
grep -hE "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|^[0-9.]+s (call|setup)" "$OUT/logs/pytest.log" \
    | sed 's/^tests\/kernels\///' >"$OUT/pytest.txt"

tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done in $(($(date +%s) - start)) s"
if ((${#failed[@]})); then
    echo "== FAILED stages: ${failed[*]}"
    exit 1
fi
