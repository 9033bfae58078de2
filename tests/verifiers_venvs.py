"""Throwaway virtual environments with a real verifiers release and the test environments.

Each is built once with uv from the registry (about a minute, ~600 MB) and cached under
``$PRIME_RL_TEST_VENVS`` (default ``~/.cache/prime-rl/test-venvs``), keyed by the verifiers
version and the content of the fixture packages, so the default suite pays for it only on
a fresh machine or after a fixture changed. A build goes to a temporary folder first and
is renamed into place once complete; a lock keeps parallel sessions from building twice.
The packages are installed as wheels (not editable), as a user's `uv pip install` would.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import REPO

FIXTURES = REPO / "tests" / "fixtures" / "verifiers_envs"
CACHE = Path(os.environ.get("PRIME_RL_TEST_VENVS", Path.home() / ".cache" / "prime-rl" / "test-venvs"))
COMPLETE = ".prime-rl-complete"


def fixture_key(version: str, packages: list[str]) -> str:
    digest = hashlib.sha256(f"{version}|{sys.version_info[:2]}".encode())
    for name in sorted(packages):
        for path in sorted((FIXTURES / name).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(FIXTURES)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def verifiers_venv(version: str, packages: list[str]) -> Path:
    """The Python of a cached venv holding verifiers==``version`` and the fixture ``packages``."""
    target = CACHE / f"verifiers-{version}-{fixture_key(version, packages)}"
    python = target / "bin" / "python"
    if (target / COMPLETE).exists():
        return python
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / COMPLETE).exists():
            return python
        build = CACHE / f"{target.name}.building"
        shutil.rmtree(build, ignore_errors=True)
        uv = shutil.which("uv")
        assert uv, "uv is needed to build the verifiers test venvs (scripts/env.sh installs it)"
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)  # noqa: E731
        try:
            run(uv, "venv", "--quiet", "--python", f"{sys.version_info[0]}.{sys.version_info[1]}", str(build))
            run(uv, "pip", "install", "--quiet", "--python", str(build / "bin" / "python"), f"verifiers=={version}",
                *(str(FIXTURES / name) for name in packages))
        except subprocess.CalledProcessError as e:
            shutil.rmtree(build, ignore_errors=True)
            raise RuntimeError(f"building the verifiers {version} test venv failed: {e.stderr[-2000:]}") from None
        (build / COMPLETE).write_text(version)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(build, target)
    return python


CLASSIC = ["vf-single", "vf-multi", "vf-tools", "vf-group", "vf-reverse-text", "vf-broken"]


V1 = ["v1-reverse", "v1-again"]
