"""Supervised fine-tuning on chats (the warm-up before RL), one process.

    python -m trainer.sft --config sft.toml [--dotted.flags]

Reads JSONL lines ``{"messages": [...]}`` (plus ``"tools": [...]``, OpenAI tool schemas,
for tool-use traces), tokenizes each chat with the model's own chat template and trains on
the assistant tokens only (tool calls included, tool results excluded), then writes the model + tokenizer to
``output_dir`` (HF format) with the ``STABLE`` marker last, so RL can start from it.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from prime_rl.chat import TemplateError, assistant_span, render_ids
from prime_rl.config import SFTConfig
from prime_rl.metrics import ConsoleSink, make_metrics
from prime_rl.rundir import MARKER
from prime_rl.settings import exit_process, run_process
from trainer.data import right_pad
from trainer.head import HeadQuery
from trainer.model import DTYPES, forward_logits, load_model, setup_world, teardown_world
from trainer.optim import build_optimizer, clip_and_step
from trainer.weights import full_state_dict, write_hf_folder

CONSOLE_KEYS = ("loss/sft", "optim/grad_norm", "perf/tokens_per_s", "time/step")
CONSOLE_EVERY = 10

Example = tuple[list[int], list[int]]  # (input_ids [T], loss_mask [T] of 0/1)


def log(msg: str) -> None:
    print(f"[sft] {msg}", flush=True)


def train_sft(cfg: SFTConfig) -> None:
    # ---- setup: one process, model + tokenizer, data, optimizer, metrics
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("SFT runs in a single process; launch it without torchrun")
    from transformers import AutoTokenizer

    world = setup_world(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name)
    model = load_model(cfg.model, world)
    examples = load_examples(cfg.data.path, tokenizer, cfg.seq_len)
    batches = batch_stream(examples, cfg.data.batch_size, cfg.seed)
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / MARKER).unlink(missing_ok=True)  # the folder is incomplete until we finish
    metrics = make_metrics("sft", output_dir, CONSOLE_KEYS, cfg.wandb, cfg.model_dump(mode="json"))
    console = [s for s in metrics.sinks if isinstance(s, ConsoleSink)]
    metrics.sinks = [s for s in metrics.sinks if not isinstance(s, ConsoleSink)]  # printed every N steps instead
    until = f" (or until {stop_rule(cfg)})" if cfg.stop_loss or cfg.stop_plateau else ""
    log(f"{len(examples)} chats from {cfg.data.path}, {cfg.max_steps} steps of {cfg.data.batch_size}{until}")

    noise = torch.Generator().manual_seed(cfg.seed)  # input_noise's draws
    losses: list[float] = []
    for step in range(1, cfg.max_steps + 1):
        t_start = time.perf_counter()
        # 1. next batch of chats (the data cycles, reshuffled every epoch)
        chats = next(batches)
        # 2. one optimizer step with gradient accumulation over micro-batches
        stats = sft_step(model, optimizer, scheduler, chats, cfg, world.device, noise)
        # 3. metrics (console every CONSOLE_EVERY steps and at the end)
        elapsed = time.perf_counter() - t_start
        row = {**stats, "perf/tokens_per_s": stats["perf/tokens"] / elapsed, "time/step": elapsed}
        metrics.log(step, row)
        losses.append(stats["loss/sft"])
        stop = should_stop(losses, cfg.stop_loss, cfg.stop_plateau, cfg.stop_window)
        if step % CONSOLE_EVERY == 0 or step in (1, cfg.max_steps) or stop:
            for sink in console:
                sink.log({"step": step, **row})
        # 4. stop early once the loss target (or its plateau) is reached
        if stop:
            log(f"stopped at step {step}: {stop_rule(cfg)} ({window_means(losses, cfg.stop_window)})")
            break
    else:
        if cfg.stop_loss is not None or cfg.stop_plateau is not None:
            log(f"warning: max_steps ({cfg.max_steps}) reached before {stop_rule(cfg)} "
                f"({window_means(losses, cfg.stop_window)})")

    # ---- publish: weights + tokenizer, marker last
    save_model(model, tokenizer, cfg.model.name, output_dir, DTYPES[cfg.model.dtype])
    metrics.close()
    teardown_world(world)  # the one-rank process group of a bfloat16 run (trainer.model)
    log(f"done: model in {output_dir}")


def should_stop(losses: list[float], target: float | None, plateau: float | None, window: int) -> bool:
    """Whether SFT may stop: the mean of the last ``window`` losses is at or below ``target``
    and less than ``plateau`` below the mean of the ``window`` losses before them (each test
    only where set; never with neither set, nor before the windows are full)."""
    if target is None and plateau is None:
        return False
    needed = 2 * window if plateau is not None else window
    if len(losses) < needed:
        return False
    last = float(np.mean(losses[-window:]))
    if target is not None and last > target:
        return False
    return plateau is None or float(np.mean(losses[-2 * window : -window])) - last < plateau


def stop_rule(cfg: SFTConfig) -> str:
    """The stop rule in words, for the log."""
    rules = [f"the mean loss of {cfg.stop_window} steps is <= {cfg.stop_loss:g}"] if cfg.stop_loss else []
    if cfg.stop_plateau:
        rules.append(f"it fell less than {cfg.stop_plateau:g} below the {cfg.stop_window} steps before")
    return " and ".join(rules)


def window_means(losses: list[float], window: int) -> str:
    """The last two windows' mean losses, for the log."""
    last = np.mean(losses[-window:])
    if len(losses) < 2 * window:
        return f"last {window}: {last:.4f}"
    return f"last {window}: {last:.4f}, the {window} before: {np.mean(losses[-2 * window : -window]):.4f}"


