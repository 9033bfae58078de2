"""Layout of the run directory shared by the three processes.

    RUN/
      configs/{trainer,orchestrator,inference}.json   resolved configs (written by the launcher)
      logs/{trainer,orchestrator,inference}.log       one log per process
      weights/step_N/                                 HF safetensors of policy version N
      weights/step_N/STABLE                           marker, written last: only then does step N exist
      checkpoints/step_N/ + STABLE                    trainer checkpoint after N steps (model, optimizer, ...)
      rollouts/step_n/ + STABLE                       orchestrator progress: batch n as sent + its data cursor
      metrics.jsonl                                   one JSON row per process per step
      traces/{rollouts,trainer}.jsonl                 a sample of the rollouts, readable (prime_rl.traces)

A directory handoff is complete only once its marker exists; readers act on the
marker alone. Writers fill ``step_N.tmp`` first and rename it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

MARKER = "STABLE"
_STEP_DIR = re.compile(r"step_(\d+)")


def configs_dir(run: Path) -> Path:
    return Path(run) / "configs"


def config_path(run: Path, process: str) -> Path:
    return configs_dir(run) / f"{process}.json"


def logs_dir(run: Path) -> Path:
    return Path(run) / "logs"


def log_path(run: Path, process: str) -> Path:
    return logs_dir(run) / f"{process}.log"


def load_state_path(run: Path) -> Path:
    """``RUN/logs/load.json``: what the orchestrator's episode limiter last saw (its memory
    budget, the environment workers' pids), rewritten atomically every poll; the launcher's
    out-of-memory report reads it (``prime_rl.launch.oom``)."""
    return logs_dir(run) / "load.json"


def metrics_path(run: Path) -> Path:
    return Path(run) / "metrics.jsonl"


def traces_dir(run: Path) -> Path:
    return Path(run) / "traces"


def weights_dir(run: Path) -> Path:
    return Path(run) / "weights"


def weights_step_dir(run: Path, step: int) -> Path:
    return step_dir(weights_dir(run), step)


def checkpoints_dir(run: Path) -> Path:
    return Path(run) / "checkpoints"


def checkpoint_step_dir(run: Path, step: int) -> Path:
    return step_dir(checkpoints_dir(run), step)


def rollouts_dir(run: Path) -> Path:
    return Path(run) / "rollouts"


def rollouts_step_dir(run: Path, step: int) -> Path:
    return step_dir(rollouts_dir(run), step)


def step_dir(parent: Path, step: int) -> Path:
    """``parent/step_N``: complete once it holds the marker."""
    return Path(parent) / f"step_{step}"


def tmp_step_dir(parent: Path, step: int) -> Path:
    """``parent/step_N.tmp``: where step N is filled before the rename."""
    return Path(parent) / f"step_{step}.tmp"


def complete_steps(parent: Path) -> list[int]:
    """Steps under ``parent`` whose ``step_N`` directory holds the marker, ascending."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    steps = []
    for child in parent.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_weights_step(run: Path) -> int | None:
    steps = complete_steps(weights_dir(run))
    return steps[-1] if steps else None


