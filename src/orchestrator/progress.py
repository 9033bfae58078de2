"""The orchestrator's resumable progress: every batch it sends, recorded before it is sent.

    rollouts/step_n/
      rank_R.msgpack    the batch for trainer rank R, exactly the frame sent (prime_rl.wire)
      progress.json     data cursor before and after step n, the batch's examples, the
                        policy versions sampled with, the step's metrics row, the data order,
                        and (continuous batching) the examples started but in no batch yet
      traces.jsonl      the step's trace rows (``orchestrator.traces``), written again on a replay
      STABLE            marker, written last

With async_level >= 1 the orchestrator runs ahead of the trainer, so when the trainer
checkpoints step N, batches N, N+1, ... may already be sampled. Recording each batch
before sending it means a restart loses none of them: resuming from checkpoint N
re-sends the recorded batches N, N+1, ... that were sampled by policy versions <= N (the
trajectory the checkpoint is part of) and samples on from the data cursor after the last
of them. Later records came from weights the restart discards; they are deleted, and
their steps are sampled again from the same cursor, so the same prompts come in the same
order. With continuous batching the cursor also lists the examples in flight when the
step was cut (``Cursor.pending``): a resume samples those first, then
draws on. Records older than the oldest complete trainer checkpoint (minus one, whose
cursor a resume may need) are pruned. A resume on another number of trainer ranks
re-packs each recorded batch for them (``repacked_frames``): the same samples, balanced
the way a fresh step is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_rl.rundir import (
    MARKER,
    checkpoints_dir,
    complete_steps,
    remove_step_dir,
    rollouts_dir,
    rollouts_step_dir,
    step_dirs,
    write_json_atomic,
    write_step_dir,
)
from prime_rl.wire import decode_batch, encode_batch

from orchestrator.batch import pack_samples

PROGRESS_FILE = "progress.json"
TRACES_FILE = "traces.jsonl"


class ResumeError(RuntimeError):
    """The recorded progress cannot continue this run (missing, or made with other data settings)."""


@dataclass(frozen=True)
class Cursor:
    """Where sampling stands between two steps: what a resume continues from."""

    order: Any
    """Data order state (``ExampleOrder.state_dict()``, JSON)."""

    pending: list[tuple[int, int]] = field(default_factory=list)
    """(environment index, example index) of the examples started but in no batch yet, in
    start order: a resume samples them first. Empty in records made before this existed."""


@dataclass
class StepRecord:
    step: int
    frames: list[bytes]
    """One encoded TrainBatch per trainer rank, in rank order."""

    before: Cursor
    after: Cursor
    """The cursor before and after the step."""

    picks: list[tuple[int, int]]
    """(environment index, example index) of every group in the step's batch, in order."""

    min_version: int
    max_version: int
    """Oldest and newest policy version among the batch's tokens."""

    data: dict = field(default_factory=dict)
    """What the cursor means: seed, dataset sizes, examples per step. A resume must match it."""

    metrics: dict = field(default_factory=dict)

    traces: list[str] = field(default_factory=list)
    """The step's trace rows as `RUN/traces/rollouts.jsonl` lines (a resume drops them there
    and the replay writes them again); empty in records made before traces existed."""

    def meta(self) -> dict:
        """progress.json: everything but the frames, the cursors flat (the layout records
        have had since before ``Cursor``, so a resume reads older runs' records)."""
        return {
            "step": self.step,
            "cursor_before": self.before.order,
            "cursor_after": self.after.order,
            "picks": self.picks,
            "min_version": self.min_version,
            "max_version": self.max_version,
            "data": self.data,
            "metrics": self.metrics,
            "pending_before": self.before.pending,
            "pending_after": self.after.pending,
            "num_ranks": len(self.frames),
        }


def save_record(run_dir: Path, record: StepRecord) -> Path:
    """Write ``rollouts/step_n`` (marker last); a failed write raises ``WriteFailed`` naming it."""

    def fill(tmp: Path) -> None:
        for rank, frame in enumerate(record.frames):
            (tmp / f"rank_{rank}.msgpack").write_bytes(frame)
        write_json_atomic(tmp / PROGRESS_FILE, record.meta())
        if record.traces:
            (tmp / TRACES_FILE).write_text("".join(line + "\n" for line in record.traces))

    return write_step_dir(rollouts_dir(run_dir), record.step, "rollouts", fill)


