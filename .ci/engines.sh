#!/usr/bin/env bash
# The engines' own parsers (CPU): vLLM's released argument parser and config validators judge the vLLM exports, for
# every vLLM release the facts cover that pip can fetch (tests/export/test_vllm_oracle.py), and SGLang's argument
# parser and server-argument hooks judge the SGLang exports (tests/export/test_sglang_oracle.py). Each wheel is
# fetched without its dependencies and only its Python sources are unpacked; the few packages its config modules
# import go into a side directory. Called by the README's test command after the floors; about 3 minutes,
# downloads included.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_RELEASES=${VLLM_RELEASES:-"0.33.0 0.34.0"}
SGLANG_RELEASE=${SGLANG_RELEASE:-0.5.23}
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

# SGLang: its Python sources, the folders its JIT kernel loader checks for at import, and the packages its
# server-args modules import (torchvision, imported by its VL configs, is stood in for by the test)
pip install -q --target "$work/sgdeps" --no-deps msgspec orjson pybase64 starlette pyzmq ipython traitlets aiohttp \
  multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist dill apache-tvm-ffi sentencepiece \
  compressed-tensors loguru gguf
pip download -q --no-deps -d "$work/wheel-sglang" "sglang==$SGLANG_RELEASE"
python - "$work/wheel-sglang" "$work/sglang" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("sglang-*.whl"))
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
for folder in ("include", "csrc"):
    (pathlib.Path(sys.argv[2]) / "sglang/kernels/jit" / folder).mkdir(parents=True, exist_ok=True)
PY
rm -rf "$work/wheel-sglang"
echo "engines: SGLang $SGLANG_RELEASE's parser and hooks"
out=$(PYTHONPATH="$PWD:$work/sglang:$work/sgdeps" pytest -q -p no:cacheprovider -n 2 tests/export/test_sglang_oracle.py 2>&1) \
  || { echo "$out"; exit 1; }
echo "$out" | tail -1
case "$out" in *" passed"*) ;; *) echo "engines: SGLang $SGLANG_RELEASE's oracle ran no test" >&2; exit 1 ;; esac
