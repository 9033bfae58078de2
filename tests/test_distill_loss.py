"""On-policy distillation on the trainer side: the per-token advantages and the top-k reverse
KL (hand-computed), the teacher logprobs and top-k rows through collate, the step's token count
and one train_step on the tiny model."""

import math

import numpy as np
import pytest
import torch

from prime_rl.config import DistillConfig, LossConfig, ModelConfig, TrainerConfig
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch, make_sample, sample_arrays
from trainer.data import MicroTensors, collate
from trainer.loss import distill_advantages, policy_loss, reverse_kl_sum, top_k_reverse_kl
from trainer.rl import SUM_KEYS, loss_token_count, step_metrics, token_advantages

# 2 samples x 3 tokens; sample 1's token 0 is off the loss mask. All values are binary
# fractions, so every expected number below is exact in float32.
#   student - teacher: [[-0.5, 1.0, 0.0], [0.5 (off the mask), -0.5, -2.0]]
STUDENT = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -3.0]])
TEACHER = torch.tensor([[-0.5, -1.5, -2.0], [-0.7, -1.0, -1.0]])
MASK = torch.tensor([[1, 1, 1], [0, 1, 1]]).bool()
ADV = torch.tensor([2.0, -1.0])


def test_pure_distillation_is_minus_the_log_ratio_to_the_teacher():
    got = distill_advantages(ADV, STUDENT, TEACHER, MASK, DistillConfig(reward_weight=0.0, kl_weight=1.0))
    # -(student - teacher) on the mask; the group advantage plays no part
    expected = torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.5, 2.0]])
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


def test_mixed_reward_and_kl():
    got = distill_advantages(ADV, STUDENT, TEACHER, MASK, DistillConfig(reward_weight=1.0, kl_weight=0.5))
    # sample 0: 2 - 0.5 * [-0.5, 1.0, 0.0] = [2.25, 1.5, 2.0]
    # sample 1: -1 - 0.5 * [-0.5, -2.0] = [-0.75, 0.0] on its two loss tokens
    expected = torch.tensor([[2.25, 1.5, 2.0], [0.0, -0.75, 0.0]])
    assert torch.equal(got, expected)


def test_off_mask_tokens_get_zero_whatever_the_logprobs():
    student = torch.tensor([[-50.0, -1.0]])
    teacher = torch.tensor([[0.0, -1.0]])
    mask = torch.tensor([[0, 1]]).bool()
    got = distill_advantages(torch.tensor([3.0]), student, teacher, mask, DistillConfig(reward_weight=1.0))
    assert torch.equal(got, torch.tensor([[0.0, 3.0]]))


def test_reverse_kl_sum_over_loss_tokens():
    # -0.5 + 1.0 + 0.0 + (-0.5) + (-2.0); the off-mask 0.5 is left out
    assert reverse_kl_sum(STUDENT, TEACHER, MASK).item() == -2.0


def test_reward_only_distillation_matches_rl_exactly():
    """kl_weight 0: per-token advantages A on the mask give RL's loss and gradient bit for bit."""
    trainer = torch.tensor([[-0.9, -0.6, -2.1], [-0.2, -1.4, -3.2]])
    cfg = LossConfig()

    def run(advantages):
        lp = trainer.clone().requires_grad_(True)
        loss, _ = policy_loss(lp, STUDENT, advantages, MASK, cfg, 5)
        loss.backward()
        return loss, lp.grad

    per_token = distill_advantages(ADV, STUDENT, TEACHER, MASK, DistillConfig(reward_weight=1.0, kl_weight=0.0))
    loss_rl, grad_rl = run(ADV)
    loss_d, grad_d = run(per_token)
    assert torch.equal(loss_rl, loss_d) and torch.equal(grad_rl, grad_d)


def test_pure_distillation_pushes_up_tokens_the_teacher_prefers():
    """On policy (ratio 1), the gradient on each loss token is -A / num_tokens: negative where
    the teacher is more likely than the student, so a descent step raises those logprobs."""
    advantages = distill_advantages(ADV, STUDENT, TEACHER, MASK, DistillConfig())
    lp = STUDENT.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, STUDENT, advantages, MASK, LossConfig(), num_tokens=5)
    loss.backward()
    # A = [[0.5, -1.0, 0.0], [0, 0.5, 2.0]] -> -A / 5
    expected = torch.tensor([[-0.1, 0.2, 0.0], [0.0, -0.1, -0.4]])
    torch.testing.assert_close(lp.grad, expected, atol=1e-7, rtol=0)
    teacher_prefers = MASK & (TEACHER > STUDENT)
    assert (lp.grad[teacher_prefers] < 0).all() and (lp.grad[MASK & (TEACHER < STUDENT)] > 0).all()
    stepped = lp.detach() - 0.1 * lp.grad
    assert (stepped[teacher_prefers] > STUDENT[teacher_prefers]).all()


