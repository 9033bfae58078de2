"""The online difficulty filter (orchestrator.filtering): verdicts and `filter/*` counts by hand."""

import pytest
from prime_rl.config import FilterConfig

from orchestrator.filtering import StepFilter


def verdicts(groups, group_size=2, **config):
    judge = StepFilter(FilterConfig(enabled=True, **config), group_size)
    return [judge.takes(rewards) for rewards in groups], judge.row()


def test_a_disabled_filter_takes_every_group_and_logs_nothing():
    for config in (None, FilterConfig(enabled=False)):
        judge = StepFilter(config, 2)
        assert [judge.takes(g) for g in ([1.0, 1.0], [0.0, 0.0], [0.0, 1.0])] == [True, True, True]
        assert judge.row() == {}


def test_groups_with_all_equal_rewards_are_rejected_unless_told_otherwise():
    taken, _ = verdicts([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    assert taken == [False, False, True]
    taken, _ = verdicts([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]], drop_equal_rewards=False)
    assert taken == [True, True, True]
    taken, _ = verdicts([[0.5, 0.5, 0.5], [0.5, 0.5, 0.6]], group_size=3)
    assert taken == [False, True]


def test_the_mean_reward_band_rejects_too_hard_and_too_easy_groups():
    # means 0.25, 0.5, 0.75, 0.3 (its bound, kept), 0.7 (its bound, kept)
    groups = [[0.0, 0.5], [0.0, 1.0], [0.5, 1.0], [0.2, 0.4], [0.6, 0.8]]
    taken, _ = verdicts(groups, min_mean_reward=0.3, max_mean_reward=0.7)
    assert taken == [False, True, False, True, True]


def test_past_the_cap_rejected_groups_are_topped_up_and_every_metric_counts_by_hand():
    # cap 2: the first two rejected groups are dropped (an extra example each), the third is
    # topped up; kept ones pass throughout
    groups = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]
    taken, row = verdicts(groups, max_extra_examples=2)
    assert taken == [False, True, False, True, True]
    assert row == {
        "filter/dropped_frac": pytest.approx(3 / 5),  # 3 rejected of 5 judged, the topped-up one included
        "filter/extra_rollouts": 2 * 2,  # 2 groups left out, 2 rollouts each
        "filter/topped_up": 1,
        "filter/sampled_reward_mean": pytest.approx(4 / 10),  # every reward of the 5 judged groups
    }


def test_a_cap_of_zero_tops_up_every_rejected_group_and_still_counts_it_rejected():
    taken, row = verdicts([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]], max_extra_examples=0)
    assert taken == [True, True, True]
    assert row["filter/dropped_frac"] == pytest.approx(2 / 3)
    assert (row["filter/extra_rollouts"], row["filter/topped_up"]) == (0, 2)
