"""Which module an environment id names, and in which Python it lives.

One registry (``registry.toml`` beside this file, data only) names the module of each
built-in id; any other id names a user's module the way verifiers resolves it (`my-env`
and `org/my-env` -> `my_env`). The launcher validates ids with it before any process
starts, and the orchestrator loads every environment, built-in or not, through the same
``resolve``.

An ``[[env]]`` entry may name another Python (`python = ".../bin/python"`, a virtual
environment holding the environment package and its verifiers version). ``probe_python``
asks that interpreter, in a short subprocess that imports nothing but the standard
library, which verifiers it has and whether the module is importable there.

Imports neither torch, vLLM nor the orchestrator.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

HUB_PREFIX = "primeintellect/"

# verifiers releases whose API this project drives: the classic API (0.3.x: `vf.Environment`,
# `load_environment`) and the v1 taskset API (0.4.x). Both tested with 0.3.1 and 0.4.0.
SUPPORTED_VERIFIERS = {"classic": ((0, 3), (0, 4)), "v1": ((0, 4), (0, 5))}
SUPPORTED_TEXT = "0.3.x (classic API) or 0.4.x (v1 tasksets)"

PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Builtin:
    id: str
    module: str
    tools: bool


@functools.cache
def builtins() -> dict[str, Builtin]:
    """The built-in environments, by id, as `registry.toml` lists them."""
    data = tomllib.loads((Path(__file__).with_name("registry.toml")).read_text())
    return {env_id: Builtin(env_id, entry["module"], bool(entry.get("tools", False))) for env_id, entry in data.items()}


SET_PARSER = "set `[inference] tool_call_parser`"
PASS_PARSER = "pass `--inference.tool_call_parser hermes`"
"""How a run's config, and the command line of `prime-rl eval` / `gepa`, give the parser."""


def tool_parser_problem(env_id: str, calls_tools: bool, parser: str | None, how: str = SET_PARSER) -> str | None:
    """The one check that an environment which calls tools gets vLLM's tool-call parser (its
    calls would otherwise come back as plain text): None, or the one-line problem. Before
    launch ``calls_tools`` is a built-in's `tools` (``registry.toml``, which a test checks
    against each environment's own tool schemas); where an environment is loaded it is its
    ``tool_defs``, so a user's tool environment is caught there."""
    if not calls_tools or parser is not None:
        return None
    return (f"environment {env_id!r} calls tools: {how} (vLLM's tool-call parser for the model family: \"hermes\" "
            "for Qwen3, Qwen2.5 and the tiny test model; another family needs its own)")


def declares_tools(env_id: str) -> bool:
    """A built-in environment that calls tools (``registry.toml``); False for a user's, which
    only its loaded ``tool_defs`` tell."""
    entry = builtin(env_id)
    return entry is not None and entry.tools


def environment_name(env_id: str) -> str:
    """`primeintellect/reverse-text` -> `reverse-text` (the hosted form names the owner)."""
    return env_id.removeprefix(HUB_PREFIX)


def environment_module(env_id: str) -> str:
    """The module a user's environment id names, as verifiers resolves it: `my-env` or
    `org/my-env` -> `my_env` (a dotted module path is kept as it is)."""
    return env_id.split("/")[-1].replace("-", "_")


def builtin(env_id: str) -> Builtin | None:
    return builtins().get(environment_name(env_id))


def resolve(env_id: str) -> str:
    """The module that defines the environment's `load_environment` (or exports its taskset)."""
    entry = builtin(env_id)
    return entry.module if entry is not None else environment_module(env_id)


def valid_module_name(module: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", module) is not None


def importable_here(module: str) -> bool:
    if not valid_module_name(module):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- another Python

_PROBE = r"""
import importlib.metadata, importlib.util, json, sys
module = sys.argv[1]
try:
    version = importlib.metadata.version("verifiers")
except importlib.metadata.PackageNotFoundError:
    version = None
try:
    found = importlib.util.find_spec(module) is not None
except (ImportError, ValueError):
    found = False
print(json.dumps({"verifiers": version, "found": found, "python": sys.version.split()[0]}))
"""


@dataclass(frozen=True)
class PythonProbe:
    python: str
    verifiers: str | None
    """The verifiers version installed there (None: not installed)."""

    found: bool
    """The environment's module is importable there."""

    version: str
    """That interpreter's Python version."""


class ProbeError(ValueError):
    """The Python an `[[env]]` entry names cannot run it; the message says why and the fix."""


def check_python_path(python: str | os.PathLike) -> str:
    path = Path(python).expanduser()
    if not path.exists():
        raise ProbeError(
            f"python: {str(python)!r} does not exist (expected the Python of a virtual environment that holds the "
            "environment and its verifiers version, e.g. /path/to/venv/bin/python)"
        )
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ProbeError(f"python: {str(python)!r} is not an executable file (expected e.g. /path/to/venv/bin/python)")
    return str(path)


@functools.cache
def probe_python(python: str, module: str) -> PythonProbe:
    """Ask ``python`` for its verifiers version and whether ``module`` is importable there."""
    python = check_python_path(python)
    if not valid_module_name(module):
        raise ProbeError(f"{module!r} is not a Python module name")
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, module], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
            env={k: v for k, v in os.environ.items() if k not in ("PYTHONHOME",)},
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProbeError(f"python: {python!r} could not be run ({type(e).__name__}: {e})") from None
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeError(f"python: {python!r} did not answer the probe (exit {done.returncode}: {last})") from None
    return PythonProbe(python, answer["verifiers"], bool(answer["found"]), answer["python"])


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def verifiers_api(version: str) -> str | None:
    """`classic` or `v1` for a supported verifiers version, else None."""
    v = version_tuple(version)[:2]
    for api, (low, high) in SUPPORTED_VERIFIERS.items():
        if low <= v < high:
            return api
    return None


def check_worker_python(env_id: str, python: str | os.PathLike) -> PythonProbe:
    """An `[[env]]` entry with `python`: that interpreter must have a supported verifiers and
    the environment's module. One line for each way it can fail."""
    module = resolve(env_id)
    probe = probe_python(str(Path(python).expanduser()), module)
    if probe.verifiers is None:
        raise ProbeError(
            f"environment {env_id!r}: {probe.python} has no verifiers installed; install the environment with its "
            f"verifiers version there (`uv pip install --python {probe.python} -e ./{env_id.split('/')[-1]}`)"
        )
    if verifiers_api(probe.verifiers) is None:
        raise ProbeError(
            f"environment {env_id!r}: {probe.python} has verifiers {probe.verifiers}; supported: {SUPPORTED_TEXT}"
        )
    if not probe.found:
        raise ProbeError(
            f"environment {env_id!r}: module {module!r} is not importable in {probe.python} (nor named by a built-in id); "
            f"install it there: `uv pip install --python {probe.python} -e ./{env_id.split('/')[-1]}`"
        )
    return probe
