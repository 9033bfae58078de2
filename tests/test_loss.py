"""Loss math on CPU with hand-computed expected values (trainer/loss.py)."""

import math

import pytest
import torch

from prime_rl.config import LossConfig
from trainer.loss import entropy_from_logits, policy_loss, selective_log_softmax

# Band [0.5, 2] and clamp 1.5 so one small example hits every case.
CFG = LossConfig(mask_ratio_low=0.5, mask_ratio_high=2.0, log_ratio_clamp=1.5)

# 2 samples x 3 tokens. Raw log-ratios trainer - inference:
#   sample 0: [0.0, 0.2, 0.9]   -> ratios 1, e^0.2 = 1.2214028 (in band), e^0.9 = 2.4596031 (> 2: masked)
#   sample 1: [-0.9, 5.0, 48.0] -> e^-0.9 = 0.4065697 (< 0.5: masked), [1] is outside the
#             loss mask, 48 is clamped to 1.5 -> e^1.5 = 4.4816891 (> 2: masked, and finite)
TRAINER = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]]
INFERENCE = [[-1.0, -2.2, -1.4], [-0.6, -5.3, -50.0]]
LOSS_MASK = [[1, 1, 1], [1, 0, 1]]
ADV = [2.0, -1.0]
NUM_TOKENS = 5  # loss-mask tokens


def _run(trainer=TRAINER, inference=INFERENCE, mask=LOSS_MASK, adv=ADV, num_tokens=NUM_TOKENS, cfg=CFG):
    lp = torch.tensor(trainer, requires_grad=True)
    mask = torch.tensor(mask).bool()
    loss, stats = policy_loss(lp, torch.tensor(inference), torch.tensor(adv), mask, cfg, num_tokens)
    loss.backward()
    return loss, stats, lp.grad


def test_policy_loss_hand_computed():
    loss, stats, _ = _run()
    # Kept: sample 0 tokens 0 and 1 (adv 2): -(1 * 2) - (1.2214028 * 2) = -4.4428055, / 5 tokens.
    assert loss.item() == pytest.approx(-4.4428055 / 5, abs=1e-6)
    assert stats["loss_tokens"].item() == 5
    assert stats["masked_tokens"].item() == 3  # 2.46 (high), 0.41 (low), clamped 4.48 (high); not the unmasked-out 5.0
    # Clamped ratios: 1 + 1.2214028 + 2.4596031 + 0.4065697 + 4.4816891
    assert stats["ratio_sum"].item() == pytest.approx(9.5692647, abs=1e-5)
    # k3 = r - 1 - log r per loss token: 0 + 0.0214028 + 0.5596031 + 0.3065697 + 1.9816891
    assert stats["mismatch_kl_sum"].item() == pytest.approx(2.8692647, abs=1e-5)


def test_policy_loss_gradient_is_minus_ratio_times_advantage_on_kept_tokens():
    _, _, grad = _run()
    expected = torch.tensor([[-1.0 * 2 / 5, -1.2214028 * 2 / 5, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_policy_loss_on_policy_is_minus_mean_advantage_with_zero_kl():
    same = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]]
    loss, stats, grad = _run(trainer=same, inference=same, mask=[[1, 1, 1], [1, 1, 1]], num_tokens=6)
    assert loss.item() == pytest.approx(-(3 * 2.0 + 3 * -1.0) / 6)
    assert stats["mismatch_kl_sum"].item() == 0.0
    assert stats["masked_tokens"].item() == 0
    torch.testing.assert_close(grad, torch.tensor([[-2 / 6] * 3, [1 / 6] * 3]))


def test_per_token_advantages_match_broadcast_ones():
    loss_b, _, grad_b = _run()
    loss_t, _, grad_t = _run(adv=[[2.0] * 3, [-1.0] * 3])
    assert loss_b.item() == loss_t.item()
    torch.testing.assert_close(grad_b, grad_t)


def test_micro_batches_add_up_to_the_step_mean():
    """Each micro-batch divides by the step's token count, so their sum is the step loss."""
    full_loss, _, full_grad = _run()
    parts = [
        _run(trainer=[TRAINER[i]], inference=[INFERENCE[i]], mask=[LOSS_MASK[i]], adv=[ADV[i]]) for i in range(2)
    ]
    assert sum(p[0].item() for p in parts) == pytest.approx(full_loss.item())
    torch.testing.assert_close(torch.cat([p[2] for p in parts]), full_grad)


def test_huge_log_ratio_stays_finite():
    loss, stats, grad = _run(
        trainer=[[0.0]], inference=[[-1000.0]], mask=[[1]], adv=[1.0], num_tokens=1, cfg=LossConfig()
    )
    assert torch.isfinite(loss) and torch.isfinite(stats["mismatch_kl_sum"]) and torch.isfinite(grad).all()
    assert stats["masked_tokens"].item() == 1 and loss.item() == 0.0


def test_selective_log_softmax_hand_computed():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, 1.0, 1.5, 2.0]])
    out = selective_log_softmax(logits, torch.tensor([2, 3]))
    # uniform over 4: -log 4; second row: 2 - logsumexp = -log(1 + e^-0.5 + e^-1 + e^-1.5) = -0.7873387
    torch.testing.assert_close(out, torch.tensor([-math.log(4), -0.7873387]))


