#!/usr/bin/env bash
# Kernel tests and the emulation benchmark on one GPU, inside 235 s of wall time.
#
#   OUT=/tmp/out bash benchmarks/gpu/kernels.sh       (from the repository root)
#
# 1. python3 -m pytest over tests/kernels, in four processes (on a GPU the tests run at the real models' shapes);
# 2. benchmarks/bench_emulation.py at batch 16, 4096 steps, 64 peer steps, for kda (with the torch.compile
#    peer: issue #14's bar), mamba2 (with the tiling sweep of the six-variant launch) and gdn (no compile
#    peer: it cost 30-60 s per kind in earlier runs).
# Writes $OUT/emulation_{kda,mamba2,gdn}.md, $OUT/pytest.txt (its summary) and $OUT/logs.tar.gz (every
# stage's full log). Each stage has its own time limit, cut to what the overall budget leaves; a failed
# or timed-out stage is reported at the end and makes the script exit non-zero.
set -uo pipefail
# shellcheck source=benchmarks/gpu/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
STAGE_TAIL=25 # lines of each stage's log printed
STAGE_MIN_S=15
gpu_begin 235
gpu_versions

# Four pytest processes at once: the GPU is shared, but most of their time is Triton compiling (CPU, one core
# each; ~100 distinct kernels), which a fresh machine has not cached.
# shellcheck disable=SC2329 # run by `stage ... bash -c` (export -f)
pytest_parts() {
    local pids=() i=0 rc=0
    for part in "tests/kernels/test_multi_variant.py" "tests/kernels/test_emulation_kernels.py" \
        "tests/kernels/test_kda_kernel.py" "tests/kernels/test_nvfp4_write.py tests/kernels/test_int16_tile.py"; do
        # shellcheck disable=SC2086
        python3 -m pytest -q -rfE -p no:cacheprovider $part >"$OUT/logs/pytest_$i.log" 2>&1 &
        pids+=($!)
        i=$((i + 1))
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    cat "$OUT"/logs/pytest_*.log
    return "$rc"
}
export -f pytest_parts
export OUT
stage pytest 85 bash -c pytest_parts
grep -hE "passed|failed|error" "$OUT"/logs/pytest_*.log >"$OUT/pytest.txt" 2>/dev/null
stage bench_kda 80 python3 benchmarks/bench_emulation.py --steps 4096 --batch 16 --peer-steps 64 --reps 3 \
    --kinds kda --compile-variants fp8_e4m3@conventional --out "$OUT/emulation_kda.md"
stage bench_mamba2 45 python3 benchmarks/bench_emulation.py --steps 4096 --batch 16 --peer-steps 64 --reps 3 \
    --kinds mamba2 --no-compile --multi-sweep --out "$OUT/emulation_mamba2.md"
stage bench_gdn 25 python3 benchmarks/bench_emulation.py --steps 4096 --batch 16 --peer-steps 64 --reps 3 \
    --kinds gdn --no-compile --out "$OUT/emulation_gdn.md"

gpu_end
