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
from typing import Literal

from rapidfuzz.distance import LCSseq

from prime_rl.envs import Parser, Rubric, SingleTurnEnv, XMLParser

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


def load_environment(
    num_examples: int = 10000,
    min_len: int = 3,
    max_len: int = 8,
    seed: int = 0,
    answer_format: Literal["plain", "xml"] = "plain",
    num_eval_examples: int = 100,
    system_prompt: str | None = None,
) -> SingleTurnEnv:
    if not 1 <= min_len <= max_len:
        raise ValueError(f"reverse-text: need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if num_examples < 1 or num_eval_examples < 0:
        raise ValueError(f"reverse-text: num_examples must be >= 1 and num_eval_examples >= 0, got {num_examples}, {num_eval_examples}")
    if answer_format not in ("plain", "xml"):
        raise ValueError(f"reverse-text: answer_format must be 'plain' or 'xml', got {answer_format!r}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"reverse-text: system_prompt must be a string (\"\" for none), got {type(system_prompt).__name__}")
    if system_prompt is None:
        system_prompt = XML_SYSTEM_PROMPT if answer_format == "xml" else SYSTEM_PROMPT
    parser = XMLParser(["reversed_text"], answer_field="reversed_text") if answer_format == "xml" else Parser()
    rubric = Rubric(funcs=[lcs_reward], parser=parser)
    if answer_format == "xml":
        rubric.add_reward_func(parser.get_format_reward_func(), weight=0.0)
    return SingleTurnEnv(
        dataset=make_rows(num_examples, min_len, max_len, seed),
        # a different seed than any training seed a run is likely to use
        eval_dataset=make_rows(num_eval_examples, min_len, max_len, seed + 10_000) if num_eval_examples else None,
        system_prompt=system_prompt or None,  # "": no system message
        parser=parser,
        rubric=rubric,
    )
