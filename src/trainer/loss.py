"""Pure loss math: tensors in, tensors out. No model, no config files, no distributed.

Shapes: B samples, T positions. Logprobs are float32 and aligned to the token they
score: ``logprobs[b, t]`` is log pi(token t+1 | tokens <= t), as the trainer's head
(``trainer.head``) computes them at the positions its query names (the first token of a
sequence is never scored).
"""

from __future__ import annotations

import torch

from prime_rl.config import DistillConfig, LossConfig


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[..., ids] in float32 without materialising the log-softmax.

    logits [..., V] (any float dtype), ids [...] int -> [...] float32.
    """
    logits = logits.float()
    chosen = logits.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) per position: [..., V] -> [...] float32."""
    scaled = logits.float() / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    probs = torch.softmax(scaled, dim=-1)
    return log_z - (probs * scaled).sum(-1)


def importance_weights(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, in_band) per token for ``cfg.importance`` (see ``policy_loss``), both [B, T].

    log_ratio [B, T] (clamped, no gradient), loss_mask [B, T] bool."""
    ratio = torch.exp(log_ratio)
    everything = torch.ones_like(loss_mask, dtype=torch.bool)
    if cfg.importance == "none":
        return torch.ones_like(ratio), everything
    if cfg.importance == "truncated":
        return ratio.clamp(max=cfg.truncate_max), everything
    if cfg.importance == "sequence_mask":
        mask_f = loss_mask.float()
        mean_log = (log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)  # [B]
        banded = torch.exp(mean_log)[:, None].expand_as(ratio)  # each sample's geometric mean
    else:  # token_mask
        banded = ratio
    return ratio, (banded >= cfg.mask_ratio_low) & (banded <= cfg.mask_ratio_high)


def policy_loss(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
    num_tokens: int | float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy gradient, corrected by the trainer/inference importance ratio.

    trainer_logprobs [B, T] (carries the gradient), inference_logprobs [B, T],
    advantages [B] (one per sample, broadcast over tokens) or [B, T], loss_mask [B, T]
    bool. ``num_tokens`` is the number of loss-mask tokens of the whole step (all
    micro-batches, all ranks), so summing the micro-batch losses gives the step's token
    mean and their gradients add up to the gradient of that mean.

    ratio = exp(clamp(trainer - inference, -c, c)). Each kept token's loss is
    -w * A, where the weight w (no gradient of its own) depends on ``cfg.importance``, and
    its gradient is -w * A * grad(trainer_logprob):

    - ``token_mask``: w = ratio (REINFORCE weighted by the importance ratio); tokens whose
      ratio leaves [mask_ratio_low, mask_ratio_high] are dropped;
    - ``sequence_mask``: w = ratio; a sample whose geometric-mean ratio over its loss
      tokens, exp(mean log ratio), leaves that band is dropped whole;
    - ``truncated``: w = min(ratio, truncate_max), nothing dropped;
    - ``none``: w = 1, nothing dropped (the gap is ignored).

    The drop decisions carry no gradient. A clamped log-ratio has zero gradient; the
    config keeps the band inside the clamp, so a masking mode drops clamped tokens anyway.

    Returns (loss, stats). Stats are detached 0-d sums and counts so a step can add them
    up across micro-batches and ranks exactly:
      loss_tokens      loss-mask tokens in this micro-batch
      masked_tokens    of those, tokens dropped by the ratio band (token or sample)
      ratio_sum        sum of the (clamped) ratio over loss-mask tokens
      mismatch_kl_sum  sum over loss-mask tokens of the k3 estimator of
                       KL(pi_inference || pi_trainer): ratio - 1 - log ratio (Schulman's k3
                       with samples drawn from pi_inference, r = pi_trainer / pi_inference;
                       >= 0 per token, unbiased), using the clamped log-ratio so it stays finite.
    """
    loss_mask = loss_mask.bool()
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # [B] -> [B, 1], broadcast over tokens
    log_ratio = (trainer_logprobs - inference_logprobs).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)

    with torch.no_grad():  # the gradient flows through log_ratio in per_token only
        ratio = torch.exp(log_ratio)
        weight, in_band = importance_weights(log_ratio.detach(), loss_mask, cfg)
        keep = loss_mask & in_band

    # value -w * A; gradient -w * A * grad(log_ratio) = -w * A * grad(trainer_logprob)
    per_token = -weight * torch.exp(log_ratio - log_ratio.detach()) * advantages
    loss = torch.where(keep, per_token, torch.zeros_like(per_token)).sum() / num_tokens

    with torch.no_grad():
        mask_f = loss_mask.float()
        k3 = ratio - 1.0 - log_ratio
        stats = {
            "loss_tokens": mask_f.sum(),
            "masked_tokens": (loss_mask & ~in_band).float().sum(),
            "ratio_sum": (ratio * mask_f).sum(),
            "mismatch_kl_sum": (k3 * mask_f).sum(),
        }
    return loss, stats


