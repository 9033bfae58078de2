"""The peer: TRL's GRPOTrainer on the task of a prime-rl config, set up as a new user would.

    python -m benchmarks.trl_grpo CONFIG.toml MODEL OUT.jsonl [--t0 UNIX_TIME] [-- FLAG ...]

Reads the same RL config as `prime-rl CONFIG.toml` (with the same override flags after
`--`), so both systems run one task: the reverse-text environment with the config's
arguments (its own chats) and LCS reward, `rollouts_per_example` completions per prompt,
`batch_size` completions per optimizer step in micro-batches of `micro_batch_size`,
`sampling.max_tokens` new tokens at `sampling.temperature`, AdamW with the trainer's lr,
betas, weight decay, clipping and lr decay (transformers' schedule of the same shape),
`max_steps` steps, the seed.
Token-level loss, advantages = reward - group mean, no KL term, one pass per batch.
Generation is TRL's CPU path (transformers `generate`). Writes one JSON row per step:
step, reward, mean completion tokens, seconds since ``--t0`` (the command's start, set
by the caller).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def trl_schedule(optim) -> dict:
    """The trainer's lr decay as transformers' scheduler arguments. A warm-up is refused:
    transformers' starts at a factor of 0 where the trainer's starts at 1/W, so the two
    would train on different lrs (the configs benchmarked against TRL have none)."""
    if optim.warmup_steps:
        raise SystemExit(f"trl_grpo: trainer.optim.warmup_steps = {optim.warmup_steps} has no matching transformers "
                         "schedule (its warm-up starts at 0, the trainer's at 1/W); compare a config without warm-up")
    if optim.decay == "none":
        return {"lr_scheduler_type": "constant"}
    if optim.decay == "cosine":
        return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": optim.min_lr_ratio}}
    if optim.min_lr_ratio == 0:
        return {"lr_scheduler_type": "linear"}
    raise SystemExit("trl_grpo: a linear decay to a floor above 0 (trainer.optim.min_lr_ratio) has no transformers schedule")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trl_grpo")
    parser.add_argument("config", type=Path, help="a prime-rl RL config (reverse-text)")
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--t0", type=float, default=None, help="Unix time the command started (default: now)")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    flags = argv[split + 1 :]  # prime-rl override flags
    t0 = args.t0 if args.t0 is not None else time.time()

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orchestrator.envs import load_env
    from orchestrator.envs.reverse_text import lcs_ratio
    from prime_rl.config import RLConfig
    from prime_rl.settings import load_config

    cfg = load_config(RLConfig, [args.config], flags)
    orch, optim = cfg.orchestrator, cfg.trainer.optim
    (env_cfg,) = orch.env
    if env_cfg.id.removeprefix("primeintellect/") != "reverse-text":
        raise SystemExit(f"{args.config}: the peer runs reverse-text only, got env {env_cfg.id!r}")
    if orch.batch_size % orch.micro_batch_size:
        raise SystemExit(f"{args.config}: batch_size ({orch.batch_size}) must be a multiple of micro_batch_size "
                         f"({orch.micro_batch_size}) for the peer's gradient accumulation")
    env = load_env(env_cfg)
    rows = [{"prompt": example.prompt, "answer": example.answer} for example in env.dataset]

    def lcs_reward(completions, answer, **_) -> list[float]:
        return [lcs_ratio(c[-1]["content"].strip(), a) for c, a in zip(completions, answer)]

    out = args.out.open("w")

    class StepLog(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_):
            if logs and "reward" in logs:
                row = {"step": state.global_step - 1, "reward": logs["reward"],
                       "completion_tokens": logs.get("completions/mean_length"), "time": time.time() - t0}
                out.write(json.dumps(row) + "\n")
                out.flush()

    config = GRPOConfig(
        output_dir=str(args.out.parent / "trl_output"),
        max_steps=orch.max_steps or cfg.trainer.max_steps,
        per_device_train_batch_size=orch.micro_batch_size,
        gradient_accumulation_steps=orch.batch_size // orch.micro_batch_size,
        num_generations=orch.rollouts_per_example,
        max_completion_length=orch.sampling.max_tokens,
        temperature=orch.sampling.temperature,
        learning_rate=optim.lr,
        **trl_schedule(optim),
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.max_grad_norm,
        beta=0.0,
        scale_rewards="none",
        loss_type="dapo",  # token-level: every completion token of the batch weighs the same
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=orch.seed,
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
