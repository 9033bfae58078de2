"""AdamW with linear warm-up, and the clip-then-step that ends every optimizer step.

Shared by RL (``trainer.rl``) and SFT (``trainer.sft``) so the two cannot drift.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prime_rl.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over trainable parameters; lr ramps linearly over ``warmup_steps`` then stays."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_factor(s, cfg.warmup_steps))
    return optimizer, scheduler


def warmup_factor(step_index: int, warmup_steps: int) -> float:
    """Multiplier of the lr for 0-based optimizer step ``step_index``: 1/W, 2/W, ..., 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step_index + 1) / warmup_steps)


def clip_and_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
) -> tuple[float, float]:
    """Clip the global grad norm, step, zero grads, advance the lr; returns (grad_norm, lr used).

    A non-finite gradient norm skips the update (the weights stay as they were) instead
    of writing NaNs into the policy that inference will load next. So does a zero one: an
    RL batch whose groups all got equal rewards has zero advantages and carries no signal,
    but AdamW would still move the weights along its momentum from earlier steps (and
    decay them). Measured on wiki-search (sparse reward): two informative steps in 30, yet
    the policy drifted every step until its tool-call rate fell from 0.97 to 0.

    The lr schedule counts applied updates: a skipped step leaves it where it was, so the
    warm-up spans ``warmup_steps`` real updates however many batches carried no signal (and
    the next update uses the lr this one would have used).
    """
    lr = optimizer.param_groups[0]["lr"]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor, already reduced over ranks
        norm = norm.full_tensor()
    grad_norm = float(norm)
    if math.isfinite(grad_norm) and grad_norm > 0:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr
