"""Resuming a run: choose the checkpoint, check it is whole, rewind the run directory to it.

`prime-rl CONFIG.toml --resume` continues from the newest complete trainer checkpoint,
`--resume-step N` from checkpoint N. Resuming from N needs:
  - `checkpoints/step_N/` with its marker (the trainer's state after N steps);
  - `weights/step_N/` with its marker (inference starts on it);
  - the orchestrator's progress record of step N-1 or N under `rollouts/`.
Everything the run did after step N is then undone, so every later step is trained
exactly once and logged once: newer weights and checkpoints (and half-written `.tmp`
folders) are deleted and metrics rows of steps >= N are dropped, and so are trace rows
(`prime_rl.traces`) of steps >= N: the orchestrator writes those of the batches it re-sends again. The orchestrator decides
itself which of its recorded batches it re-sends (`orchestrator.progress`).

Nothing is deleted before everything is checked: a damaged metrics line refuses the resume,
naming it. Nothing is deleted through a link: a `step_N` that is one goes as a link, whatever
it points at (maybe outside the run directory) untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

from prime_rl.transfer import announcement_path, clear_announcement
from prime_rl.rundir import (
    MARKER,
    BadRow,
    checkpoint_step_dir,
    checkpoints_dir,
    complete_steps,
    metrics_path,
    parse_row,
    remove_entry,
    remove_step_dir,
    rollouts_dir,
    step_dirs,
    tmp_step_dir,
    weights_dir,
    weights_step_dir,
)
from prime_rl.traces import trace_files


class ResumeRefused(ValueError):
    """The run directory cannot be resumed as asked; the message says what is missing."""


def choose_resume_step(run_dir: Path, requested: int | None) -> int:
    """The checkpoint to resume from: ``requested`` if complete, else the newest complete one."""
    run_dir = Path(run_dir)
    complete = complete_steps(checkpoints_dir(run_dir))
    if requested is None:
        if not complete:
            raise ResumeRefused(
                f"--resume: no complete checkpoint in {checkpoints_dir(run_dir)} "
                f"(a checkpoint is a step_N folder with its {MARKER} marker; see ckpt.interval)"
            )
        return complete[-1]
    if requested not in complete:
        raise ResumeRefused(
            f"--resume-step {requested}: {checkpoint_step_dir(run_dir, requested)} is not a complete checkpoint; "
            f"complete ones: {', '.join(map(str, complete)) or 'none'}"
        )
    return requested


def check_resumable(run_dir: Path, step: int, max_steps: int) -> None:
    """Everything a resume from ``step`` reads exists and is complete."""
    if step >= max_steps:
        raise ResumeRefused(
            f"checkpoint step {step} is already the end of the run (max_steps = {max_steps}); "
            "raise max_steps (e.g. --max-steps) to train further"
        )
    if not (weights_step_dir(run_dir, step) / MARKER).is_file():
        raise ResumeRefused(f"resume from step {step}: {weights_step_dir(run_dir, step)} (with its {MARKER} marker) is missing")
    records = set(complete_steps(rollouts_dir(run_dir)))
    if not records & {step - 1, step}:
        raise ResumeRefused(
            f"resume from step {step}: no orchestrator progress (step_{step - 1} or step_{step} with its {MARKER} "
            f"marker) in {rollouts_dir(run_dir)}"
        )
    metrics_to_keep(metrics_path(run_dir), step)  # refuses a damaged metrics file now, before the rewind


def rewind(run_dir: Path, step: int) -> list[str]:
    """Undo what the run did after ``step``; returns a line per thing removed. The metrics file
    is checked first, so a resume it refuses (``ResumeRefused``) has deleted nothing. A
    ``step_N`` or ``step_N.tmp`` that is a link goes as a link: nothing is deleted through it."""
    metrics = metrics_path(run_dir)
    kept, dropped = metrics_to_keep(metrics, step)
    removed = []
    for parent in (weights_dir(run_dir), checkpoints_dir(run_dir)):
        complete = set(complete_steps(parent))
        for later in step_dirs(parent):  # step_N and step_N.tmp folders
            if later > step or later not in complete:
                remove_step_dir(parent, later)
                removed.append(f"{parent.name}/step_{later}{'' if later in complete else ' (incomplete)'}")
            elif os.path.lexists(leftover := tmp_step_dir(parent, later)):  # a half-written twin of a kept step
                remove_entry(leftover)
                removed.append(f"{parent.name}/{leftover.name}")
    if dropped:
        rewrite_lines(metrics, kept)
        removed.append(f"{dropped} metrics rows of steps >= {step}")
    if announcement_path(run_dir).exists():  # memory mode: a version of the stopped trainer's group
        clear_announcement(run_dir)
        removed.append(f"{weights_dir(run_dir).name}/{announcement_path(run_dir).name}")
    for path in trace_files(run_dir):
        if dropped := drop_trace_rows(path, step):
            removed.append(f"{dropped} trace rows of steps >= {step} in {path.name}")
    return removed


def drop_trace_rows(path: Path, step: int) -> int:
    """Rewrite a trace file without its rows of steps >= ``step`` and without a torn last line;
    returns how many lines went. Unlike metrics, a damaged line in the middle is kept as it is
    (traces are for reading: a reader skips it, and it is not the resume's to judge)."""
    if path.is_symlink() or not path.is_file():
        return 0
    *lines, last = path.read_bytes().split(b"\n")
    kept = []
    for line in lines:
        try:
            later = parse_row(line).get("step", -1) >= step
        except BadRow:
            later = False
        if line.strip() and not later:
            kept.append(line)
    dropped = len([line for line in lines if line.strip()]) - len(kept) + bool(last.strip())
    if dropped:
        rewrite_lines(path, kept)
    return dropped


def drop_metrics_from(path: Path, step: int) -> int:
    """Rewrite metrics.jsonl without rows of steps >= ``step``; returns how many lines went
    (``metrics_to_keep`` says which, and refuses a file that is not rows)."""
    kept, dropped = metrics_to_keep(path, step)
    if dropped:
        rewrite_lines(path, kept)
    return dropped


def metrics_to_keep(path: Path, step: int) -> tuple[list[bytes], int]:
    """The lines of metrics.jsonl a rewind to ``step`` keeps (rows of earlier steps, and rows
    without a step: the launcher's), and how many it drops. A last line without its newline was
    never finished (a row is written with its newline in one write), by the crash being resumed
    from: unless it is a row after all, it is dropped (and counted).
    Any other line that is not a row (``parse_row``: not JSON, not UTF-8, nested too deeply, a
    step that is not a whole number) refuses the resume in one line naming it: it is damage the
    user should see, and deleting it would hide it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    except OSError as e:
        raise ResumeRefused(f"--resume: cannot read {path}: {e.strerror or e}") from None
    *lines, last = data.split(b"\n")  # ``last`` is b"" when the file ends with its newline
    kept, dropped = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = parse_row(line)
        except BadRow as e:
            raise ResumeRefused(
                f"--resume: {path} line {number} is not a metrics row: {e}; fix or delete that line, then resume again"
            ) from None
        if row.get("step", -1) < step:
            kept.append(line)
        else:
            dropped += 1
    if last.strip():
        try:
            keep = parse_row(last).get("step", -1) < step
        except BadRow:  # cut mid-write
            keep = False
        kept += [last] if keep else []
        dropped += 0 if keep else 1
    return kept, dropped


def rewrite_lines(path: Path, lines: list[bytes]) -> None:
    """Replace ``path`` with ``lines`` through a fresh temporary file and a rename: a crash
    leaves the old file or the new one, and a planted ``.tmp`` link is replaced, not written
    through. A ``path`` that is a link is replaced by the file, its target left as it was."""
    tmp = path.with_name(path.name + ".tmp")
    remove_entry(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))
    os.replace(tmp, path)
