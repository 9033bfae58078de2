"""gsm8k: grade-school math word problems, one answer per problem.

Single turn, after verifiers' ``gsm8k`` environment. Data, in order of precedence:

- ``data_path``: a file of rows with ``question`` and ``answer`` (GSM8K's format, where the
  answer is the worked solution ending in ``#### N``, or just ``N``); split into train and
  a disjoint held-out eval set by a seeded shuffle;
- the hub dataset ``openai/gsm8k`` (config ``main``; train and test splits) when reachable
  (``source="auto"``, the default, or ``"hub"``);
- otherwise (``source="generated"``, or ``auto`` offline) a seeded generator of GSM-style
  word problems with integer answers. ``difficulty`` 1, 2 or 3 is the number of arithmetic
  steps; templates cover shopping, ages, distances, baking, savings, reading, classes...
  Train and eval come from differently seeded streams, each without repeats; train leaves
  out the eval problems.

The reference answer is GSM8K's final number (the text after ``####``, commas removed).
Every row carries a short worked solution in ``info["solution"]`` (for hub rows, GSM8K's
own solution without its ``<<...>>`` calculator notes); ``demonstration(example)`` gives
the prompt plus the reply SFT data uses: the solution, then ``\\boxed{N}`` or ``#### N``.

Reward ``correct_answer``: the model's final answer is the content of its last
``\\boxed{...}``, or failing that the text after its last ``#### `` (to the end of that
line); it is compared with the reference by ``math_verify`` (the `math` extra; ``parse`` + ``verify``, run
in-process with its signal-based timeouts off, so it works from any thread; answers over
100 characters score 0 instead, which bounds the time a reply can take). No final answer,
or any parse/verify error, scores 0. Metric ``format_reward`` (weight 0): 1 when the reply
has a final answer in the requested ``answer_format`` (`boxed`: ``\\boxed{N}``; `hash`:
a ``#### N`` line).
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar, Literal

from prime_rl.envs import Example, Messages, Parser, Rubric, SingleTurnEnv, load_rows
from pydantic import Field

from orchestrator.envs.common import CountOrAll, EvalCountOrAll, Source, TrainCountArgs, held_out_split
from orchestrator.envs.math_answers import after_hashes, answers_match, final_answer, last_boxed, load_math_verify

ENV = "gsm8k"
HUB_ID = "openai/gsm8k"
HUB_CONFIG = "main"
BOXED_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
HASH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer on the last line as #### N."
GENERATED_SIZES = {"train": 7473, "test": 1319}  # GSM8K's split sizes


# --------------------------------------------------------------------------- answers


def reference_reply(solution: str, answer: str, answer_format: str = "boxed") -> str:
    """The assistant message of a demonstration: the worked solution, then the answer."""
    final = f"\\boxed{{{answer}}}" if answer_format == "boxed" else f"#### {answer}"
    return f"{solution.strip()}\n{final}" if solution.strip() else final


def demonstration(example: Example, answer_format: str | None = None) -> Messages:
    """The prompt followed by the reference reply (for SFT), in the environment's
    ``answer_format`` (kept in ``info``) unless another one is given."""
    answer_format = answer_format or str(example.info.get("answer_format") or "boxed")
    reply = reference_reply(str(example.info.get("solution") or ""), example.answer, answer_format)
    return [*[dict(m) for m in example.prompt], {"role": "assistant", "content": reply}]


# --------------------------------------------------------------------------- rows


def row_from_gsm8k(row: dict[str, Any], index: int) -> dict[str, Any]:
    """A hub or file row (``question`` + ``answer`` with the solution before ``####``) ->
    ``question``, ``answer`` (the final number) and ``info["solution"]``."""
    if "question" not in row or "answer" not in row:
        raise ValueError(f"{ENV}: row {index} needs `question` and `answer` columns, it has {sorted(row)}")
    text = str(row["answer"])
    solution, _, final = text.rpartition("####")
    if not _:
        solution, final = "", text
    info = dict(row.get("info") or {}) if isinstance(row.get("info"), dict) else {}
    info.setdefault("solution", re.sub(r"<<[^>]*>>", "", solution).strip())
    return {"question": str(row["question"]), "answer": final.strip().replace(",", ""), "info": info}


NAMES = ["Ava", "Ben", "Cora", "Dev", "Eli", "Fay", "Gus", "Hana", "Ian", "Jo",
         "Kai", "Lena", "Max", "Nia", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma"]
ITEMS = [  # (item, lowest price, highest price)
    ("apple", 1, 3), ("pen", 1, 4), ("notebook", 2, 6), ("sticker", 1, 2),
    ("book", 5, 15), ("toy car", 3, 9), ("cupcake", 2, 5), ("ticket", 4, 12),
]
VEHICLES = ["car", "train", "bus", "truck", "boat"]


def _problem_1(rng: random.Random) -> tuple[str, list[str], int]:
    """One arithmetic step."""
    name, other = rng.sample(NAMES, 2)
    kind = rng.randrange(6)
    if kind == 0:
        item, low, high = rng.choice(ITEMS)
        n, price = rng.randint(2, 9), rng.randint(low, high)
        q = f"{name} buys {n} {item}s at ${price} each. How many dollars does {name} spend?"
        return q, [f"{n} * {price} = {n * price}"], n * price
    if kind == 1:
        age, gap = rng.randint(5, 40), rng.randint(2, 30)
        q = f"{name} is {age} years old. {other} is {gap} years older than {name}. How old is {other}?"
        return q, [f"{age} + {gap} = {age + gap}"], age + gap
    if kind == 2:
        vehicle, speed, hours = rng.choice(VEHICLES), rng.randint(3, 12) * 10, rng.randint(2, 6)
        q = f"A {vehicle} travels at {speed} km per hour. How many kilometers does it travel in {hours} hours?"
        return q, [f"{speed} * {hours} = {speed * hours}"], speed * hours
    if kind == 3:
        item = rng.choice(ITEMS)[0]
        friends, each = rng.randint(2, 8), rng.randint(2, 9)
        q = f"{name} shares {friends * each} {item}s equally among {friends} friends. How many {item}s does each friend get?"
        return q, [f"{friends * each} / {friends} = {each}"], each
    if kind == 4:
        total, read = rng.randint(8, 40) * 10, rng.randint(10, 79)
        q = f"{name} has read {read} pages of a {total}-page book. How many pages are left?"
        return q, [f"{total} - {read} = {total - read}"], total - read
    amount, weeks = rng.randint(3, 25), rng.randint(3, 12)
    q = f"{name} saves ${amount} every week. How many dollars does {name} save in {weeks} weeks?"
    return q, [f"{amount} * {weeks} = {amount * weeks}"], amount * weeks


def _problem_2(rng: random.Random) -> tuple[str, list[str], int]:
    """Two arithmetic steps."""
    name, other = rng.sample(NAMES, 2)
    kind = rng.randrange(6)
    if kind == 0:
        item, low, high = rng.choice(ITEMS)
        n, price = rng.randint(2, 6), rng.randint(low, high)
        cost = n * price
        bill = next(b for b in (10, 20, 50, 100) if b > cost)
        q = f"{name} buys {n} {item}s at ${price} each and pays with a ${bill} bill. How many dollars of change does {name} get?"
        return q, [f"Cost: {n} * {price} = {cost}", f"Change: {bill} - {cost} = {bill - cost}"], bill - cost
    if kind == 1:
        age, times, years = rng.randint(3, 15), rng.randint(2, 4), rng.randint(2, 10)
        now = age * times
        q = f"{name} is {age} years old. {other} is {times} times as old as {name}. How old will {other} be in {years} years?"
        return q, [f"{other} now: {age} * {times} = {now}", f"In {years} years: {now} + {years} = {now + years}"], now + years
    if kind == 2:
        vehicle, speed, hours, extra = rng.choice(VEHICLES), rng.randint(3, 9) * 10, rng.randint(2, 5), rng.randint(5, 60)
        first = speed * hours
        q = (f"A {vehicle} travels at {speed} km per hour for {hours} hours, then {extra} more kilometers. "
             "How many kilometers does it travel in total?")
        return q, [f"{speed} * {hours} = {first}", f"{first} + {extra} = {first + extra}"], first + extra
    if kind == 3:
        trays, per, eaten = rng.randint(2, 5), rng.randint(6, 12), rng.randint(1, 9)
        baked = trays * per
        q = f"{name} bakes {trays} trays of {per} cookies and eats {eaten} of them. How many cookies are left?"
        return q, [f"Baked: {trays} * {per} = {baked}", f"Left: {baked} - {eaten} = {baked - eaten}"], baked - eaten
    if kind == 4:
        monday = rng.randint(5, 30)
        q = f"{name} picks {monday} apples on Monday and twice as many on Tuesday. How many apples does {name} pick in total?"
        return q, [f"Tuesday: 2 * {monday} = {2 * monday}", f"Total: {monday} + {2 * monday} = {3 * monday}"], 3 * monday
    size, groups = rng.randint(3, 6), rng.randint(3, 8)
    boys = rng.randint(1, size * groups - 1)
    girls = size * groups - boys
    q = f"A class has {boys} boys and {girls} girls. The teacher splits them into groups of {size}. How many groups are there?"
    return q, [f"Students: {boys} + {girls} = {boys + girls}", f"Groups: {boys + girls} / {size} = {groups}"], groups


def _problem_3(rng: random.Random) -> tuple[str, list[str], int]:
    """Three arithmetic steps."""
    name, other = rng.sample(NAMES, 2)
    kind = rng.randrange(6)
    if kind == 0:
        (item1, lo1, hi1), (item2, lo2, hi2) = rng.sample(ITEMS, 2)
        n1, p1, n2, p2 = rng.randint(2, 6), rng.randint(lo1, hi1), rng.randint(2, 6), rng.randint(lo2, hi2)
        c1, c2 = n1 * p1, n2 * p2
        q = f"{name} buys {n1} {item1}s at ${p1} each and {n2} {item2}s at ${p2} each. How many dollars does {name} spend?"
        return q, [f"{item1}s: {n1} * {p1} = {c1}", f"{item2}s: {n2} * {p2} = {c2}", f"Total: {c1} + {c2} = {c1 + c2}"], c1 + c2
    if kind == 1:
        age, less, years = rng.randint(6, 20), rng.randint(1, 5), rng.randint(2, 10)
        now = 2 * age - less
        q = (f"{name} is {age} years old. {other} is {less} years younger than twice {name}'s age. "
             f"How old will {other} be in {years} years?")
        steps = [f"Twice {name}'s age: 2 * {age} = {2 * age}", f"{other} now: {2 * age} - {less} = {now}",
                 f"In {years} years: {now} + {years} = {now + years}"]
        return q, steps, now + years
    if kind == 2:
        s1, h1, s2, h2 = rng.randint(2, 6) * 5, rng.randint(2, 4), rng.randint(2, 6) * 5, rng.randint(1, 3)
        d1, d2 = s1 * h1, s2 * h2
        q = (f"{name} cycles at {s1} km per hour for {h1} hours, then at {s2} km per hour for {h2} hours. "
             f"How many kilometers does {name} cycle in total?")
        return q, [f"{s1} * {h1} = {d1}", f"{s2} * {h2} = {d2}", f"{d1} + {d2} = {d1 + d2}"], d1 + d2
    if kind == 3:
        wage, hours, weeks = rng.randint(8, 20), rng.randint(3, 10), rng.randint(2, 8)
        spend = rng.randint(5, wage * hours - 1)
        earned, kept = wage * hours, wage * hours - spend
        q = (f"{name} earns ${wage} an hour and works {hours} hours a week. {name} spends ${spend} of it each week. "
             f"How many dollars does {name} save in {weeks} weeks?")
        steps = [f"Earned a week: {wage} * {hours} = {earned}", f"Saved a week: {earned} - {spend} = {kept}",
                 f"In {weeks} weeks: {kept} * {weeks} = {kept * weeks}"]
        return q, steps, kept * weeks
    if kind == 4:
        trays, per, box = rng.randint(2, 6), rng.randint(6, 12), rng.randint(2, 6)
        baked = trays * per
        boxes = rng.randint(1, baked // box - 1) if baked // box > 1 else 1
        sold = baked - boxes * box
        q = (f"{name} bakes {trays} trays of {per} muffins, sells {sold} of them and packs the rest in boxes of {box}. "
             f"How many boxes does {name} fill?")
        steps = [f"Baked: {trays} * {per} = {baked}", f"Left: {baked} - {sold} = {baked - sold}",
                 f"Boxes: {baked - sold} / {box} = {boxes}"]
        return q, steps, boxes
    per_day, days, extra = rng.randint(5, 20), rng.randint(2, 6), rng.randint(3, 15)
    read = per_day * days + extra
    total = read + rng.randint(5, 100)
    q = (f"A book has {total} pages. {name} reads {per_day} pages a day for {days} days, then {extra} pages the next day. "
         "How many pages are left?")
    steps = [f"{per_day} * {days} = {per_day * days}", f"{per_day * days} + {extra} = {read}",
             f"{total} - {read} = {total - read}"]
    return q, steps, total - read


PROBLEMS = {1: _problem_1, 2: _problem_2, 3: _problem_3}


def generated_rows(count: int, difficulty: int, seed: int | str, exclude: set[str] = frozenset()) -> list[dict[str, Any]]:
    """``count`` distinct GSM-style problems of ``difficulty`` steps from a seeded generator,
    none of whose question is in ``exclude`` (fewer only if the generator runs dry)."""
    rng = random.Random(f"{ENV}/{difficulty}/{seed}")
    rows, seen = [], set(exclude)
    for _ in range(50 * count):
        if len(rows) == count:
            break
        question, steps, answer = PROBLEMS[difficulty](rng)
        if question in seen:
            continue
        seen.add(question)
        solution = "\n".join(step[0].upper() + step[1:] for step in steps)
        rows.append({"question": question, "answer": str(answer), "info": {"solution": solution}})
    return rows


# --------------------------------------------------------------------------- environment


def make_rubric(parser: Parser, answer_format: str) -> Rubric:
    def correct_answer(completion, answer, parser) -> float:
        return float(answers_match(parser.parse_answer(completion), answer))

    def format_reward(completion) -> float:
        replies = [str(m.get("content") or "") for m in completion if m.get("role") == "assistant"]
        if not replies:
            return 0.0
        found = last_boxed(replies[-1]) if answer_format == "boxed" else after_hashes(replies[-1])
        return float(bool(found and found.strip()))

    rubric = Rubric(funcs=[correct_answer], parser=parser)
    rubric.add_metric(format_reward)
    return rubric


class Gsm8kArgs(TrainCountArgs):
    """gsm8k's arguments: verifiers' gsm8k (``num_train_examples``, ``num_eval_examples``,
    ``system_prompt``) and prime-rl's own."""

    env: ClassVar[str] = ENV
    num_train_examples: CountOrAll = -1
    """Train examples; -1: all (every hub or file row, GSM8K's 7473 when generated)."""
    num_eval_examples: EvalCountOrAll = -1
    """Held-out examples; -1: all (the hub's test split, GSM8K's 1319 when generated, a tenth of a `data_path` file)."""
    answer_format: Literal["boxed", "hash"] = "boxed"
    """How the prompt asks for the final answer, `\\boxed{N}` or a last line `#### N` (a weight-0 metric checks it)."""
    system_prompt: str | None = None
    """Replaces the default instruction (which asks for `answer_format`)."""
    difficulty: int = Field(2, ge=1, le=3)
    """Arithmetic steps per generated problem."""
    seed: int = 0
    """Seeds the generated problems and the held-out split of a file."""
    source: Source = "auto"
    """`auto` (the hub when it answers, else generated), `hub` or `generated`."""
    data_path: str | None = None
    """A file of `question` + `answer` rows (GSM8K's format) instead of the hub."""
    num_examples: CountOrAll | None = None
    """Another name for `num_train_examples`."""


def load_splits(a: Gsm8kArgs) -> tuple[list[dict], list[dict]]:
    """(train, eval) rows from the file (a seeded held-out split), the hub (its train and test
    splits) or the generator (two seeded streams, train without the eval problems)."""

    def size(split: str) -> int:
        n = a.train_count if split == "train" else a.num_eval_examples
        return GENERATED_SIZES[split] if n == -1 else n

    offline: dict[str, list[dict]] = {}  # the generated splits, when it comes to that

    def generate() -> list[dict]:  # eval first, so that train can leave its problems out
        offline["test"] = generated_rows(size("test"), a.difficulty, f"{a.seed}/test") if a.num_eval_examples else []
        held_out = {r["question"] for r in offline["test"]}
        return generated_rows(size("train"), a.difficulty, f"{a.seed}/train", held_out)

    train, _ = load_rows(
        source=a.source, data_path=a.data_path, hub_id=HUB_ID, hub_config=HUB_CONFIG, split="train", generate=generate
    )
    if a.data_path is not None:
        rows = [row_from_gsm8k(r, i) for i, r in enumerate(train)]
        return held_out_split(rows, a.num_eval_examples, a.seed, ENV, f"rows in data_path {a.data_path!r}")
    if "test" in offline:
        return train, offline["test"]
    test = [] if a.num_eval_examples == 0 else load_rows(source="hub", hub_id=HUB_ID, hub_config=HUB_CONFIG, split="test")[0]
    return [row_from_gsm8k(r, i) for i, r in enumerate(train)], [row_from_gsm8k(r, i) for i, r in enumerate(test)]


def load_environment(**args: Any) -> SingleTurnEnv:
    """gsm8k with ``args`` (``Gsm8kArgs``)."""
    a = Gsm8kArgs.parse(args)
    load_math_verify(ENV)  # the reward needs it: say so now, not at the first score

    def take(rows: list[dict], n: int) -> list[dict]:
        return rows if n == -1 else rows[:n]

    train, eval_rows = load_splits(a)
    train, eval_rows = take(train, a.train_count), take(eval_rows, a.num_eval_examples)
    for row in (*train, *eval_rows):
        row["info"] = {**row.get("info", {}), "answer_format": a.answer_format}
        row["task"] = ENV
    parser = Parser(extract_fn=final_answer)
    default_prompt = BOXED_SYSTEM_PROMPT if a.answer_format == "boxed" else HASH_SYSTEM_PROMPT
    env = SingleTurnEnv(
        dataset=train,
        eval_dataset=eval_rows or None,
        system_prompt=default_prompt if a.system_prompt is None else a.system_prompt,
        parser=parser,
        rubric=make_rubric(parser, a.answer_format),
    )
    env.runs_programs = False  # math-verify checks the answer in this process's threads
    return env
