#!/usr/bin/env bash
# The FlashInfer export run through the real kernels (issue #13): every committed fixture recipe
# (tests/export/fixtures/flashinfer) is exported, its flashinfer_alloc.py executed on the GPU and its kernel_args
# drive flashinfer.mamba.checkpointing_ssu / selective_state_update over the recipe's calibration run; the test
# prints and writes both numbers per recipe (ssmquant's emulation and the real kernel).
#
# From the repository root on the GPU machine, with the FlashInfer bundle (python -m lab.engines.bundle) at
# $BUNDLE (default .stage-engines/bundle). Needs no nvidia-modelopt and no network. Writes to $OUT:
#   export_flashinfer_gpu.json  every number, per recipe
#   export_flashinfer_gpu.log   the pytest output
# The FlashInfer modules it uses are those the engine oracle prebuilds (lab.engines.oracle.default_cases,
# 64 heads, 8 groups): checkpointing_ssu int8 / fp8_e4m3 / fp8_e4m3+SR / bf16 at max_window 16, one token per
# call; selective_state_update bf16 and fp16+SR. A module not prebuilt is compiled on first use (minutes).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
BUNDLE=${BUNDLE:-$PWD/.stage-engines/bundle}
LIMIT=${LIMIT:-480}
export PYTHONPATH="$PWD:$BUNDLE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 SSMQUANT_RESULTS_DIR="$OUT"
mkdir -p "$OUT"
python3 -c "import flashinfer.mamba, torch; assert torch.cuda.is_available(); print('flashinfer.mamba from', flashinfer.mamba.__file__)"
timeout "$LIMIT" python3 -m pytest -q -s -rA -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/export/test_export_flashinfer_gpu.py 2>&1 | tee "$OUT/export_flashinfer_gpu.log"
