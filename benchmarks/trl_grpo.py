"""The peer: TRL's GRPOTrainer on the quickstart task, set up as a new user would.

    python -m benchmarks.trl_grpo MODEL OUT.jsonl --steps N [--t0 UNIX_TIME]

Same task as `configs/reverse-text/rl.toml`: the reverse-text prompts (the environment's
own chats) and LCS reward, groups of 8, 256 completions per optimizer step, 16 new
tokens, temperature 1, AdamW lr 1e-3 constant (betas 0.9/0.99, no weight decay, clip
1.0), token-level loss, advantages = reward - group mean, no KL term, one pass per batch.
Generation is TRL's CPU path (transformers `generate`). Writes one JSON row per step:
step, reward, seconds since ``--t0`` (the command's start, set by the caller).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trl_grpo")
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--t0", type=float, default=None, help="Unix time the command started (default: now)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    t0 = args.t0 if args.t0 is not None else time.time()

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orchestrator.envs import load_env
    from orchestrator.envs.reverse_text import lcs_ratio
    from prime_rl.config import EnvConfig

    env = load_env(EnvConfig(id="reverse-text"))
    rows = [{"prompt": example.prompt, "answer": example.answer} for example in env.dataset]

    def lcs_reward(completions, answer, **_) -> list[float]:
        return [lcs_ratio(c[-1]["content"].strip(), a) for c, a in zip(completions, answer)]

    out = args.out.open("w")

    class StepLog(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_):
            if logs and "reward" in logs:
                row = {"step": state.global_step - 1, "reward": logs["reward"], "time": time.time() - t0}
                out.write(json.dumps(row) + "\n")
                out.flush()

    config = GRPOConfig(
        output_dir=str(args.out.parent / "trl_output"),
        max_steps=args.steps,
        per_device_train_batch_size=128,  # completions per micro-batch, as the quickstart's
        gradient_accumulation_steps=2,  # 256 completions per optimizer step
        num_generations=8,
        max_completion_length=16,
        temperature=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        scale_rewards="none",
        loss_type="dapo",  # token-level: every completion token of the batch weighs the same
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=str(args.model), reward_funcs=lcs_reward, args=config,
        train_dataset=Dataset.from_list(rows), callbacks=[StepLog()],
    )
    trainer.train()
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
