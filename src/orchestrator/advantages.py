"""GRPO group advantages: each rollout is judged against the other rollouts of its prompt.

Rewards arrive flat, ``[num_groups * group_size]``, with a group's rollouts adjacent
(the order the orchestrator samples them in). Pure numpy; no knowledge of batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _grouped(rewards: Sequence[float] | np.ndarray, group_size: int) -> np.ndarray:
    flat = np.asarray(rewards, dtype=np.float64)
    if flat.ndim != 1 or group_size < 1 or len(flat) % group_size:
        raise ValueError(f"{len(flat)} rewards do not split into groups of {group_size}")
    return flat.reshape(-1, group_size)  # [num_groups, group_size]


def zero_variance_groups(rewards: Sequence[float] | np.ndarray, group_size: int) -> np.ndarray:
    """bool [num_groups]: groups whose rollouts all got the same reward (they teach nothing)."""
    groups = _grouped(rewards, group_size)
    return np.all(groups == groups[:, :1], axis=1)


def group_advantages(
    rewards: Sequence[float] | np.ndarray,
    group_size: int,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> np.ndarray:
    """float64 [num_groups * group_size]: reward - group mean (optionally / (group std + eps)).

    Groups with identical rewards get exactly 0 (the mean of equal floats can differ
    from them in the last bit, which would leak a tiny non-zero signal).
    """
    groups = _grouped(rewards, group_size)
    advantages = groups - groups.mean(axis=1, keepdims=True)
    if normalize_std:
        advantages = advantages / (groups.std(axis=1, keepdims=True) + eps)  # population std, as in GRPO
    advantages[zero_variance_groups(rewards, group_size)] = 0.0
    return advantages.reshape(-1)


def keep_groups(
    rewards: Sequence[float] | np.ndarray,
    group_size: int,
    drop_equal: bool,
    min_mean: float | None = None,
    max_mean: float | None = None,
) -> np.ndarray:
    """bool [num_groups]: groups online difficulty filtering keeps: not all rewards equal
    (when ``drop_equal``) and a mean reward within [min_mean, max_mean] (bounds optional)."""
    groups = _grouped(rewards, group_size)
    keep = ~zero_variance_groups(rewards, group_size) if drop_equal else np.ones(len(groups), dtype=bool)
    means = groups.mean(axis=1)
    if min_mean is not None:
        keep &= means >= min_mean
    if max_mean is not None:
        keep &= means <= max_mean
    return keep
