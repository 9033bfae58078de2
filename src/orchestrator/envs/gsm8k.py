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
line); it is compared with the reference by ``math_verify`` (``parse`` + ``verify``, run
in-process with its signal-based timeouts off, so it works from any thread; answers over
100 characters score 0 instead, which bounds the time a reply can take). No final answer,
or any parse/verify error, scores 0. Metric ``format_reward`` (weight 0): 1 when the reply
has a final answer in the requested ``answer_format`` (`boxed`: ``\\boxed{N}``; `hash`:
a ``#### N`` line).
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable
from typing import Any

from prime_rl.envs import Example, Messages, Parser, Rubric, SingleTurnEnv, load_rows

ENV = "gsm8k"
HUB_ID = "openai/gsm8k"
HUB_CONFIG = "main"
BOXED_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
HASH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer on the last line as #### N."
GENERATED_SIZES = {"train": 7473, "test": 1319}  # GSM8K's split sizes
MAX_ANSWER_CHARS = 100


# --------------------------------------------------------------------------- answers


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


def _load_math_verify() -> tuple[Callable, Callable]:
    global _math_verify
    if _math_verify is None:
        from math_verify import parse, verify

        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_NoTimeoutWarning())
        _math_verify = (parse, verify)
    return _math_verify


def answers_match(predicted: str | None, reference: str) -> bool:
    """math_verify's verdict on the final answer against the reference (False on any error)."""
    if not predicted or len(predicted) > MAX_ANSWER_CHARS:
        return False
    parse, verify = _load_math_verify()
    try:
        gold = parse(f"\\boxed{{{normalize_number(reference)}}}", parsing_timeout=None)
        guess = parse(f"\\boxed{{{normalize_number(predicted)}}}", parsing_timeout=None)
        return bool(gold and guess and verify(gold, guess, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
        return False


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
PLANTS = ["tomato", "rose", "carrot", "tulip", "pepper"]


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


def count_arg(name: str, value: Any, minimum: int, env: str = ENV) -> None:
    """An example count: an integer >= ``minimum``, or -1 for all (shared with math-python)."""
    if not isinstance(value, int) or isinstance(value, bool) or (value < minimum and value != -1):
        raise ValueError(f"{env}: {name} must be an integer >= {minimum} or -1 (all), got {value!r}")


def check_common_args(seed: Any, source: Any, system_prompt: Any, env: str = ENV) -> None:
    """`seed`, `source` and `system_prompt` of a math environment (shared with math-python)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"{env}: seed must be an integer, got {seed!r}")
    if source not in ("auto", "hub", "generated"):
        raise ValueError(f"{env}: source must be 'auto', 'hub' or 'generated', got {source!r}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"{env}: system_prompt must be a string, got {system_prompt!r}")


def load_environment(
    num_train_examples: int = -1,
    num_eval_examples: int = -1,
    answer_format: str = "boxed",
    system_prompt: str | None = None,
    difficulty: int = 2,
    seed: int = 0,
    source: str = "auto",
    data_path: str | None = None,
    num_examples: int | None = None,
) -> SingleTurnEnv:
    """Args as verifiers' gsm8k (``num_train_examples``, ``num_eval_examples``: -1 for all:
    every hub row, or GSM8K's 7473 / 1319 when generated; ``system_prompt``), plus
    ``answer_format`` (`boxed` or `hash`), ``difficulty`` (1-3, generated problems only),
    ``seed``, ``source`` (`auto`, `hub`, `generated`), ``data_path`` and ``num_examples``
    (another name for ``num_train_examples``)."""
    if num_examples is not None:
        if num_train_examples not in (-1, num_examples):
            raise ValueError(
                f"{ENV}: num_examples is another name for num_train_examples; give one, "
                f"got {num_examples} and {num_train_examples}"
            )
        num_train_examples = num_examples
    count_arg("num_train_examples", num_train_examples, 1)
    count_arg("num_eval_examples", num_eval_examples, 0)
    if answer_format not in ("boxed", "hash"):
        raise ValueError(f"{ENV}: answer_format must be 'boxed' or 'hash', got {answer_format!r}")
    if not isinstance(difficulty, int) or isinstance(difficulty, bool) or difficulty not in PROBLEMS:
        raise ValueError(f"{ENV}: difficulty must be 1, 2 or 3 (arithmetic steps per problem), got {difficulty!r}")
    check_common_args(seed, source, system_prompt)

    def take(rows: list[dict], n: int) -> list[dict]:
        return rows if n == -1 else rows[:n]

    def size(split: str) -> int:
        n = num_train_examples if split == "train" else num_eval_examples
        return GENERATED_SIZES[split] if n == -1 else n

    offline: dict[str, list[dict]] = {}  # the generated splits, when it comes to that

    def generate() -> list[dict]:  # eval first, so that train can leave its problems out
        offline["test"] = generated_rows(size("test"), difficulty, f"{seed}/test") if num_eval_examples else []
        held_out = {r["question"] for r in offline["test"]}
        return generated_rows(size("train"), difficulty, f"{seed}/train", held_out)

    train, _ = load_rows(
        source=source, data_path=data_path, hub_id=HUB_ID, hub_config=HUB_CONFIG, split="train", generate=generate
    )
    if data_path is not None:  # one file: a seeded held-out split
        train = [row_from_gsm8k(r, i) for i, r in enumerate(train)]
        n_eval = max(1, len(train) // 10) if num_eval_examples == -1 else num_eval_examples
        if len(train) <= n_eval:
            raise ValueError(f"{ENV}: data_path {data_path!r} has {len(train)} rows, not more than num_eval_examples={n_eval}")
        order = list(range(len(train)))
        random.Random(f"{ENV}/split/{seed}").shuffle(order)
        held = set(order[:n_eval])
        eval_rows = [r for i, r in enumerate(train) if i in held]
        train = [r for i, r in enumerate(train) if i not in held]
    elif "test" in offline:  # generated: two seeded streams
        eval_rows = offline["test"]
    else:  # the hub's train and test splits
        train = [row_from_gsm8k(r, i) for i, r in enumerate(train)]
        eval_rows = [] if num_eval_examples == 0 else [
            row_from_gsm8k(r, i)
            for i, r in enumerate(load_rows(source="hub", hub_id=HUB_ID, hub_config=HUB_CONFIG, split="test")[0])
        ]

    train, eval_rows = take(train, num_train_examples), take(eval_rows, num_eval_examples)
    for row in (*train, *eval_rows):
        row["info"] = {**row.get("info", {}), "answer_format": answer_format}
        row["task"] = ENV
    parser = Parser(extract_fn=final_answer)
    default_prompt = BOXED_SYSTEM_PROMPT if answer_format == "boxed" else HASH_SYSTEM_PROMPT
    return SingleTurnEnv(
        dataset=train,
        eval_dataset=eval_rows or None,
        system_prompt=default_prompt if system_prompt is None else system_prompt,
        parser=parser,
        rubric=make_rubric(parser, answer_format),
    )
