"""Chats to token ids with the model's own chat template, safely and exactly.

Shared by the orchestrator (prompts it sends to vLLM as token ids) and SFT (the chats it
trains on), so both see the same tokens. Works with any HF tokenizer object; imports
neither torch nor vLLM.

Safety: a chat template renders text, and tokenizing that text turns every occurrence of
a control token's string into the control token, including one that comes from a user, a
dataset or an environment (a literal ``<|im_end|>`` in a message would end the turn).
``render_ids`` tokenizes message contents that contain such strings as plain text
(``split_special_tokens``); only the template's own glue yields control tokens.

Exactness: multi-turn rollouts are trained as one sequence only when the template renders
each turn as an extension of the previous ones (``check_extension``); templates that
rewrite earlier turns (Qwen3 and DeepSeek-R1 strip ``<think>`` blocks from earlier
assistant messages) must train each turn as its own sample instead.
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None
"""OpenAI tool schemas the template shows the model (None or empty: no tools)."""

# A conversation that exercises what templates rewrite: reasoning blocks in assistant turns.
PROBE_CHAT: Messages = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "First question?"},
    {"role": "assistant", "content": "<think>\nFirst reasoning.\n</think>\n\nFirst answer."},
    {"role": "user", "content": "Second question?"},
    {"role": "assistant", "content": "<think>\nSecond reasoning.\n</think>\n\nSecond answer."},
    {"role": "user", "content": "Third question?"},
    {"role": "assistant", "content": "Third answer."},
]

PROBE_TEXT = " 0123 héllo wörld ✓ \t\n"
"""Text whose tokenization tells tokenizers apart, beside the chat template's own tokens."""


def probe_text(tokenizer) -> str:
    """The chat template's rendering of ``PROBE_CHAT`` (its special tokens), then ``PROBE_TEXT``:
    two tokenizers that encode it alike score the same token ids alike (a distillation
    teacher must use the student's tokenizer)."""
    try:
        return tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False) + PROBE_TEXT
    except ValueError:  # no chat template
        return PROBE_TEXT


class TemplateError(ValueError):
    """The chat template cannot give what training needs; the message says why and the fix."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


def control_token_strings(tokenizer) -> list[str]:
    """Strings that tokenize to a special (control) token, longest first."""
    found = {tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special}
    found.update(t for t in getattr(tokenizer, "all_special_tokens", []) if t)
    return sorted(found, key=len, reverse=True)


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with no control token: their strings stay plain characters."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def render_text(tokenizer, messages: Messages, add_generation_prompt: bool = False, tools: Tools = None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def render_ids(tokenizer, messages: Messages, add_generation_prompt: bool = False, tools: Tools = None) -> list[int]:
    """The template's rendering of ``messages`` as token ids, where message contents never
    become control tokens.

    When no content holds a control token's string this is exactly what vLLM's chat endpoint
    and ``apply_chat_template(tokenize=True)`` give. Otherwise each such content is found in
    the rendered text (in message order) and tokenized as plain text, the glue around it as
    usual. A template that changes such a content beyond recognition is refused.
    """
    text = render_text(tokenizer, messages, add_generation_prompt, tools)
    controls = control_token_strings(tokenizer)
    risky = [str(m.get("content")) for m in messages if isinstance(m.get("content"), str) and any(c in m["content"] for c in controls)]
    if not risky:
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids: list[int] = []
    cursor = 0
    for content in risky:
        at = text.find(content, cursor)
        if at < 0:
            raise TemplateError(
                "a message contains a control-token string and the chat template rewrote it, so it cannot be "
                f"tokenized safely: {content[:80]!r}"
            )
        ids += tokenizer.encode(text[cursor:at], add_special_tokens=False) + encode_plain(tokenizer, content)
        cursor = at + len(content)
    return ids + list(tokenizer.encode(text[cursor:], add_special_tokens=False))


def end_of_turn_ids(tokenizer) -> set[int]:
    """eos plus every special added token (ChatML's <|im_end|>, Llama 3's <|eot_id|>, ...)."""
    ids = {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def assistant_span(tokenizer, messages: Messages, index: int, tools: Tools = None) -> tuple[list[int], int, int, int]:
    """Where assistant message ``index`` lies in the rendering of ``messages[:index + 1]``.

    Returns (ids, start, end, close): ``ids[start:end]`` is what the model generates for it
    (its content and its end-of-turn token), ``ids[end:]`` the template's glue after that
    token, and ``close`` the start of the template's closing tokens (the end-of-turn token
    onwards, ``close == end`` when the template writes none). Raises ``TemplateError`` when
    the rendering up to the turn does not extend the prompt the model saw.
    """
    prefix = render_ids(tokenizer, messages[:index], add_generation_prompt=True, tools=tools)
    ids = render_ids(tokenizer, messages[: index + 1], tools=tools)
    if ids[: len(prefix)] != prefix:
        raise TemplateError(f"message {index} (assistant) does not extend the prompt rendered before it", index)
    turn = ids[len(prefix) :]
    stops = [j for j, t in enumerate(turn) if t in end_of_turn_ids(tokenizer)]
    if not stops:
        return ids, len(prefix), len(ids), len(ids)
    close = len(prefix) + stops[-1]
    return ids, len(prefix), close + 1, close


def check_extension(tokenizer, messages: Messages) -> None:
    """Raise ``TemplateError`` (with the message index) unless every prefix of the chat
    renders as a prefix of the next one, assistant turns included."""
    previous: list[int] = []
    for index in range(len(messages)):
        if messages[index].get("role") == "assistant":
            assistant_span(tokenizer, messages, index)
        ids = render_ids(tokenizer, messages[: index + 1])
        if ids[: len(previous)] != previous:
            changed = index - 1
            while changed > 0 and messages[changed].get("role") != "assistant":
                changed -= 1
            raise TemplateError(
                f"adding message {index} ({messages[index].get('role')}) re-renders earlier messages "
                f"(e.g. message {changed}, {messages[changed].get('role')})",
                index,
            )
        previous = ids
