# shellcheck shell=bash
# The staging the GPU scripts share: a wall-time budget, stages each under its own time limit with its log kept,
# failures collected and reported at the end. Sourced, not run:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"     (scripts run from the repository root)
#   gpu_begin 120                         $BUDGET (default: the argument) seconds for the whole script; needs $OUT;
#                                         exports PYTHONUNBUFFERED=1 and PYTHONPATH=$PWD, makes $OUT/logs;
#                                         set STAGE_TAIL / STAGE_MIN_S (below) on lines of their own before it
#   gpu_versions                          the GPU (nvidia-smi) and torch / triton versions, one line each
#   stage NAME LIMIT_S COMMAND...         COMMAND under `timeout` min(LIMIT_S, the budget left), its output in
#                                         $OUT/logs/NAME.log, the last STAGE_TAIL (30) lines printed; a failure,
#                                         a time-out, or a skip (fewer than STAGE_MIN_S (8) s left) is noted
#   budget_left                           seconds of the budget left (for the limit of a stage sized by the rest)
#   gpu_end                               $OUT/logs into $OUT/logs.tar.gz; exits 1 when a stage failed, else 0
#
# A shell function run as a stage must be exported (`export -f f`, then `stage NAME LIMIT bash -c f`), with the
# variables it reads. Used by engine_twin.sh, eval_dips.sh and fla_kda.sh; the other scripts run one or two commands
# through `timeout ... | tee` without a shared budget.

gpu_begin() {
    : "${OUT:?set OUT to the output folder}"
    BUDGET=${BUDGET:-$1}
    STAGE_TAIL=${STAGE_TAIL:-30}
    STAGE_MIN_S=${STAGE_MIN_S:-8}
    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
    mkdir -p "$OUT/logs"
    _gpu_start=$(date +%s)
    _gpu_failed=()
}

_gpu_elapsed() { echo $(($(date +%s) - _gpu_start)); }

budget_left() { echo $((BUDGET - $(_gpu_elapsed))); }

gpu_versions() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null ||
        echo "nvidia-smi: no GPU visible"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}

stage() { # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 left rc
    shift 2
    left=$(budget_left)
    if ((left < STAGE_MIN_S)); then
        echo "== $name: SKIPPED, only ${left} s of the budget left"
        _gpu_failed+=("$name (skipped)")
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s, $(_gpu_elapsed) s elapsed)"
    timeout --kill-after=3 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
    rc=$?
    tail -n "$STAGE_TAIL" "$OUT/logs/$name.log"
    if ((rc != 0)); then
        echo "== $name: FAILED rc=$rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)')"
        _gpu_failed+=("$name (rc $rc)")
    fi
    return 0
}

gpu_end() {
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
    echo "== done in $(_gpu_elapsed) s"
    if ((${#_gpu_failed[@]})); then
        echo "== FAILED stages: ${_gpu_failed[*]}"
        exit 1
    fi
    exit 0
}