# --------------------------------------------------------------------------- the top-k reverse KL

LN2 = math.log(2.0)


def test_top_k_reverse_kl_over_the_teachers_tokens_and_the_rest():
    # student p = [1/2, 1/4, 1/8, 1/8]; teacher's top 2 = tokens 1 and 0 with 1/2 and 1/4, so its
    # rest (tokens 2 and 3) holds 1/4, the student's 1/4 too:
    #   1/2 ln((1/2)/(1/4)) + 1/4 ln((1/4)/(1/2)) + 1/4 ln((1/4)/(1/4)) = ln2 / 2 - ln2 / 4 = ln2 / 4
    scoring = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]])) + 3.0  # logits: any shift
    got = top_k_reverse_kl(scoring, torch.tensor([[1, 0]]), torch.log(torch.tensor([[0.5, 0.25]])))
    assert got.shape == (1,) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor([LN2 / 4]))


def test_top_k_reverse_kl_is_the_exact_kl_when_k_covers_the_vocabulary():
    torch.manual_seed(0)
    student_logits, teacher_logits = torch.randn(3, 6), torch.randn(3, 6)
    teacher = torch.log_softmax(teacher_logits, -1)
    top = teacher.argsort(-1, descending=True)
    got = top_k_reverse_kl(student_logits.requires_grad_(True), top, teacher.gather(-1, top))
    student = torch.log_softmax(student_logits, -1)
    exact = (student.exp() * (student - teacher)).sum(-1)
    torch.testing.assert_close(got, exact, atol=1e-6, rtol=0)
    # and its gradient is the exact KL's
    (grad_got,) = torch.autograd.grad(got.sum(), student_logits, retain_graph=True)
    (grad_exact,) = torch.autograd.grad(exact.sum(), student_logits)
    torch.testing.assert_close(grad_got, grad_exact, atol=1e-6, rtol=0)


def test_top_k_reverse_kl_is_zero_at_the_teacher_and_a_descent_step_moves_toward_it():
    teacher = torch.log(torch.tensor([[0.7, 0.2, 0.05, 0.05]]))
    ids, logprobs = torch.tensor([[0, 1]]), teacher[:, :2]
    assert top_k_reverse_kl(teacher.clone(), ids, logprobs).abs().item() < 1e-6
    student = torch.zeros(1, 4, requires_grad=True)  # uniform
    before = top_k_reverse_kl(student, ids, logprobs)
    before.backward()
    with torch.no_grad():
        after = top_k_reverse_kl(student - 0.5 * student.grad, ids, logprobs)
    assert before.item() > 0.3 and after.item() < before.item()
    assert student.grad[0, 0] < 0 < student.grad[0, 2]  # raise the teacher's favourite, lower the rest


# --------------------------------------------------------------------------- micro-batch tensors


