#!/usr/bin/env bash
# The test suite: installs what it needs (uv sync) and runs pytest.
#   bash scripts/test.sh            default suite (real trio runs: at least one per capability)
#   bash scripts/test.sh -m slow    the slow end-to-end runs
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Debian packages some tests need, installed when this runs as root with apt (without them
# those tests skip, saying why): the math-python sandbox's bubblewrap (tests/test_sandbox.py)
# and the chromium the dashboard's browser test drives (tests/test_dashboard_browser.py)
apt_install() {
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
    apt-get install -y -qq "$1" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$1" >/dev/null 2>&1; }
}
command -v bwrap >/dev/null || apt_install bubblewrap \
    || echo "warning: bwrap is missing and could not be installed (apt-get install bubblewrap): sandbox tests will skip" >&2
command -v chromium >/dev/null || apt_install chromium \
    || echo "warning: chromium is missing and could not be installed (apt-get install chromium): the browser test will skip" >&2
uv sync --quiet --compile-bytecode "${FEATURE_EXTRAS[@]}"  # scripts/env.sh: every feature's extra
uv run --no-sync ruff check --quiet src tests scripts benchmarks
exec uv run --no-sync pytest "$@"
