"""alphabet-sort: keep a list of names sorted alphabetically across several turns.

Multi-turn, after verifiers' ``alphabet_sort`` environment. Each example has a number of
turns drawn from [min_turns, max_turns] and, per turn, a number of names drawn from
[min_names_per_turn, max_names_per_turn]. Names are "combined" CamelCase names
(``VladimirDrinfeld``: the first name is the text up to the second capital letter, the last
name is the rest) and each example sorts by FIRST or by LAST name (drawn per example).

- Turn 1 (the prompt): ``Sort these names in alphabetical order by FIRST name: A, B, C``
  and a format block ``<alphabetical_sorted>`` / ``Name1`` ... / ``</alphabetical_sorted>``
  (a random number of placeholder lines, as in the original).
- Turn k > 1 (``env_response``): ``Now sort ALL of these names alphabetically by FIRST
  name: D, E``; the model re-sorts every name seen so far inside
  ``<combined_alphabetical_sorted>`` and marks the names new in this turn with
  `` // new name!``. Turn 2 shows the format block, later turns say ``Follow the same
  format as before.``
- The episode ends once the model has answered every turn of the example.

Scoring, per turn: every ``<tag>...</tag>`` block of that turn's assistant message (the tag
of that turn) is read as lines (stripped, non-empty, lowercased, joined by newlines) and
compared with the ground truth by ``difflib.SequenceMatcher(...).ratio()``. No block
scores 0; with several blocks each must strictly improve on the previous one (else 0) and
the last one counts. A turn the model never reached scores 0. The reward is
``mean(ratio ** similarity_power)`` over the example's turns when ``power_per_turn``, else
``mean(ratio) ** similarity_power``; ``mean_similarity`` (the plain mean ratio) is logged
as a metric.

Names come from, in order of precedence: ``names_path`` (a text file, one "First Last"
name per line), ``data_path`` (rows with a ``names`` list, the hub dataset's format), the
hub dataset ``hf_dataset_path`` (rows of arXiv author lists; one example per row), or an
offline generator of pronounceable names (seeded; first and last names are unique within
an example, so either sort order is unambiguous). Hub or file rows are split into a train
set and a disjoint held-out eval set by a seeded shuffle; generated data draws the two
sets from differently seeded streams (train examples equal to an eval example are dropped).

``demonstration(example)`` gives the whole correct conversation of an example (for SFT).
"""

from __future__ import annotations

import difflib
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Self

from prime_rl.envs import Example, Messages, MultiTurnEnv, Rubric, State, load_rows
from pydantic import Field, model_validator

from orchestrator.envs.common import CountOrAll, EnvArgs, Source, held_out_split

ENV = "alphabet-sort"
NEW_MARK = " // new name!"
FIRST_TAG = "alphabetical_sorted"
COMBINED_TAG = "combined_alphabetical_sorted"
DEFAULT_NUM_GENERATED = 2000

# Generated names: two or three consonant-vowel syllables, a closing consonant now and then.
_SYLLABLES = [c + v for c in "bdfghjklmnprstvz" for v in "aeiou"] + [c + v for c in ("ch", "sh") for v in "aeiou"]
_CODAS = "nlrsmk"


# --------------------------------------------------------------------------- names


def first_name(combined: str) -> str:
    """``VladimirDrinfeld`` -> ``Vladimir`` (the text before the second capital letter)."""
    for i in range(1, len(combined)):
        if combined[i].isupper():
            return combined[:i]
    return combined


def last_name(combined: str) -> str:
    """``VladimirDrinfeld`` -> ``Drinfeld`` (empty when there is no second capital)."""
    for i in range(1, len(combined)):
        if combined[i].isupper():
            return combined[i:]
    return ""


def _word(rng: random.Random) -> str:
    word = "".join(rng.choices(_SYLLABLES, k=2 if rng.random() < 0.75 else 3))
    if rng.random() < 0.3:
        word += _CODAS[int(rng.random() * len(_CODAS))]
    return word.capitalize()


def generated_names(rng: random.Random, count: int) -> list[str]:
    """``count`` combined names with pairwise different first names and last names."""
    names, firsts, lasts = [], set(), set()
    while len(names) < count:
        first, last = _word(rng), _word(rng)
        if first in firsts or last in lasts or first == last:
            continue
        firsts.add(first)
        lasts.add(last)
        names.append(first + last)
    return names


