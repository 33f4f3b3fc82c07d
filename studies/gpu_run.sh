#!/usr/bin/env bash
# The benchmarks and the GPU-scale studies, on one CUDA GPU:
#
#   bash studies/gpu_run.sh              # benchmarks, then `python -m studies.run --scale gpu --device cuda`
#
# The studies' GPU scale (32768-step horizons, more layers and sequences; see each studies/<study>/study.py)
# writes its summary tables into studies/<study>/data/, replacing the committed CPU-scale tables; then
# `python studies/make_pages.py` rebuilds the pages, which state the scale they were built from. The GPU
# scale has not been run for the committed pages. When $OUT is set (the device tool), the tables and the
# benchmark results are packed into $OUT/studies_data.tar.gz after each step, so a run cut short still
# returns what it made. e2e_horizon reads studies/tiny_models/data/heldout.txt (git-ignored: made by
# studies/tiny_models/get_corpus.py, which needs PyPI and Debian; carry it to a machine without them).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/studies_data.tar.gz" studies/*/data benchmarks/results 2>/dev/null; true; }

timeout 150 "$PY" benchmarks/run.py emulation --reps 3 --compile-variants fp8_e4m3@conventional 2>&1 | tail -18
timeout 90 "$PY" benchmarks/run.py analyze gpu --runs cold 2>&1 | tail -6
pack
for study in conv_vs_replay buffer_length granularity_calibration speculative synthetic_profiles e2e_horizon; do
  "$PY" -m studies.run --scale gpu --device cuda --only "$study" || echo "FAILED: $study"
  pack
done
echo "done"
