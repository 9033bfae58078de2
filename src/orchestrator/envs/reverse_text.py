"""reverse-text: reverse a short random lowercase string character by character.

Single turn. Offline and generated (no download): example i is drawn from a seeded
generator, so the same args always give the same dataset. The reward is the
longest-common-subsequence ratio between the model's answer and the reversed text, so
near misses earn partial credit (a smooth signal for a small model).

``answer_format="xml"`` asks for the hub version's format (`<reversed_text>...</reversed_text>`,
parsed with an XMLParser); the default `plain` takes the whole reply as the answer.
``system_prompt`` replaces the instruction; "" asks with no system message at all (the bare
text: a student that context distillation teaches to do without the instruction).
"""

from __future__ import annotations

import random
import string
from typing import Any, ClassVar, Literal, Self

from prime_rl.envs import Parser, Rubric, SingleTurnEnv, XMLParser
from pydantic import Field, model_validator
from rapidfuzz.distance import LCSseq

from orchestrator.envs.common import EnvArgs

ENV = "reverse-text"
SYSTEM_PROMPT = "Reverse the text character by character."
XML_SYSTEM_PROMPT = (
    "Reverse the given text character by character. Respond in the following format:\n"
    "<reversed_text>\n...\n</reversed_text>"
)


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence (rapidfuzz's bit-parallel LCS, in C++)."""
    return LCSseq.similarity(a, b)


def lcs_ratio(a: str, b: str) -> float:
    """2 * LCS(a, b) / (len(a) + len(b)); 1.0 when both are empty, 0.0 when only one is."""
    if not a and not b:
        return 1.0
    if not a or not b:
        return 0.0
    return 2 * lcs_length(a, b) / (len(a) + len(b))


def make_rows(num_examples: int, min_len: int, max_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        text = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))
        rows.append({"question": text, "answer": text[::-1], "info": {"text": text}})
    return rows


def lcs_reward(completion, answer, parser) -> float:
    """LCS ratio of the parsed answer (stripped) and the reversed text."""
    return lcs_ratio((parser.parse_answer(completion) or "").strip(), answer)


class ReverseTextArgs(EnvArgs):
    """reverse-text's arguments."""

    env: ClassVar[str] = ENV
    num_examples: int = Field(10000, ge=1)
    """Train examples."""
    min_len: int = Field(3, ge=1)
    """Shortest text, in characters."""
    max_len: int = Field(8, ge=1)
    """Longest text, in characters."""
    seed: int = 0
    """Seeds the train texts (eval: ``seed + 10000``)."""
    answer_format: Literal["plain", "xml"] = "plain"
    """`plain`: the whole reply is the answer; `xml`: inside `<reversed_text>` (with a format metric)."""
    num_eval_examples: int = Field(100, ge=0)
    """Held-out examples."""
    system_prompt: str | None = None
    """Replaces the instruction; "" asks with no system message at all."""

    @model_validator(mode="after")
    def _lengths(self) -> Self:
        if self.min_len > self.max_len:
            raise ValueError(f"need min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        return self


def load_environment(**args: Any) -> SingleTurnEnv:
    """reverse-text with ``args`` (``ReverseTextArgs``)."""
    a = ReverseTextArgs.parse(args)
    system_prompt = a.system_prompt
    if system_prompt is None:
        system_prompt = XML_SYSTEM_PROMPT if a.answer_format == "xml" else SYSTEM_PROMPT
    parser = XMLParser(["reversed_text"], answer_field="reversed_text") if a.answer_format == "xml" else Parser()
    rubric = Rubric(funcs=[lcs_reward], parser=parser)
    if a.answer_format == "xml":
        rubric.add_reward_func(parser.get_format_reward_func(), weight=0.0)
    env = SingleTurnEnv(
        dataset=make_rows(a.num_examples, a.min_len, a.max_len, a.seed),
        # a different seed than any training seed a run is likely to use
        eval_dataset=make_rows(a.num_eval_examples, a.min_len, a.max_len, a.seed + 10_000) if a.num_eval_examples else None,
        system_prompt=system_prompt or None,  # "": no system message
        parser=parser,
        rubric=rubric,
    )
    env.runs_programs = False  # a reply and a string comparison
    return env
