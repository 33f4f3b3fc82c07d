#!/usr/bin/env bash
# The floors job (CPU): a fresh virtual environment with the lowest versions of .ci/floors.txt, and the tests that
# touch those packages' APIs (transformers' models and caches, modelopt's quantizers, triton's interpreter, pandas,
# the plots). Called by the README's test command after the main run; about 3 minutes on 2 cores, the install included.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-floors
. .venv-floors/bin/activate
pip install -q -c .ci/floors.txt torch==2.13.0
pip install -q -c .ci/floors.txt -e . triton pytest pytest-xdist
python - <<'PY'
import importlib.metadata as m
for name in ("torch", "triton", "transformers", "nvidia-modelopt", "numpy", "pandas", "matplotlib", "seaborn"):
    print(f"floors: {name} {m.version(name)}")
PY
pytest -q -p no:cacheprovider -n 2 tests/test_floors.py tests/formats tests/models tests/replay/test_oracle_transformers.py \
  tests/evaluate/test_evaluate.py tests/calibrate/test_scales.py tests/analysis/test_analyze.py \
  tests/kernels/test_rounding_ties.py tests/kernels/test_store_state.py
