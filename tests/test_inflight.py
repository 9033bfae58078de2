"""The group pool (orchestrator.inflight): groups in flight across step boundaries
(continuous batching), the per-group async bound, what a resume needs, and the step barrier
as the pool with one step in flight, on environments whose groups complete when the test
says so."""

import asyncio
import random

import pytest
from prime_rl.config import FilterConfig
from prime_rl.envs import Example, Rollout, Turn

from orchestrator.data import ExampleOrder
from orchestrator.inflight import GroupPool

N = 2  # rollouts per example


class GatedEnv:
    """Each example's group completes once the test opens its gate; its rollouts' tokens are
    labelled with the versions the test sets (as the sampler labels them)."""

    def __init__(self, size=100):
        self.dataset = [Example(i, [{"role": "user", "content": str(i)}]) for i in range(size)]
        self.gates: dict[int, asyncio.Event] = {}
        self.started: list[int] = []
        self.cancelled: list[int] = []
        self.rewards: dict[int, list[float]] = {}
        self.versions = (0, 0)
        self.fail_on: set[int] = set()
        self.error = RuntimeError

    def gate(self, example_id):
        return self.gates.setdefault(example_id, asyncio.Event())

    async def rollout_group(self, sampler, example, n):
        self.started.append(example.id)
        try:
            await self.gate(example.id).wait()
        except asyncio.CancelledError:
            self.cancelled.append(example.id)
            raise
        if example.id in self.fail_on:
            raise self.error(f"example {example.id} failed")
        rewards = self.rewards.get(example.id, [float(i) for i in range(n)])
        return [Rollout(example.id, [Turn([1, 2], [3], [-0.5], versions=self.versions)], rewards[i]) for i in range(n)]


class Version:
    def __init__(self):
        self.value = 0

    def __call__(self):
        return self.value


def make_pool(env, version, *, k=2, async_level=1, max_inflight=8, pending=(), logs=None, max_steps=None, one_step=False,
              timeout_s=None, max_off_policy=None):
    order = ExampleOrder([len(env.dataset)], seed=0)
    pool = GroupPool(
        [("env", env)], order, sampler=None, rollouts_per_example=N, groups_per_step=k, async_level=async_level,
        max_inflight=max_inflight, version=version, pending=list(pending),
        log=(logs.append if logs is not None else lambda _: None), max_steps=max_steps, one_step=one_step,
        timeouts=[timeout_s], max_off_policy=max_off_policy,
    )
    return pool, ExampleOrder([len(env.dataset)], seed=0)


def stall(needed):
    return f"no weights/step_{needed}"


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def examples(groups):
    return [group.pick[1] for group in groups]


def test_the_step_is_cut_from_the_groups_that_complete_first():
    """A slow group holds its own slot only: the step's batch is the first two to complete,
    and the slow one goes on in flight into the next step."""

    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version)
        first = reference.next(4)  # version 0, async_level 1: steps 0 and 1 may start: 4 groups
        cutting = asyncio.create_task(pool.cut(0, stall, 5))
        await settle()
        assert env.started == [i for _, i in first]
        env.gate(first[2][1]).set()
        env.gate(first[1][1]).set()
        cut = await cutting
        assert examples(cut.groups) == [first[2][1], first[1][1]] and cut.stale == 0
        assert cut.span_s >= cut.wait_s > 0  # since the pool began: the basis of the step's tokens/s
        assert cut.in_flight == 2 and pool.pending() == [first[0], first[3]]
        await pool.close()
        assert sorted(env.cancelled) == sorted([first[0][1], first[3][1]])

    asyncio.run(go())


def test_the_async_bound_admits_groups_only_for_steps_the_served_version_may_train():
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=2, async_level=1, max_inflight=100)
        picks = reference.next(8)
        cutting = asyncio.create_task(pool.cut(0, stall, 5))
        await settle()
        assert len(env.started) == 4  # steps 0 and 1 with version 0; not step 2
        for _, i in picks[:2]:
            env.gate(i).set()
        await cutting  # step 0 cut: still only steps 0 and 1 (2 in flight) + nothing new
        await settle()
        assert len(env.started) == 4
        version.value = 1  # the trainer's weights after step 0 are loaded: step 2 may start
        pool.notify()
        cutting = asyncio.create_task(pool.cut(1, stall, 5))
        await settle()
        assert env.started == [i for _, i in picks[:6]]
        cutting.cancel()
        await pool.close()

    asyncio.run(go())


