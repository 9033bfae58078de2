"""The final answer of a math reply and its comparison with the reference, shared by gsm8k
and math-python.

A reply's final answer is the content of its last ``\\boxed{...}`` (braces balanced), or failing
that the text after its last ``#### `` (to the end of that line). It is compared with the
reference by ``math_verify`` (``parse`` + ``verify``; the `math` extra), run in-process with its
signal-based timeouts off, so it works from any thread; answers over ``MAX_ANSWER_CHARS``
characters score 0 instead, which bounds the time a reply can take. No final answer, or any
parse/verify error, is a wrong answer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from prime_rl.extras import import_extra

MAX_ANSWER_CHARS = 100


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced), None when there is none."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        begin = i
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[begin : i - 1]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: try the one before
    return None


def after_hashes(text: str) -> str | None:
    """The text after the last ``#### `` up to the end of its line, None when there is none."""
    index = text.rfind("#### ")
    if index == -1:
        return None
    return text[index + len("#### ") :].split("\n", 1)[0]


def final_answer(text: str) -> str | None:
    """The reply's final answer: the last ``\\boxed{}``, else the text after the last ``####``."""
    found = last_boxed(text)
    if found is None:
        found = after_hashes(text)
    return None if found is None else found.strip()


def normalize_number(text: str) -> str:
    """``$1,234.`` -> ``$1234`` (thousands separators and a closing period dropped)."""
    text = text.strip().rstrip(".").strip()
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


class _NoTimeoutWarning(logging.Filter):
    """math_verify warns once that its timeouts are off; this module turns them off on
    purpose (signals only work in the main thread) and bounds the input instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_math_verify: tuple[Callable, Callable] | None = None


def load_math_verify(env: str) -> tuple[Callable, Callable]:
    """math_verify's (parse, verify); ``MissingExtra`` naming the `math` extra, and ``env`` as
    the one that needs it, when it is not installed (environments call it at load time)."""
    global _math_verify
    if _math_verify is None:
        math_verify = import_extra("math_verify", env)
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_NoTimeoutWarning())
        _math_verify = (math_verify.parse, math_verify.verify)
    return _math_verify


def answers_match(predicted: str | None, reference: str) -> bool:
    """math_verify's verdict on the final answer against the reference (False on any error)."""
    if not predicted or len(predicted) > MAX_ANSWER_CHARS:
        return False
    parse, verify = load_math_verify("grading math answers")
    try:
        gold = parse(f"\\boxed{{{normalize_number(reference)}}}", parsing_timeout=None)
        guess = parse(f"\\boxed{{{normalize_number(predicted)}}}", parsing_timeout=None)
        return bool(gold and guess and verify(gold, guess, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
        return False
