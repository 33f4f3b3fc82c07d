#!/usr/bin/env bash
# vLLM 0.33.0 and TensorRT-LLM (main@1d2bb3b) Triton Mamba-2 decode kernels, step by step next to the
# `vllm` / `trtllm` profiles' arithmetic and the ideal emulation (lab.engines.oracle_ssu).
#
# Needs the kernels' sources, the `ssu` folder built by
#   python -m lab.engines.bundle .stage-vllm --ssu --vllm-wheel WHEEL --trtllm-src DIR
# found as $SSMQUANT_SSU, else $BUNDLE/ssu (merged bundle), else .stage-vllm/bundle/ssu (run() with
# carry [".stage-vllm/bundle"]). No network, no GPU compile step beyond Triton's JIT. ~30-60 s on an H200.
#   bash lab/gpu/engines_vllm.sh        # writes $OUT/oracle_ssu/{oracle_ssu.json,oracle_ssu.md}, $OUT/engines_vllm.log
set -euo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
export PYTHONPATH="$PWD${BUNDLE:+:$BUNDLE}${PYTHONPATH:+:$PYTHONPATH}"
for d in "${SSMQUANT_SSU:-}" "${BUNDLE:-/nonexistent}/ssu" ".stage-vllm/bundle/ssu"; do
  if [ -n "$d" ] && [ -f "$d/MANIFEST.json" ]; then export SSMQUANT_SSU="$d"; break; fi
done
if [ -z "${SSMQUANT_SSU:-}" ] || [ ! -f "$SSMQUANT_SSU/MANIFEST.json" ]; then
  echo "error: no ssu bundle (vLLM / TensorRT-LLM kernel sources): set SSMQUANT_SSU, merge it into \$BUNDLE/ssu, or carry .stage-vllm/bundle" >&2
  exit 2
fi
echo "ssu sources: $SSMQUANT_SSU"; cat "$SSMQUANT_SSU/MANIFEST.json" | head -5
mkdir -p "$OUT/oracle_ssu"
# Nemotron-3-Nano-30B-A3B layer heads (64 x 64 x 128, 8 groups), batch 2, 4096 steps (CPU check:
# SSU_DEVICE=cpu SSU_STEPS=20 SSU_SHAPE=1,4,8,16,2 TRITON_INTERPRET=1), then the oracle tests
timeout 70 python3 -m lab.engines.oracle_ssu --out "$OUT/oracle_ssu" --steps "${SSU_STEPS:-4096}" --device "${SSU_DEVICE:-cuda}" \
  --shape "${SSU_SHAPE:-2,64,64,128,8}" 2>&1 | grep -v "default Mamba SSU config" | tee "$OUT/engines_vllm.log"
timeout 20 python3 -m pytest -q -x tests/engines/test_ssu_oracle.py 2>&1 | tail -5 | tee -a "$OUT/engines_vllm.log"