def micro_tensors(advantages, teacher=None) -> MicroTensors:
    """3 samples of 5 positions with 3, 4 and 2 loss tokens (position 0 is never scored)."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]]).bool()
    ids = torch.zeros(3, 5, dtype=torch.long)
    return MicroTensors(
        input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask, inference_logprobs=torch.zeros(3, 5),
        advantages=torch.tensor(advantages), num_truncated=0, model_ids=ids, model_positions=ids,
        model_mask=torch.ones_like(ids), source=ids, num_model_tokens=15, teacher_logprobs=teacher,
    )


def test_pure_rl_keeps_the_sample_advantages():
    mt = micro_tensors([0.5, 0.0, -0.5])
    advantages, kl = token_advantages(mt, mt.inference_logprobs[:, 1:], mt.loss_mask[:, 1:], None)
    assert advantages is mt.advantages and kl.item() == 0.0


def test_distilling_without_teacher_logprobs_is_a_clear_error():
    mt = micro_tensors([0.5, 0.0, -0.5])
    with pytest.raises(ValueError, match=r"trainer.loss.distill is set but a micro-batch carries no teacher logprobs"):
        token_advantages(mt, mt.inference_logprobs[:, 1:], mt.loss_mask[:, 1:], DistillConfig())


def test_every_sample_is_informative_when_distilling():
    mt = micro_tensors([0.5, 0.0, -0.5], teacher=torch.zeros(3, 5))
    assert loss_token_count(mt, "informative") == 3 + 2  # RL: the zero-advantage sample is left out
    assert loss_token_count(mt, "informative", DistillConfig()) == 3 + 4 + 2
    assert loss_token_count(mt, "all", DistillConfig()) == 3 + 4 + 2
    # no KL term: only the group advantage teaches, as in RL
    assert loss_token_count(mt, "informative", DistillConfig(reward_weight=1.0, kl_weight=0.0)) == 3 + 2


def sample(n: int, teacher: bool = True, advantage: float = 0.5):
    """n tokens, the last n - 2 of them sampled; logprobs -1 (student) and -0.25 * t (teacher)."""
    mask = [0, 0] + [1] * (n - 2)
    student = [0.0, 0.0] + [-1.0] * (n - 2)
    teacher_lp = [0.0, 0.0] + [-0.25 * t for t in range(2, n)] if teacher else None
    return make_sample(list(range(3, 3 + n)), mask, student, advantage=advantage, reward=0.0, policy_version=0,
                       example_id=0, teacher_logprobs=teacher_lp)


def test_collate_pads_and_cuts_teacher_logprobs_like_inference_logprobs():
    mt = collate(MicroBatch([sample(6), sample(3)]), seq_len=5, pad_id=0, device=torch.device("cpu"))
    assert mt.teacher_logprobs.dtype == torch.float32
    assert mt.teacher_logprobs.shape == mt.inference_logprobs.shape == (2, 5)
    expected = torch.tensor([[0.0, 0.0, -0.5, -0.75, -1.0], [0.0, 0.0, -0.5, 0.0, 0.0]])  # cut at 5, padded with 0
    assert torch.equal(mt.teacher_logprobs, expected)
    assert collate(MicroBatch([sample(3, teacher=False)]), 5, 0, torch.device("cpu")).teacher_logprobs is None


def top_k_sample(n: int, k: int = 2):
    """``sample(n)`` with the teacher's top-k at each of its n - 2 sampled tokens: row r holds
    ids [10 r, 10 r + 1, ...] and logprobs [-1 - r, -2 - r, ...]."""
    base = sample(n)
    rows = n - 2
    ids = np.array([[10 * r + j for j in range(k)] for r in range(rows)])
    logprobs = np.array([[-1.0 - r - j for j in range(k)] for r in range(rows)], dtype=np.float32)
    ids_, mask, student = sample_arrays(base)
    return make_sample(ids_, mask, student, advantage=base.advantage, reward=0.0, policy_version=0, example_id=0,
                       teacher_logprobs=[0.0, 0.0] + [-0.25 * t for t in range(2, n)], teacher_top=(ids, logprobs))


def test_collate_lines_up_the_top_k_rows_with_the_loss_tokens_and_cuts_them_like_the_samples():
    mt = collate(MicroBatch([top_k_sample(6), top_k_sample(4)]), seq_len=5, pad_id=0, device=torch.device("cpu"))
    # sample 0 cut at 5 tokens keeps its first 3 sampled tokens (rows 0-2), sample 1 both (rows 0-1)
    assert mt.loss_mask[:, 1:].sum().item() == 5
    assert mt.teacher_top_ids.tolist() == [[0, 1], [10, 11], [20, 21], [0, 1], [10, 11]]
    assert mt.teacher_top_ids.dtype == torch.int64 and mt.teacher_top_logprobs.dtype == torch.float32
    assert mt.teacher_top_logprobs[:, 0].tolist() == [-1.0, -2.0, -3.0, -1.0, -2.0]
    assert collate(MicroBatch([sample(4)]), 5, 0, torch.device("cpu")).teacher_top_ids is None
    with pytest.raises(ValueError, match=r"mixes samples with and without the teacher's top-k \(1 of 2 have them\)"):
        collate(MicroBatch([top_k_sample(4), sample(4)]), 8, 0, torch.device("cpu"))


def test_collate_refuses_a_micro_batch_with_and_without_teacher_logprobs():
    with pytest.raises(ValueError, match=r"mixes samples with and without teacher logprobs \(1 of 2 have them\)"):
        collate(MicroBatch([sample(4), sample(4, teacher=False)]), 8, 0, torch.device("cpu"))


# --------------------------------------------------------------------------- one step on the tiny model


def one_step(tiny_model, samples, distill: DistillConfig | None) -> dict[str, float]:
    from trainer.model import World, load_model
    from trainer.optim import build_optimizer
    from trainer.rl import train_step

    # importance "none": the made-up sampling logprobs (-1) are far from the tiny model's own,
    # and a ratio band would drop every token; the weight is then 1 and the loss -sum(A) / N.
    loss = LossConfig(importance="none", distill=distill)
    cfg = TrainerConfig(model=ModelConfig(name=str(tiny_model)), seq_len=64, loss=loss)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = load_model(cfg.model, world)
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    batch = TrainBatch(SCHEMA_VERSION, step=4, rank=0, temperature=1.0, micro_batches=[MicroBatch(samples[:1]), MicroBatch(samples[1:])])
    return train_step(model, optimizer, scheduler, batch, cfg, world)


def test_train_step_distills_samples_without_advantage(tiny_model):
    """Both samples have advantage 0 (RL would learn nothing); the teacher still teaches."""
    samples = [sample(6, advantage=0.0), sample(5, advantage=0.0)]
    stats = one_step(tiny_model, samples, DistillConfig())
    # loss tokens are positions 2.. (scored from position 1 on): student -1, teacher -0.25 * t
    #   sample 0: (-1 + 0.5) + (-1 + 0.75) + (-1 + 1.0) + (-1 + 1.25) = -0.5
    #   sample 1: (-1 + 0.5) + (-1 + 0.75) + (-1 + 1.0) = -0.75
    assert stats["distill_kl_sum"] == pytest.approx(-1.25)
    assert stats["loss_tokens"] == 7
    assert stats["loss_sum"] == pytest.approx(-1.25 / 7)  # A = -(student - teacher), weight 1
    assert stats["grad_norm"] > 0
    row = step_metrics(stats, {"train": 1.0}, step=4, distill=DistillConfig())
    assert row["loss/reverse_kl"] == pytest.approx(-1.25 / 7)
    assert "loss/reverse_kl" not in step_metrics(stats, {"train": 1.0}, step=4)
    assert list(SUM_KEYS).count("distill_kl_sum") == 1


def test_train_step_with_top_k_adds_the_kl_loss_and_logs_it(tiny_model):
    """reward_weight 0 and top_k: the policy gradient has nothing to do (advantages 0), so the
    loss is kl_weight x the mean top-k KL over the 7 loss tokens, which the step also logs."""
    samples = [top_k_sample(6), top_k_sample(5)]
    stats = one_step(tiny_model, samples, DistillConfig(kl_weight=0.5, top_k=2))
    assert stats["loss_tokens"] == 7 and stats["top_k_kl_sum"] > 0
    assert stats["loss_sum"] == pytest.approx(0.5 * stats["top_k_kl_sum"] / 7)
    assert stats["distill_kl_sum"] == pytest.approx(-1.25)  # the sampled estimate is still reported
    assert stats["grad_norm"] > 0
    row = step_metrics(stats, {"train": 1.0}, step=4, distill=DistillConfig(top_k=2))
    assert row["loss/reverse_kl_top_k"] == pytest.approx(stats["top_k_kl_sum"] / 7)
    assert "loss/reverse_kl_top_k" not in step_metrics(stats, {"train": 1.0}, step=4, distill=DistillConfig())
    with pytest.raises(ValueError, match=r"top-k rows \(7, 2\) do not match the micro-batch's 7 loss tokens x .*top_k 3"):
        one_step(tiny_model, samples, DistillConfig(top_k=3))
    with pytest.raises(ValueError, match=r"a micro-batch carries no top-2 tokens of the teacher"):
        one_step(tiny_model, [sample(6), sample(5)], DistillConfig(top_k=2))


def test_train_step_refuses_to_distill_without_teacher_logprobs(tiny_model):
    samples = [sample(6, teacher=False), sample(5, teacher=False)]
    with pytest.raises(ValueError, match=r"the batch of step 4 carries no teacher logprobs \(is \[teacher\] configured"):
        one_step(tiny_model, samples, DistillConfig())
