"""Trainer test helpers: reverse-text samples scored by the tiny model, their batch frames,
a small trainer config, and a `trainer.rl` process fed over ZeroMQ by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import zmq

from prime_rl.config import LoraConfig, OptimConfig
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch, encode_batch, make_sample
from trainer.data import collate
from trainer.lora import add_lora
from trainer.optim import build_optimizer, clip_and_step

TEMPERATURE = 0.8
WORDS = ["abc", "hello", "xyz", "reverse"]


def make_samples(model_dir: Path, policy_version: int) -> list:
    """Reverse-text style chats; inference logprobs from transformers on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = []
    for i, word in enumerate(WORDS):
        chat = [{"role": "user", "content": word}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        completion = list(word[::-1].encode()) + [tok.eos_token_id]  # byte-level: id == byte
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / TEMPERATURE  # [T, V]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]  # scores tokens 1..T-1
        logprobs = [0.0] * len(prompt) + lp[len(prompt) - 1 :].tolist()
        mask = [0] * len(prompt) + [1] * len(completion)
        adv = [1.0, -1.0, 0.5, -0.5][i]
        meta = {"advantage": adv, "reward": adv, "policy_version": policy_version, "example_id": i}
        samples.append(make_sample(prompt + completion, mask, logprobs, **meta))
    return samples


def completion_logprobs(model_dir: Path, samples: list) -> list[float]:
    """Sum of each sample's completion-token logprobs under the model in ``model_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums = []
    for sample in samples:
        mt = collate(MicroBatch(samples=[sample]), 64, 0, torch.device("cpu"))
        with torch.no_grad():
            logits = model(input_ids=mt.input_ids).logits.float() / TEMPERATURE
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, mt.input_ids[0, 1:, None])[:, 0]
        sums.append(float(lp[mt.loss_mask[0, 1:]].sum()))
    return sums


def batch_frame(step: int, samples: list, schema_version: int = SCHEMA_VERSION) -> bytes:
    micro = [MicroBatch(samples=samples[:2]), MicroBatch(samples=samples[2:])]
    return encode_batch(TrainBatch(schema_version, step, rank=0, temperature=TEMPERATURE, micro_batches=micro))


def trainer_config(model_dir: Path, run: Path, port: int, *, lr: float = 1e-3, timeout_s: float = 60, **extra) -> dict:
    """A small trainer config: 64-token samples, batches on 127.0.0.1:port (+ rank)."""
    return {
        "model": {"name": str(model_dir)},
        "output_dir": str(run),
        "max_steps": 2,
        "seq_len": 64,
        "transport": {"port": port, "timeout_s": timeout_s},
        "optim": {"lr": lr},
        **extra,
    }


def run_trainer_process(tmp_path: Path, config: dict, frames) -> tuple[int, str]:
    """Run `python -m trainer.rl` against a PUSH socket bound here (the test plays the
    orchestrator), send ``frames`` in order, and return (exit code, output)."""
    config_path = tmp_path / "trainer.json"
    config_path.write_text(json.dumps(config))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 90_000)  # a bound PUSH blocks until the trainer connects
    push.setsockopt(zmq.LINGER, 0)
    push.bind(f"tcp://127.0.0.1:{config['transport']['port']}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.rl", "--config", str(config_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        for frame in frames:
            try:
                push.send(frame)
            except zmq.Again:  # the trainer stopped taking batches (it failed or finished)
                break
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        push.close()
        ctx.term()
    assert not Path(f"/proc/{proc.pid}").exists()
    return proc.returncode, out


LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def fresh(tiny_model, lora: LoraConfig | None = None, optim: OptimConfig | None = None, total_steps: int | None = None):
    """The tiny model (with LoRA adapters when ``lora`` is given) and its optimizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if lora is not None:
        torch.manual_seed(0)  # lora_A starts random (the trainer seeds before loading, too)
        model = add_lora(model, lora)
    optim = optim or OptimConfig(lr=1e-2, warmup_steps=3, weight_decay=0.1)
    optimizer, scheduler = build_optimizer(model, optim, total_steps)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, step: int) -> None:
    """One optimizer step on a batch that depends only on ``step``."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)
