#!/usr/bin/env bash
# Train tiny-nemotron and tiny-qwen (or the models named in $TINY_NAMES, e.g. TINY_NAMES=tiny-kda) concurrently
# on one GPU, then summarise and pack the results.
#
#   bash studies/tiny_models/train_both.sh [MINUTES]        # from the repository root; MINUTES default 6
#   TINY_NAMES=tiny-kda bash studies/tiny_models/train_both.sh 5
#
# Needs studies/tiny_models/data/{train,heldout}.txt (python studies/tiny_models/get_corpus.py).
# Writes ssmquant/assets/tiny-{nemotron,qwen}/ (weights + config + model card + logs + plots + eval.json),
# copies everything but the weights to studies/tiny_models/results/<name>/, and the two console logs and
# a summary to studies/tiny_models/results/console/. When $OUT is set (the device machine), also writes there:
#   $OUT/tiny_models.tar.gz          both checkpoint dirs and the console logs (the primary artefact)
#   $OUT/tiny_models_results.tar.gz  studies/tiny_models/results/tiny-* (the checkpoint dirs without weights)
#   $OUT/tiny-nemotron.log, $OUT/tiny-qwen.log, $OUT/summary.txt
# Extra arguments after MINUTES are passed to both trainings (e.g. --batch 48).
set -uo pipefail
cd "$(dirname "$0")/../.."
MINUTES="${1:-6}"
read -r -a NAMES <<< "${TINY_NAMES:-tiny-nemotron tiny-qwen}"
shift || true
PY="${PYTHON:-python3}"
# where the checkpoints and the committed record go (overridable for a dry run: TINY_ASSETS=/tmp/a ...)
ASSETS="${TINY_ASSETS:-ssmquant/assets}"
RESULTS="${TINY_RESULTS:-studies/tiny_models/results}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
LOGS="$RESULTS/console"
mkdir -p "$LOGS"

for f in train.txt heldout.txt; do
  if [ ! -f "studies/tiny_models/data/$f" ]; then
    echo "missing studies/tiny_models/data/$f: run python studies/tiny_models/get_corpus.py first" >&2
    exit 2
  fi
done

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null || true
"$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'

start=$(date +%s)
pids=()
for name in "${NAMES[@]}"; do
  "$PY" studies/tiny_models/train.py --arch "$name" --minutes "$MINUTES" --cpu-threads 6 \
    --out "$ASSETS/$name" --results-dir "$RESULTS/$name" "$@" > "$LOGS/$name.log" 2>&1 &
  pids+=($!)
  echo "started $name (pid ${pids[-1]}), log $LOGS/$name.log"
done

# progress: the last line of each log every 60 s until both are done
n=0
while kill -0 "${pids[@]}" 2>/dev/null; do
  sleep 5
  n=$(( n + 1 ))
  if (( n % 12 == 0 )); then
    for name in "${NAMES[@]}"; do
      echo "[$(( $(date +%s) - start )) s] $name: $(grep -v 'falling back' "$LOGS/$name.log" | tail -n 1 | cut -c1-160)"
    done
  fi
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || rc=$?
done
echo "all finished after $(( $(date +%s) - start )) s (exit status $rc)"

SUMMARY="$LOGS/summary.txt"
[ "${NAMES[*]}" = "tiny-nemotron tiny-qwen" ] || SUMMARY="$LOGS/summary-${NAMES[*]// /-}.txt"
NAMES="${NAMES[*]}" ASSETS="$ASSETS" "$PY" - <<'EOF' | tee "$SUMMARY"
import json, os
from pathlib import Path
for name in os.environ["NAMES"].split():
    d = Path(os.environ["ASSETS"]) / name
    try:
        info = json.loads((d / "run_info.json").read_text())
    except Exception as e:
        print(f"{name}: no run_info.json ({e})")
        continue
    tr, hf = info["training"], info.get("heldout_final", {})
    ev = json.loads((d / "eval.json").read_text()) if (d / "eval.json").is_file() else {}
    dec = info.get("decays", {})
    unit = "key channels" if name == "tiny-kda" else "SSM heads"
    print(f"{name}: {info['params']['total']:,} params; model.safetensors {info['weights_bytes']:,} bytes; "
          f"{tr['steps']} steps, {tr['tokens'] / 1e6:.1f} M tokens ({tr['epochs']:.2f} epochs) in {tr['train_seconds']:.0f} s, "
          f"{tr['tokens_per_second']:,.0f} tok/s, peak GPU {tr['peak_gpu_memory_gib']} GiB")
    print(f"  held-out bpb (all heldout.txt, bf16 weights, fp32): {hf.get('bits_per_byte', float('nan')):.4f}; "
          f"unigram {info['unigram']['heldout_bpb']:.3f}; eval.json slice {ev.get('bits_per_byte', float('nan')):.4f} "
          f"(gpu cross-check diff {ev.get('crosscheck', {}).get('abs_diff_vs_cpu')})")
    if dec:
        print(f"  {unit}: {dec['num_heads']}, typical half-life median {dec['typical_half_life_median']:.3g}, "
              f"max {dec['typical_half_life_max']:.3g}; >100 tokens: {dec['heads_typical_half_life_gt_100']}, "
              f">1000: {dec['heads_typical_half_life_gt_1000']}, mostly a>0.99: {dec['heads_mostly_a_gt_0.99']}; "
              f"reload exact: {info.get('reload_exact')}; errors: {'yes' if 'finish_error' in info else 'no'}")
    for f in sorted(d.iterdir()):
        print(f"    {f.name:28s} {f.stat().st_size:>10,d}")
EOF

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  for name in "${NAMES[@]}"; do cp "$LOGS/$name.log" "$OUT"/ 2>/dev/null; done
  cp "$SUMMARY" "$OUT"/ 2>/dev/null
  # paths inside the tarballs are relative to the repository root (absolute ones lose their leading /).
  # The checkpoints (~16 MB of weights) and the record without weights go in separate tarballs, so that each
  # stays under the device tool's 16 MiB per file.
  paths=()
  for p in "${NAMES[@]/#/$ASSETS/}" "$LOGS"; do
    [ -e "$p" ] && paths+=("$p")
  done
  tar czf "$OUT/tiny_models.tar.gz" "${paths[@]}"
  paths=()
  for p in "${NAMES[@]/#/$RESULTS/}"; do
    [ -e "$p" ] && paths+=("$p")
  done
  [ ${#paths[@]} -gt 0 ] && tar czf "$OUT/tiny_models_results.tar.gz" "${paths[@]}"
  ls -la "$OUT"
  tar tzvf "$OUT/tiny_models.tar.gz"
fi
exit $rc