def test_a_group_older_than_the_bound_is_dropped_counted_logged_and_never_trained():
    """Groups of version 0 completing when step 3 is cut (version 3 served, as after the
    orchestrator fell behind): too old for async_level 1, so dropped, and a newer one trains."""
    async def go():
        env, version, logs = GatedEnv(), Version(), []
        pool, reference = make_pool(env, version, k=1, async_level=1, max_inflight=3, logs=logs)
        old = reference.next(2)
        pool.fill(0)  # version 0: steps 0 and 1 may start
        await settle()
        version.value = 3
        pool.notify()
        for _, i in old:
            env.gate(i).set()
        cutting = asyncio.create_task(pool.cut(3, stall, 5))
        await settle()
        fresh = [i for i in env.started if i not in [i for _, i in old]]
        env.gate(fresh[0]).set()
        cut = await cutting
        assert cut.stale == 2 and examples(cut.groups) == [fresh[0]] and cut.groups[0].version == 3
        assert sum("policy version 0" in line and "not trained on" in line for line in logs) == 2, logs
        await pool.close()

    asyncio.run(go())


def test_a_step_waits_for_the_groups_that_expire_with_it_rather_than_let_them_go_stale():
    """Step 1 (async_level 1) is the last that a group of version 0 may train: when a newer
    group completes first, the step still takes the old one, and the newer one goes on to
    step 2, which it may train."""
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=1, async_level=1, max_inflight=3)
        picks = reference.next(3)
        cutting = asyncio.create_task(pool.cut(0, stall, 5))
        await settle()
        env.gate(picks[1][1]).set()
        assert examples((await cutting).groups) == [picks[1][1]]  # picks[0] (version 0) still in flight
        version.value = 1
        pool.notify()
        cutting = asyncio.create_task(pool.cut(1, stall, 5))
        await settle()
        assert picks[2][1] in env.started
        env.gate(picks[2][1]).set()  # the newer group (version 1) completes first
        await settle()
        assert not cutting.done()  # the step waits for the group that expires with it
        env.gate(picks[0][1]).set()
        cut = await cutting
        assert examples(cut.groups) == [picks[0][1]] and cut.stale == 0
        version.value = 2
        pool.notify()
        cut = await pool.cut(2, stall, 5)
        assert examples(cut.groups) == [picks[2][1]] and cut.stale == 0
        await pool.close()

    asyncio.run(go())


def test_above_async_level_more_groups_start_than_a_step_needs_and_a_straggler_lands_later():
    """max_off_policy 2 over async_level 1, one group a step, three slots: at version 0 all
    three slots start (the step being cut may train each), step 0 takes the first to
    complete, step 1 does not wait for the version-0 straggler, which trains in step 2,
    two versions behind."""
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=1, async_level=1, max_inflight=3, max_off_policy=2)
        picks = reference.next(5)
        cutting = asyncio.create_task(pool.cut(0, stall, 5))
        await settle()
        assert env.started == [i for _, i in picks[:3]]  # with max_off_policy 1: two (steps 0 and 1)
        env.gate(picks[1][1]).set()
        assert examples((await cutting).groups) == [picks[1][1]]
        await settle()
        assert env.started == [i for _, i in picks[:4]]  # the freed slot: step 1 may train version 0
        version.value = 1
        pool.notify()
        cutting = asyncio.create_task(pool.cut(1, stall, 5))
        await settle()
        env.gate(picks[2][1]).set()
        cut = await cutting  # without waiting for picks[0]
        assert examples(cut.groups) == [picks[2][1]] and picks[0] in pool.pending()
        env.gate(picks[0][1]).set()
        version.value = 2
        pool.notify()
        cut = await pool.cut(2, stall, 5)
        assert examples(cut.groups) == [picks[0][1]] and cut.groups[0].version == 0 and cut.stale == 0
        await pool.close()

    asyncio.run(go())


