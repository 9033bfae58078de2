#!/usr/bin/env bash
# Check the trainer's CUDA path on this machine in one short run (docs: scripts/gpu_check.py):
# the environment, a replay of recorded batches in 1 process, then the same replay under
# torchrun over every GPU (FSDP2, loss compared with the 1-process one), vLLM's import; then
# the summary. Exit 0 when every check that could run passed.
#   bash scripts/gpu_check.sh [--run-dir RUN] [--model M] [--steps 3] [--out outputs/gpu_check.json] ...
# Each phase is stopped after GPU_CHECK_TIMEOUT_S seconds (default 600).
set -uo pipefail  # no -e: a failed phase is recorded, and the summary still prints
cd "$(dirname "$0")/.."
[ -f scripts/env.sh ] && source scripts/env.sh
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
LIMIT="${GPU_CHECK_TIMEOUT_S:-600}"

# The report path: the last --out among the flags (as argparse reads them), else the default.
OUT=outputs/gpu_check.json
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --out) OUT="${args[i + 1]:-$OUT}" ;;
        --out=*) OUT="${args[i]#--out=}" ;;
    esac
done
rm -f "$OUT"  # a report left by an earlier run must not pass for this one's

# GPUs: those CUDA_VISIBLE_DEVICES names, else every one nvidia-smi lists (0 without a driver).
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    GPUS=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
echo "== gpu_check: $GPUS GPU(s) visible; report -> $OUT"

echo "== 1/3 one process: environment, replay, vLLM"
timeout --kill-after=30 "$LIMIT" "$PY" scripts/gpu_check.py --out "$OUT" --no-summary "$@"
rc=$?
if [ ! -f "$OUT" ]; then  # it died before writing its report (a crash, or the time limit)
    "$PY" scripts/gpu_check.py --out "$OUT" --record-failure replay "the 1-process check exited with code $rc before writing its report (output above)"
fi

if [ "$GPUS" -gt 1 ]; then
    echo "== 2/3 torchrun over $GPUS GPUs: FSDP2 replay"
    timeout --kill-after=30 "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
        scripts/gpu_check.py --out "$OUT" "$@"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        "$PY" scripts/gpu_check.py --out "$OUT" --record-failure fsdp "torchrun exited with code $rc (its output is above)"
    fi
else
    echo "== 2/3 torchrun: skipped ($GPUS GPU(s); FSDP2 needs 2 or more)"
fi

echo "== 3/3 summary"
exec "$PY" scripts/gpu_check.py --out "$OUT" --summary
