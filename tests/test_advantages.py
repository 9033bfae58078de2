"""GRPO group advantages, hand-computed."""

import numpy as np
import pytest

from orchestrator.advantages import group_advantages, keep_groups, zero_variance_groups


def test_reward_minus_group_mean():
    # groups [1, 0] (mean 0.5) and [0.5, 0.5] (mean 0.5)
    assert group_advantages([1.0, 0.0, 0.5, 0.5], group_size=2).tolist() == [0.5, -0.5, 0.0, 0.0]
    # groups [1, 2, 3] (mean 2) and [5, 5, 5]
    assert group_advantages([1, 2, 3, 5, 5, 5], group_size=3).tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_std_normalization():
    # [1, 3]: mean 2, population std 1 -> [-1, 1]; [0, 0, 0, 4]: mean 1, std sqrt(3) -> [-1, -1, -1, 3] / sqrt(3)
    assert group_advantages([1, 3], 2, normalize_std=True, eps=0.0).tolist() == [-1.0, 1.0]
    got = group_advantages([0, 0, 0, 4], 4, normalize_std=True, eps=0.0)
    np.testing.assert_allclose(got, np.array([-1, -1, -1, 3]) / np.sqrt(3))
    # eps keeps it finite and is added to the std
    np.testing.assert_allclose(group_advantages([1, 3], 2, normalize_std=True, eps=1.0), [-0.5, 0.5])


def test_equal_rewards_give_exactly_zero():
    # the mean of three 0.1s is 0.10000000000000002 in float64; the group must still give 0
    assert group_advantages([0.1, 0.1, 0.1], 3).tolist() == [0.0, 0.0, 0.0]
    assert group_advantages([0.1, 0.1, 0.1], 3, normalize_std=True).tolist() == [0.0, 0.0, 0.0]


def test_zero_variance_groups():
    flags = zero_variance_groups([1, 1, 0, 1, 0.5, 0.5], group_size=2)
    assert flags.tolist() == [True, False, True]
    assert flags.mean() == pytest.approx(2 / 3)


def test_group_size_one_has_no_signal():
    assert group_advantages([0.3, 0.9], 1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("group_size", [0, 4])
def test_bad_group_size(group_size):
    with pytest.raises(ValueError, match="groups of"):
        group_advantages([1.0, 2.0, 3.0], group_size)


def test_keep_groups_drops_equal_rewards_and_means_outside_the_band():
    rewards = [0, 0,  1, 0,  1, 1,  0.25, 0.75,  1, 0.5]  # means 0, .5, 1, .5, .75
    assert keep_groups(rewards, 2, drop_equal=True).tolist() == [False, True, False, True, True]
    assert keep_groups(rewards, 2, drop_equal=False, max_mean=0.6).tolist() == [True, True, False, True, False]
    assert keep_groups(rewards, 2, drop_equal=True, min_mean=0.6, max_mean=0.8).tolist() == [False, False, False, False, True]
