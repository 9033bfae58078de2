"""Preflight: before RL trains, is the task within reach of the starting model?

The check reads the first step's groups of a fresh run: every group the step judged
(its batch, and the groups a filter dropped), all sampled by the starting model with the
run's own sampling. It costs no generation of its own and delays nothing: the groups are
the ones step 0 trains on, and the check runs before that batch is sent. Per environment it
reports the mean reward, the share of examples that scored 0 on every attempt (the
documentation's rule of thumb: 0% after 10+ attempts means the task is too hard), the share
at or above 0.8 mean reward (too easy), and the share of groups with no reward diversity
(they give zero advantage: no learning signal), and prints the documentation's advice for
each threshold crossed; ``strict`` makes that an error, raised before step 0 is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prime_rl.config import PreflightConfig
from prime_rl.envs import Rollout

from orchestrator.rollouts import EASY_REWARD, summarize

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


def advice(name: str, summary: dict[str, float], cfg: PreflightConfig, attempts: int) -> list[str]:
    """The documentation's advice for every threshold ``summary`` crosses (``attempts``:
    rollouts per example)."""
    checks = {
        "too_hard": (summary["all_zero_frac"], cfg.too_hard_frac),
        "too_easy": (summary["easy_frac"], cfg.too_easy_frac),
        "no_diversity": (summary["no_diversity_frac"], cfg.no_diversity_frac),
    }
    return [
        ADVICE[key].format(frac=frac, env=name, k=attempts)
        for key, (frac, limit) in checks.items()
        if frac > limit and not (key == "no_diversity" and attempts < 2)
    ]


def preflight(
    groups: Sequence[tuple[str, Sequence[Rollout]]], env_names: Sequence[str], cfg: PreflightConfig,
    log: Callable[[str], None],
) -> dict[str, float]:
    """Check every environment on the first step's groups, ``(environment name, its
    rollouts)`` each; returns a metrics row (`preflight/<env>/...`)."""
    by_env: dict[str, list[Sequence[Rollout]]] = {name: [] for name in env_names}
    for name, rollouts in groups:
        by_env[name].append(rollouts)
    row: dict[str, float] = {}
    warnings: list[str] = []
    for name, env_groups in by_env.items():
        if not env_groups:
            log(f"preflight {name}: no group of it in the first step, not checked")
            continue
        summary, attempts = summarize(env_groups), min(len(g) for g in env_groups)
        log(
            f"preflight {name}: mean reward {summary['reward/mean']:.3f} over the first step's {summary['examples']} "
            f"examples x {attempts}; all attempts 0: {summary['all_zero_frac']:.0%}, mean >= {EASY_REWARD:g}: "
            f"{summary['easy_frac']:.0%}, no reward diversity: {summary['no_diversity_frac']:.0%}"
        )
        for key in ("reward/mean", "examples", "all_zero_frac", "easy_frac", "no_diversity_frac"):
            row[f"preflight/{name}/{key}"] = summary[key]
        for line in advice(name, summary, cfg, attempts):
            log(f"preflight advice: {line}")
            warnings.append(line)
    if warnings and cfg.strict:
        raise PreflightFailed(
            f"preflight (strict): {warnings[0]} Set preflight.strict = false to train anyway, or preflight.enabled = false to skip the check"
        )
    return row
