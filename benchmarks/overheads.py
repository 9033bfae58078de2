"""Overheads against their limits, on the batches a prime-rl run recorded (`rollouts/step_N/`).

- transport: the orchestrator's encode + ZeroMQ send + the trainer's receive + decode of
  each recorded batch (the real ``BatchSender`` / ``BatchReceiver`` over tcp on 127.0.0.1),
  against copying the same batch within one process (``copy.deepcopy``);
- trainer: the trainer's own ``train_step`` against a bare PyTorch loop doing the same
  forward, backward and AdamW step on the same batches (each sample in a right-padded row
  of its own, a plain REINFORCE loss), both on one thread with nothing else running.
  Tokens/s counts the samples' tokens, so work the trainer avoids (shared prompts) shows.
  Then the trainer's step once more with the threads a run gives it (`trainer.num_threads`):
  the trainer's half of the machine's limit a step (`benchmarks.run`).

Each figure is the median over the recorded steps.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch

from benchmarks.loadgen import free_port
from prime_rl.wire import TrainBatch, decode_batch


def recorded_batches(run_dir: Path, limit: int) -> list[tuple[int, bytes]]:
    """(step, rank-0 frame) of up to ``limit`` recorded steps, in step order."""
    steps = sorted((int(d.name.split("_")[1]), d) for d in (run_dir / "rollouts").glob("step_*") if (d / "rank_0.msgpack").is_file())
    return [(step, (d / "rank_0.msgpack").read_bytes()) for step, d in steps[:limit]]


def transport(frames: list[tuple[int, bytes]]) -> dict[str, float]:
    from orchestrator.sender import BatchSender
    from prime_rl.config import TransportConfig
    from prime_rl.wire import encode_batch
    from trainer.data import BatchReceiver

    cfg = TransportConfig(port=free_port())
    sender, receiver = BatchSender(cfg, 1), BatchReceiver(cfg, 0, log=lambda _: None)
    wire, copied = [], []
    try:
        for step, frame in frames:
            batch = decode_batch(frame)
            t0 = time.perf_counter()
            sender.send_frame(0, step, encode_batch(batch))
            received = receiver.receive(step)
            wire.append(time.perf_counter() - t0)
            assert received == batch
            t0 = time.perf_counter()
            copy.deepcopy(batch)
            copied.append(time.perf_counter() - t0)
    finally:
        sender.close()
        receiver.close()
    return {"transport/wire_s": statistics.median(wire), "transport/copy_s": statistics.median(copied),
            "transport/bytes": statistics.median(len(f) for _, f in frames)}


def bare_step(model, optimizer, batch: TrainBatch, pad_id: int) -> None:
    """Forward, backward and AdamW step with nothing but PyTorch and the HF model."""
    from trainer.data import collate

    micros = [collate(m, 10**6, pad_id, torch.device("cpu")) for m in batch.micro_batches]
    n = sum(int(m.loss_mask[:, 1:].sum()) for m in micros)
    for m in micros:
        logits = model(input_ids=m.input_ids, attention_mask=m.attention_mask).logits[:, :-1].float() / batch.temperature
        logprobs = torch.log_softmax(logits, -1).gather(-1, m.input_ids[:, 1:, None])[..., 0]
        loss = -(logprobs * m.advantages[:, None] * m.loss_mask[:, 1:]).sum() / n
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def trainer_vs_bare(frames: list[tuple[int, bytes]], model_dir: Path, seq_len: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from prime_rl.config import ModelConfig, TrainerConfig
    from trainer.model import load_model, setup_world
    from trainer.optim import build_optimizer
    from trainer.rl import train_step

    world = setup_world(1)
    cfg = TrainerConfig(model=ModelConfig(name=str(model_dir)), seq_len=seq_len)
    torch.set_num_threads(1)
    ours = load_model(cfg.model, world)
    optimizer, scheduler = build_optimizer(ours, cfg.optim)
    bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=0.0)
    pad_id = getattr(bare.config, "pad_token_id", None) or 0
    batches = [decode_batch(frame) for _, frame in frames]
    tokens = [sum(len(s.input_ids) // 4 for m in b.micro_batches for s in m.samples) for b in batches]
    timed: dict[str, list[float]] = {"trainer": [], "bare": []}
    for batch in [batches[0], *batches]:  # the first pass warms both up and is not counted
        for name, step in (("trainer", lambda b: train_step(ours, optimizer, scheduler, b, cfg, world)),
                           ("bare", lambda b: bare_step(bare, bare_opt, b, pad_id))):
            t0 = time.perf_counter()
            step(batch)
            timed[name].append(time.perf_counter() - t0)
    per_step = {name: statistics.median(times[1:]) for name, times in timed.items()}
    rate = statistics.median(tokens)
    torch.set_num_threads(cfg.num_threads)  # as in a run
    run_threads = []
    for batch in [batches[0], *batches]:
        t0 = time.perf_counter()
        train_step(ours, optimizer, scheduler, batch, cfg, world)
        run_threads.append(time.perf_counter() - t0)
    return {"trainer/step_alone_s": per_step["trainer"], "trainer/bare_step_s": per_step["bare"],
            "trainer/tokens_per_s": rate / per_step["trainer"], "trainer/bare_tokens_per_s": rate / per_step["bare"],
            "trainer/step_run_threads_s": statistics.median(run_threads[1:]), "trainer/run_threads": cfg.num_threads}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.overheads", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a prime-rl run directory with recorded batches")
    parser.add_argument("model", type=Path, help="the model the run started from")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="recorded steps to measure on")
    args = parser.parse_args(argv)
    frames = recorded_batches(args.run_dir, args.steps)
    if not frames:
        raise SystemExit(f"no recorded batches in {args.run_dir / 'rollouts'}")
    print(json.dumps({**transport(frames), **trainer_vs_bare(frames, args.model, args.seq_len)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
