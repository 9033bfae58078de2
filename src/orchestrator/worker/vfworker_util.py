"""Helpers shared by the worker's modules (standard library only; see vfworker_main)."""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
from typing import Any


class LoadError(Exception):
    """The environment cannot be loaded; the message is one line for the user."""


def log(message: str) -> None:
    print(f"[env-worker] {message}", file=sys.stderr, flush=True)


def exit_process(code: int) -> None:
    """``prime_rl.settings.exit_process``, which the worker cannot import: the interpreter's
    shutdown steps (threads, atexit handlers, flushed output) without its module teardown,
    which takes ~0.8 s after verifiers and datasets and holds up every orchestrator's end."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:1000]


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as msgpack-able data: pydantic models dumped, tuples as lists, the rest as text."""
    if depth > 64:
        return repr(value)[:200]
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [plain(v, depth + 1) for v in value]
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return plain(dump(exclude_none=True), depth + 1)
    return str(value)


def import_module(module: str):
    """The environment's module; LoadError when it is not there at all (not for its own imports)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise LoadError(f"module {module!r} is not importable in {sys.executable}") from None
        raise
