"""Packing scored rollouts into per-rank ``TrainBatch`` messages (pure, no I/O).

A sample's tokens are its turns' ``prompt_ids + completion_ids`` concatenated in order.
``loss_mask`` is 1 exactly on tokens the policy sampled and ``inference_logprobs``
carries the sampler's logprob there (0 elsewhere). Samples longer than ``seq_len`` are
cut at ``seq_len``, all three buffers alike. With a distillation teacher each sample also
carries the teacher's logprob of every sampled token (``ScoredRollout.teacher_logprobs``,
``orchestrator.teacher``).

A rollout whose environment re-rendered the conversation itself (``Turn.restart``: a v1
taskset's client) is one sample per run of turns that extend each other. With ``per_turn``
(chat templates that rewrite earlier turns), every turn is a sample of its own: its prompt (the whole conversation so far, as rendered) and its completion, with
the rollout's advantage.

Ranks get shares of equal token count, not of equal sample count: a rank's step time
grows with its tokens, and every rank waits for the slowest. Whole groups (the adjacent
samples of one example) go to ranks largest first, each to the rank with the fewest tokens
so far (LPT); with fewer groups than ranks, single samples do. A rank keeps its samples in
their original order, so a group stays adjacent and the trainer can share its prompt
within a micro-batch. Each rank's samples are cut into micro-batches of
``micro_batch_size``; the last one may be smaller, and ranks may get different counts: a
rank with fewer micro-batches joins the others' passes with empty ones (the trainer keeps
FSDP ranks in lockstep).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prime_rl.envs import Rollout, Turn
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, Sample, TrainBatch, make_sample


@dataclass(frozen=True)
class ScoredRollout:
    rollout: Rollout
    advantage: float
    policy_version: int
    """Weights step the rollout was sampled with (0 = the initial model)."""

    env: str = ""
    """Name of the environment it came from (for metrics)."""

    last_policy_version: int | None = None
    """Newest weights step among its tokens (a reload landed while it was sampled); None =
    ``policy_version``."""

    teacher_logprobs: tuple[np.ndarray, ...] | None = None
    """Distillation: the teacher's logprob of every token, one float32 array per sample of the
    rollout (``sample_turns``), aligned with its tokens cut at ``seq_len`` (0 off the
    sampled tokens); None = no teacher."""

    teacher_top: tuple[tuple[np.ndarray, np.ndarray], ...] | None = None
    """Distillation with `top_k`: per sample, the teacher's K most likely tokens (ids int32,
    logprobs float32, both [N, K]) at each of its N sampled tokens cut at ``seq_len``; None = not asked."""

    trace_id: str | None = None
    """Its id in `RUN/traces/` when traced (``orchestrator.traces``); the trainer traces its samples under it."""


def rollout_tokens(rollout: Rollout, turns: list[Turn] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids int32 [T], loss_mask uint8 [T], inference_logprobs float32 [T]) of the
    rollout's turns (or of ``turns``) in order, untruncated."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for turn in rollout.turns if turns is None else turns:
        if len(turn.completion_ids) != len(turn.completion_logprobs):
            raise ValueError(
                f"example {rollout.example_id}: a turn has {len(turn.completion_ids)} completion ids "
                f"but {len(turn.completion_logprobs)} logprobs"
            )
        ids += turn.prompt_ids + turn.completion_ids
        mask += [0] * len(turn.prompt_ids) + [1] * len(turn.completion_ids)
        logprobs += [0.0] * len(turn.prompt_ids) + list(turn.completion_logprobs)
    return np.asarray(ids, np.int32), np.asarray(mask, np.uint8), np.asarray(logprobs, np.float32)


def to_samples(scored: ScoredRollout, seq_len: int, per_turn: bool = False) -> list[Sample]:
    """One sample for the rollout (one per run of turns that extend each other, when the
    environment's client re-rendered the conversation: ``Turn.restart``), or one per turn
    with ``per_turn``; none for a rollout without tokens (its episode failed before the model
    replied, as a v1 harness can under load: it still counts in its group's advantages, with
    its reward, and in `batch/rollouts_without_tokens`)."""
    if not scored.rollout.turns:  # an episode that failed before the model's first reply: scored, not trained
        return []
    splits = sample_turns(scored.rollout, per_turn)
    teacher = scored.teacher_logprobs or (None,) * len(splits)
    top = scored.teacher_top or (None,) * len(splits)
    if not len(teacher) == len(top) == len(splits):
        raise ValueError(f"example {scored.rollout.example_id}: {len(teacher)} teacher arrays for {len(splits)} samples")
    return [to_sample(scored, seq_len, turns, t, k, part) for part, (turns, t, k) in enumerate(zip(splits, teacher, top))]


def sample_turns(rollout: Rollout, per_turn: bool = False) -> list[list[Turn]]:
    """The turns of each sample the rollout trains as (see ``to_samples``)."""
    turns = rollout.turns
    if not turns:
        raise ValueError(f"example {rollout.example_id}: a rollout without tokens cannot be trained on")
    if per_turn:
        return [[turn] for turn in turns]
    starts = [0] + [i for i, turn in enumerate(turns) if turn.restart and i > 0]
    return [turns[a:b] for a, b in zip(starts, [*starts[1:], len(turns)])]


def to_sample(
    scored: ScoredRollout, seq_len: int, turns: list[Turn] | None = None, teacher_logprobs: np.ndarray | None = None,
    teacher_top: tuple[np.ndarray, np.ndarray] | None = None, part: int = 0,
) -> Sample:
    ids, mask, logprobs = rollout_tokens(scored.rollout, turns)
    if min(len(ids), seq_len) < 2:  # the trainer predicts token t+1 from t: one token teaches nothing
        raise ValueError(f"example {scored.rollout.example_id}: a sample needs at least 2 tokens, got {len(ids)}")
    # context distillation with the teacher in the trainer (none scored it here): the
    # teacher's first prompt goes along, for the trainer to score the sample under it
    first = (turns or scored.rollout.turns)[0]
    teacher_prompt = None
    if teacher_logprobs is None and first.teacher_prompt_ids is not None and len(first.prompt_ids) < min(len(ids), seq_len):
        teacher_prompt = (first.teacher_prompt_ids, len(first.prompt_ids))
    return make_sample(
        ids[:seq_len],
        mask[:seq_len],
        logprobs[:seq_len],
        advantage=scored.advantage,
        reward=scored.rollout.reward,
        policy_version=scored.policy_version,
        example_id=scored.rollout.example_id,
        last_policy_version=scored.last_policy_version,
        teacher_logprobs=teacher_logprobs,
        teacher_top=teacher_top,
        teacher_prompt=teacher_prompt,
        trace_id=scored.trace_id,
        trace_part=part,
    )


def pack_batches(
    items: Sequence[ScoredRollout],
    *,
    step: int,
    num_ranks: int,
    micro_batch_size: int,
    temperature: float,
    seq_len: int,
    per_turn: bool = False,
) -> list[TrainBatch]:
    """One ``TrainBatch`` per rank (index = rank); ``items`` arrive group by group."""
    samples = [sample for item in items for sample in to_samples(item, seq_len, per_turn)]
    return pack_samples(
        samples, step=step, num_ranks=num_ranks, micro_batch_size=micro_batch_size, temperature=temperature
    )


def pack_samples(
    samples: Sequence[Sample], *, step: int, num_ranks: int, micro_batch_size: int, temperature: float
) -> list[TrainBatch]:
    """One ``TrainBatch`` per rank from built samples: a fresh step's, or a recorded step's
    gathered from its frames when a resume runs on another number of ranks."""
    if num_ranks < 1 or micro_batch_size < 1:
        raise ValueError(f"num_ranks ({num_ranks}) and micro_batch_size ({micro_batch_size}) must be >= 1")
    batches = []
    for rank, mine in enumerate(balance_ranks(samples, num_ranks)):
        micro = [MicroBatch(mine[i : i + micro_batch_size]) for i in range(0, len(mine), micro_batch_size)]
        batches.append(
            TrainBatch(
                schema_version=SCHEMA_VERSION, step=step, rank=rank, temperature=temperature, micro_batches=micro
            )
        )
    return batches


def balance_ranks(samples: Sequence[Sample], num_ranks: int) -> list[list[Sample]]:
    """Each rank's samples, in their original order, with token counts as equal as whole
    groups allow (LPT: largest group first, each to the rank with the fewest tokens so far;
    ties go to the lower rank). With fewer groups than ranks, single samples are the units,
    so that every rank still gets work."""
    if len(samples) < num_ranks:
        raise ValueError(f"{len(samples)} samples cannot feed {num_ranks} trainer ranks")
    units = example_groups(samples)
    if len(units) < num_ranks:
        units = [range(i, i + 1) for i in range(len(samples))]
    tokens = [sum(sample_tokens(samples[i]) for i in unit) for unit in units]
    loads = [0] * num_ranks
    owner = [0] * len(samples)  # rank of each sample
    for u in sorted(range(len(units)), key=lambda u: -tokens[u]):  # stable: equal sizes keep their order
        rank = min(range(num_ranks), key=loads.__getitem__)
        loads[rank] += tokens[u]
        for i in units[u]:
            owner[i] = rank
    return [[sample for sample, r in zip(samples, owner) if r == rank] for rank in range(num_ranks)]


def example_groups(samples: Sequence[Sample]) -> list[range]:
    """Index ranges of the runs of adjacent samples with the same ``example_id``: one
    example's rollouts (with ``per_turn``, their turns). Two groups of one example that
    happen to be adjacent form one run, which only makes the balance coarser."""
    groups: list[range] = []
    start = 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i].example_id != samples[start].example_id:
            groups.append(range(start, i))
            start = i
    return groups


def sample_tokens(sample: Sample) -> int:
    """Tokens of a sample, already cut at ``seq_len`` (``input_ids`` is int32, 4 bytes each)."""
    return len(sample.input_ids) // 4
