"""Rollout traces: what the model generated, in files a person (or the dashboard) can read.

    RUN/traces/rollouts.jsonl   the orchestrator's (``orchestrator.traces``): one row a rollout
    RUN/traces/trainer.jsonl    the trainer's (``trainer.traces``): one row a traced sample it
                                trained on, keyed by its rollout's ``id``

A rollout row: ``id`` (unique in the run), ``kind`` (``train``, ``eval``, ``gepa``), ``step``,
``env``, ``example_id``, ``group`` (the group's place in its step or evaluation), ``sample``
(the rollout's place in its group), ``prompt`` and ``completion`` (chat messages: every model
reply with its tool calls and every environment reply in order), ``reward``, ``metrics`` (each
rubric function's raw score), ``errors``, ``advantage`` (null outside training),
``policy_version`` ([oldest, newest] among its tokens), ``stop_condition``, ``finish_reason``,
``truncated`` (longer than ``seq_len``: the trainer saw it cut), ``wall`` (Unix time) and
``turns``: per model call ``prompt_ids`` (the tokens the call added before it: the whole prompt for the first, the environment's reply and the template's glue after), ``completion_ids``, ``tokens`` (each
completion token's text alone), ``logprobs`` (as sampled), ``versions`` and ``part`` (the
sample it trains in: the trainer row of that part covers its turns' completion tokens).

A trainer row: ``id``, ``part`` (a rollout the environment re-rendered, or any multi-turn
rollout with ``multi_turn = "per_turn"``, trains as several samples), ``step``, ``rank`` and,
per token the sample trained on (its completion tokens in order, cut at ``seq_len``):
``logprobs`` (the trainer's, at the sampling temperature: the mismatch is the rollout row's
``logprobs`` minus these), ``entropy``, ``masked`` (1 where the importance band dropped it)
and, in a distillation run, ``teacher_logprobs`` (the teacher's, raw: temperature 1).

Both files are append-only, each step's rows one write (``rundir.append_lines``). A reader
skips what is not a row (a torn last line after a crash, damage), counts it, and never fails
on one. A resume drops the rows of the steps it redoes (``launch.resume.rewind``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.rundir import BadRow, parse_row, traces_dir

ROLLOUTS_FILE = "rollouts.jsonl"
TRAINER_FILE = "trainer.jsonl"
MAX_ID_CHARS = 128
"""A trace id is built from a kind, a step and indices; a longer one is not ours."""


def rollout_traces_path(run: Path) -> Path:
    return traces_dir(run) / ROLLOUTS_FILE


def trainer_traces_path(run: Path) -> Path:
    return traces_dir(run) / TRAINER_FILE


def trace_id(kind: str, step: int, group: int, sample: int, tag: str = "") -> str:
    """``train-12-3-5``: unique in a run (an evaluation's ``tag`` names its environment, GEPA's
    its candidate), the same when a resumed run samples the step again."""
    return "-".join(str(part) for part in (kind, tag, step, group, sample) if part != "")


@dataclass
class TraceRead:
    rows: list[dict] = field(default_factory=list)
    skipped: int = 0
    """Complete lines that were not rows (damage); each is counted, none is fatal."""

    offset: int = 0
    """Where the next read continues: after the last complete line. An unfinished last line
    (being written, or torn by a crash) is read again next time."""


def read_traces(path: Path, offset: int = 0, max_bytes: int | None = None) -> TraceRead:
    """The rows of a trace file from byte ``offset`` on (up to about ``max_bytes``), skipping
    lines that are not JSON objects with a whole-number ``step``. A missing file has none."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(-1 if max_bytes is None else max_bytes)
    except FileNotFoundError:
        return TraceRead(offset=offset)
    complete = data[: data.rfind(b"\n") + 1]
    read = TraceRead(offset=offset + len(complete))
    for line in complete.split(b"\n"):
        if not line.strip():
            continue
        if (row := trace_row(line)) is None:
            read.skipped += 1
        else:
            read.rows.append(row)
    return read


def trace_row(line: bytes) -> dict | None:
    """One line as a trace row (a JSON object with an ``id`` and a whole-number ``step``), or
    None for anything else."""
    try:
        row = parse_row(line)
    except BadRow:
        return None
    return row if "step" in row and isinstance(row.get("id"), str) else None


def trace_files(run: Path) -> list[Path]:
    """The run's trace files that exist."""
    return [p for p in (rollout_traces_path(run), trainer_traces_path(run)) if os.path.lexists(p)]
