"""Helpers shared by the worker's modules (standard library only; see vfworker_main)."""

from __future__ import annotations

import atexit
import importlib
import io
import os
import sys
import threading
from typing import Any


class LoadError(Exception):
    """The environment cannot be loaded; the message is one line for the user."""


OUTPUT_CAP_BYTES = 20_000_000
"""The most the environment's own prints (stdout and stderr together) may add to its log."""


def log(message: str) -> None:
    """The worker's own line: past the cap on the environment's output (``cap_output``)."""
    stream = sys.__stderr__ or sys.stderr
    print(f"[env-worker] {message}", file=stream, flush=True)


class _CappedStream(io.TextIOBase):
    """A text stream that writes through to ``raw`` until the shared ``budget`` is spent,
    then says once that the rest is cut off (an environment that prints megabytes an
    episode would fill the disk under load)."""

    def __init__(self, raw, budget: list[int]):
        self.raw, self.budget = raw, budget

    def write(self, text: str) -> int:
        size = len(text)
        if self.budget[0] >= size:
            self.budget[0] -= size
            self.raw.write(text)
        elif self.budget[0] >= 0:
            self.budget[0] = -1
            log(f"the environment's output passed {OUTPUT_CAP_BYTES / 1e6:.0f} MB: the rest is cut off "
                "(said once; the run goes on)")
        return size

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return getattr(self.raw, "encoding", "utf-8")


def cap_output(cap: int = OUTPUT_CAP_BYTES) -> None:
    """Cap what the environment prints (stdout and stderr together, Python's own writes) at
    ``cap`` characters; the worker's ``log`` lines are not counted."""
    budget = [cap]
    sys.stdout = _CappedStream(sys.__stdout__, budget)
    sys.stderr = _CappedStream(sys.__stderr__, budget)


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
