"""The orchestrator's side of the rollout traces (`prime_rl.traces` has the format).

Each step, whole groups are chosen at random (seeded by the run's seed and the step, so a
resumed run chooses the same ones) and each of their rollouts becomes a row of
`RUN/traces/rollouts.jsonl`; the trainer is told their ids with the batch
(``ScoredRollout.trace_id``) and traces its view of their tokens. Evaluations (during RL and
`prime-rl eval`) and GEPA's candidates are traced the same way, with their own ``kind``.

Secrets stay out: every row goes through ``keys.scrub_found`` with the run's settings (every
secret-named field's value, as written raw, by ``repr`` or by JSON) and what
``keys.redact_text`` recognises by its look (bearer tokens, keys of known providers, a URL's
user part), before it is written or sent to W&B.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from prime_rl.config.orchestrator import TracesConfig
from prime_rl.envs import Rollout
from prime_rl.keys import scrub_found, scrubbed_secrets
from prime_rl.rundir import append_lines
from prime_rl.traces import rollout_traces_path, trace_id

from orchestrator.batch import ScoredRollout, sample_turns

WANDB_COLUMNS = ("step", "env", "example_id", "group", "prompt", "completion", "reward", "advantage", "stop")


def chosen_groups(num_groups: int, groups: int | str, seed: int, step: int) -> list[int]:
    """Indices of the groups to trace, ascending: all, or ``groups`` of them at random
    (the same ones for the same seed and step)."""
    if groups == "all" or groups >= num_groups:
        return list(range(num_groups))
    rng = np.random.default_rng([seed, step])
    return sorted(int(i) for i in rng.choice(num_groups, size=groups, replace=False))


class TraceWriter:
    """Writes the traced rows of a run (or of an evaluation's output folder)."""

    def __init__(self, run_dir: Path, cfg: TracesConfig, tokenizer, seq_len: int, secrets: Sequence[Any] = (),
                 seed: int = 0, wandb=None, per_turn: bool = False):
        self.path = rollout_traces_path(run_dir)
        self.cfg, self.tokenizer, self.seq_len, self.seed, self.per_turn = cfg, tokenizer, seq_len, seed, per_turn
        self.secrets = scrubbed_secrets(*secrets)
        """The run's secret values, found once (``keys.scrubbed_secrets``), not per row."""
        self.wandb = wandb
        """A W&B run (``WandbSink.run``) for the table every ``cfg.wandb_interval`` steps; None = none."""

    @property
    def enabled(self) -> bool:
        return self.cfg.groups != 0

    def mark(self, step: int, items: list[ScoredRollout], group_sizes: Sequence[int]) -> list[ScoredRollout]:
        """``items`` (group by group, ``group_sizes`` rollouts each) with a ``trace_id`` on the
        rollouts of the chosen groups; the others are left as they are."""
        if not self.enabled:
            return items
        starts = np.cumsum([0, *group_sizes])
        chosen = set(chosen_groups(len(group_sizes), self.cfg.groups, self.seed, step))
        marked = list(items)
        for g in chosen:
            for i in range(starts[g], starts[g + 1]):
                marked[i] = replace(items[i], trace_id=trace_id("train", step, g, int(i - starts[g])))
        return marked

    def train_rows(self, step: int, items: list[ScoredRollout], group_sizes: Sequence[int]) -> list[dict]:
        """The rows of the traced items of a step (``mark`` chose them)."""
        starts = np.cumsum([0, *group_sizes])
        group_of = np.repeat(np.arange(len(group_sizes)), group_sizes)
        return [
            self.row(item.rollout, "train", step, item.env, int(group_of[i]), int(i - starts[group_of[i]]), item.trace_id,
                     advantage=item.advantage)
            for i, item in enumerate(items) if item.trace_id is not None
        ]

    def group_rows(self, kind: str, step: int, env: str, groups: Sequence[Sequence[Rollout]], tag: str = "",
                   **extra: Any) -> list[dict]:
        """Rows of evaluation (or GEPA) groups: the chosen ones of ``groups``, no advantage."""
        if not self.enabled:
            return []
        return [
            self.row(rollout, kind, step, env, g, i, trace_id(kind, step, g, i, tag), **extra)
            for g in chosen_groups(len(groups), self.cfg.groups, self.seed, step)
            for i, rollout in enumerate(groups[g])
        ]

    def row(self, rollout: Rollout, kind: str, step: int, env: str, group: int, sample: int, rid: str,
            advantage: float | None = None, **extra: Any) -> dict:
        oldest, newest = rollout.versions
        part_of = {id(turn): k for k, turns in enumerate(sample_turns(rollout, self.per_turn) if rollout.turns else [])
                   for turn in turns}
        return {
            "id": rid, "kind": kind, "step": step, "env": env, "example_id": rollout.example_id, "group": group,
            "sample": sample, **extra,
            "prompt": rollout.prompt, "completion": rollout.completion, "reward": finite(rollout.reward),
            "metrics": {name: finite(value) for name, value in rollout.metrics.items()}, "errors": list(rollout.errors),
            "advantage": advantage, "policy_version": [oldest, newest], "stop_condition": rollout.stop_condition,
            "finish_reason": rollout.finish_reason, "truncated": rollout.total_tokens > self.seq_len,
            "wall": round(time.time(), 3),
            "turns": [
                {"prompt_ids": list(t.prompt_ids), "completion_ids": list(t.completion_ids),
                 "tokens": self.pieces(t.completion_ids), "logprobs": [round(float(lp), 5) for lp in t.completion_logprobs],
                 "versions": list(t.versions), "part": part_of[id(t)]}
                for t in rollout.turns
            ],
        }

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each token's text alone (a token that is part of a character shows as a replacement mark)."""
        return [self.tokenizer.decode([i]) for i in ids] if self.tokenizer is not None else []

    def lines(self, rows: list[dict]) -> list[str]:
        """The rows as the file keeps them: JSON, every secret scrubbed."""
        return [scrub_found(json.dumps(row, separators=(",", ":"), ensure_ascii=False, default=str), self.secrets)
                for row in rows]

    def write(self, lines: list[str], step: int | None = None) -> None:
        """Append the lines (one write); every ``wandb_interval`` steps also W&B's table."""
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_lines(self.path, lines)
        if self.wandb is not None and step is not None and self.cfg.wandb_interval and step % self.cfg.wandb_interval == 0:
            self.log_table(step, [json.loads(line) for line in lines])

    def log_table(self, step: int, rows: list[dict]) -> None:
        import wandb  # only with W&B on

        try:
            table = wandb.Table(columns=list(WANDB_COLUMNS), data=[table_row(row) for row in rows])
            self.wandb.log({"traces/rollouts": table}, step=step)
        except Exception as e:  # noqa: BLE001 - monitoring never stops training
            print(f"[orchestrator] W&B trace table disabled: {e}", flush=True)
            self.wandb = None


def env_secrets(*names: str | None) -> dict[str, str | None]:
    """The values of the environment variables ``names`` (keys the run reads), under secret names
    so that ``keys.scrub`` hides them."""
    return {f"{name}_key": os.environ.get(name) for name in names if name}


def table_row(row: dict) -> list:
    """A trace row as W&B's table shows it: the chat as text."""
    return [row["step"], row["env"], row["example_id"], row["group"], chat_text(row["prompt"]), chat_text(row["completion"]),
            row["reward"], row["advantage"], row["stop_condition"]]


def chat_text(messages: list[dict]) -> str:
    parts = []
    for m in messages:
        text = f"[{m.get('role', '?')}] {m.get('content') or ''}"
        for call in m.get("tool_calls") or []:
            function = call.get("function", {})
            text += f"\n  -> {function.get('name')}({function.get('arguments')})"
        parts.append(text)
    return "\n".join(parts)


def finite(value: float) -> float | None:
    """JSON has no NaN or infinity: such a score is written as null."""
    value = float(value)
    return value if np.isfinite(value) else None
