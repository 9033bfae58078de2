"""The seeded, resumable example order over one or several environments."""

from orchestrator.data import ExampleOrder


def test_each_epoch_is_a_permutation_and_seeded():
    order = ExampleOrder([10], seed=0)
    first, second = order.next(10), order.next(10)
    assert sorted(first) == sorted(second) == [(0, i) for i in range(10)]
    assert first != second  # a fresh permutation per epoch
    assert ExampleOrder([10], seed=0).next(20) == first + second
    assert ExampleOrder([10], seed=1).next(10) != first


def test_mixing_covers_every_environment_in_proportion():
    picks = ExampleOrder([3, 5], seed=0).next(8)
    assert sorted(picks) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]


def test_resume_from_cursor():
    order = ExampleOrder([7, 4], seed=2)
    order.next(9)
    resumed = ExampleOrder([7, 4], seed=2)
    resumed.load_state_dict(order.state_dict())
    assert resumed.next(15) == order.next(15)
