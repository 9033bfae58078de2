# Sourced by the scripts: makes `uv` work on a fresh machine of this project's kind.
# - installs uv with pip when it is missing;
# - uv does not read pip's configuration, so pip's find-links (where the CPU build of
#   torch lies on these machines) is handed to uv as UV_FIND_LINKS. Nothing machine
#   specific is written into the repository: the location is read from pip here.
if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --quiet uv
fi
if [ -z "${UV_FIND_LINKS:-}" ]; then
    links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
    if [ -n "$links" ]; then
        export UV_FIND_LINKS="$links"
    fi
fi
