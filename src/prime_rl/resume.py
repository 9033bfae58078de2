"""Resuming a run: choose the checkpoint, check it is whole, rewind the run directory to it.

`prime-rl CONFIG.toml --resume` continues from the newest complete trainer checkpoint,
`--resume-step N` from checkpoint N. Resuming from N needs:
  - `checkpoints/step_N/` with its marker (the trainer's state after N steps);
  - `weights/step_N/` with its marker (inference starts on it);
  - the orchestrator's progress record of step N-1 or N under `rollouts/`.
Everything the run did after step N is then undone, so every later step is trained
exactly once and logged once: newer weights and checkpoints (and half-written `.tmp`
folders) are deleted and metrics rows of steps >= N are dropped. The orchestrator
decides itself which of its recorded batches it re-sends (`orchestrator.progress`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from prime_rl.rundir import (
    MARKER,
    checkpoint_step_dir,
    checkpoints_dir,
    complete_steps,
    metrics_path,
    remove_step_dir,
    rollouts_dir,
    step_dirs,
    tmp_step_dir,
    weights_dir,
    weights_step_dir,
)


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


def rewind(run_dir: Path, step: int) -> list[str]:
    """Undo what the run did after ``step``; returns a line per thing removed."""
    removed = []
    for parent in (weights_dir(run_dir), checkpoints_dir(run_dir)):
        complete = set(complete_steps(parent))
        for later in step_dirs(parent):  # step_N and step_N.tmp folders
            if later > step or later not in complete:
                remove_step_dir(parent, later)
                removed.append(f"{parent.name}/step_{later}{'' if later in complete else ' (incomplete)'}")
            elif (leftover := tmp_step_dir(parent, later)).exists():  # a half-written twin of a kept step
                shutil.rmtree(leftover, ignore_errors=True)
                removed.append(f"{parent.name}/{leftover.name}")
    dropped = drop_metrics_from(metrics_path(run_dir), step)
    if dropped:
        removed.append(f"{dropped} metrics rows of steps >= {step}")
    return removed


def drop_metrics_from(path: Path, step: int) -> int:
    """Rewrite metrics.jsonl without rows of steps >= ``step`` (temp file + rename); returns how
    many. A line that is not a row (cut mid-write by the crash being resumed from) goes too."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if (row := json_row(line)) is not None and row.get("step", -1) < step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def json_row(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None
