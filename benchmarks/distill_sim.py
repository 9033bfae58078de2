"""What bounds on-policy distillation's speed on the quickstart: a what-if sweep, in-process.

    uv run --group bench python -m benchmarks.distill_sim TEACHER [--loss sampled|top-k|exact|rl]
                                                          [--top-k 20] [--lr 1e-3] [--warmup 0] [--steps 40]
                                                          [--rollouts-per-example 8] [--seed 0]

Not the product's path: one process replays the quickstart's step (256 samples a step,
temperature 1, at most 16 tokens, AdamW betas (0.9, 0.99), grad norm clipped at 1, strictly
on-policy) with transformers alone, so that a loss or a learning rate can be tried in about 80 s
instead of a trio run. Student: the quickstart's SFT model (`benchmarks.run.prepare_model`);
TEACHER: a weights folder (e.g. an RL run's `weights/step_120`). Losses:

- ``sampled``: the product's loss with `reward_weight = 0` (the advantage of each sampled token
  is -(log p_student - log p_teacher), centered over the batch), REINFORCE on it;
- ``top-k``: the product's loss with `top_k` (``trainer.loss.top_k_reverse_kl``): the reverse KL
  over the teacher's K most likely tokens and one bucket for the rest;
- ``exact``: the exact reverse KL of every position over the whole vocabulary (the teacher's
  full distribution, which a byte vocabulary makes cheap): no sampling noise in the estimate;
- ``rl``: the quickstart's RL (group advantage, informative-token mean).

It also prints how far each weight tensor of the teacher lies from the student's: AdamW
moves a weight by about `lr` a step at most, so a tensor that must move by D needs about
D / lr steps, whatever the loss (docs/distillation.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.run import Recipe, mean5, prepare_model
from orchestrator.envs.reverse_text import lcs_ratio, load_environment
from trainer.loss import top_k_reverse_kl

BATCH, MAX_TOKENS = 256, 16


def displacement(student: Path, teacher: Path) -> list[tuple[str, float, float]]:
    """(tensor, max |teacher - student|, mean |teacher - student|) per weight tensor, largest first."""
    a, b = load_file(student / "model.safetensors"), load_file(teacher / "model.safetensors")
    rows = [(k, float((b[k] - a[k]).abs().max()), float((b[k] - a[k]).abs().mean())) for k in a]
    return sorted(rows, key=lambda r: -r[1])


@torch.no_grad()
def sample(model, prompts: list[list[int]], eos: int, pad: int) -> list[list[int]]:
    """Each prompt followed by a completion sampled at temperature 1 (left-padded batches)."""
    seqs, done = [list(p) for p in prompts], [False] * len(prompts)
    for _ in range(MAX_TOKENS):
        live = [i for i, d in enumerate(done) if not d]
        if not live:
            break
        width = max(len(seqs[i]) for i in live)
        ids = torch.full((len(live), width), pad)
        att = torch.zeros((len(live), width), dtype=torch.long)
        for r, i in enumerate(live):
            ids[r, width - len(seqs[i]):], att[r, width - len(seqs[i]):] = torch.tensor(seqs[i]), 1
        logits = model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
        for r, token in zip(live, torch.multinomial(logits.float().softmax(-1), 1).squeeze(-1).tolist()):
            seqs[r].append(token)
            done[r] = token == eos
    return seqs


def log_probs(model, seqs: list[list[int]], prompt_lens: list[int], pad: int):
    """(log softmax [B, T-1, V], next tokens [B, T-1], completion mask [B, T-1])."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad)
    att = torch.zeros_like(ids)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        ids[i, : len(s)], att[i, : len(s)] = torch.tensor(s), 1
        mask[i, p - 1 : len(s) - 1] = True
    return model(input_ids=ids, attention_mask=att).logits[:, :-1].float().log_softmax(-1), ids[:, 1:], mask


def loss_of(kind: str, student_all, teacher_all, targets, mask, advantages, top_k: int) -> torch.Tensor:
    n = mask.sum()
    student = student_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if kind == "rl":
        keep = mask & (advantages[:, None] != 0)
        return -(advantages[:, None] * student * keep).sum() / keep.sum().clamp(min=1)
    if kind == "exact":
        return ((student_all.exp() * (student_all - teacher_all)).sum(-1) * mask).sum() / n
    if kind == "top-k":
        top = teacher_all[mask].topk(top_k, dim=-1).indices
        return top_k_reverse_kl(student_all[mask], top, teacher_all[mask].gather(-1, top)).sum() / n
    gap = (student - teacher_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).detach()
    gap = gap - (gap * mask).sum() / n
    return ((gap * student) * mask).sum() / n


def run(args) -> list[float]:
    torch.manual_seed(args.seed)
    sft = prepare_model(Recipe())
    tok = AutoTokenizer.from_pretrained(sft)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    student = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup) if args.warmup else 1.0)
    data = load_environment(seed=0).dataset
    order = random.Random(args.seed).sample(range(len(data)), len(data))
    per_step, rewards = BATCH // args.rollouts_per_example, []
    for step in range(args.steps):
        examples = [data[order[(step * per_step + j) % len(order)]] for j in range(per_step)]
        prompts, answers = [], []
        for e in examples:
            ids = tok.apply_chat_template(e.prompt, add_generation_prompt=True, tokenize=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])
            prompts += [ids] * args.rollouts_per_example
            answers += [e.answer] * args.rollouts_per_example
        seqs = sample(student, prompts, eos, pad)
        texts = [tok.decode([t for t in s[len(p):] if t != eos]).strip() for s, p in zip(seqs, prompts)]
        reward = torch.tensor([lcs_ratio(t, a) for t, a in zip(texts, answers)])
        groups = reward.view(-1, args.rollouts_per_example)
        advantages = (groups - groups.mean(-1, keepdim=True)).view(-1)
        student_all, targets, mask = log_probs(student, seqs, [len(p) for p in prompts], pad)
        with torch.no_grad():
            teacher_all, _, _ = log_probs(teacher, seqs, [len(p) for p in prompts], pad)
        exact_kl = float(((student_all.exp() * (student_all - teacher_all)).sum(-1) * mask).sum().detach() / mask.sum())
        optimizer.zero_grad()
        loss_of(args.loss, student_all, teacher_all, targets, mask, advantages, args.top_k).backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        rewards.append(float(reward.mean()))
        if step % 5 == 4:
            print(f"step {step + 1:3d}  reward (5-step mean) {mean5(rewards)[-1]:.3f}  reverse KL {exact_kl:.3f}", flush=True)
    return rewards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("teacher", type=Path)
    parser.add_argument("--loss", choices=("sampled", "top-k", "exact", "rl"), default="sampled")
    parser.add_argument("--top-k", type=int, default=20, help="the teacher's tokens a position, with --loss top-k")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rollouts-per-example", type=int, default=8, choices=(1, 2, 4, 8, 16))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    for name, largest, mean in displacement(prepare_model(Recipe()), args.teacher)[:3]:
        print(f"teacher - student: {name} max |d| {largest:.3f} (mean {mean:.4f}): >= {largest / args.lr:.0f} steps at lr {args.lr:g}")
    rewards = run(args)
    print(f"last 5 steps: {statistics.fmean(rewards[-5:]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
