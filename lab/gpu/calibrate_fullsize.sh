#!/usr/bin/env bash
# `ssmquant calibrate` at full size through the normal checkpoint path (issue #15), one H200, < 300 s
# (build 55 s + calibrate 240 s limits; 85 s stopped the 2026-12-01 run after 12 of 24 layers):
# build nemotron-h-8b (8.1 B parameters, random weights, sharded bf16 safetensors in /tmp) with
# `ssmquant build`, then `ssmquant calibrate --model DIR` (24 Mamba-2 layers, horizon 1024 x
# batch 4, held-out 4; default candidates, schemes and static-scale methods, buffer length 16 only).
# From the repo root:   OUT=/path bash lab/gpu/calibrate_fullsize.sh
# calibrate needs nvidia-modelopt (not on the device image): when `import modelopt` fails, the wheels in
# ${WHEELS:-.whl} (nvidia-modelopt 0.47.0, pydantic, pydantic-core, annotated-types, typing-inspection,
# typing-extensions, omegaconf, pulp; 21 MiB, staged in /work/wt-fullcal/.whl: copy them into the carried .whl)
# are installed into /tmp/site-cal; without them the script stops at once (rc 1) before building anything.
# Writes $OUT/calibrate_fullsize.json (wall times, stage times, peak GPU memory), calibrate_fullsize.log,
# calibrate_env.txt, recipe_config.json (the recipe's ssm_quant_config.json).
# CPU check of every path (a 4-layer nemotron-h-8b with small widths, CPU-sized run):
#   OUT=/tmp/cf CPU_CHECK=1 bash lab/gpu/calibrate_fullsize.sh
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
CKPT=${CKPT:-/tmp/ssmquant-cal-nemotron-h-8b}
LOG="$OUT/calibrate_fullsize.log"
WHEELS=${WHEELS:-.whl}
if ! $PY -c 'import modelopt' 2>/dev/null; then
  echo "== installing nvidia-modelopt from $WHEELS" | tee -a "$LOG"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-cal "$WHEELS"/*.whl 2>&1 | tail -3 | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:/tmp/site-cal"
  $PY -c 'import modelopt.torch.quantization.calib' || { echo "!! nvidia-modelopt cannot be imported" | tee -a "$LOG"; exit 1; }
fi
{
  date -u; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 || true
  $PY -c 'import torch, transformers, modelopt; print("torch", torch.__version__, "transformers", transformers.__version__, "modelopt", modelopt.__version__)' 2>&1
  df -h /tmp | tail -1
} > "$OUT/calibrate_env.txt" 2>&1
cat "$OUT/calibrate_env.txt"
if [ -n "${CPU_CHECK:-}" ]; then
  DEV=cpu; HORIZON=32; BATCH=1; LIMIT_BUILD=120; LIMIT_CAL=240
  BUILD_ARGS=(--layers 4 --dtype float32 --overrides '{"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2}')
else
  DEV=cuda; HORIZON=${HORIZON:-1024}; BATCH=${BATCH:-4}; LIMIT_BUILD=55; LIMIT_CAL=${LIMIT_CAL:-240}
  BUILD_ARGS=()
fi
rm -rf "$CKPT"
now() { date +%s.%N; }
failed=0
echo "== build nemotron-h-8b into $CKPT (limit ${LIMIT_BUILD} s)" | tee -a "$LOG"
t0=$(now)
timeout --kill-after=3 "$LIMIT_BUILD" $PY -m ssmquant build nemotron-h-8b "$CKPT" --device "$DEV" "${BUILD_ARGS[@]}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}; t1=$(now)
[ "$rc" -ne 0 ] && { echo "!! build FAILED (rc $rc)" | tee -a "$LOG"; exit 1; }
echo "== calibrate (horizon $HORIZON x batch $BATCH, limit ${LIMIT_CAL} s)" | tee -a "$LOG"
timeout --kill-after=3 "$LIMIT_CAL" $PY -m ssmquant calibrate --model "$CKPT" --device "$DEV" \
  --horizon "$HORIZON" --batch "$BATCH" --budget 0.1 --buffer-lens 16 --out "$OUT/recipe" --force 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}; t2=$(now)
[ "$rc" -ne 0 ] && { echo "!! calibrate FAILED (rc $rc)" | tee -a "$LOG"; failed=1; }
$PY - "$OUT" "$CKPT" "$t0" "$t1" "$t2" "$rc" "$HORIZON" "$BATCH" <<'PYEOF'
import json, pathlib, shutil, sys
out, ckpt, t0, t1, t2, rc, horizon, batch = sys.argv[1:]
out = pathlib.Path(out)
res = {"preset": "nemotron-h-8b", "horizon": int(horizon), "batch": int(batch), "calibrate_rc": int(rc),
       "build_wall_s": round(float(t1) - float(t0), 2), "calibrate_wall_s": round(float(t2) - float(t1), 2)}
try:
    import torch
    res["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    build = json.loads((pathlib.Path(ckpt) / "ssmquant_build.json").read_text())
    res |= {"parameters": build["parameters"], "checkpoint_GiB": round(build["safetensors_bytes"] / 2**30, 2)}
except Exception as exc:  # noqa: BLE001 - the numbers above still go out
    res["build_info_error"] = repr(exc)
cfg = out / "recipe" / "ssm_quant_config.json"
if cfg.exists():
    doc = json.loads(cfg.read_text())
    shutil.copy(cfg, out / "recipe_config.json")
    res |= {"elapsed_s": doc["producer"]["elapsed_s"], "stages": doc["producer"].get("stages"),
            "settings_evaluated": doc["search"]["settings_evaluated"], "layers": len(doc["model"]["calibrated_layers"]),
            "global": ((doc.get("global") or {}).get("setting") or {}).get("name"), "verification_passed": (doc.get("verification") or {}).get("passed")}
(out / "calibrate_fullsize.json").write_text(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2))
PYEOF
rm -rf "$CKPT" "$OUT/recipe"
exit $failed