def load_record(run_dir: Path, step: int) -> StepRecord | None:
    """The record of ``step``, or None when it is missing or incomplete (no marker)."""
    folder = rollouts_step_dir(run_dir, step)
    if not (folder / MARKER).is_file():
        return None
    try:
        meta = json.loads((folder / PROGRESS_FILE).read_text())
        frames = [(folder / f"rank_{r}.msgpack").read_bytes() for r in range(meta.pop("num_ranks"))]
        cursors = {when: Cursor(meta.pop(f"cursor_{when}"), [tuple(p) for p in meta.pop(f"pending_{when}", [])])
                   for when in ("before", "after")}
        meta["picks"] = [tuple(p) for p in meta["picks"]]
        traces = folder / TRACES_FILE
        lines = [line for line in traces.read_text().split("\n") if line.strip()] if traces.is_file() else []
        return StepRecord(frames=frames, **cursors, **meta, traces=lines)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ResumeError(f"unreadable orchestrator progress {folder}: {e}") from e


@dataclass(frozen=True)
class ResumePlan:
    replay: list[StepRecord]
    """Recorded batches to send again, from the checkpoint's step on."""

    next_step: int
    """First step to sample anew."""

    cursor: Cursor
    """Where sampling stands before ``next_step`` (the examples in flight then are sampled first)."""


def plan_resume(run_dir: Path, resume_step: int, data: dict) -> ResumePlan:
    """What to re-send and where to continue after a restart from checkpoint ``resume_step``.

    Deletes the records this resume supersedes (sampled by weights newer than the checkpoint).
    """
    replay: list[StepRecord] = []
    step = resume_step
    while (record := load_record(run_dir, step)) is not None and record.max_version <= resume_step:
        check_compatible(record, data, run_dir)
        replay.append(record)
        step += 1
    if record is not None:  # recorded, but sampled by weights the restart discards
        cursor = record.before
    elif replay:
        cursor = replay[-1].after
    elif (previous := load_record(run_dir, resume_step - 1)) is not None:
        check_compatible(previous, data, run_dir)
        cursor = previous.after
    else:
        raise ResumeError(
            f"no orchestrator progress for step {resume_step} in {rollouts_dir(run_dir)} "
            f"(expected step_{resume_step - 1} or step_{resume_step} with its {MARKER} marker)"
        )
    for stale in step_dirs(rollouts_dir(run_dir)):
        if stale >= step:
            remove_step_dir(rollouts_dir(run_dir), stale)
    return ResumePlan(replay=replay, next_step=step, cursor=cursor)


def check_compatible(record: StepRecord, data: dict, run_dir: Path) -> None:
    """A resume must read the data the way the recorded run did, or the recorded cursor
    points at other examples; the number of trainer ranks may change (``repacked_frames``)."""
    changed = [f"{key} was {record.data.get(key)!r}, now {value!r}" for key, value in data.items() if record.data.get(key) != value]
    if changed:
        raise ResumeError(
            f"cannot resume from {rollouts_step_dir(run_dir, record.step)}: the run's data settings changed "
            f"({'; '.join(changed)}); resume with the original settings"
        )


def repacked_frames(record: StepRecord, num_ranks: int, micro_batch_size: int) -> list[bytes]:
    """The record's batch re-packed for ``num_ranks`` trainer ranks (it was made for
    ``len(record.frames)``): every sample, gathered in rank order so that groups stay
    adjacent, balanced as a fresh step is, with the record's step and temperature."""
    try:
        batches = [
            decode_batch(frame, expected_step=record.step, expected_rank=rank) for rank, frame in enumerate(record.frames)
        ]
        samples = [sample for batch in batches for micro in batch.micro_batches for sample in micro.samples]
        repacked = pack_samples(
            samples,
            step=record.step,
            num_ranks=num_ranks,
            micro_batch_size=micro_batch_size,
            temperature=batches[0].temperature,
        )
    except ValueError as e:  # WireError included: a damaged frame
        raise ResumeError(f"cannot re-pack step {record.step}'s recorded batch for {num_ranks} trainer ranks: {e}") from e
    return [encode_batch(batch) for batch in repacked]


def prune_records(run_dir: Path) -> None:
    """Drop records no kept trainer checkpoint can need (older than the oldest one, minus one)."""
    checkpoints = complete_steps(checkpoints_dir(run_dir))
    if not checkpoints:
        return
    for step in complete_steps(rollouts_dir(run_dir)):
        if step < checkpoints[0] - 1:
            remove_step_dir(rollouts_dir(run_dir), step)
