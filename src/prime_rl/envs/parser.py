"""Parsers: pull the answer out of a model's reply, and reward replies that follow the format.

``Parser`` keeps the text as it is (or applies ``extract_fn``); ``XMLParser`` reads tagged
fields (``<answer>...</answer>``) like the classic verifiers parser; ``ThinkParser`` keeps
what follows ``</think>``. A parser is handed to reward functions that name ``parser``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from prime_rl.envs.types import Messages


def messages_of(completion: str | Messages, role: str) -> list[str]:
    """Contents of the messages with ``role`` (a plain string counts as one assistant message)."""
    if isinstance(completion, str):
        return [completion] if role == "assistant" else []
    return [str(m.get("content") or "") for m in completion if m.get("role") == role]


class Parser:
    def __init__(self, extract_fn: Callable[[str], Any] | None = None):
        self.extract_fn = extract_fn

    def parse(self, text: str) -> Any:
        return self.extract_fn(text) if self.extract_fn is not None else text

    def get_assistant_messages(self, completion: Messages) -> Messages:
        return [m for m in completion if m.get("role") == "assistant"]

    def get_user_messages(self, completion: Messages) -> Messages:
        return [m for m in completion if m.get("role") == "user"]

    def parse_answer(self, completion: str | Messages) -> str | None:
        """The parsed last assistant message (None when there is none)."""
        replies = messages_of(completion, "assistant")
        if not replies:
            return None
        parsed = self.parse(replies[-1])
        return None if parsed is None else str(parsed)

    def get_format_reward_func(self) -> Callable[..., float]:
        """A reward function (``completion`` -> [0, 1]): 1 when every reply parses to something."""

        def format_reward(completion: str | Messages) -> float:
            replies = messages_of(completion, "assistant")
            if not replies:
                return 0.0
            return sum(self.parse(r) not in (None, "") for r in replies) / len(replies)

        return format_reward


class XMLParser(Parser):
    """Tagged fields: ``XMLParser(["think", ("answer", "final")], answer_field="answer")``.

    A tuple lists alternative tag names of one field (the first is the canonical one, used by
    ``format`` and as the attribute name). ``parse`` returns a namespace with every field's
    content (the last occurrence, stripped) or None.
    """

    def __init__(self, fields: Sequence[str | tuple[str, ...]], answer_field: str = "answer"):
        super().__init__()
        self.fields: list[tuple[str, ...]] = [(f,) if isinstance(f, str) else tuple(f) for f in fields]
        if not self.fields or any(not f or not all(isinstance(n, str) and n for n in f) for f in self.fields):
            raise ValueError(f"XMLParser needs field names (strings or tuples of strings), got {fields!r}")
        self.answer_field = answer_field
        if answer_field not in {f[0] for f in self.fields} | {n for f in self.fields for n in f}:
            raise ValueError(f"XMLParser: answer_field {answer_field!r} is not one of the fields {fields!r}")

    @staticmethod
    def _matches(text: str, tag: str) -> list[str]:
        return re.findall(rf"<{re.escape(tag)}>\s*(.*?)\s*</{re.escape(tag)}>", text, re.DOTALL)

    def parse(self, text: str) -> SimpleNamespace:
        values = {}
        for names in self.fields:
            found = None
            for name in names:
                matches = self._matches(text, name)
                if matches:
                    found = matches[-1]
                    break
            values[names[0]] = found
        return SimpleNamespace(**values)

    def _field_of(self, name: str) -> str:
        return next(f[0] for f in self.fields if name in f)

    def parse_answer(self, completion: str | Messages) -> str | None:
        """The answer field of the last assistant message that has one."""
        key = self._field_of(self.answer_field)
        for reply in reversed(messages_of(completion, "assistant")):
            value = getattr(self.parse(reply), key)
            if value is not None:
                return value
        return None

    def format(self, **values: Any) -> str:
        """``format(answer="42")`` -> ``<answer>\\n42\\n</answer>`` (fields in declared order)."""
        parts = []
        for names in self.fields:
            for name in names:
                if name in values and values[name] is not None:
                    parts.append(f"<{name}>\n{values[name]}\n</{name}>")
                    break
        return "\n".join(parts)

    def get_format_reward_func(self) -> Callable[..., float]:
        """Per assistant message: 0.6 x the share of fields present with content, + 0.2 when
        no field appears more than once, + 0.2 when the message ends with a field's closing
        tag; averaged over the assistant messages (0 when there are none)."""

        def format_reward(completion: str | Messages) -> float:
            replies = messages_of(completion, "assistant")
            if not replies:
                return 0.0
            return sum(self._format_score(r) for r in replies) / len(replies)

        return format_reward

    def _format_score(self, text: str) -> float:
        present, once = 0, True
        for names in self.fields:
            counts = [len(self._matches(text, n)) for n in names]
            if any(self._matches(text, n) and any(m.strip() for m in self._matches(text, n)) for n in names):
                present += 1
            once = once and sum(counts) <= 1
        if present == 0:
            return 0.0
        closes = any(text.rstrip().endswith(f"</{n}>") for names in self.fields for n in names)
        return 0.6 * present / len(self.fields) + 0.2 * once + 0.2 * closes


class ThinkParser(Parser):
    """Keeps what follows ``</think>`` (passed through ``extract_fn`` if given); a reply
    without ``</think>`` parses to the empty string (the model never finished thinking)."""

    def parse(self, text: str) -> Any:
        if "</think>" not in text:
            return ""
        return super().parse(text.rsplit("</think>", 1)[1].strip())
