#!/usr/bin/env bash
# The CUDA install (README "Installing"): vllm and PyPI's CUDA build of torch in .venv instead
# of the CPU build the default groups install, and FlashAttention-2 with --flash-attn.
#   bash scripts/setup_cuda.sh [--flash-attn] [more `uv sync` flags, e.g. --dry-run]
# Run it once, and again after every change to pyproject.toml (a pull). Then run everything
# with UV_NO_SYNC=1 set (`export UV_NO_SYNC=1`, then `uv run prime-rl CONFIG.toml`): a plain
# `uv run` would first sync the default groups, i.e. put the CPU build back (pyproject.toml's
# dependency groups say why a variable and not a file).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh  # uv, and UV_FIND_LINKS: the lock covers the `cpu` group too
groups=(--no-group cpu --group cuda)
flags=()
for arg in "$@"; do
    if [ "$arg" = "--flash-attn" ]; then groups+=(--group flash-attn); else flags+=("$arg"); fi
done
uv sync --compile-bytecode "${groups[@]}" ${flags[@]+"${flags[@]}"}
echo "[setup_cuda] done: uv sync ${groups[*]}${flags[*]+ ${flags[*]}}. Run prime-rl with UV_NO_SYNC=1" \
    "set: export UV_NO_SYNC=1; uv run prime-rl CONFIG.toml"
