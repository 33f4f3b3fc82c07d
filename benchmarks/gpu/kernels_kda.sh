#!/usr/bin/env bash
# Issue #14's KDA kernel bar on one GPU, inside 120 s of wall time (BUDGET):
#
#   OUT=/tmp/out bash benchmarks/gpu/kernels_kda.sh            final numbers (MODE=final, the default)
#   OUT=/tmp/out MODE=sweep bash benchmarks/gpu/kernels_kda.sh  the code-path sweep
#
# final: 1. benchmarks/bench_emulation.py --kinds kda, batch 16, 4096 steps, the torch.compile peer in
#           COMPILE_MODE (default reduce-overhead) -> $OUT/emulation_kda.md
#        2. benchmarks/gpu/kda_paths.py --final: the default path against fast_round + fp_fusion, with
#           the metrics of each checked against the default path's -> $OUT/kda_paths.json
# sweep: 1. kda_paths.py: every candidate path (fast_round x fp_fusion) and tiling -> $OUT/kda_paths.json
#        2. kda_paths.py --stage peers: the eager loop and torch.compile (default, reduce-overhead) of the
#           same per-step function, fp8_e4m3 conventional -> $OUT/kda_peers.json
# both:  3. pytest: the KDA kernel tests, the delta-rule path tests and the GDN kernel tests at full model
#           shapes -> $OUT/pytest.txt
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
    local left=$((BUDGET - ($(date +%s) - start)))
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
    stage bench 70 python3 benchmarks/bench_emulation.py --steps 4096 --batch 16 --peer-steps 64 --reps 2 \
        --kinds kda --compile-mode "${COMPILE_MODE:-reduce-overhead}" --out "$OUT/emulation_kda.md"
    stage paths 22 python3 benchmarks/gpu/kda_paths.py --stage paths --final --steps 4096 --batch 16 --reps 3 \
        --out "$OUT/kda_paths.json"
fi
stage pytest 25 python3 -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_kda_kernel.py \
    tests/kernels/test_delta_rule_paths.py \
    "tests/kernels/test_emulation_kernels.py::test_kernels_match_naive_reference[gdn]" \
    tests/kernels/test_emulation_kernels.py::test_gdn_initial_state_and_record_every
grep -hE "passed|failed|error" "$OUT/logs/pytest.log" >"$OUT/pytest.txt"

tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done in $(($(date +%s) - start)) s"
if ((${#failed[@]})); then
    echo "== FAILED stages: ${failed[*]}"
    exit 1
fi
