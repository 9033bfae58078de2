#!/usr/bin/env bash
# The test suite: installs what it needs (uv sync) and runs pytest.
#   bash scripts/test.sh            default suite (includes one real trio run)
#   bash scripts/test.sh -m slow    the slow end-to-end runs
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
uv sync --quiet --compile-bytecode
exec uv run --no-sync pytest "$@"
