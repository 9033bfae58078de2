"""The data an environment works with: examples, model replies, exact tokens, rollouts.

Plain dataclasses and one protocol; nothing here knows how a model is served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Messages = list[dict[str, Any]]
"""Chat messages in the OpenAI format: ``[{"role": "user", "content": "..."}, ...]``."""

State = dict[str, Any]
"""One rollout's mutable state (see ``Environment.initial_state`` for its keys)."""


@dataclass(frozen=True)
class Example:
    id: int
    """Index of the example in its dataset."""

    prompt: Messages
    """Chat messages the first model call sees (system prompt included)."""

    answer: str = ""
    """Reference answer, for the reward functions."""

    info: dict[str, Any] = field(default_factory=dict)
    """Anything else the environment needs to play or score the episode."""

    task: str = "default"
    """Task label (a dataset may mix several)."""


@dataclass(frozen=True)
class Turn:
    """The exact tokens of one model call. Concatenating every turn's ``prompt_ids +
    completion_ids`` in order gives the rollout's token sequence: ``prompt_ids`` of turn
    k > 0 holds only the tokens added since turn k-1's completion (environment and user
    messages, template glue), never the history again (unless the run trains each turn as
    its own sample, where it is the whole prompt)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    """Sampler logprob of each completion token (same length as ``completion_ids``)."""

    restart: bool = False
    """``prompt_ids`` is the whole prompt, not an extension of the turns before: the
    environment's own client re-rendered the conversation (a verifiers v1 taskset whose
    model text does not re-tokenize to what was sampled). The rollout then trains as one
    sample per run of turns that extend each other, each exact."""

    versions: tuple[int, int] = (0, 0)
    """Policy versions that sampled ``completion_ids``: the one served when the request went
    out and the one served when it came back. They differ when a new policy was loaded
    while the request was in flight: its first tokens come from the older weights, the
    rest from the newer (each token's logprob is the one it was sampled with)."""

    teacher_prompt_ids: list[int] | None = None
    """Context distillation: the prompt the teacher scores this turn's completion under, in
    place of ``prompt_ids`` (the conversation rendered with the teacher's system prompt).
    Only on a turn that starts a sequence; None = the teacher sees ``prompt_ids``."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a model reply, as the model server's tool-call parser read it."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text, exactly as parsed (possibly invalid: the model wrote it)."""

    def message(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry of the assistant message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ModelReply:
    text: str
    """The assistant message's content (without its tool calls)."""

    finish_reason: str | None
    """`stop` (end of turn) or `length` (hit the token limit)."""

    turn: Turn | None = None
    """Exact tokens and logprobs; None from a text-only endpoint (evaluation of an API model)."""

    tool_calls: tuple[ToolCall, ...] = ()
    """The tool calls the server parsed out of the reply (only when tools were offered)."""

    def message(self) -> dict[str, Any]:
        """The assistant message this reply adds to the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.message() for call in self.tool_calls]
        return message


class PromptTooLong(Exception):
    """The conversation no longer fits the model's context: the rollout must stop."""


@runtime_checkable
class ModelClient(Protocol):
    """What an environment calls to get the model's next message. The orchestrator's
    implementation renders ``messages`` with the model's chat template, extends the exact
    tokens of ``context`` (this rollout's previous turns) and samples ``n`` replies. With
    ``tools`` (OpenAI tool schemas) the template shows them to the model and the server's
    tool-call parser fills ``ModelReply.tool_calls``."""

    async def reply(
        self, messages: Messages, context: Sequence[Turn], n: int = 1, tools: list[dict[str, Any]] | None = None
    ) -> list[ModelReply]: ...


@dataclass
class Rollout:
    example_id: int
    turns: list[Turn]
    """Exact tokens of every model call, in order (empty from a text-only endpoint)."""

    reward: float
    """Weighted sum of the rubric's reward functions."""

    prompt: Messages = field(default_factory=list)
    completion: Messages = field(default_factory=list)
    """Every message after the prompt: the model's and the environment's, in order."""

    metrics: dict[str, float] = field(default_factory=dict)
    """Raw value of every rubric function (reward functions and metrics), by name."""

    errors: tuple[str, ...] = ()
    """Names of the rubric functions that raised for this rollout (they scored 0)."""

    stop_condition: str = ""
    """Why the episode ended: `completed`, `max_turns` or `prompt_too_long`."""

    finish_reason: str | None = None
    """`stop` or `length` of the last model call."""

    state: State = field(default_factory=dict, repr=False, compare=False)
    """The final state (not sent anywhere; for logs and tests)."""

    @property
    def versions(self) -> tuple[int, int]:
        """Oldest and newest policy version among the turns' tokens ((0, 0) without turns)."""
        if not self.turns:
            return (0, 0)
        return min(t.versions[0] for t in self.turns), max(t.versions[1] for t in self.turns)

    @property
    def completion_text(self) -> str:
        """Content of the last assistant message."""
        replies = [m for m in self.completion if m.get("role") == "assistant"]
        return str(replies[-1].get("content") or "") if replies else ""

    @property
    def num_turns(self) -> int:
        return sum(m.get("role") == "assistant" for m in self.completion) or len(self.turns)

    @property
    def completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def total_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.turns)
