"""The distillation teacher, from the orchestrator's side: it scores every token the student
sampled (`[teacher]`, `[trainer.loss.distill]`).

Each sample's exact token ids go to the teacher's vLLM server as a prompt, and its prompt
logprobs come back: log p_teacher of every token given the ones before it, under the
teacher's weights, with nothing re-tokenized. With context distillation the sample's first
prompt is swapped for the teacher's rendering of the same conversation with its own system
prompt (``Turn.teacher_prompt_ids``); the completion and everything after it are the same
tokens, shifted. The trainer turns the gap into each token's advantage
(``trainer.loss.distill_advantages``). With ``top_k`` the teacher also returns its K most
likely tokens at every sampled position, for the trainer's top-k reverse KL
(``trainer.loss.top_k_reverse_kl``).

Before the first step, ``check`` refuses in one line a teacher that does not answer, one
whose tokenizer differs from the student's, one whose context is shorter than a sample, one
that returns no prompt logprobs and, with ``top_k``, one that cannot return K tokens a position.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
from prime_rl.chat import probe_text
from prime_rl.config import TeacherClientConfig
from prime_rl.envs import Rollout, Turn
from prime_rl.wire import in_teacher_prompt

from orchestrator.batch import ScoredRollout, rollout_tokens, sample_turns
from orchestrator.client import InferenceError, TeacherClient

PROMPTS_PER_REQUEST = 64
"""Samples scored per request (vLLM's completions API takes a list of token-id prompts). On
the quickstart (256 samples of ~40 tokens a step, `benchmarks/distill.py --quick`) the
teacher took 4.1 s a step with one request a sample, 1.65 s with 16 a request, 1.35 s with 64."""


class TeacherError(RuntimeError):
    """The teacher cannot serve this run (one line saying why)."""


class Teacher:
    def __init__(self, cfg: TeacherClientConfig):
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        client = cfg.client if key is None else cfg.client.model_copy(update={"api_key": key})
        # an endpoint's key goes with every request; a local teacher proves it holds the run's key first
        self.client = TeacherClient(client, cfg.model, own_server=cfg.api_key_env is None)
        self.url = self.client.base_url
        self.top_k = cfg.top_k

    async def close(self) -> None:
        await self.client.close()

    async def check(self, tokenizer, seq_len: int) -> None:
        """Refuse a teacher that cannot score this run's samples, before the first step."""
        timeout = self.client.config.startup_timeout_s
        try:
            await self.client.wait_healthy(timeout)
        except (TimeoutError, InferenceError) as e:
            raise TeacherError(f"teacher at {self.url}: not reachable ({e})") from None
        text = probe_text(tokenizer)
        ours = tokenizer.encode(text, add_special_tokens=False)
        try:
            theirs, limit = await self.client.tokenize(text)
        except InferenceError as e:
            raise TeacherError(f"teacher at {self.url}: cannot check its tokenizer ({e}); a teacher must be a vLLM server") from None
        if theirs != ours:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise TeacherError(
                f"teacher at {self.url}: its tokenizer differs from the student's (a probe text's token {first} differs: "
                "the teacher scores the student's exact token ids, so it needs the same tokenizer)"
            )
        if limit is not None and limit < seq_len + 1:
            raise TeacherError(
                f"teacher at {self.url}: its context is {limit} tokens, shorter than a sample (seq_len {seq_len} + 1): "
                "serve it with a longer max_model_len (teacher.seq_len for a local teacher)"
            )
        try:
            await self.client.prompt_logprobs([ours[:32]])
        except InferenceError as e:
            raise TeacherError(f"teacher at {self.url}: {e}") from None
        if self.top_k:
            try:
                await self.client.prompt_top_logprobs([ours[:32]], self.top_k)
            except InferenceError as e:
                raise TeacherError(
                    f"teacher at {self.url}: cannot return its {self.top_k} most likely tokens a position "
                    f"(trainer.loss.distill.top_k): {e}; a vLLM server needs --max-logprobs >= {self.top_k} "
                    "(a local teacher gets it)"
                ) from None

    async def score(
        self, items: list[ScoredRollout], seq_len: int, per_turn: bool = False
    ) -> tuple[list[ScoredRollout], dict[str, float]]:
        """``items`` with the teacher's logprob of every sampled token, and the step's metrics:
        `distill/reverse_kl` (mean over sampled tokens of log p_student - log p_teacher), the
        teacher's time and tokens per second."""
        start = time.perf_counter()
        splits = [sample_turns(item.rollout, per_turn) for item in items]
        samples = [prepare(item.rollout, turns, seq_len) for item, turns_of in zip(items, splits) for turns in turns_of]
        chunks = [samples[i : i + PROMPTS_PER_REQUEST] for i in range(0, len(samples), PROMPTS_PER_REQUEST)]
        answers = await asyncio.gather(*(self.ask([s.sequence for s in chunk]) for chunk in chunks))
        scored = [sample.aligned(*teacher) for chunk, got in zip(chunks, answers) for sample, teacher in zip(chunk, got)]
        elapsed = time.perf_counter() - start
        out, at = [], 0
        for item, turns_of in zip(items, splits):
            mine = scored[at : at + len(turns_of)]
            top = tuple(t.top for t in mine) if self.top_k else None
            out.append(dataclasses.replace(item, teacher_logprobs=tuple(t.logprobs for t in mine), teacher_top=top))
            at += len(turns_of)
        gap = np.concatenate([t.gap for t in scored]) if scored else np.zeros(0)
        tokens = sum(len(s.sequence) for s in samples)
        return out, {
            "distill/reverse_kl": float(gap.mean()) if len(gap) else 0.0,
            "distill/teacher_s": elapsed,
            "distill/teacher_tokens_per_s": tokens / max(elapsed, 1e-9),
        }


    async def ask(self, sequences: list[list[int]]) -> list[tuple[np.ndarray, ...]]:
        """The teacher's answer for each sequence: (logprobs [T],) or, with top_k, (logprobs [T],
        top ids [T, K], top logprobs [T, K])."""
        if self.top_k:
            return await self.client.prompt_top_logprobs(sequences, self.top_k)
        return [(logprobs,) for logprobs in await self.client.prompt_logprobs(sequences)]


@dataclass(frozen=True)
class Scored:
    """The teacher's scores of one sample, at the student's positions."""

    logprobs: np.ndarray
    """float32 [T]: the teacher's logprob of each sampled token, 0 elsewhere."""

    gap: np.ndarray
    """float32 [N]: log p_student - log p_teacher of each of the N sampled tokens."""

    top: tuple[np.ndarray, np.ndarray] | None
    """(ids int32 [N, K], logprobs float32 [N, K]): the teacher's top-k at each sampled token; None without top_k."""


@dataclass(frozen=True)
class ToScore:
    """One sample as the teacher sees it."""

    sequence: list[int]
    """The ids the teacher scores (``teacher_sequence``)."""

    offset: int
    """How far each student position moves in ``sequence``."""

    mask: np.ndarray
    """The student's sampled tokens, bool [T] (T: its tokens cut at seq_len)."""

    student: np.ndarray
    """The student's sampling logprobs, float32 [T]."""

    def aligned(self, teacher: np.ndarray, top_ids: np.ndarray | None = None, top_logprobs: np.ndarray | None = None) -> Scored:
        """The teacher's scores at the student's positions, from its answer for ``sequence``:
        its logprobs [len(sequence)] and, with top_k, its top ids and logprobs [len(sequence), K]."""
        where = np.flatnonzero(self.mask)
        out = np.zeros(len(self.mask), dtype=np.float32)
        out[where] = teacher[where + self.offset]
        top = None if top_ids is None else (top_ids[where + self.offset], top_logprobs[where + self.offset])
        return Scored(out, self.student[where] - out[where], top)


def prepare(rollout: Rollout, turns: list[Turn], seq_len: int) -> ToScore:
    """The sample of ``rollout`` made of ``turns``, its tokens cut at ``seq_len``, for the teacher."""
    ids, mask, student = (a[:seq_len] for a in rollout_tokens(rollout, turns))
    sequence, offset = teacher_sequence(turns, ids)
    return ToScore(sequence, offset, mask.astype(bool), student)


def teacher_sequence(turns: list[Turn], ids: np.ndarray) -> tuple[list[int], int]:
    """(the token ids the teacher scores for a sample of ``turns`` whose student tokens are
    ``ids``, how far each student position moves in them): the same ids, or with context
    distillation the teacher's first prompt in place of the student's."""
    first = turns[0]
    if first.teacher_prompt_ids is None:
        return [int(t) for t in ids], 0
    sequence, offset = in_teacher_prompt(ids, first.teacher_prompt_ids, len(first.prompt_ids))
    return sequence.tolist(), offset
