"""Optimizer helpers: warm-up and decay values and the clip-then-step guard."""

import pytest
import torch

from prime_rl.config import OptimConfig
from trainer.optim import build_optimizer, clip_and_step, lr_factor, warmup_factor


def test_warmup_is_linear_then_flat():
    assert [warmup_factor(i, 4) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_linear_decay_falls_after_the_warm_up_toward_the_floor():
    # 2 warm-up updates, then 4 decaying ones of a 6-update run to a floor of 0.2:
    # p = 0, 1/4, 2/4, 3/4 -> 1 - 0.8 p
    assert [lr_factor(i, 2, "linear", 6, 0.2) for i in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4])
    assert lr_factor(9, 2, "linear", 6, 0.2) == pytest.approx(0.2)  # past the run's end: the floor
    assert [lr_factor(i, 0, "none", 6, 0.2) for i in range(3)] == [1.0, 1.0, 1.0]


def test_cosine_decay_follows_half_a_cosine():
    # no warm-up, 4 updates, floor 0: p = 0, 1/4, 1/2, 3/4 -> (1 + cos(pi p)) / 2
    expected = [1.0, (1 + 2**-0.5) / 2, 0.5, (1 - 2**-0.5) / 2]
    assert [lr_factor(i, 0, "cosine", 4, 0.0) for i in range(4)] == pytest.approx(expected)
    assert lr_factor(2, 0, "cosine", 4, 0.5) == pytest.approx(0.75)  # halfway between 1 and the floor


def test_the_scheduler_applies_the_decay_and_needs_the_runs_length():
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=0.4, decay="linear"), total_steps=4)
    used = []
    for _ in range(4):
        model(torch.tensor([[3.0, 4.0]])).sum().backward()
        used.append(clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)[1])
    assert used == pytest.approx([0.4, 0.3, 0.2, 0.1])
    with pytest.raises(ValueError, match="optim.decay = 'cosine' needs the run's number of steps"):
        build_optimizer(model, OptimConfig(decay="cosine"))


@pytest.mark.parametrize("bad", [{"decay": "exponential"}, {"min_lr_ratio": 1.5}, {"min_lr_ratio": -0.1}])
def test_a_decay_outside_what_is_offered_is_refused(bad):
    with pytest.raises(ValueError):
        OptimConfig(**bad)


def test_clip_and_step_reports_lr_used_and_skips_non_finite_gradients():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0]]))
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=0.1, warmup_steps=2, max_grad_norm=1.0))

    model(torch.tensor([[3.0, 4.0]])).sum().backward()  # grad [3, 4], norm 5 -> clipped to 1
    grad_norm, lr = clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)
    assert grad_norm == 5.0 and lr == 0.05  # first warm-up step: lr / 2
    assert model.weight.grad is None and optimizer.param_groups[0]["lr"] == 0.1

    before = model.weight.detach().clone()
    model(torch.tensor([[float("inf"), 1.0]])).sum().backward()
    grad_norm, _ = clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)
    assert grad_norm == float("inf")
    torch.testing.assert_close(model.weight.detach(), before)


def test_a_zero_gradient_leaves_the_weights_alone():
    """A batch without signal (all advantages zero) must not move the policy: AdamW would
    otherwise keep stepping along its momentum from the last informative batch."""
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=0.1))
    model(torch.tensor([[3.0, 4.0]])).sum().backward()
    clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)
    before = model.weight.detach().clone()
    (0.0 * model(torch.tensor([[3.0, 4.0]])).sum()).backward()  # a zero gradient, not None
    grad_norm, _ = clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)
    assert grad_norm == 0.0
    torch.testing.assert_close(model.weight.detach(), before)
    # and the weights would have moved with plain AdamW: momentum from the first step
    model.weight.grad = torch.zeros_like(model.weight)
    optimizer.step()
    assert not torch.equal(model.weight.detach(), before)


def test_a_skipped_step_does_not_advance_the_lr_schedule():
    """Warm-up counts applied updates: after a non-finite and a zero-gradient step, the next
    real update uses the lr the skipped ones would have used (here 2/3 of it)."""
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=0.3, warmup_steps=3))
    x = torch.tensor([[3.0, 4.0]])

    model(x).sum().backward()
    assert clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)[1] == pytest.approx(0.1)  # 1/3
    model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    assert clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)[1] == pytest.approx(0.2)  # skipped
    (0.0 * model(x).sum()).backward()
    assert clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)[1] == pytest.approx(0.2)  # skipped
    model(x).sum().backward()
    assert clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)[1] == pytest.approx(0.2)  # the second update
    model(x).sum().backward()
    assert clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)[1] == pytest.approx(0.3)
