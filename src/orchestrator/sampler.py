"""The environments' ``ModelClient`` for training: chats in, exact tokens out.

The orchestrator renders every prompt itself with the model's chat template
(``prime_rl.chat.render_ids``: message contents never become control tokens) and sends it
to vLLM as token ids. Multi-turn rollouts are exact: turn k's prompt is the previous
turns' tokens exactly as sampled, then the "bridge" the template puts between the last
assistant message and the next generation prompt (the end-of-turn token when the model
did not emit one, the environment's messages, the glue). So the trainer sees precisely
the sequence vLLM saw and nothing is ever re-tokenized.

With ``per_turn`` (for chat templates that rewrite earlier turns), each turn's prompt is
instead the template's fresh rendering of the whole conversation, and each turn becomes
its own training sample.

``ChatSampler`` is the text-only counterpart for evaluating API models (``prime-rl eval``
with an endpoint): chats go out as messages, text comes back, no tokens.

The samplers know nothing of steps, advantages or the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prime_rl.chat import PROBE_CHAT, TemplateError, assistant_span, check_extension, end_of_turn_ids, render_ids
from prime_rl.config import EvalSamplingConfig, SamplingConfig
from prime_rl.envs import Messages, ModelReply, PromptTooLong, ToolCall, Turn

from orchestrator.client import ChatClient, Completion, InferenceClient


class TokenSampler:
    def __init__(
        self,
        client: InferenceClient,
        tokenizer,
        sampling: SamplingConfig,
        seq_len: int,
        per_turn: bool = False,
        tool_call_parser: str | None = None,
        teacher_system_prompt: str | None = None,
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.seq_len = seq_len
        self.per_turn = per_turn
        self.tool_call_parser = tool_call_parser
        self.teacher_system_prompt = teacher_system_prompt
        """Context distillation: each sequence's first prompt is also rendered with this system
        message, for the teacher (``Turn.teacher_prompt_ids``)."""
        self._end_of_turn = end_of_turn_ids(tokenizer)

    async def reply(
        self, messages: Messages, context: Sequence[Turn], n: int = 1, tools: list[dict[str, Any]] | None = None
    ) -> list[ModelReply]:
        """``n`` replies to ``messages``, whose earlier turns were sampled as ``context``; with
        ``tools``, the template shows them and the server's parser reads the calls."""
        teacher = None
        if context and not self.per_turn:
            prefix = sequence_so_far(context)
            new = self.bridge(messages, context[-1], tools)
            prompt = prefix + new
        else:
            prompt = new = render_ids(self.tokenizer, messages, add_generation_prompt=True, tools=tools)
            if self.teacher_system_prompt is not None:
                teacher_messages = with_system_prompt(messages, self.teacher_system_prompt)
                teacher = render_ids(self.tokenizer, teacher_messages, add_generation_prompt=True, tools=tools)
        room = self.seq_len - len(prompt)
        if room < 1:
            raise PromptTooLong(f"the prompt has {len(prompt)} tokens; seq_len is {self.seq_len}")
        results = await self.client.complete_n(
            prompt, n=n, max_tokens=min(self.sampling.max_tokens, room), temperature=self.sampling.temperature
        )
        parsed = await self.parse_tool_calls(prompt, results, tools) if tools else [(r.text, ()) for r in results]
        return [
            ModelReply(text, r.finish_reason, Turn(list(new), r.completion_ids, r.completion_logprobs, versions=r.versions,
                                                  teacher_prompt_ids=teacher), calls)
            for r, (text, calls) in zip(results, parsed)
        ]

    async def extend(self, prompt: list[int], context: Sequence[Turn]) -> ModelReply:
        """One reply to a prompt the environment rendered to token ids itself (a verifiers v1
        taskset's client does). When it extends the exact tokens of ``context`` (this rollout's
        previous turns, as sampled), only the new tokens become this turn's ``prompt_ids``.
        When it does not (the client re-rendered model text that does not re-tokenize to
        what was sampled), the turn restarts the sequence with the whole prompt
        (``Turn.restart``): the trainer then sees each part exactly as vLLM did."""
        if self.teacher_system_prompt is not None:
            raise TemplateError(
                "context distillation (teacher.system_prompt) needs the conversation as messages, and this "
                "environment renders its own token ids (a verifiers v1 taskset's client): drop the teacher's system prompt"
            )
        new, restart = list(prompt), False
        if context and not self.per_turn:
            prefix = sequence_so_far(context)
            if new[: len(prefix)] == prefix:
                new = new[len(prefix):]
            else:
                restart = True
        room = self.seq_len - len(prompt)
        if room < 1:
            raise PromptTooLong(f"the prompt has {len(prompt)} tokens; seq_len is {self.seq_len}")
        (r,) = await self.client.complete_n(
            list(prompt), n=1, max_tokens=min(self.sampling.max_tokens, room), temperature=self.sampling.temperature
        )
        return ModelReply(r.text, r.finish_reason, Turn(new, r.completion_ids, r.completion_logprobs, restart, r.versions))

    async def parse_tool_calls(
        self, prompt: list[int], results: list[Completion], tools: list[dict[str, Any]]
    ) -> list[tuple[str, tuple[ToolCall, ...]]]:
        """(content, tool calls) of each completion, by vLLM's tool-call parser."""
        if self.tool_call_parser is None:
            raise TemplateError(
                "an environment offers tools but no tool-call parser is configured: set `[inference] "
                "tool_call_parser` (e.g. \"hermes\" for Qwen3 and the tiny model)"
            )
        completions = [r.completion_ids for r in results]
        completions = [ids[:-1] if ids and ids[-1] in self._end_of_turn else ids for ids in completions]
        return await self.client.parse_tool_calls(prompt, completions, tools)

    def bridge(self, messages: Messages, last: Turn, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Tokens between the last assistant turn's sampled tokens and the next generation:
        the template's closing of that turn (just its glue when the model emitted the
        end-of-turn token itself), then the messages after it (environment replies, tool
        results) and the generation prompt."""
        j = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
        upto, _, end, close = assistant_span(self.tokenizer, messages, j, tools)
        full = render_ids(self.tokenizer, messages, add_generation_prompt=True, tools=tools)
        if full[: len(upto)] != upto:
            raise TemplateError(
                f"the chat template re-renders assistant message {j} once later messages follow; "
                "set orchestrator.multi_turn = \"per_turn\"", j
            )
        # the model closed its turn itself only if it sampled the template's own end-of-turn
        # token(s) (another special token at the max_tokens cut does not close it)
        end_of_turn = upto[close:end]
        emitted_end = bool(end_of_turn) and last.completion_ids[-len(end_of_turn):] == end_of_turn
        return upto[end if emitted_end else close :] + full[len(upto) :]


def with_system_prompt(messages: Messages, system_prompt: str) -> Messages:
    """``messages`` with ``system_prompt`` as the system message: in place of the
    conversation's own, or put first when it has none."""
    rest = messages[1:] if messages and messages[0].get("role") == "system" else list(messages)
    return [{"role": "system", "content": system_prompt}, *rest]


