#!/usr/bin/env bash
# The wheels a fresh `pip install -e ".[dev,gpu]"` resolves beyond what a GPU machine without network already has
# (torch, triton, pandas, seaborn, ...): transformers, nvidia-modelopt and the dependencies it imports (pydantic,
# omegaconf, pulp, ...), and flash-linear-attention. For the GPU test run at both ends of transformers' range
# (README, Development):
#
#   bash lab/gpu/test_wheels.sh .whl/tf525 5.25.0      # here, with PyPI; Python 3.12 x86-64 wheels
#   bash lab/gpu/test_wheels.sh .whl/tf524 5.24.0      # (default version: the one installed here)
#   # on the GPU machine, this checkout with .whl/ beside it (carried):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/tf525/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 -m pytest -m gpu -q -n 4
#
# transformers 5.25 needs huggingface_hub 2.x (with httpx2) and the kernels package, which the GPU image lacks: for
# a transformers of 5.25 or later they come along, at the versions installed here (a fresh install's).
# pulp ships its CBC solver for six platforms (16 MB); modelopt imports pulp but the tests never solve, so only the
# x86-64 Linux binary is kept (the wheel is otherwise unchanged) to keep the transfer small.
set -euo pipefail
out=${1:?usage: test_wheels.sh OUTDIR [TRANSFORMERS_VERSION]}
mkdir -p "$out"
ver() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
tf=${2:-$(ver transformers)}
pins=(
  "transformers==$tf"
  "regex==$(ver regex)"
  "nvidia-modelopt==$(ver nvidia-modelopt)"
  "omegaconf==$(ver omegaconf)"
  "pulp==$(ver pulp)"
  "pydantic==$(ver pydantic)"
  "pydantic-core==$(ver pydantic-core)"
  "annotated-types==$(ver annotated-types)"
  "typing-inspection==$(ver typing-inspection)"
  "flash-linear-attention==0.6.0"
  "fla-core==0.6.0"
)
if python3 -c "from packaging.version import Version; import sys; sys.exit(Version('$tf') < Version('5.25'))"; then
  for name in huggingface_hub kernels tomlkit httpx2 httpcore2 truststore hf-xet anyio idna h11 typing-extensions; do
    pins+=("$name==$(ver $name)")
  done
fi
for p in "${pins[@]}"; do
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out" "$p" -q
done
for w in "$out"/pulp-*.whl; do
  python3 - "$w" <<'EOF'
import sys, zipfile, pathlib, shutil
src = pathlib.Path(sys.argv[1]); tmp = src.with_suffix(".tmp")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if "/solverdir/cbc/" in item.filename and "/linux/i64/" not in item.filename:
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):  # drop the removed files' lines
            data = b"\n".join(l for l in data.split(b"\n") if b"/solverdir/cbc/" not in l or b"/linux/i64/" in l)
        zout.writestr(item, data)
shutil.move(tmp, src)
EOF
done
ls -la "$out"
du -sh "$out"
