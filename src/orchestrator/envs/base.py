"""The environment protocol, modelled on the classic `verifiers` API.

A module exposes ``load_environment(**args) -> Environment``. An environment owns a
deterministic, indexable ``dataset`` of ``Example`` and an async ``rollout`` that plays
one episode through the inference client and scores it. It returns exact tokens, turn
by turn, so the trainer sees what the sampler saw (never re-tokenized text).

Environments know nothing about advantages, batches, ranks or the trainer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from prime_rl.config import SamplingConfig

from orchestrator.client import ChatResult, InferenceClient

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Example:
    id: int
    """Index of the example in its environment's dataset."""

    prompt: Messages
    """Chat messages sent to the model (OpenAI format)."""

    answer: str
    """Reference answer used by the scorer."""

    info: dict[str, Any] = field(default_factory=dict)
    """Anything else the environment needs to score or play the episode."""


@dataclass(frozen=True)
class Turn:
    """One model call. Concatenating all turns' ``prompt_ids + completion_ids`` in order
    gives the episode's full token sequence, so ``prompt_ids`` of turn k > 0 holds only
    the tokens added since turn k-1's completion (environment/tool messages, template
    glue), not the whole history again."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    """Sampler logprob of each completion token (same length as ``completion_ids``)."""


@dataclass(frozen=True)
class Rollout:
    example_id: int
    turns: list[Turn]
    reward: float
    completion_text: str = ""
    """Text of the last completion (for logs and debugging)."""

    finish_reason: str | None = None
    """`stop` or `length` of the last model call."""

    @property
    def completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def total_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.turns)


@runtime_checkable
class Environment(Protocol):
    dataset: Sequence[Example]

    async def rollout(self, client: InferenceClient, example: Example, sampling: SamplingConfig) -> Rollout: ...


async def rollout_group(
    env: Environment, client: InferenceClient, example: Example, sampling: SamplingConfig, n: int
) -> list[Rollout]:
    """``n`` rollouts of one example: the environment's own ``rollout_group`` when it has one
    (a single-turn env samples all ``n`` in one request), else ``n`` concurrent ``rollout`` calls."""
    if hasattr(env, "rollout_group"):
        return await env.rollout_group(client, example, sampling, n)
    return list(await asyncio.gather(*(env.rollout(client, example, sampling) for _ in range(n))))


class SingleTurnEnv:
    """One chat call, then ``score(example, completion_text)``. Subclasses set
    ``self.dataset`` and override ``score``."""

    dataset: Sequence[Example]

    def score(self, example: Example, completion_text: str) -> float:
        raise NotImplementedError

    async def rollout(self, client: InferenceClient, example: Example, sampling: SamplingConfig) -> Rollout:
        return (await self.rollout_group(client, example, sampling, 1))[0]

    async def rollout_group(
        self, client: InferenceClient, example: Example, sampling: SamplingConfig, n: int
    ) -> list[Rollout]:
        # One request with n choices: the prompt is prefilled once and the HTTP overhead,
        # which dominates on CPU for short answers, is paid once per group.
        results = await client.chat_n(
            example.prompt, n=n, max_tokens=sampling.max_tokens, temperature=sampling.temperature
        )
        return [self._scored(example, result) for result in results]

    def _scored(self, example: Example, result: ChatResult) -> Rollout:
        turn = Turn(result.prompt_ids, result.completion_ids, result.completion_logprobs)
        return Rollout(
            example_id=example.id,
            turns=[turn],
            reward=float(self.score(example, result.text)),
            completion_text=result.text,
            finish_reason=result.finish_reason,
        )
