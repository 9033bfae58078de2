"""reverse-text: reverse a short random lowercase string character by character.

Offline and generated (no download): example i is drawn from a seeded generator, so
the same args always give the same dataset. Reward is the longest-common-subsequence
ratio between the model's answer and the reversed text, so near misses earn partial
credit (a smooth signal for a small model).
"""

from __future__ import annotations

import random
import string

from orchestrator.envs.base import Example, SingleTurnEnv

SYSTEM_PROMPT = "Reverse the text character by character."


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence (classic O(len(a) * len(b)) table, one row kept)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for ca in a:
        prev_diag = 0  # row[j - 1] of the previous row
        for j, cb in enumerate(b, start=1):
            above = row[j]
            row[j] = prev_diag + 1 if ca == cb else max(row[j], row[j - 1])
            prev_diag = above
    return row[-1]


def lcs_ratio(a: str, b: str) -> float:
    """2 * LCS(a, b) / (len(a) + len(b)); 1.0 when both are empty, 0.0 when only one is."""
    if not a and not b:
        return 1.0
    if not a or not b:
        return 0.0
    return 2 * lcs_length(a, b) / (len(a) + len(b))


def make_dataset(num_examples: int, min_len: int, max_len: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    examples = []
    for i in range(num_examples):
        text = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
        examples.append(Example(id=i, prompt=prompt, answer=text[::-1], info={"text": text}))
    return examples


class ReverseTextEnv(SingleTurnEnv):
    def __init__(self, num_examples: int = 10000, min_len: int = 3, max_len: int = 8, seed: int = 0):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"reverse-text: need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        if num_examples < 1:
            raise ValueError(f"reverse-text: num_examples must be >= 1, got {num_examples}")
        self.dataset = make_dataset(num_examples, min_len, max_len, seed)

    def score(self, example: Example, completion_text: str) -> float:
        return lcs_ratio(completion_text.strip(), example.answer)


def load_environment(num_examples: int = 10000, min_len: int = 3, max_len: int = 8, seed: int = 0) -> ReverseTextEnv:
    return ReverseTextEnv(num_examples=num_examples, min_len=min_len, max_len=max_len, seed=seed)