def pool_names(rng: random.Random, pool: list[str], count: int) -> list[str]:
    """``count`` names drawn from ``pool``, preferring names whose first and last names are
    not taken yet (names that repeat one fill up the rest when the pool runs short)."""
    chosen, spare, firsts, lasts = [], [], set(), set()
    for name in rng.sample(pool, min(len(pool), 4 * count)):
        if first_name(name) in firsts or last_name(name) in lasts:
            spare.append(name)
            continue
        chosen.append(name)
        firsts.add(first_name(name))
        lasts.add(last_name(name))
        if len(chosen) == count:
            return chosen
    return (chosen + spare)[:count]


def read_names_file(path: str | Path) -> list[str]:
    """Combined names (spaces removed, duplicates dropped) of a file of one name a line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{ENV}: names_path {str(path)!r} does not exist (expected a text file, one 'First Last' name a line)")
    return combined_names([line.strip() for line in path.read_text().splitlines()])


# --------------------------------------------------------------------------- examples


def _sorted_names(names: list[str], by_first: bool) -> list[str]:
    return sorted(names, key=first_name if by_first else last_name)


def _format_block(tag: str, lines: list[str]) -> str:
    return f"<{tag}>\n" + "\n".join(lines) + f"\n</{tag}>"


def build_example_row(rng: random.Random, cfg: dict[str, int], names_for: Callable[[int], list[str] | None]) -> dict | None:
    """One dataset row: draws the turns and names per turn, then asks ``names_for(total)``
    for that many combined names (None, and so no row, when it has too few)."""
    num_turns = rng.randint(cfg["min_turns"], cfg["max_turns"])
    per_turn = [rng.randint(cfg["min_names_per_turn"], cfg["max_names_per_turn"]) for _ in range(num_turns)]
    combined = names_for(sum(per_turn))
    if combined is None:
        return None
    by_first = rng.random() < 0.5
    key = "FIRST" if by_first else "LAST"
    turn_names, start = [], 0
    for count in per_turn:
        turn_names.append(combined[start : start + count])
        start += count

    ground_truths, seen = [], []
    for k, new in enumerate(turn_names):
        seen = seen + new
        ordered = _sorted_names(seen, by_first)
        ground_truths.append([n + NEW_MARK if k > 0 and n in new else n for n in ordered])

    shown = rng.sample(turn_names[0], len(turn_names[0]))
    placeholders = [f"Name{i}" for i in range(1, rng.randint(cfg["min_names_per_turn"], cfg["max_names_per_turn"]) + 1)]
    first_prompt = (
        f"Sort these names in alphabetical order by {key} name: {', '.join(shown)}\n\n"
        f"Use exactly this format:\n{_format_block(FIRST_TAG, placeholders)}"
    )
    follow_ups = []
    for k in range(1, num_turns):
        shown = rng.sample(turn_names[k], len(turn_names[k]))
        text = (
            f"Now sort ALL of these names alphabetically by {key} name: {', '.join(shown)}\n\n"
            "These are in addition to the prior list. Mark any NEW names (that weren't in the prior list) "
            "with `// new name!` at the end."
        )
        if k == 1:
            count = rng.randint(cfg["min_names_per_turn"], sum(per_turn[: k + 1]))
            first_new = rng.randint(1, count)  # placeholder lines from this one on carry the mark
            lines = [f"Name{i}" + (NEW_MARK if i >= first_new else "") for i in range(1, count + 1)]
            text += f"\n\nUse exactly this format:\n{_format_block(COMBINED_TAG, lines)}"
        else:
            text += " Follow the same format as before."
        follow_ups.append(text)

    return {
        "prompt": [{"role": "user", "content": first_prompt}],
        "answer": json.dumps({"ground_truths": ground_truths, "turn_names": turn_names}),
        "task": ENV,
        "info": {
            "follow_ups": follow_ups,
            "turn_names": turn_names,
            "ground_truths": ground_truths,
            "num_turns": num_turns,
            "sort_by_first": by_first,
        },
    }


def combined_names(names: list[str]) -> list[str]:
    """``["Vladimir Drinfeld", ...]`` -> ``["VladimirDrinfeld", ...]`` (duplicates dropped)."""
    return list(dict.fromkeys(n.replace(" ", "") for n in names if n.replace(" ", "")))


def rows_from_name_lists(name_rows: list[dict], seed: int | str, cfg: dict[str, int]) -> list[dict]:
    """One dataset row per row with a ``names`` list (the hub's format), using the row's
    leading names in order; rows too short for their draw are skipped, as in the original."""
    rng = random.Random(f"{ENV}/examples/{seed}")
    rows = []
    for index, row in enumerate(name_rows):
        names = row.get("names") if isinstance(row, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{ENV}: row {index} has no `names` list of strings (keys {keys})")
        combined = combined_names(names)
        built = build_example_row(rng, cfg, lambda n, c=combined: c[:n] if len(c) >= n else None)
        if built is not None:
            rows.append(built)
    return rows


def generated_rows(count: int, seed: int | str, cfg: dict[str, int], pool: list[str] | None = None) -> list[dict]:
    """``count`` dataset rows of generated names (or names drawn from ``pool``)."""
    rng = random.Random(f"{ENV}/examples/{seed}")
    names_rng = random.Random(f"{ENV}/names/{seed}")
    if pool is None:
        names_for = lambda n: generated_names(names_rng, n)  # noqa: E731
    else:
        names_for = lambda n: pool_names(names_rng, pool, n)  # noqa: E731
    return [build_example_row(rng, cfg, names_for) for _ in range(count)]


def tag_of(turn: int) -> str:
    """The answer tag of turn ``turn`` (1-based)."""
    return FIRST_TAG if turn == 1 else COMBINED_TAG


def demonstration(example: Example | dict[str, Any]) -> Messages:
    """The whole correct conversation: the prompt, then for each turn the ground truth in
    that turn's tag, followed by the next follow-up."""
    prompt, info = (example.prompt, example.info) if isinstance(example, Example) else (example["prompt"], example["info"])
    messages = [dict(m) for m in prompt]
    for turn, truth in enumerate(info["ground_truths"], start=1):
        messages.append({"role": "assistant", "content": _format_block(tag_of(turn), truth)})
        if turn < info["num_turns"]:
            messages.append({"role": "user", "content": info["follow_ups"][turn - 1]})
    return messages


# --------------------------------------------------------------------------- scoring


def similarity(block: str, expected: list[str]) -> float:
    """SequenceMatcher ratio of a tag's content and the expected lines (both normalized)."""
    predicted = [line.strip().lower() for line in block.strip().split("\n") if line.strip()]
    if not predicted or not expected:
        return 0.0
    wanted = "\n".join(line.strip().lower() for line in expected)
    return difflib.SequenceMatcher(None, "\n".join(predicted), wanted).ratio()


def turn_similarity(text: str, expected: list[str], tag: str) -> float:
    """Score of one assistant message: 0 without a block; with several, each block must beat
    the one before (else 0) and the last counts."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
    if not blocks:
        return 0.0
    scores = [similarity(b, expected) for b in blocks]
    if any(later <= earlier for earlier, later in zip(scores, scores[1:])):
        return 0.0
    return scores[-1]


def turn_similarities(completion: Messages, info: dict[str, Any]) -> list[float]:
    """The raw ratio of each of the example's turns (0 for turns the model never answered)."""
    replies = [str(m.get("content") or "") for m in completion if m.get("role") == "assistant"]
    truths = info["ground_truths"]
    return [
        turn_similarity(replies[k], truths[k], tag_of(k + 1)) if k < len(replies) else 0.0
        for k in range(info["num_turns"])
    ]


def make_rubric(similarity_power: float, power_per_turn: bool) -> Rubric:
    def weighted_reward(completion, info) -> float:
        ratios = turn_similarities(completion, info)
        if not ratios:
            return 0.0
        if power_per_turn:
            return sum(r**similarity_power for r in ratios) / len(ratios)
        return (sum(ratios) / len(ratios)) ** similarity_power

    def mean_similarity(completion, info) -> float:
        ratios = turn_similarities(completion, info)
        return sum(ratios) / len(ratios) if ratios else 0.0

    rubric = Rubric(funcs=[weighted_reward])
    rubric.add_metric(mean_similarity)
    return rubric


# --------------------------------------------------------------------------- environment


class AlphabetSortEnv(MultiTurnEnv):
    runs_programs = False  # its episodes only exchange messages

    def is_completed(self, messages: Messages, state: State) -> bool:
        return sum(m.get("role") == "assistant" for m in messages) >= state["info"]["num_turns"]

    def env_response(self, messages: Messages, state: State) -> Messages:
        answered = sum(m.get("role") == "assistant" for m in messages)
        follow_ups = state["info"]["follow_ups"]
        if 1 <= answered <= len(follow_ups):
            return [{"role": "user", "content": follow_ups[answered - 1]}]
        return [{"role": "user", "content": "Continue"}]


class AlphabetSortArgs(EnvArgs):
    """alphabet-sort's arguments: verifiers' alphabet_sort, plus where the names come from."""

    env: ClassVar[str] = ENV
    max_turns: int = Field(3, ge=1)
    """Most turns of an example."""
    min_turns: int = Field(1, ge=1)
    """Fewest turns of an example."""
    min_names_per_turn: int = Field(1, ge=1)
    """Fewest names a turn adds."""
    max_names_per_turn: int = Field(5, ge=1)
    """Most names a turn adds."""
    similarity_power: float = Field(4, gt=0)
    """The reward raises the similarity to this power (per turn or of the mean: `power_per_turn`)."""
    power_per_turn: bool = True
    """Mean of each turn's similarity to the power, rather than the mean's power."""
    hf_dataset_path: str = "kalomaze/alphabetic-arxiv-authors-it1"
    """The hub dataset of `names` lists."""
    seed: int = 1337420
    """Seeds the examples and the held-out split."""
    num_examples: CountOrAll = -1
    """Train examples; -1: every hub or file row (2000 when generated)."""
    num_eval_examples: int = Field(100, ge=0)
    """Held-out examples."""
    source: Source = "auto"
    """`auto` (the hub when it answers, else generated), `hub` or `generated`."""
    data_path: str | None = None
    """A file of rows with a `names` list instead of the hub."""
    names_path: str | None = None
    """A text file of names, one "First Last" a line: examples draw from it (no hub)."""

    @model_validator(mode="after")
    def _ranges(self) -> Self:
        for low, high in (("min_turns", "max_turns"), ("min_names_per_turn", "max_names_per_turn")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"need {low} <= {high}, got {low}={getattr(self, low)}, {high}={getattr(self, high)}")
        return self


def load_environment(**args: Any) -> AlphabetSortEnv:
    """alphabet-sort with ``args`` (``AlphabetSortArgs``)."""
    a = AlphabetSortArgs.parse(args)
    cfg = dict(
        min_turns=a.min_turns, max_turns=a.max_turns, min_names_per_turn=a.min_names_per_turn,
        max_names_per_turn=a.max_names_per_turn,
    )  # fmt: skip
    per_row = a.max_turns * a.max_names_per_turn
    wanted = DEFAULT_NUM_GENERATED if a.num_examples == -1 else a.num_examples

    pool = read_names_file(a.names_path) if a.names_path is not None else None
    if pool is not None and len(pool) < per_row:
        raise ValueError(
            f"{ENV}: names_path {a.names_path!r} has {len(pool)} distinct names; "
            f"max_turns * max_names_per_turn = {per_row} are needed"
        )

    def generate(count: int, stream: str) -> list[dict]:
        return generated_rows(count, f"{a.seed}/{stream}", cfg, pool)

    if pool is not None or (a.source == "generated" and a.data_path is None):
        name_rows, origin = None, "generated"
    else:
        # generate() returning None means "offline": the generated data is built below, from
        # two seeded streams (train and eval), rather than split from one list
        name_rows, origin = load_rows(
            source=a.source, data_path=a.data_path, hub_id=a.hf_dataset_path, split="train", generate=lambda: None
        )

    if name_rows is None:  # generated (or drawn from names_path): two seeded streams
        eval_rows = generate(a.num_eval_examples, "eval") if a.num_eval_examples else []
        held_out = {r["prompt"][0]["content"] for r in eval_rows}
        train_rows = [r for r in generate(wanted, "train") if r["prompt"][0]["content"] not in held_out]
    else:  # hub or file rows: one example per row, a seeded held-out split
        rows = rows_from_name_lists(name_rows, a.seed, cfg)
        what = f"usable examples (rows with enough names) from {origin}"
        train_rows, eval_rows = held_out_split(rows, a.num_eval_examples, a.seed, ENV, what)
        if a.num_examples != -1:
            train_rows = train_rows[: a.num_examples]

    return AlphabetSortEnv(
        dataset=train_rows,
        eval_dataset=eval_rows or None,
        rubric=make_rubric(a.similarity_power, a.power_per_turn),
        max_turns=a.max_turns,
    )
