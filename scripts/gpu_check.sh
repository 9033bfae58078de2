#!/usr/bin/env bash
# The trainer's CUDA path at the real size in one short run (what it checks: scripts/gpu_check.py):
# one process on GPU 0, then, with several GPUs, the same steps under torchrun (FSDP2) over all
# of them; then the table. Exit 0 when every check that could run passed.
#   bash scripts/gpu_check.sh [--steps 3] [--micro-batch-tokens 8192] [--out outputs/gpu_check.json] ...
# On a GPU machine without a package index: run `bash scripts/gpu_wheels.sh` where pip works
# first; the wheels it leaves in .whl/ are installed here (pydantic, msgspec, pyzmq).
# Each phase is stopped after GPU_CHECK_TIMEOUT_S seconds (default 480: one call fits in 10 minutes).
set -uo pipefail  # no -e: a failed phase is recorded, and the table still prints
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
LIMIT="${GPU_CHECK_TIMEOUT_S:-480}"
if ! "$PY" -c "import pydantic, msgspec, zmq" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site .whl/*.whl \
            && export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_check: pydantic, msgspec or pyzmq is missing and there is no .whl/ (bash scripts/gpu_wheels.sh)" >&2
    fi
fi
export PYTHONUNBUFFERED=1

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

if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    GPUS=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
echo "== gpu_check: $GPUS GPU(s) visible; report -> $OUT"

echo "== 1/2 one process"
CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" timeout --kill-after=30 "$LIMIT" "$PY" scripts/gpu_check.py --out "$OUT" "$@" >/dev/null
rc=$?
[ -f "$OUT" ] || "$PY" scripts/gpu_check.py --out "$OUT" --record-failure build "the one-process check exited with code $rc before writing its report"

if [ "$GPUS" -gt 1 ]; then
    echo "== 2/2 torchrun over $GPUS GPUs (FSDP2)"
    timeout --kill-after=30 "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
        scripts/gpu_check.py --fsdp-of "$OUT" --out "$OUT.fsdp" "$@" >/dev/null \
        || "$PY" scripts/gpu_check.py --out "$OUT" --record-failure fsdp "torchrun exited with code $? (its output is above)"
else
    echo "== 2/2 torchrun: skipped ($GPUS GPU(s); FSDP2 over several needs 2 or more)"
fi
exec "$PY" scripts/gpu_check.py --out "$OUT" --summary
