"""AdamW with linear warm-up and an optional decay, and the clip-then-step that ends every
optimizer step.

Shared by RL (``trainer.rl``) and SFT (``trainer.sft``) so the two cannot drift.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prime_rl.config import OptimConfig


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, total_steps: int | None = None
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over trainable parameters; lr ramps linearly over ``warmup_steps``, then stays or
    (``cfg.decay``) falls over the rest of ``total_steps`` updates (``lr_factor``)."""
    if cfg.decay != "none" and total_steps is None:
        raise ValueError(f"optim.decay = {cfg.decay!r} needs the run's number of steps")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.decay, total_steps or 0, cfg.min_lr_ratio)
    )
    return optimizer, scheduler


def warmup_factor(step_index: int, warmup_steps: int) -> float:
    """Multiplier of the lr for 0-based optimizer step ``step_index``: 1/W, 2/W, ..., 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step_index + 1) / warmup_steps)


def lr_factor(step_index: int, warmup_steps: int, decay: str, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the lr for 0-based update ``step_index``: the warm-up's, then with a
    decay 1 at the first update after it, falling toward ``min_ratio`` by the fraction
    p = (step_index - W) / (total_steps - W) of the decay done (as transformers' schedules
    count it, so the last update's lr is not yet the floor): ``linear`` 1 - (1 - m) p,
    ``cosine`` m + (1 - m) (1 + cos(pi p)) / 2."""
    factor = warmup_factor(step_index, warmup_steps)
    if decay == "none" or step_index < warmup_steps:
        return factor
    done = min(1.0, (step_index - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "linear":
        return 1.0 - (1.0 - min_ratio) * done
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))


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