def sequence_so_far(context: Sequence[Turn]) -> list[int]:
    """The exact tokens a next turn extends: every turn since the last restart, in order."""
    start = max((i for i, turn in enumerate(context) if turn.restart), default=0)
    return [t for turn in context[start:] for t in (*turn.prompt_ids, *turn.completion_ids)]


def check_multi_turn_template(tokenizer, model: str) -> None:
    """Refuse a chat template that rewrites earlier turns (one message: model, turn, fix)."""
    try:
        check_extension(tokenizer, PROBE_CHAT)
    except TemplateError as e:
        raise TemplateError(
            f"model {model!r}: its chat template is non-increasing: {e}; it rewrites earlier turns "
            "(Qwen3 and DeepSeek-R1 templates strip <think> blocks from earlier assistant messages), so a "
            "multi-turn rollout cannot be trained as one sequence. Fix: set `orchestrator.multi_turn = "
            "\"per_turn\"` to train each turn as its own sample, or use a chat template that keeps earlier turns",
            e.index,
        ) from None


class ChatSampler:
    """The environments' ``ModelClient`` for a text-only endpoint (evaluation of an API model).

    The messages go to the chat completions API as they are and the replies come back as
    text: the server applies its own template, and no tokens or logprobs come back
    (``ModelReply.turn`` is None), so nothing sampled here can be trained on. ``context``
    is not needed: the messages hold the whole conversation.
    """

    def __init__(self, client: ChatClient, sampling: EvalSamplingConfig):
        self.client = client
        self.sampling = sampling

    async def reply(
        self, messages: Messages, context: Sequence[Turn], n: int = 1, tools: list[dict[str, Any]] | None = None
    ) -> list[ModelReply]:
        results = await self.client.chat_text_n(
            messages, n=n, max_tokens=self.sampling.max_tokens, temperature=self.sampling.temperature, tools=tools
        )
        return [ModelReply(text, finish_reason, None, calls) for text, finish_reason, calls in results]
