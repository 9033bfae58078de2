"""Online difficulty filtering of one step's groups, and its four `filter/*` metrics.

Both batching schedules cut a step from the group pool (``orchestrator.inflight``), which
asks a ``StepFilter`` about each group as the step takes it. A group whose rewards teach
nothing (``keep_groups``: all equal, or a mean outside the configured band) is rejected;
the pool then starts another example in its place, at most ``max_extra_examples`` times
per step. Past that cap a rejected group is taken anyway ("topped up"), so every step
trains on ``batch_size`` rollouts. The filter does not know about the pool, versions or
time: it sees rewards, in the order the step judges its groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from prime_rl.config import FilterConfig

from orchestrator.advantages import keep_groups


@dataclass
class StepFilter:
    """One step's verdicts; a new one per step. A disabled config takes every group and
    logs nothing."""

    config: FilterConfig | None
    group_size: int

    judged: int = 0
    """Groups the step judged: the ones in its batch and the ones it dropped."""

    rejected: int = 0
    """Groups ``keep_groups`` rejects, the topped-up ones included."""

    topped_up: int = 0
    """Rejected groups taken anyway because the cap on extra examples was reached."""

    rewards: list[float] = field(default_factory=list)
    """Every reward of every judged group, in judging order."""

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.enabled

    def takes(self, rewards: Sequence[float]) -> bool:
        """Whether the step's batch takes the group with these rewards (one per rollout);
        False = it is dropped and an extra example replaces it."""
        if not self.enabled:
            return True
        f = self.config
        self.judged += 1
        self.rewards += rewards
        if keep_groups(rewards, self.group_size, f.drop_equal_rewards, f.min_mean_reward, f.max_mean_reward)[0]:
            return True
        drop = self.dropped < f.max_extra_examples  # an extra example may still replace it
        self.rejected += 1
        self.topped_up += not drop
        return not drop

    @property
    def dropped(self) -> int:
        """Groups left out of the batch: one extra example was sampled for each."""
        return self.rejected - self.topped_up

    def row(self) -> dict[str, float | int]:
        """The step's `filter/*` metrics; empty when filtering is off.

        `filter/dropped_frac` is the share of judged groups the filter rejects, counting the
        topped-up ones: that is the rate at which the task stops teaching, comparable from
        step to step whether the cap binds or not. Counting only the groups left out would
        saturate at max_extra_examples / (groups per step + max_extra_examples) exactly when
        the rate climbs, and would repeat what `filter/extra_rollouts` (those groups'
        rollouts) and `filter/topped_up` already say."""
        if not self.enabled:
            return {}
        return {
            "filter/dropped_frac": self.rejected / self.judged,
            "filter/extra_rollouts": self.dropped * self.group_size,
            "filter/topped_up": self.topped_up,
            "filter/sampled_reward_mean": float(np.mean(self.rewards)),
        }
