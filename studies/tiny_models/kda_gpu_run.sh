#!/usr/bin/env bash
# One H200 call for issue 14 (KDA), about 9 minutes: train tiny-kda, test the KDA kernel at GLM-5.3-Flash
# shapes (while the model trains), then the KDA rows of the emulation benchmark and conventional vs replay16
# on tiny-kda and on a synthetic GLM-5.3-Flash layer, with everything packed into $OUT.
#
#   bash studies/tiny_models/kda_gpu_run.sh [MINUTES]      # from the repository root; MINUTES default 3.5
#
# Needs studies/tiny_models/data/{train,heldout}.txt (get_corpus.py) and, where the GPU machine's transformers
# lacks kimi_linear (< 5.24), the transformers 5.24 wheel in .whl/ (installed into /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/../.."
MINUTES="${1:-3.5}"
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/kda_out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
"$PY" -c 'import transformers.models.kimi_linear, torch; print("transformers", __import__("transformers").__version__, torch.cuda.get_device_name(0))' || exit 1

LOG="$OUT/kda_run.log"  # everything but train_both.sh's own files ($OUT holds at most 8 files)
RES=/tmp/kda_results
mkdir -p "$RES"
TINY_NAMES=tiny-kda bash studies/tiny_models/train_both.sh "$MINUTES" > "$RES/train_stdout.log" 2>&1 &
train_pid=$!
# correctness at full shapes while the model trains (timings come after it)
"$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kda_kernel.py > "$RES/kernel_tests.log" 2>&1
tail -n 3 "$RES/kernel_tests.log" | tee -a "$LOG"
wait "$train_pid"; echo "training exit status $?" | tee -a "$LOG"; tail -n 6 "$RES/train_stdout.log" | tee -a "$LOG"

"$PY" benchmarks/run.py emulation --kinds kda --raw-dir "$RES" > "$RES/bench.log" 2>&1
tail -n 12 "$RES/bench.log" | tee -a "$LOG"

for m in "ssmquant/assets/tiny-kda" "glm-5.3-flash --synthetic --layers 0"; do
  name=$(basename "${m%% *}")
  # shellcheck disable=SC2086
  "$PY" -m ssmquant.cli analyze --model $m --formats fp8_e4m3,int8,nvfp4 --schemes conventional,replay16 \
    --steps 4096 --batch 4 --no-plots -q --out "$RES/analyze_$name" --force >> "$LOG" 2>&1
  echo "analyze $name exit status $?" | tee -a "$LOG"
done
tar czf "$OUT/kda_results.tar.gz" -C /tmp kda_results
ls -la "$OUT"