def sft_step(model: nn.Module, optimizer, scheduler, chats: list[Example], cfg: SFTConfig, device,
             noise: torch.Generator | None = None) -> dict[str, float]:
    """Token-mean cross-entropy over all assistant tokens of the batch (label-smoothed with
    ``cfg.label_smoothing``), accumulated over micro-batches."""
    # Position 0 is never predicted, so its mask entry never counts.
    num_tokens = max(1, sum(sum(mask[1:]) for _, mask in chats))
    smoothing = cfg.label_smoothing
    total_loss, total_nll, total_tokens = 0.0, 0.0, 0
    for start in range(0, len(chats), cfg.data.micro_batch_size):
        micro = chats[start : start + cfg.data.micro_batch_size]
        ids = torch.from_numpy(right_pad([np.array(i) for i, _ in micro], 0, np.int64)).to(device)  # [B, T]
        attention_mask = torch.from_numpy(right_pad([np.ones(len(i)) for i, _ in micro], 0, np.int64)).to(device)
        loss_mask = torch.from_numpy(right_pad([np.array(m, dtype=bool) for _, m in micro], False, bool)).to(device)
        inputs = corrupt(ids, loss_mask, cfg.input_noise, model.get_input_embeddings().num_embeddings, noise) if cfg.input_noise else ids
        scores = forward_logits(model, inputs, attention_mask, query=next_token_query(ids, loss_mask, smoothing > 0))
        loss = smoothed_nll(scores, smoothing).sum() / num_tokens
        loss.backward()
        total_loss += loss.item()
        total_nll += -scores["logprobs"].detach().sum().item() / num_tokens
        total_tokens += int(attention_mask.sum())
    grad_norm, lr = clip_and_step(model, optimizer, scheduler, cfg.optim.max_grad_norm)
    nll = {"loss/nll": total_nll} if smoothing else {}
    return {"loss/sft": total_loss, **nll, "optim/grad_norm": grad_norm, "optim/lr": lr,
            "perf/loss_tokens": num_tokens, "perf/tokens": total_tokens}


def corrupt(ids: torch.Tensor, loss_mask: torch.Tensor, share: float, vocab: int, generator: torch.Generator | None) -> torch.Tensor:
    """ids [B, T] with each target token (loss_mask) replaced, with probability ``share``, by a
    token drawn uniformly from the vocabulary: the model's input only, its targets stay the
    data's, so it learns to go on correctly after a wrong token of its own."""
    draw = torch.rand(ids.shape, generator=generator).to(ids.device) < share
    random_ids = torch.randint(vocab, ids.shape, generator=generator).to(ids.device)
    return torch.where(draw & loss_mask, random_ids, ids)


