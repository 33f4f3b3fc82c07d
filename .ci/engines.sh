#!/usr/bin/env bash
# The engines' own parsers (CPU): vLLM's released argument parser and config validators judge the vLLM exports, for
# every vLLM release the facts cover that pip can fetch (tests/export/test_vllm_oracle.py). Each wheel is fetched
# without its dependencies and only its Python sources are unpacked; the few packages its config modules import
# go into a side directory. Called by the README's test command after the floors; about 2 minutes, downloads
# included.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_RELEASES=${VLLM_RELEASES:-"0.33.0 0.34.0"}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip install -q --target "$work/deps" --no-deps cbor2 pyzmq msgspec cloudpickle pybase64 cachetools uvloop \
  py-cpuinfo prometheus_client xgrammar apache-tvm-ffi fastapi starlette partial_json_parser llguidance openai \
  openai_harmony aiohttp opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions multidict yarl \
  propcache attrs aiohappyeyeballs aiosignal frozenlist sniffio einops
for version in $VLLM_RELEASES; do
  pip download -q --no-deps -d "$work/wheel-$version" "vllm==$version"
  python - "$work/wheel-$version" "$work/vllm-$version" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("vllm-*.whl"))
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
PY
  rm -rf "$work/wheel-$version"
  echo "engines: vLLM $version's parser and validators"
  out=$(VLLM_TARGET_DEVICE=cpu PYTHONPATH="$PWD:$work/vllm-$version:$work/deps" \
    pytest -q -p no:cacheprovider -n 2 tests/export/test_vllm_oracle.py 2>&1) || { echo "$out"; exit 1; }
  echo "$out" | tail -1
  case "$out" in *" passed"*) ;; *) echo "engines: vLLM $version's oracle ran no test" >&2; exit 1 ;; esac
  rm -rf "$work/vllm-$version"
done
