"""Preflight: before RL, is the task within reach of the starting model?

A few rollouts per example on a seeded sample of each environment's training examples,
with the starting model. It reports the mean reward, the share of examples that scored 0
on every attempt (the documentation's rule of thumb: 0% after 10+ attempts means the task
is too hard), the share at or above 0.8 mean reward (too easy), and the share of groups
with no reward diversity (they give zero advantage: no learning signal), and prints the
documentation's advice for each threshold crossed; ``strict`` makes that an error.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from prime_rl.config import PreflightConfig
from prime_rl.envs import Environment, ModelClient

from orchestrator.rollouts import EASY_REWARD, run_groups, summarize

ADVICE = {
    "too_hard": (
        "{frac:.0%} of {env}'s examples scored 0 on all {k} attempts: the task is too hard for this model "
        "(0% after 10+ attempts gives no learning signal). Start from a stronger or instruction-tuned model, "
        "warm it up with SFT, or make the task easier through the environment's args."
    ),
    "too_easy": (
        "{frac:.0%} of {env}'s examples already have a mean reward of " + f"{EASY_REWARD:g}" + " or more: the task is "
        "too easy, little is left to learn. Use harder examples (environment args) or a smaller model."
    ),
    "no_diversity": (
        "{frac:.0%} of {env}'s groups got the same reward on all {k} attempts, which gives zero advantage. "
        "Raise rollouts_per_example or the temperature, or use a reward with partial credit."
    ),
}


class PreflightFailed(RuntimeError):
    """``preflight.strict`` and a threshold was crossed."""


def preflight_examples(env: Environment, n: int, seed: int) -> list:
    order = np.random.default_rng([seed, 7]).permutation(len(env.dataset))[:n]
    return [env.dataset[int(i)] for i in order]


def advice(name: str, summary: dict[str, float], cfg: PreflightConfig) -> list[str]:
    """The documentation's advice for every threshold ``summary`` crosses."""
    checks = {
        "too_hard": (summary["all_zero_frac"], cfg.too_hard_frac),
        "too_easy": (summary["easy_frac"], cfg.too_easy_frac),
        "no_diversity": (summary["no_diversity_frac"], cfg.no_diversity_frac),
    }
    return [
        ADVICE[key].format(frac=frac, env=name, k=cfg.rollouts_per_example)
        for key, (frac, limit) in checks.items()
        if frac > limit and not (key == "no_diversity" and cfg.rollouts_per_example < 2)
    ]


async def preflight(
    envs: dict[str, Environment], client: ModelClient, cfg: PreflightConfig, seed: int, log: Callable[[str], None]
) -> dict[str, float]:
    """Run the check on every environment; returns a metrics row (`preflight/<env>/...`)."""
    row: dict[str, float] = {}
    warnings: list[str] = []
    for name, env in envs.items():
        groups = await run_groups(env, client, preflight_examples(env, cfg.num_examples, seed), cfg.rollouts_per_example)
        summary = summarize(groups)
        log(
            f"preflight {name}: mean reward {summary['reward/mean']:.3f} over {summary['examples']} examples x "
            f"{cfg.rollouts_per_example}; all attempts 0: {summary['all_zero_frac']:.0%}, mean >= {EASY_REWARD:g}: "
            f"{summary['easy_frac']:.0%}, no reward diversity: {summary['no_diversity_frac']:.0%}"
        )
        for key in ("reward/mean", "all_zero_frac", "easy_frac", "no_diversity_frac"):
            row[f"preflight/{name}/{key}"] = summary[key]
        for line in advice(name, summary, cfg):
            log(f"preflight advice: {line}")
            warnings.append(line)
    if warnings and cfg.strict:
        raise PreflightFailed(
            f"preflight (strict): {warnings[0]} Set preflight.strict = false to train anyway, or preflight.enabled = false to skip the check"
        )
    return row
