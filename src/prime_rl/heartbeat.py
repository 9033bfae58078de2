"""Heartbeats: what each process is doing, for the launcher's watchdog ("never a silent hang").

Each Python process publishes its state to ``RUN/logs/<process>.heartbeat.json``:

    {"pid": 4242, "progress": "trained step 5", "progress_unix": 1767225600.0,
     "waiting_for": "batch of step 6 from tcp://127.0.0.1:5555", "waiting_since": 1767225601.5}

Use in a process (the orchestrator's process name is "orchestrator", the trainer's "trainer",
written by rank 0 only)::

    hb = Heartbeat(cfg.output_dir, "orchestrator")     # writes progress "started"
    ...
    hb.progress(f"sent batch {step}")                   # after each unit of real work
    with hb.waiting(f"weights step {step} in {weights_dir}"):
        wait_for_weights(step)                          # any blocking wait
        ...

``detail(text)`` says what the process has in flight (the orchestrator's episodes), shown by
the watchdog beside the wait. ``progress(text)`` marks real work done (the watchdog's clock restarts); ``waiting(text)``
says what the process blocks on, since when, and restores the previous state on exit (waits
nest: the inner one is shown while it lasts). A wait is not progress. Neither ever raises: a
failed write (disk full, permission denied) is reported once on stderr and otherwise ignored,
since monitoring never crashes training. Writes are atomic (a temporary file and a rename);
``waiting`` writes on entry and exit, and so does the first ``progress`` after it; progress calls
in a row (a loop over requests) write at most once per ``min_interval_s``, the next write
carrying the latest. Use them per step or per request, not per token.
``Heartbeat(..., enabled=False)`` is the null implementation (other ranks, tests).

The launcher reads the files with ``read_heartbeats``, which returns None for a file that is
missing, half-written or not a heartbeat. This module is stdlib only (contracts package).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prime_rl.rundir import logs_dir, write_json_atomic


def heartbeat_path(run_dir: Path, process: str) -> Path:
    return logs_dir(run_dir) / f"{process}.heartbeat.json"


@dataclass(frozen=True)
class Beat:
    """One heartbeat file's content; times are unix seconds."""

    pid: int
    progress: str
    progress_unix: float
    waiting_for: str | None = None
    waiting_since: float | None = None
    detail: str | None = None
    """What the process has in flight now (the orchestrator: episodes per environment, the
    oldest's start, groups waiting for memory), shown beside what it waits for."""


class Heartbeat:
    """The writer side: one per process (see the module docstring)."""

    def __init__(self, run_dir: Path, process: str, enabled: bool = True, min_interval_s: float = 1.0):
        self.path = heartbeat_path(run_dir, process)
        self.enabled = enabled
        self.min_interval_s = min_interval_s
        self._progress, self._progress_unix = "started", time.time()
        self._waits: list[tuple[str, float]] = []  # stack of (what, since): the innermost is shown
        self._detail: str | None = None
        self._written_at = -math.inf  # monotonic time of the last write
        self._burst = False  # the last write was a progress(): the next one within min_interval_s waits
        self._warned = False
        if enabled:
            with contextlib.suppress(OSError):
                self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def progress(self, text: str) -> None:
        """Real work done (``text``: what, e.g. "trained step 5")."""
        self._progress, self._progress_unix = text, time.time()
        if not self._burst or time.monotonic() - self._written_at >= self.min_interval_s:
            self._write()
            self._burst = True

    @contextlib.contextmanager
    def waiting(self, text: str) -> Iterator[None]:
        """Blocked on ``text`` (e.g. "batch of step 6 from tcp://..."), until the block exits."""
        self._waits.append((text, time.time()))
        self._write()
        try:
            yield
        finally:
            self._waits.pop()
            self._write()

    def detail(self, text: str | None) -> None:
        """What is in flight now (see ``Beat.detail``); written with the next write, or now
        when the last write is ``min_interval_s`` old."""
        if text != self._detail:
            self._detail = text
            if time.monotonic() - self._written_at >= self.min_interval_s:
                self._write()

    def beat(self) -> Beat:
        what, since = self._waits[-1] if self._waits else (None, None)
        return Beat(os.getpid(), self._progress, self._progress_unix, what, since, self._detail)

    def _write(self) -> None:
        self._burst = False
        if not self.enabled:
            return
        self._written_at = time.monotonic()
        try:
            write_json_atomic(self.path, self.beat().__dict__)
        except OSError as e:
            if not self._warned:
                self._warned = True
                print(f"[heartbeat] cannot write {self.path}: {e.strerror or e}; the watchdog will not see this process",
                      file=sys.stderr, flush=True)


def read_heartbeat(path: Path) -> Beat | None:
    """The beat in ``path``, or None when it is missing, half-written or not a heartbeat."""
    try:
        data = json.loads(Path(path).read_text())
        beat = Beat(**data)
    except (OSError, ValueError, TypeError):  # ValueError covers JSON and UTF-8 decoding errors
        return None
    return beat if _well_typed(beat) else None


def read_heartbeats(run_dir: Path, names: Iterable[str]) -> dict[str, Beat | None]:
    return {name: read_heartbeat(heartbeat_path(run_dir, name)) for name in names}


def _well_typed(b: Beat) -> bool:
    def unix(x) -> bool:  # a time the clock functions accept: finite, from 1970 to year ~5000
        return isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x < 1e11

    waiting_ok = (b.waiting_for is None and b.waiting_since is None) or (
        isinstance(b.waiting_for, str) and unix(b.waiting_since)
    )
    detail_ok = b.detail is None or isinstance(b.detail, str)
    return isinstance(b.pid, int) and isinstance(b.progress, str) and unix(b.progress_unix) and waiting_ok and detail_ok
