"""Optimizer helpers: linear warm-up values and the clip-then-step guard."""

import torch

from prime_rl.config import OptimConfig
from trainer.optim import build_optimizer, clip_and_step, warmup_factor


def test_warmup_is_linear_then_flat():
    assert [warmup_factor(i, 4) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


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