def test_a_straggler_past_max_off_policy_is_dropped_not_trained():
    async def go():
        env, version, logs = GatedEnv(), Version(), []
        pool, reference = make_pool(env, version, k=1, async_level=1, max_inflight=1, max_off_policy=2, logs=logs)
        old = reference.next(1)[0]
        pool.fill(0)  # one slot: the version-0 group alone
        await settle()
        version.value = 4
        pool.notify()
        env.gate(old[1]).set()
        cutting = asyncio.create_task(pool.cut(3, stall, 5))  # version 0 < 3 - 2
        await settle()
        env.gate(next(i for i in env.started if i != old[1])).set()
        cut = await cutting
        assert cut.stale == 1 and old[1] not in examples(cut.groups)
        assert any("max_off_policy_steps 2 allows >= 1" in line for line in logs), logs
        await pool.close()

    asyncio.run(go())


def test_a_group_spanning_a_reload_carries_both_versions():
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=1, async_level=1, max_inflight=1)
        (pick,) = reference.next(1)
        cutting = asyncio.create_task(pool.cut(0, stall, 5))
        await settle()
        env.versions = (0, 1)  # a reload landed while its requests were in flight
        env.gate(pick[1]).set()
        (group,) = (await cutting).groups
        assert (group.version, group.last_version) == (0, 1)
        await pool.close()

    asyncio.run(go())


def test_a_resumed_pool_restarts_the_pending_examples_first_then_draws_on():
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=2, async_level=0, max_inflight=4)
        picks = reference.next(4)
        cutting = asyncio.create_task(pool.cut(0, stall, 5))
        await settle()
        env.gate(picks[1][1]).set()
        env.gate(picks[0][1]).set()
        await cutting
        pending, state = pool.pending(), pool.order.state_dict()
        await pool.close()
        assert pending == []  # async_level 0: nothing for step 1 starts before version 1

        version.value = 1
        pool.notify()
        pool2_env = GatedEnv()
        pool2, _ = make_pool(pool2_env, version, k=2, async_level=1, max_inflight=3, pending=[picks[0]])
        pool2.order.load_state_dict(state)
        cutting = asyncio.create_task(pool2.cut(1, stall, 5))
        await settle()
        assert pool2_env.started == [picks[0][1], picks[2][1], picks[3][1]]
        cutting.cancel()
        await pool2.close()

    asyncio.run(go())


def test_nothing_in_flight_and_an_old_policy_waits_for_weights_then_times_out_naming_them():
    async def go():
        env, version = GatedEnv(), Version()
        pool, _ = make_pool(env, version, k=1, async_level=0)
        with pytest.raises(TimeoutError, match="no weights/step_3"):
            await pool.cut(3, stall, 0.2)
        assert env.started == []
        await pool.close()

    asyncio.run(go())


def test_a_group_failing_on_what_every_group_needs_fails_the_cut_and_close_stops_the_rest():
    """Inference (or the worker, or the chat template) failing is the run's failure, at once."""
    from orchestrator.client import InferenceError

    async def go():
        env, version = GatedEnv(), Version()
        env.error = InferenceError
        pool, reference = make_pool(env, version, k=2, async_level=0, max_inflight=2)
        picks = reference.next(2)
        env.fail_on = {picks[0][1]}
        cutting = asyncio.create_task(pool.cut(0, stall, 5))
        await settle()
        env.gate(picks[0][1]).set()
        with pytest.raises(RuntimeError, match=f"example {picks[0][1]} failed"):
            await cutting
        await pool.close()
        assert env.cancelled == [picks[1][1]]

    asyncio.run(go())


def test_a_group_whose_episodes_raise_or_hang_is_dropped_counted_said_once_and_replaced():
    async def go():
        env, version, logs = GatedEnv(), Version(), []
        pool, reference = make_pool(env, version, k=2, async_level=0, max_inflight=4, logs=logs, timeout_s=0.3)
        picks = [i for _, i in reference.next(6)]
        env.fail_on = {picks[0], picks[1]}  # two raise; picks[2] hangs (its gate never opens)
        for i in (picks[0], picks[1], picks[3], picks[4]):
            env.gate(i).set()
        cut = await pool.cut(0, stall, 5)
        failures = pool.take_failures()
        await pool.close()
        return picks, cut, failures, logs, env

    picks, cut, failures, logs, env = asyncio.run(go())
    assert examples(cut.groups) == [picks[3], picks[4]]  # the failed groups' slots went to the next examples
    assert failures == {"errors/env/episode_error": 2 * N, "errors/env/episode_timeout": N}
    assert picks[2] in env.cancelled  # the hung group was cut off
    said = [line for line in logs if "a group was dropped" in line]
    assert len(said) == 2, logs  # once per kind
    assert any("its episodes raised RuntimeError: example" in line and "test_inflight.py:" in line for line in said)
    assert any("ran past episode_timeout_s = 0.3 s" in line for line in said)


