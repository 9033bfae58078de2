"""Groups of rollouts on chosen examples, and what their rewards say (for eval and preflight).

``run_groups`` plays ``n`` rollouts of each example concurrently; ``summarize`` reduces the
groups to the figures the eval table, the preflight check and the ``eval/*`` metrics show:
mean reward, per-metric means, the share of examples that scored 0 on every attempt, the
share whose mean reward is >= 0.8, the share of groups without reward diversity, and
pass@k when every reward is 0 or 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from math import comb
from typing import TYPE_CHECKING

import numpy as np
from prime_rl.envs import Environment, Example, ModelClient, Rollout

if TYPE_CHECKING:
    from orchestrator.load import EpisodeLimiter

EASY_REWARD = 0.8


async def run_groups(
    env: Environment,
    client: ModelClient,
    examples: Sequence[Example],
    n: int,
    on_group: Callable[[list[Rollout]], None] | None = None,
    limiter: EpisodeLimiter | None = None,
    name: str = "",
) -> list[list[Rollout]]:
    """``n`` rollouts of every example (concurrently; the client caps requests in flight, and
    ``limiter`` the episodes in flight of environment ``name``)."""

    async def one(example: Example) -> list[Rollout]:
        if limiter is None:
            group = await env.rollout_group(client, example, n)
        else:
            async with limiter.episodes(name, n):
                group = await env.rollout_group(client, example, n)
        if on_group is not None:
            on_group(group)
        return group

    async with asyncio.TaskGroup() as tasks:
        futures = [tasks.create_task(one(example)) for example in examples]
    return [f.result() for f in futures]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one example with ``c`` correct out of ``n`` attempts (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def function_figures(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Per rubric function, in name order: `metrics/<function>` (its mean raw value, 0 where a
    rollout has none) and `errors/<function>` (rollouts whose function raised)."""
    row: dict[str, float] = {}
    for name in sorted({name for r in rollouts for name in r.metrics}):
        row[f"metrics/{name}"] = float(np.mean([r.metrics.get(name, 0.0) for r in rollouts]))
    for name in sorted({name for r in rollouts for name in r.errors}):
        row[f"errors/{name}"] = sum(name in r.errors for r in rollouts)
    return row


def summarize(groups: Sequence[Sequence[Rollout]]) -> dict[str, float]:
    """Flat figures over the groups (see the module docstring); keys without a prefix."""
    rewards = [np.array([r.reward for r in group], dtype=np.float64) for group in groups if group]
    if not rewards:
        return {}
    flat = np.concatenate(rewards)
    row: dict[str, float] = {
        "reward/mean": float(flat.mean()),
        "reward/std": float(flat.std()),
        "examples": len(rewards),
        "rollouts": int(flat.size),
        "all_zero_frac": float(np.mean([np.all(g == 0) for g in rewards])),
        "easy_frac": float(np.mean([g.mean() >= EASY_REWARD for g in rewards])),
        "no_diversity_frac": float(np.mean([np.all(g == g[0]) for g in rewards])),
    }
    row.update(function_figures([r for group in groups for r in group]))
    n = min(len(g) for g in rewards)
    if np.isin(flat, (0.0, 1.0)).all() and n > 0:
        for k in sorted({1, *(k for k in (2, 4, 8, 16, 32) if k <= n), n}):
            row[f"pass@{k}"] = float(np.mean([pass_at_k(len(g), int(g.sum()), k) for g in rewards]))
    return row
