#!/usr/bin/env bash
# Nemotron-3-Nano at full size (31.6 B parameters, about 59 GiB in bf16) on ONE H200, built in memory with random
# weights from the family's initialisation (no download, no disk: models.build.build_random_model), then
# `analyze` through the captured path at the issue's shapes: 23 Mamba-2 layers x 6 variants (fp8_e4m3 / int8 /
# nvfp4 x conventional / replay16) x STEPS (4096) x BATCH (8). Runs lab/gpu/multigpu.py part b on one
# device: a warm-up on 2 synthetic layers, the captured run, then the same captured run again (a repeat on a
# warm process; skipped when the budget is short). From the repo root:
#   OUT=/path bash lab/gpu/fullsize_nano.sh            (limit LIMIT, default 250 s)
# Writes $OUT/fullsize_nano.json (build time, parameters, memory, every run's stage times and peak GPU memory)
# and $OUT/fullsize_nano.log. Needs transformers >= 5.24 (NemotronH with MoE blocks): carry the wheel.
# CPU check of the same path (6 narrow layers, 8 experts, float32):
#   OUT=/tmp/nn CPU_CHECK=1 bash lab/gpu/fullsize_nano.sh
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
LOG="$OUT/fullsize_nano.log"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 || true
  $PY -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' 2>&1
} | tee "$LOG"
if [ -n "${CPU_CHECK:-}" ]; then
  LIMIT=${LIMIT:-300}
  ARGS=(--devices cpu --layers 6 --dtype float32 --headroom-gib 0 --steps 32 --batch 2 --warm-layers none
        --overrides '{"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2, "moe_intermediate_size": 32, "n_routed_experts": 8, "moe_shared_expert_intermediate_size": 32}')
else
  LIMIT=${LIMIT:-250}
  ARGS=(--devices cuda:0 --steps "${STEPS:-4096}" --batch "${BATCH:-8}")
fi
timeout --kill-after=3 "$LIMIT" $PY lab/gpu/multigpu.py b --preset nemotron-3-nano "${ARGS[@]}" \
  --out "$OUT/fullsize_nano.json" --budget $((LIMIT - 15)) 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && echo "!! FAILED (rc $rc)" | tee -a "$LOG"
exit "$rc"