def test_groups_failing_one_after_another_stop_the_run_with_the_last_error():
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=2, async_level=0, max_inflight=2)
        env.fail_on = set(range(100))
        for i in range(100):
            env.gate(i).set()
        with pytest.raises(RuntimeError, match=r"environment 'env': 5 groups in a row failed; the last: its episodes "
                                               r"raised RuntimeError: example \d+ failed"):
            await pool.cut(0, stall, 5)
        await pool.close()

    asyncio.run(go())


def test_the_filter_drops_groups_without_signal_up_to_its_cap():
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=1, async_level=0, max_inflight=1)
        picks = reference.next(3)
        for _, i in picks[:2]:
            env.rewards[i] = [1.0, 1.0]  # equal rewards: nothing to learn
        for _, i in picks:
            env.gate(i).set()
        f = FilterConfig(enabled=True, max_extra_examples=1)
        cut = await pool.cut(0, stall, 5, f)
        assert examples(cut.groups) == [picks[1][1]]  # the first dropped, the second kept at the cap
        assert examples(cut.judged) == [picks[0][1], picks[1][1]]  # what the preflight reads at step 0
        assert cut.filter_row["filter/extra_rollouts"] == N and cut.filter_row["filter/topped_up"] == 1
        assert cut.filter_row["filter/dropped_frac"] == 1.0  # both rejected, the topped-up one too
        await pool.close()

    asyncio.run(go())


def test_no_group_starts_for_a_step_past_the_last():
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=2, async_level=1, max_inflight=8, max_steps=1)
        pool.fill(0)  # version 0 may sample steps 0 and 1, but the run has step 0 only
        await settle()
        assert env.started == [i for _, i in reference.next(2)]
        await pool.close()

    asyncio.run(go())


# --------------------------------------------------------------------------- one step in flight (the step barrier)


def test_one_step_in_flight_starts_only_the_steps_groups_and_takes_them_in_start_order():
    """Version 0 and async_level 1 would admit steps 0 and 1; with one step in flight only
    step 0's two groups start (nothing before the cut: the policy is synced there), the batch
    is in start order though the second finished first, and nothing starts for step 1."""
    async def go():
        env, version = GatedEnv(), Version()
        pool, reference = make_pool(env, version, k=2, async_level=1, max_inflight=8, one_step=True)
        picks = reference.next(2)
        pool.fill(0)
        await settle()
        assert env.started == []
        cutting = asyncio.create_task(pool.cut(0, stall, 5))
        await settle()
        assert env.started == [i for _, i in picks]
        env.gate(picks[1][1]).set()
        await settle()
        assert not cutting.done()  # the first started still runs: the step waits for it
        env.gate(picks[0][1]).set()
        cut = await cutting
        assert examples(cut.groups) == [i for _, i in picks] and cut.in_flight == 0 and pool.pending() == []
        assert cut.span_s == cut.wait_s  # nothing generates between cuts: the rate's basis is the cut
        await settle()
        assert len(env.started) == 2
        await pool.close()

    asyncio.run(go())


def barrier_step(patterns, k, **filter_args):
    """One step on the one-step pool (the step barrier) over groups whose rewards are
    ``patterns[example]``, every group complete at once: (examples sampled, the batch's
    examples, the filter row)."""
    async def go():
        env = GatedEnv(size=len(patterns))
        for i, rewards in enumerate(patterns):
            env.rewards[i] = rewards
            env.gate(i).set()
        pool, _ = make_pool(env, Version(), k=k, async_level=0, one_step=True)
        cut = await pool.cut(0, stall, 5, FilterConfig(enabled=True, **filter_args))
        await pool.close()
        return env.started, examples(cut.groups), cut.filter_row

    return asyncio.run(go())


