#!/usr/bin/env bash
# The main job: build a tiny model, warm it up with SFT, then train it with async RL on
# reverse-text (real vLLM + orchestrator + trainer), print the reward before and after and
# draw the run's curves (RUN/report.png).
#   bash scripts/quickstart.sh [extra prime-rl flags, e.g. --no-tmux or --max-steps 20]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
uv sync --quiet --compile-bytecode

OUT=outputs/reverse-text
echo "== 1/4 tiny model -> $OUT/base"
uv run --no-sync python scripts/build_tiny_model.py "$OUT/base"
echo "== 2/4 SFT data + warm-up -> $OUT/sft"
uv run --no-sync python scripts/make_sft_data.py "$OUT/sft.jsonl"
uv run --no-sync prime-rl sft configs/reverse-text/sft.toml
echo "== 3/4 async RL -> $OUT/rl"
uv run --no-sync prime-rl configs/reverse-text/rl.toml --clean "$@"
echo "== 4/4 summary"
uv run --no-sync python scripts/summarize_run.py "$OUT/rl"
uv run --no-sync prime-rl report "$OUT/rl"   # prints the PNG's path
