"""The seeded, resumable example order over one or several environments."""

from orchestrator.data import ExampleOrder


def test_each_epoch_is_a_permutation_and_seeded():
    order = ExampleOrder([10], seed=0)
    first, second = order.next(10), order.next(10)
    assert sorted(first) == sorted(second) == [(0, i) for i in range(10)]
    assert first != second  # a fresh permutation per epoch
    assert ExampleOrder([10], seed=0).next(20) == first + second
    assert ExampleOrder([10], seed=1).next(10) != first


def test_weights_set_each_environments_share_of_every_batch():
    order = ExampleOrder([3, 50], seed=0, weights=[3, 1])
    for _ in range(10):  # 8 examples per step at 3:1 -> exactly 6 and 2, every step
        envs = [env for env, _ in order.next(8)]
        assert (envs.count(0), envs.count(1)) == (6, 2)
    # a small dataset simply cycles through its epochs: 60 picks of the 3 examples
    assert order.counts == [60, 20]


def test_uneven_weights_stay_within_one_of_the_exact_share():
    order = ExampleOrder([5, 5, 5], seed=0, weights=[0.5, 0.3, 0.2])
    seen = [0, 0, 0]
    for t in range(1, 101):
        (env, _), = order.next(1)
        seen[env] += 1
        assert all(abs(seen[e] - share * t) < 1 for e, share in enumerate((0.5, 0.3, 0.2))), (t, seen)


def test_default_weights_are_equal():
    envs = [env for env, _ in ExampleOrder([3, 5], seed=0).next(8)]
    assert envs.count(0) == envs.count(1) == 4


def test_resume_from_cursor():
    order = ExampleOrder([7, 4], seed=2)
    order.next(9)
    resumed = ExampleOrder([7, 4], seed=2)
    resumed.load_state_dict(order.state_dict())
    assert resumed.next(15) == order.next(15)
