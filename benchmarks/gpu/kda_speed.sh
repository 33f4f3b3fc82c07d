#!/usr/bin/env bash
# Issue #14's KDA speed bar on one GPU (final run), inside BUDGET (default 120) s of wall time:
#
#   OUT=/tmp/out bash benchmarks/gpu/kda_speed.sh
#   OUT=/tmp/out DEVICE=cpu bash benchmarks/gpu/kda_speed.sh     a check of the script: Triton's interpreter, tiny
#                      shapes, limits x10 (about 80 s on 2 CPU cores; no timing means anything; needs python3
#                      to be the project's interpreter, e.g. PATH=/work/main/.venv/bin:$PATH)
#
# All stages share one inductor cache, empty at the start (TORCHINDUCTOR_CACHE_DIR under /tmp), so the first compile
# of the fp8_e4m3 conventional peer autotunes from scratch and the bench's compile of the same graph reuses it.
# 1. peer (limit 32 s): benchmarks/gpu/kda_peer.py, the fp8_e4m3 conventional torch.compile peer alone in a fresh
#    process (GLM-5.3-Flash shapes, batch 16, 64 steps per run, median of 5): default mode, reduce-overhead, and
#    default compiled again with the inductor caches off; each with its host time per step, one profiled run
#    (device busy time per step, top kernels), GPU clocks, and inductor's autotuning log -> $OUT/kda_peer.json
#    (the repeat that tells whether this peer runs at run 5's 123.1 or run s1's 69.5 G/s)
# 2. bench (limit BENCH_S, default 82 s): benchmarks/bench_emulation.py --kinds kda, 4096 steps: the kernel's default path per
#    variant and all six in one launch, the eager peer, and for EVERY variant the torch.compile peer in modes
#    default and reduce-overhead, each compiled and timed in isolation (a recompile while timed fails the run),
#    every time the median of 5 runs with its spread -> $OUT/emulation_kda.md, $OUT/emulation_kda.json
# 3. verdict (limit 4 s): benchmarks/gpu/kda_verdict.py, each variant's kernel against its fastest compiled peer
#    of the whole run (bench and fresh process) -> $OUT/kda_verdict.json
# GPU clocks, temperature, power and the host's busiest processes are printed before each stage. Every stage's log
# goes to $OUT/logs.tar.gz; a failed, timed-out or skipped stage makes the script exit 1.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
x=1  # stage limits x this factor
if [[ ${DEVICE:-cuda} == cpu ]]; then
    x=10 BUDGET=${BUDGET:-1200}
fi
gpu_begin 120
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/kda_speed_inductor.XXXXXX)
export TORCHINDUCTOR_CACHE_DIR

if [[ ${DEVICE:-cuda} == cpu ]]; then
    export TRITON_INTERPRET=1
    shape=(--steps 4 --batch 1 --peer-steps 2 --reps 3 --device cpu)
else
    shape=(--steps 4096 --batch 16 --peer-steps 64 --reps 5)
fi

machine_state() { # one line of GPU state, the load average and the three busiest processes
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,memory.used \
        --format=csv,noheader 2>/dev/null || echo "nvidia-smi: no GPU visible"
    echo "loadavg $(cut -d' ' -f1-3 /proc/loadavg); busiest: $(ps -eo pcpu=,comm= --sort=-pcpu | head -3 | tr -s ' \n' ' ')"
}

gpu_versions
machine_state
stage peer $((32 * x)) python3 benchmarks/gpu/kda_peer.py "${shape[@]}" --variant fp8_e4m3@conventional \
    --out "$OUT/kda_peer.json"
machine_state
stage bench $((${BENCH_S:-82} * x)) python3 benchmarks/bench_emulation.py "${shape[@]}" --kinds kda \
    --compile-modes default,reduce-overhead --compile-variants all --out "$OUT/emulation_kda.md" \
    --json "$OUT/emulation_kda.json"
machine_state
STAGE_MIN_S=2 stage verdict $((4 * x)) python3 benchmarks/gpu/kda_verdict.py --bench "$OUT/emulation_kda.json" \
    --peer "$OUT/kda_peer.json" --out "$OUT/kda_verdict.json"
rm -rf "$TORCHINDUCTOR_CACHE_DIR"
gpu_end