def smoothed_nll(scores: dict[str, torch.Tensor], smoothing: float) -> torch.Tensor:
    """Per-token cross-entropy against the target mixed with the uniform distribution over
    the vocabulary, ``smoothing`` of it uniform (torch's ``label_smoothing``): [N]."""
    if not smoothing:
        return -scores["logprobs"]
    return -((1 - smoothing) * scores["logprobs"] + smoothing * scores["mean_logprobs"])


def next_token_query(ids: torch.Tensor, loss_mask: torch.Tensor, mean_logprob: bool = False) -> HeadQuery:
    """The head's query for right-padded rows ids [B, T] with loss_mask [B, T] bool: at every
    target token t (mask[b, t], t >= 1), position t - 1 of its row and the token itself
    (and, with ``mean_logprob``, the mean logprob of the whole vocabulary there)."""
    targets = loss_mask[:, 1:]
    positions = torch.arange(ids.numel(), device=ids.device).view_as(ids)[:, :-1][targets]
    return HeadQuery(positions=positions, targets=ids[:, 1:][targets], temperature=1.0, entropy=False,
                     mean_logprob=mean_logprob)


# --------------------------------------------------------------------------- data


def load_examples(path: Path, tokenizer, seq_len: int) -> list[Example]:
    """Tokenized chats with assistant masks, cut to seq_len; chats left with no target are dropped."""
    examples, dropped = [], 0
    for lineno, line in enumerate(Path(path).read_text().split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            messages, tools = row["messages"], row.get("tools")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{lineno}: expected a JSON object with `messages`: {e}") from None
        ids, mask = tokenize_chat(tokenizer, messages, tools)
        ids, mask = ids[:seq_len], mask[:seq_len]
        if sum(mask[1:]) == 0:
            dropped += 1
            continue
        examples.append((ids, mask))
    if dropped:
        log(f"dropped {dropped} chats with no assistant tokens within seq_len {seq_len}")
    if not examples:
        raise ValueError(f"{path}: no usable chats (need assistant turns within seq_len {seq_len})")
    return examples


def tokenize_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> Example:
    """(input_ids, loss_mask) with 1 exactly on the tokens of each assistant turn.

    Generic for any chat template (``prime_rl.chat``, the same rendering RL prompts use): a
    turn's tokens are those between the conversation up to it rendered with the generation
    prompt and the conversation including it, up to its end-of-turn token; what the template
    writes after that (ChatML's newline) is formatting the model never generates. Message
    contents never become control tokens.
    """
    ids = render_ids(tokenizer, messages, tools=tools)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        try:
            upto, start, end, _ = assistant_span(tokenizer, messages, i, tools)
        except TemplateError:
            upto, start, end = [], 0, 0
        if not upto or ids[: len(upto)] != upto:
            raise ValueError(
                f"chat template does not render turn {i} as an extension of the turns before it "
                "(e.g. it rewrites earlier turns); cannot locate the assistant tokens"
            )
        mask[start:end] = [1] * (end - start)
    return ids, mask


def batch_stream(examples: list[Example], batch_size: int, seed: int) -> Iterator[list[Example]]:
    """Endless batches: each epoch is a fresh seeded shuffle; a batch may span two epochs."""
    rng = random.Random(seed)

    def indices() -> Iterator[int]:
        while True:
            order = list(range(len(examples)))
            rng.shuffle(order)
            yield from order

    stream = indices()
    while True:
        yield [examples[i] for i in itertools.islice(stream, batch_size)]


# --------------------------------------------------------------------------- output


def save_model(model: nn.Module, tokenizer, source_model: str, output_dir: Path, dtype: torch.dtype | None = None) -> None:
    """HF folder (safetensors, tensors in ``dtype``: the compute dtype) + tokenizer, then the
    marker, written last and fsynced.

    SFT does not change the tokenizer: a local source's files (and its generation_config.json)
    are copied as they are, as the RL trainer's weight folders do (``write_hf_folder``).
    """
    source = Path(source_model)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_hf_folder(model, full_state_dict(model, dtype), output_dir, source if source.is_dir() else None)
    if not source.is_dir():  # a hub id: the tokenizer as loaded
        tokenizer.save_pretrained(output_dir)
    with open(output_dir / MARKER, "w") as f:
        f.write("sft\n")
        f.flush()
        os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    return run_process("sft", SFTConfig, train_sft, argv)


if __name__ == "__main__":
    exit_process(main())
