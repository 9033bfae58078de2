#!/usr/bin/env bash
# The quickstart for any environment with CPU configs in configs/ENV/{sft,rl}.toml: build the
# tiny model, write SFT data from the environment's own generator, warm the model up with SFT,
# run async RL (real vLLM + orchestrator + trainer), and print the reward before and after.
#   bash scripts/train_env.sh ENV [extra prime-rl flags for the RL run, e.g. --no-tmux --max-steps 20]
#   bash scripts/train_env.sh gsm8k
#   bash scripts/train_env.sh wordle --no-tmux
# Everything goes to outputs/ENV/{base,sft.jsonl,sft,rl} (the paths the configs name).
# Environment variables, for a quick check: SFT_MAX_STEPS=N (fewer warm-up steps than the
# SFT config's), SFT_NUM_EXAMPLES=N (fewer chats than the table's), NO_SYNC=1 (skip `uv sync`
# when the environment is installed already).
set -euo pipefail
cd "$(dirname "$0")/.."

ENV_ID="${1:-}"
if [ -z "$ENV_ID" ] || [ "${ENV_ID#-}" != "$ENV_ID" ]; then
    echo "usage: bash scripts/train_env.sh ENV [extra prime-rl flags]   (ENV: one of: $(ls configs/*/sft.toml 2>/dev/null | cut -d/ -f2 | tr '\n' ' '))" >&2
    exit 2
fi
shift
if [ ! -f "configs/$ENV_ID/sft.toml" ] || [ ! -f "configs/$ENV_ID/rl.toml" ]; then
    echo "train_env.sh: no configs/$ENV_ID/sft.toml and configs/$ENV_ID/rl.toml" >&2
    exit 2
fi

# How scripts/make_sft_data.py writes each environment's warm-up data: the number of chats and
# the environment args of configs/ENV/rl.toml's [[env]] entry that shape the prompts (checked
# against rl.toml below, so the warm-up sees the prompts RL will see).
case "$ENV_ID" in
    reverse-text)  SFT_EXAMPLES=2000; SFT_ARGS='{}' ;;
    alphabet-sort) SFT_EXAMPLES=4000
                   SFT_ARGS='{"min_turns": 2, "max_turns": 2, "min_names_per_turn": 1, "max_names_per_turn": 2, "names_path": "configs/alphabet-sort/names.txt"}' ;;
    gsm8k)         SFT_EXAMPLES=2000; SFT_ARGS='{"source": "generated", "difficulty": 1}' ;;
    wordle)        SFT_EXAMPLES=2000; SFT_ARGS='{"system_prompt": ""}' ;;  # ~2% of the games are lost by the strategy and skipped
    wiki-search)   SFT_EXAMPLES=4000; SFT_ARGS='{"source": "generated", "max_turns": 6}' ;;  # other generated wikis than RL's (corpus seeds 1, 2, ...)
    *) echo "train_env.sh: no SFT data recipe for $ENV_ID: add it to the table in scripts/train_env.sh" >&2; exit 2 ;;
esac
SFT_EXAMPLES="${SFT_NUM_EXAMPLES:-$SFT_EXAMPLES}"

source scripts/env.sh
if [ -z "${NO_SYNC:-}" ]; then
    uv sync --quiet --compile-bytecode "${FEATURE_EXTRAS[@]}"  # scripts/env.sh: the environments' extras among them
fi
run() { uv run --no-sync "$@"; }

# The table's args must agree with rl.toml's [[env]] args (args that only change the eval
# split or the reward are not needed for the warm-up).
run python - "configs/$ENV_ID/rl.toml" "$SFT_ARGS" <<'EOF'
import json, sys, tomllib
path, table = sys.argv[1], json.loads(sys.argv[2])
envs = tomllib.load(open(path, "rb")).get("env", [])
rl = envs[0].get("args", {}) if envs else {}
ignored = {"num_eval_examples", "num_train_examples", "num_examples", "seed", "similarity_power", "power_per_turn"}
bad = [f"{k}: {table.get(k, '(not set)')!r} here, {v!r} in {path}" for k, v in rl.items() if k not in ignored and table.get(k) != v]
bad += [f"{k}: {v!r} here, not set in {path}" for k, v in table.items() if k not in rl and k != "source"]
if bad:
    sys.exit("train_env.sh: the SFT data args differ from the RL config's [[env]] args:\n  " + "\n  ".join(bad))
EOF

OUT="outputs/$ENV_ID"
phase_start=$SECONDS
took() { echo "   ($1 took $((SECONDS - phase_start)) s)"; phase_start=$SECONDS; }

echo "== 1/4 tiny model -> $OUT/base"
run python scripts/build_tiny_model.py "$OUT/base"
took "tiny model"
echo "== 2/4 SFT data + warm-up -> $OUT/sft"
run python scripts/make_sft_data.py "$OUT/sft.jsonl" --env "$ENV_ID" --num-examples "$SFT_EXAMPLES" --args "$SFT_ARGS"
took "SFT data"
sft_flags=()
if [ -n "${SFT_MAX_STEPS:-}" ]; then
    sft_flags=(--max-steps "$SFT_MAX_STEPS")
fi
run prime-rl sft "configs/$ENV_ID/sft.toml" "${sft_flags[@]}"
took "SFT"
echo "== 3/4 async RL -> $OUT/rl"
run prime-rl "configs/$ENV_ID/rl.toml" --clean "$@"
took "RL"
echo "== 4/4 summary"
run python scripts/summarize_run.py "$OUT/rl"
run prime-rl report "$OUT/rl"   # prints the PNG's path