def test_filtering_replaces_groups_without_signal_until_the_batch_is_full():
    """(Was tests/test_orchestrator_main.py's, on the barrier's own sampling loop.)"""
    patterns = [[0, 0], [1, 0], [1, 1], [0, 1], [0, 0], [1, 1], [1, 0], [0, 0]]  # 3 of 8 informative
    sampled, batch, row = barrier_step(patterns, k=2)
    assert len(batch) == 2 and all(patterns[i][0] != patterns[i][1] for i in batch)
    # every example was sampled; the ones beyond the first 2 are the extra examples
    informative = [patterns[i][0] != patterns[i][1] for i in sampled]
    assert sum(informative) == 2 and informative[-1]  # it stopped at the second informative group
    assert row["filter/extra_rollouts"] == 2 * (len(sampled) - 2)
    assert row["filter/dropped_frac"] == pytest.approx((len(sampled) - 2) / len(sampled))
    assert row["filter/topped_up"] == 0


def test_filtering_stops_at_its_cap_and_fills_the_batch_with_dropped_groups():
    """(Was tests/test_orchestrator_main.py's, on the barrier's own sampling loop.)"""
    patterns = [[0, 0], [1, 1], [0, 0], [1, 1], [1, 0]]
    sampled, batch, row = barrier_step(patterns, k=2, max_extra_examples=1)
    assert len(sampled) == 3 and row["filter/extra_rollouts"] == 2
    kept = [i for i in batch if patterns[i][0] != patterns[i][1]]
    assert len(batch) == 2 and row["filter/topped_up"] == 2 - len(kept)
    assert row["filter/sampled_reward_mean"] == pytest.approx(sum(sum(patterns[i]) for i in sampled) / 6)


def test_without_filtering_the_step_is_the_next_k_examples():
    """(Was tests/test_orchestrator_main.py's, on the barrier's own sampling loop.)"""
    async def go():
        env = GatedEnv(size=3)
        for i in range(3):
            env.gate(i).set()
        pool, reference = make_pool(env, Version(), k=2, async_level=0, one_step=True)
        cut = await pool.cut(0, stall, 5)
        await pool.close()
        return env.started, examples(cut.groups), cut.filter_row, reference.next(2)

    sampled, batch, row, first = asyncio.run(go())
    assert sampled == batch == [i for _, i in first] and row == {}


def old_barrier(verdicts, k, cap):
    """The step barrier as it sampled before it was the one-step pool: rounds of examples in
    the seeded order, all of a round at once; each round replaces the groups the filter
    rejected, up to ``cap`` extra examples; a batch still short takes the first dropped.
    ``verdicts[j]``: whether the filter keeps the order's j-th example. Returns (examples
    sampled, the batch's order positions)."""
    kept, dropped, sampled, extra = [], [], k, 0
    judged = 0
    while True:
        for j in range(judged, sampled):
            (kept if verdicts[j] else dropped).append(j)
        judged = sampled
        more = min(k - len(kept), cap - extra)
        if more <= 0:
            return sampled, kept[:k] + dropped[: max(0, k - len(kept))]
        sampled, extra = sampled + more, extra + more


def test_the_one_step_pool_samples_the_examples_the_old_barrier_did_and_trains_the_same_batch():
    """Random reward patterns: the same examples sampled, the same batch in the same order
    whenever the cap does not bind; when it binds, the same informative groups and as many
    topped-up ones (the filter now tops up with the last rejected, as the continuous pool
    always did, where the barrier took the first)."""
    rng = random.Random(0)
    binding = 0
    for _ in range(150):
        size, k, cap = 40, rng.randint(1, 4), rng.randint(0, 5)
        patterns = [[rng.choice([0.0, 1.0]) for _ in range(N)] for _ in range(size)]
        sampled, batch, row = barrier_step(patterns, k=k, max_extra_examples=cap)
        order = [i for _, i in ExampleOrder([size], seed=0).next(size)]
        count, positions = old_barrier([patterns[i][0] != patterns[i][1] for i in order], k, cap)
        assert sampled == order[:count]
        expected = [order[j] for j in positions]
        if row["filter/topped_up"] == 0:
            assert batch == expected
        else:
            binding += 1
            informative = [i for i in batch if patterns[i][0] != patterns[i][1]]
            assert informative == [i for i in expected if patterns[i][0] != patterns[i][1]] and len(batch) == k
    assert 10 < binding < 140  # both cases were exercised
