"""Packing scored rollouts into per-rank ``TrainBatch`` messages (pure, no I/O).

A sample's tokens are its turns' ``prompt_ids + completion_ids`` concatenated in order.
``loss_mask`` is 1 exactly on tokens the policy sampled and ``inference_logprobs``
carries the sampler's logprob there (0 elsewhere). Samples longer than ``seq_len`` are
cut at ``seq_len``, all three buffers alike.

Every rank gets the same number of samples (a contiguous slice, so groups mostly stay
together), then micro-batches of ``micro_batch_size``; the last one of a rank may be
smaller. Equal counts keep FSDP ranks in lockstep (same number of forward passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, Sample, TrainBatch, make_sample

from orchestrator.envs.base import Rollout


@dataclass(frozen=True)
class ScoredRollout:
    rollout: Rollout
    advantage: float
    policy_version: int
    """Weights step the rollout was sampled with (0 = the initial model)."""


def rollout_tokens(rollout: Rollout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids int32 [T], loss_mask uint8 [T], inference_logprobs float32 [T]), untruncated."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for turn in rollout.turns:
        if len(turn.completion_ids) != len(turn.completion_logprobs):
            raise ValueError(
                f"example {rollout.example_id}: a turn has {len(turn.completion_ids)} completion ids "
                f"but {len(turn.completion_logprobs)} logprobs"
            )
        ids += turn.prompt_ids + turn.completion_ids
        mask += [0] * len(turn.prompt_ids) + [1] * len(turn.completion_ids)
        logprobs += [0.0] * len(turn.prompt_ids) + list(turn.completion_logprobs)
    return np.asarray(ids, np.int32), np.asarray(mask, np.uint8), np.asarray(logprobs, np.float32)


def to_sample(scored: ScoredRollout, seq_len: int) -> Sample:
    ids, mask, logprobs = rollout_tokens(scored.rollout)
    if min(len(ids), seq_len) < 2:  # the trainer predicts token t+1 from t: one token teaches nothing
        raise ValueError(f"example {scored.rollout.example_id}: a sample needs at least 2 tokens, got {len(ids)}")
    return make_sample(
        ids[:seq_len],
        mask[:seq_len],
        logprobs[:seq_len],
        advantage=scored.advantage,
        reward=scored.rollout.reward,
        policy_version=scored.policy_version,
        example_id=scored.rollout.example_id,
    )


def pack_batches(
    items: Sequence[ScoredRollout],
    *,
    step: int,
    num_ranks: int,
    micro_batch_size: int,
    temperature: float,
    seq_len: int,
) -> list[TrainBatch]:
    """One ``TrainBatch`` per rank (index = rank), in the order of ``items``."""
    if num_ranks < 1 or micro_batch_size < 1:
        raise ValueError(f"num_ranks ({num_ranks}) and micro_batch_size ({micro_batch_size}) must be >= 1")
    if not items or len(items) % num_ranks:
        raise ValueError(f"{len(items)} samples do not split evenly over {num_ranks} trainer ranks")
    samples = [to_sample(item, seq_len) for item in items]
    per_rank = len(samples) // num_ranks
    batches = []
    for rank in range(num_ranks):
        mine = samples[rank * per_rank : (rank + 1) * per_rank]
        micro = [MicroBatch(mine[i : i + micro_batch_size]) for i in range(0, per_rank, micro_batch_size)]
        batches.append(
            TrainBatch(
                schema_version=SCHEMA_VERSION, step=step, rank=rank, temperature=temperature, micro_batches=micro
            )
        )
    return batches