def test_the_head_divides_by_the_temperature_and_normalises_in_float32():
    from trainer.head import HeadQuery, score_tokens

    # an identity output layer: the hidden states are the logits. Position 0 scores token 3,
    # position 1 token 0 (the query names them; trainer.data builds it from the shift).
    hidden = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    out = score_tokens(hidden, torch.eye(4), HeadQuery(torch.arange(2), torch.tensor([3, 0]), temperature=2.0))
    assert out["logprobs"].dtype == torch.float32
    # logits / 2 = [0.5, 1, 1.5, 2]: token 3 -> -0.7873387; second row uniform -> -log 4
    torch.testing.assert_close(out["logprobs"], torch.tensor([-0.7873387, -math.log(4)]))
    torch.testing.assert_close(out["entropy"][1], torch.tensor(math.log(4)))


def test_the_heads_logprobs_of_bf16_logits_match_a_manual_log_softmax():
    from trainer.head import HeadQuery, score_tokens

    torch.manual_seed(0)
    hidden, weight = torch.randn(9, 5).to(torch.bfloat16), torch.randn(7, 5).to(torch.bfloat16)
    ids = torch.randint(0, 7, (9,))
    out = score_tokens(hidden, weight, HeadQuery(torch.arange(9), ids, temperature=0.7))["logprobs"]
    manual = torch.log_softmax((hidden @ weight.t()).float() / 0.7, dim=-1).gather(-1, ids[:, None]).squeeze(-1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, manual)


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(4), 0.0]))


# The same 2 x 3 example under the other importance modes (band [0.5, 2], clamp 1.5, cap 2).
def test_sequence_mask_keeps_or_drops_whole_samples_by_their_geometric_mean_ratio():
    cfg = CFG.model_copy(update={"importance": "sequence_mask"})
    loss, stats, grad = _run(cfg=cfg)
    # sample 0: mean log ratio (0 + 0.2 + 0.9) / 3 = 0.3667 -> 1.4429, in band: all 3 tokens kept,
    #           2.46 included (the token mask drops it). -(1 + 1.2214028 + 2.4596031) * 2
    # sample 1: loss tokens 0 and 2: (-0.9 + 1.5) / 2 = 0.3 -> 1.3499, in band: both kept.
    #           -(0.4065697 + 4.4816891) * -1
    assert loss.item() == pytest.approx((-9.3620118 + 4.8882588) / 5, abs=1e-6)
    assert stats["masked_tokens"].item() == 0
    # gradient -w * A / 5 with w = ratio; the clamped token has none
    expected = torch.tensor([[-1.0 * 2 / 5, -1.2214028 * 2 / 5, -2.4596031 * 2 / 5], [0.4065697 / 5, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_sequence_mask_drops_a_sample_whose_mean_leaves_the_band():
    cfg = CFG.model_copy(update={"importance": "sequence_mask"})
    # log ratios [0.6, 0.9, 0.9]: mean 0.8 -> 2.2255 > 2, dropped whole, although e^0.6 = 1.82 is in band
    loss, stats, grad = _run(trainer=[[0.0] * 3], inference=[[-0.6, -0.9, -0.9]], mask=[[1, 1, 1]], adv=[1.0],
                             num_tokens=3, cfg=cfg)
    assert loss.item() == 0.0 and stats["masked_tokens"].item() == 3
    assert torch.count_nonzero(grad) == 0
    token_loss, token_stats, _ = _run(trainer=[[0.0] * 3], inference=[[-0.6, -0.9, -0.9]], mask=[[1, 1, 1]],
                                      adv=[1.0], num_tokens=3)
    assert token_loss.item() == pytest.approx(-1.8221188 / 3, abs=1e-6) and token_stats["masked_tokens"].item() == 2


def test_truncated_weights_cap_the_ratio_and_mask_nothing():
    cfg = CFG.model_copy(update={"importance": "truncated"})
    loss, stats, grad = _run(cfg=cfg)
    # weights min(ratio, 2): sample 0 [1, 1.2214028, 2], A 2; sample 1 [0.4065697, -, 2], A -1
    assert loss.item() == pytest.approx((-(1 + 1.2214028 + 2.0) * 2 + (0.4065697 + 2.0)) / 5, abs=1e-6)
    assert stats["masked_tokens"].item() == 0
    expected = torch.tensor([[-1.0 * 2 / 5, -1.2214028 * 2 / 5, -2.0 * 2 / 5], [0.4065697 / 5, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_no_correction_is_plain_reinforce():
    cfg = CFG.model_copy(update={"importance": "none"})
    loss, stats, grad = _run(cfg=cfg)
    assert loss.item() == pytest.approx((-3 * 2.0 + 2 * 1.0) / 5, abs=1e-6)  # -A per loss token
    assert stats["masked_tokens"].item() == 0
    # -A / 5 on every loss token, whatever its ratio; the clamped one has no gradient
    torch.testing.assert_close(grad, torch.tensor([[-0.4, -0.4, -0.4], [0.2, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_the_mask_band_must_fit_inside_the_clamp():
    with pytest.raises(ValueError, match="must lie inside the log-ratio clamp"):
        LossConfig(log_ratio_clamp=2.0)  # e^2 = 7.39 < mask_ratio_high 8: a clamped ratio would pass
    with pytest.raises(ValueError, match="must lie inside the log-ratio clamp"):
        LossConfig(mask_ratio_low=0.1, mask_ratio_high=2.0, log_ratio_clamp=2.0)  # e^-2 = 0.135 > 0.1
    LossConfig(mask_ratio_low=0.14, mask_ratio_high=7.0, log_ratio_clamp=2.0)
