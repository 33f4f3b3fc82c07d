#!/usr/bin/env bash
# The ceilings job (CPU): the environment the README's test command made is brought to the newest release of torch,
# Triton, transformers and nvidia-modelopt that pyproject.toml's ranges admit (.ci/ceilings.py says how), before the
# main test run; so the suite runs at the ceilings, and .ci/floors.sh afterwards at the floors. Seconds when the
# fresh install already resolved the ceilings.
set -euo pipefail
cd "$(dirname "$0")/.."
python .ci/ceilings.py