def distill_advantages(
    advantages: torch.Tensor,
    inference_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: DistillConfig,
) -> torch.Tensor:
    """Per-token advantages of on-policy distillation, to hand to ``policy_loss``.

    advantages [B] (each sample's group advantage A), inference_logprobs [B, T] (log p_student
    of the sampled token, as vLLM sampled it), teacher_logprobs [B, T], loss_mask [B, T] bool
    -> [B, T] float32, 0 off the mask:

        reward_weight * A - kl_weight * (log p_student - log p_teacher)

    The token was drawn from the student, so log p_student - log p_teacher is a one-sample
    estimate of the per-token reverse KL(student || teacher); as a negative advantage it
    pushes up the tokens the teacher likes more than the student does. It uses the sampling
    logprobs, not the trainer's, so it carries no gradient and is a fixed reward per token
    (the importance ratio in ``policy_loss`` corrects for the trainer/inference gap as in RL).
    """
    loss_mask = loss_mask.bool()
    per_token = cfg.reward_weight * advantages[:, None] - cfg.kl_weight * (inference_logprobs - teacher_logprobs)
    return torch.where(loss_mask, per_token, torch.zeros_like(per_token)).float().detach()


def top_k_reverse_kl(scoring: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    """Reverse KL(student || teacher) at each of N positions over the teacher's K most likely
    tokens plus one bucket for the rest of the vocabulary: differentiable in the student.

    scoring [N, V]: the student's logits at the positions (already divided by the sampling
    temperature, as the head computes them, ``trainer.head``); top_ids [N, K] int, top_logprobs [N, K]
    (the teacher's logprobs of those tokens) -> [N] float32 >= 0:

        sum_k p_s(k) (log p_s(k) - log p_t(k))  +  p_s(rest) (log p_s(rest) - log p_t(rest))

    with rest = every token outside the K, p(rest) = 1 - sum_k p(k). Merging tokens can only
    lower a KL, so this is a lower bound of the full one, equal to it when the K tokens hold
    all of both distributions' mass (K = the vocabulary). Its gradient is the exact gradient of
    that KL at the position: nothing is sampled.
    """
    student = torch.log_softmax(scoring.float(), dim=-1)  # [N, V]
    student_k = student.gather(-1, top_ids.long())  # [N, K]
    teacher_k = top_logprobs.float()
    kl = (student_k.exp() * (student_k - teacher_k)).sum(-1)
    student_rest = log_rest(student_k)
    teacher_rest = log_rest(teacher_k)
    return kl + student_rest.exp() * (student_rest - teacher_rest)


REST_FLOOR = 1e-12
"""Smallest probability the rest bucket is given, so its log stays finite when the top-k hold it all."""


def log_rest(logprobs_k: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(logprobs_k))) over the last dim, floored at log(REST_FLOOR): [..., K] -> [...]."""
    mass = torch.logsumexp(logprobs_k, dim=-1).exp()
    return torch.log((1.0 - mass).clamp(min=REST_FLOOR))


def reverse_kl_sum(inference_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """0-d float32 sum over loss tokens of log p_student - log p_teacher (all [B, T]): the
    sampled estimate of the reverse KL to the teacher, summed so micro-batches and ranks add
    up exactly; divided by the loss tokens it is ``loss/reverse_kl``."""
    diff = (inference_logprobs - teacher_logprobs).float()
    return torch.where(loss_mask.bool(), diff, torch.zeros_like(diff)).sum().detach()
