#!/usr/bin/env bash
# Several GPUs (issue #15), on a two-GPU H200 machine, from the repo root:
#   OUT=/path bash lab/gpu/multigpu.sh
# (a) nemotron-h-8b built on cuda:0 into /tmp by the checkpoint builder, then one process loads it on cuda:0
#     and analyzes it (2048 steps x batch 8, 6 variants) with emulation on 1 GPU and on 2 GPUs, then the same
#     preset's synthetic inputs on 1 and 2 GPUs (emulation without capture);
# (b) qwen3.5-122b-a10b (121.6 B parameters, 226.5 GiB in bf16) built in memory over both GPUs with random
#     weights from the family's init, analyzed (1024 steps x batch 4) with emulation on the GPU holding each
#     layer, then on cuda:0 only.
# Writes $OUT/multigpu_{a,b}.json (stage times, peak memory per GPU) and $OUT/multigpu_{a,b}.log, plus
# $OUT/multigpu_env.txt. Stops itself within 420 s (timeouts: build 55 s, a 210 s, b 135 s, plus ~10 s of start-up checks).
# CPU check of the script's paths (tiny sizes, the shipped tiny model, no warm-up or synthetic runs):
#   OUT=/tmp/mg CPU_CHECK=1 bash lab/gpu/multigpu.sh
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CKPT=${CKPT:-/tmp/ssmquant-ckpt-nemotron-h-8b}
failed=0
step() {  # step NAME LOG TIMEOUT CMD...: run with a time limit, append to LOG, note a failure and go on
  local name=$1 logf=$2 limit=$3; shift 3
  echo "== $name (limit ${limit} s)" | tee -a "$logf"
  timeout --kill-after=3 "$limit" "$@" 2>&1 | tee -a "$logf"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then echo "!! $name FAILED (rc $rc)" | tee -a "$logf"; failed=1; fi
}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 || true
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
  python3 -c 'import accelerate; print("accelerate", accelerate.__version__)' 2>&1
  free -g 2>&1 | head -2; df -h /tmp | tail -1
} > "$OUT/multigpu_env.txt" 2>&1
cat "$OUT/multigpu_env.txt"

A="$OUT/multigpu_a.log"; B="$OUT/multigpu_b.log"
if [ -n "${CPU_CHECK:-}" ]; then
  step "(a) CPU check: tiny-nemotron, emulation on cpu" "$A" 120 python3 lab/gpu/multigpu.py a \
    --model tiny-nemotron --preset nemotron-h-8b --device cpu --steps 16 --batch 1 --warm-layers none --no-synthetic \
    --out "$OUT/multigpu_a.json" --budget 100
  step "(b) CPU check: nemotron-h-8b, 4 small layers, built in memory on cpu" "$B" 120 python3 lab/gpu/multigpu.py b \
    --preset nemotron-h-8b --devices cpu --layers 4 --dtype float32 --headroom-gib 0 --steps 32 --batch 2 \
    --overrides '{"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2}' \
    --warm-layers none --out "$OUT/multigpu_b.json" --budget 100
else
  rm -rf "$CKPT"
  step "(a) build nemotron-h-8b on cuda:0 into $CKPT" "$A" 55 python3 -m ssmquant build nemotron-h-8b "$CKPT" --device cuda:0
  step "(a) nemotron-h-8b: emulation on 1 vs 2 GPUs" "$A" 210 python3 lab/gpu/multigpu.py a \
    --model "$CKPT" --preset nemotron-h-8b --device cuda:0 --steps 2048 --batch 8 --out "$OUT/multigpu_a.json" --budget 195
  rm -rf "$CKPT"
  step "(b) qwen3.5-122b-a10b built in memory over 2 GPUs" "$B" 135 python3 lab/gpu/multigpu.py b \
    --preset qwen3.5-122b-a10b --steps 1024 --batch 4 --out "$OUT/multigpu_b.json" --budget 120
fi
echo "== results"; cat "$OUT"/multigpu_a.json "$OUT"/multigpu_b.json 2>/dev/null | python3 -c 'import sys; print(sys.stdin.read()[-6000:])'
exit $failed