def begin_step_dir(parent: Path, step: int) -> Path:
    """A fresh temporary directory to fill before ``finish_step_dir``."""
    tmp = tmp_step_dir(parent, step)
    remove_entry(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish_step_dir(tmp: Path, step: int) -> Path:
    """Rename ``step_N.tmp`` to ``step_N`` and write the marker last."""
    final = step_dir(tmp.parent, step)
    remove_entry(final)
    os.replace(tmp, final)
    marker = final / MARKER
    with open(marker, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    return final


def write_step_dir(parent: Path, step: int, what: str, fill: Callable[[Path], None]) -> Path:
    """Write ``parent/step_N`` in one go: ``fill(tmp)`` fills ``step_N.tmp``, then the rename
    and the marker. A write that fails (disk full, permission denied) removes the partial
    folder, leaves every complete step as it was and raises ``WriteFailed`` naming step_N."""
    try:
        tmp = begin_step_dir(parent, step)
        fill(tmp)
        return finish_step_dir(tmp, step)
    except OSError as e:
        shutil.rmtree(tmp_step_dir(parent, step), ignore_errors=True)
        final = step_dir(parent, step)
        if final.is_dir() and not (final / MARKER).exists():  # renamed, but the marker failed
            shutil.rmtree(final, ignore_errors=True)
        raise write_failed(what, step_dir(parent, step), e) from e


def prune_step_dirs(parent: Path, keep_last: int, protect: set[int] = frozenset()) -> None:
    """Delete all but the newest ``keep_last`` complete step directories (never one in ``protect``)."""
    for step in complete_steps(parent)[:-keep_last]:
        if step not in protect:
            remove_step_dir(parent, step)


def remove_step_dir(parent: Path, step: int) -> None:
    """Delete ``step_N`` (marker first, so no reader sees a half-deleted complete step) and
    ``step_N.tmp``. Either one being a link is removed as a link: what it points at, maybe
    outside the run directory, is never touched."""
    victim = step_dir(parent, step)
    if not victim.is_symlink():
        try:
            (victim / MARKER).unlink(missing_ok=True)
        except OSError:  # not a directory, or not ours to delete: nothing half-deleted to hide
            pass
    remove_entry(victim)
    remove_entry(tmp_step_dir(parent, step))


def remove_entry(path: Path) -> None:
    """Delete ``path`` whatever it is, never through a link: a link (even to a folder) or a file
    is unlinked, a folder removed with everything in it (``shutil.rmtree`` unlinks the links
    inside, it does not follow them). Failures are ignored: a leftover only costs space."""
    path = Path(path)
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def step_dirs(parent: Path) -> list[int]:
    """Steps of every ``step_N`` or ``step_N.tmp`` under ``parent``, complete or not, ascending."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = {int(m.group(1)) for c in parent.iterdir() if (m := re.fullmatch(r"step_(\d+)(?:\.tmp)?", c.name))}
    return sorted(found)


def append_jsonl(path: Path, row: dict) -> None:
    """Append one row with a single write (O_APPEND), so concurrent writers don't interleave."""
    line = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def append_lines(path: Path, lines: list[str]) -> None:
    """Append JSON lines (each without its newline) in one write, as ``append_jsonl`` does one."""
    if not lines:
        return
    data = "".join(line + "\n" for line in lines).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while data:  # a regular file takes it in one write; a short write must not lose the rest
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


# --------------------------------------------------------------------------- reading metrics rows

MAX_STEP = 2**63
"""Steps are counted from 0 and stay far below this; a larger one is damage (and a step near
10**400 overflows the float a view turns it into)."""


class BadRow(ValueError):
    """A metrics.jsonl line that is not a row; the message says what it is instead."""


def is_step(value) -> bool:
    """A step as the processes write it: a whole number (not a bool, not 3.0) in 0..MAX_STEP."""
    return type(value) is int and 0 <= value < MAX_STEP


def parse_row(line: bytes | str) -> dict:
    """One metrics.jsonl line as a row: a JSON object whose ``step``, when it has one, passes
    ``is_step``. Anything else raises ``BadRow``, never another error: every reader of the rows
    (resume, report, the status views) goes through here, and a view must not die on a line."""
    try:
        row = json.loads(line)
    except RecursionError:  # json's parser recurses once per nesting level
        raise BadRow("nested too deeply to be a row") from None
    except UnicodeDecodeError:
        raise BadRow("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise BadRow(f"not JSON ({e.msg}, character {e.pos})") from None
    except ValueError:  # an integer literal of more than 4300 digits
        raise BadRow("holds a number too long to read") from None
    if not isinstance(row, dict):
        raise BadRow(f"a JSON {_JSON_KINDS.get(type(row), 'value')}, not an object")
    if "step" in row and not is_step(step := row["step"]):
        shown = "above 10**20" if isinstance(step, int) and abs(step) > 10**20 else repr(step)[:40]
        raise BadRow(f"step {shown} is not a whole number from 0 to 2**63")
    return row


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "true/false", type(None): "null"}


class WriteFailed(OSError):
    """A write into the run directory failed (disk full, permission denied, ...)."""


def write_failed(what: str, target: Path, error: BaseException) -> WriteFailed:
    """One line naming what could not be written, where, and why."""
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    culprit = getattr(error, "filename", None)
    where = f" ({culprit})" if culprit and str(culprit) != str(target) else ""
    return WriteFailed(f"cannot write {what} {target}: {reason}{where}")


def write_json_atomic(path: Path, data: dict, private: bool = False) -> None:
    """Write JSON through a temporary file and a rename: readers see the old or the new file,
    whole. ``private``: readable by its owner only (a config that holds an API key)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):  # a crash's leftover would keep its old mode
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the run marker

RUN_MARKER = ".prime-rl-run"
"""``RUN/.prime-rl-run``: written by the launcher when a run starts, after every check passed.
`--clean` deletes a directory's run state only when this marker says a prime-rl run made it."""

RUN_MARKER_FORMAT = "prime-rl-run"
"""The marker's ``format`` tag. Markers written before it existed (JSON with ``kind``,
``created``, ``hostname``, ``pid``) still count; an empty file never did: prime-rl never wrote one."""

_MARKER_MAX_BYTES = 4096  # a marker is ~150 bytes; a bigger file is not one of ours


def run_marker_path(run: Path) -> Path:
    return Path(run) / RUN_MARKER


def is_marked_run(run: Path) -> bool:
    return run_marker_problem(run) is None


def run_marker_problem(run: Path) -> str | None:
    """None when ``run`` holds a marker a prime-rl run wrote, else what is wrong with it, as
    the end of a sentence ("holds no .prime-rl-run marker", "... is a link"). The marker is read
    without following a link (``O_NOFOLLOW``): a link proves nothing about this folder."""
    path = run_marker_path(run)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO must not hang us
    except FileNotFoundError:
        return f"holds no {RUN_MARKER} marker"
    except OSError as e:
        if path.is_symlink():  # ELOOP from O_NOFOLLOW
            return f"has a link as its {RUN_MARKER} marker, not a file a prime-rl run wrote"
        return f"has a {RUN_MARKER} marker that cannot be read ({e.strerror or e})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a FIFO, a device
            return f"has a {RUN_MARKER} that is not a regular file"
        content = os.read(fd, _MARKER_MAX_BYTES + 1)
    except OSError as e:
        return f"has a {RUN_MARKER} marker that cannot be read ({e.strerror or e})"
    finally:
        os.close(fd)
    if not content.strip():
        return f"has an empty {RUN_MARKER} marker, which no prime-rl run writes (its marker holds JSON)"
    if not _is_marker_content(content):
        return f"has a {RUN_MARKER} marker whose content is not a prime-rl run's (expected JSON with format {RUN_MARKER_FORMAT!r})"
    return None


def _is_marker_content(content: bytes) -> bool:
    if len(content) > _MARKER_MAX_BYTES:
        return False
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested absurdly
        return False
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        return False
    if data.get("format") == RUN_MARKER_FORMAT:
        return isinstance(data.get("run_id"), str)
    # The first markers (before the format tag): kind, created, hostname, pid.
    return "format" not in data and isinstance(data.get("created"), str) and isinstance(data.get("hostname"), str) \
        and type(data.get("pid")) is int


def write_run_marker(run: Path, kind: str = "rl", **extra) -> Path:
    """Mark ``run`` as a prime-rl run directory (JSON: format tag, a fresh run id, kind, created
    time, host, pid), atomically and never through a link: ``write_json_atomic`` creates its
    temporary file with ``O_EXCL`` (which refuses a link in its place) and renames it over the
    marker, which replaces a link there instead of writing where it points."""
    import socket
    import time
    import uuid

    path = run_marker_path(run)
    data = {"format": RUN_MARKER_FORMAT, "run_id": uuid.uuid4().hex, "kind": kind,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hostname": socket.gethostname(), "pid": os.getpid(), **extra}
    write_json_atomic(path, data)
    return path


# Folders that are never a run directory: the system's pseudo-filesystems (a write there
# fails oddly, or worse, succeeds) and folders whose deletion would be a disaster.
_SYSTEM_TREES = (Path("/proc"), Path("/sys"), Path("/dev"))


def output_dir_problem(path: Path, may_clean: bool = True) -> str | None:
    """Why ``path`` cannot be a run's output directory, or None when it can. Refused: a file (or
    a path inside one), anything under /proc, /sys or /dev, and `/`; with ``may_clean`` (a
    directory `--clean` may empty) also the home folder, the project root and every folder
    above them."""
    path = Path(path)
    resolved = path.resolve()
    for tree in _SYSTEM_TREES:
        if resolved == tree or tree in resolved.parents:
            return f"{str(path)!r} is under {tree}; expected a folder for the run's files, e.g. outputs/run"
    if resolved.exists() and not resolved.is_dir():
        return f"{str(path)!r} is a file; expected a folder (existing or to be created) for the run's files"
    existing = next((p for p in resolved.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{str(path)!r} lies inside {str(existing)!r}, which is a file; expected a folder for the run's files"
    if resolved == Path(resolved.anchor):
        return f"{str(path)!r} is the filesystem root; choose a folder of its own for the run, e.g. outputs/run"
    for name, protected in _protected_dirs() if may_clean else ():
        if resolved == protected or resolved in protected.parents:
            what = name if resolved == protected else f"a folder above {name} {protected}"
            return f"{str(path)!r} is {what}; choose a folder of its own for the run, e.g. outputs/run"
    return None


def _protected_dirs() -> list[tuple[str, Path]]:
    """(what, folder): the home folder, this checkout of prime-rl, and the project the command
    runs in (the nearest folder above the working directory holding pyproject.toml or .git)."""
    dirs = []
    try:
        dirs.append(("the home folder", Path.home().resolve()))
    except RuntimeError:  # no home folder known (HOME unset, no passwd entry)
        pass
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        dirs.append(("the project root", checkout))
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the working directory was deleted
        return dirs
    project = next((p for p in (cwd, *cwd.parents) if (p / "pyproject.toml").exists() or (p / ".git").exists()), None)
    if project is not None and project != Path("/"):
        dirs.append(("the project root", project))
    return dirs
