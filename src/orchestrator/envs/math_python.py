"""math-python: math problems solved with a ``python`` tool that runs in a sandbox.

After verifiers' ``math_python``. The model may call ``python(code)`` as often as it likes
(within ``max_turns``); each call runs the program in a fresh bubblewrap sandbox
(``prime_rl.envs.sandbox``: no network, read-only system, a per-rollout scratch directory as
its working directory, wall-clock, CPU, memory and process limits) and returns what it printed,
or the error the model has to fix (``Error: timed out after 10 s (wall-clock limit)``,
``Error: memory limit of 1024 MB reached (MemoryError)``, a traceback). Variables do not
persist between calls; files in the working directory do. A reply without a tool call is the
final answer, in ``\\boxed{}``.

Data, in order of precedence:

- ``data_path``: a file of rows with ``problem`` + ``solution`` (MATH's format: the answer is
  the solution's last ``\\boxed{}``) or ``question`` + ``answer``; split into train and a
  disjoint held-out eval set by a seeded shuffle;
- the hub dataset ``chiayewken/competition_math`` (MATH: train and test splits) when reachable
  (``source="auto"``, the default, or ``"hub"``);
- otherwise (``source="generated"``, or ``auto`` offline) a seeded generator of problems that
  want a computer: large products, modular powers, digit sums of powers, divisor counts, least
  common multiples, Fibonacci numbers mod m, prime counts, sums of multiples. Integer answers;
  each row carries the program that computes it (``info["code"]``) and what it prints
  (``info["output"]``). Train and eval come from differently seeded streams; train leaves out
  the eval problems.

Reward ``correct_answer``: the final answer (last ``\\boxed{}``, else the text after ``####``)
compared with the reference by math-verify, as in gsm8k (the same functions). Metric
``format_reward`` (weight 0): the last reply has a ``\\boxed{}``. The tool loop adds
``total_tool_calls``, ``python_calls``, ``python_errors`` (calls that never ran: bad
arguments), ``malformed_calls``, ``turns``; this environment adds ``python_failures`` (runs
that did not exit cleanly: a traceback, a limit, a timeout).

``demonstration(example)`` gives an SFT trace of a generated example: the prompt, an assistant
tool call running ``info["code"]``, the tool's output, then ``\\boxed{answer}`` (None for rows
without a program, e.g. hub rows).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
from collections.abc import Callable
from typing import Any

from prime_rl.envs import Example, Messages, Parser, Rubric, State, StatefulToolEnv, load_rows
from prime_rl.envs.sandbox import Sandbox, SandboxLimits

from orchestrator.envs.gsm8k import answers_match, check_common_args, count_arg, final_answer, last_boxed

ENV = "math-python"
HUB_ID = "chiayewken/competition_math"
GENERATED_SIZES = {"train": 7500, "test": 5000}  # MATH's split sizes
SYSTEM_PROMPT = (
    "Solve the math problem. You can run Python code with the `python` tool (sympy and numpy are "
    "available; print what you want to see). Put your final answer within \\boxed{}."
)


# --------------------------------------------------------------------------- generated problems

Problem = tuple[str, str, int]
"""(question, the program that solves it, its answer)."""


def _product(rng: random.Random) -> Problem:
    a, b = rng.randint(1000, 99999), rng.randint(1000, 99999)
    return f"Compute ${a} \\times {b}$.", f"print({a} * {b})", a * b


def _power_mod(rng: random.Random) -> Problem:
    base, exponent, modulus = rng.randint(2, 99), rng.randint(50, 999), rng.choice([97, 997, 1000, 1009, 10000, 10007])
    question = f"What is the remainder when ${base}^{{{exponent}}}$ is divided by {modulus}?"
    return question, f"print(pow({base}, {exponent}, {modulus}))", pow(base, exponent, modulus)


def _digit_sum(rng: random.Random) -> Problem:
    base, exponent = rng.choice([2, 3, 5, 7]), rng.randint(50, 500)
    question = f"What is the sum of the digits of ${base}^{{{exponent}}}$?"
    return question, f"print(sum(int(d) for d in str({base} ** {exponent})))", sum(map(int, str(base**exponent)))


def _divisor_count(rng: random.Random) -> Problem:
    n = rng.randint(1000, 50000)
    count = 1
    rest = n
    for p in range(2, math.isqrt(n) + 1):  # the count from the factorization: prod(e + 1)
        e = 0
        while rest % p == 0:
            rest, e = rest // p, e + 1
        count *= e + 1
    count *= 2 if rest > 1 else 1
    return f"How many positive divisors does {n} have?", f"print(sum(1 for d in range(1, {n} + 1) if {n} % d == 0))", count


def _lcm(rng: random.Random) -> Problem:
    a, b, c = (rng.randint(12, 999) for _ in range(3))
    question = f"What is the least common multiple of {a}, {b} and {c}?"
    return question, f"import math\nprint(math.lcm({a}, {b}, {c}))", math.lcm(a, b, c)


def _fibonacci_mod(rng: random.Random) -> Problem:
    n, modulus = rng.randint(100, 2000), rng.choice([1000, 10000, 100000])
    a, b = 1, 1
    for _ in range(n - 2):
        a, b = b, a + b
    question = (
        f"Let $F_1 = F_2 = 1$ and $F_{{n+2}} = F_{{n+1}} + F_n$ for $n \\geq 1$. "
        f"What is the remainder when $F_{{{n}}}$ is divided by {modulus}?"
    )
    code = f"a, b = 1, 1\nfor _ in range({n} - 2):\n    a, b = b, a + b\nprint(b % {modulus})"
    return question, code, b % modulus


def _primes_below(limit: int) -> list[int]:
    """``counts[n]``: how many primes are less than ``n``, for n <= limit (a sieve)."""
    is_prime = [False, False] + [True] * (limit - 1)
    for p in range(2, math.isqrt(limit) + 1):
        if is_prime[p]:
            is_prime[p * p :: p] = [False] * len(is_prime[p * p :: p])
    return [0, *itertools.accumulate(is_prime[:limit])]


PRIME_LIMIT = 30000
_PRIME_COUNTS = _primes_below(PRIME_LIMIT)


def _prime_count(rng: random.Random) -> Problem:
    n = rng.randint(1000, PRIME_LIMIT)
    return f"How many prime numbers are less than {n}?", f"from sympy import primepi\nprint(primepi({n} - 1))", _PRIME_COUNTS[n]


def _sum_of_multiples(rng: random.Random) -> Problem:
    low, k = rng.randint(1, 5000), rng.randint(3, 97)
    high = low + rng.randint(1000, 90000)
    first, last = -(-low // k) * k, high // k * k
    total = (first + last) * ((last - first) // k + 1) // 2
    question = f"What is the sum of all integers from {low} to {high}, inclusive, that are divisible by {k}?"
    return question, f"print(sum(n for n in range({low}, {high} + 1) if n % {k} == 0))", total


PROBLEMS: dict[str, Callable[[random.Random], Problem]] = {
    "product": _product,
    "power_mod": _power_mod,
    "digit_sum": _digit_sum,
    "divisor_count": _divisor_count,
    "lcm": _lcm,
    "fibonacci_mod": _fibonacci_mod,
    "prime_count": _prime_count,
    "sum_of_multiples": _sum_of_multiples,
}


def generated_rows(count: int, seed: int | str, exclude: set[str] = frozenset()) -> list[dict[str, Any]]:
    """``count`` distinct problems from a seeded generator (kinds drawn uniformly), none whose
    question is in ``exclude``."""
    rng = random.Random(f"{ENV}/{seed}")
    kinds = sorted(PROBLEMS)
    rows, seen = [], set(exclude)
    for _ in range(50 * count):
        if len(rows) == count:
            break
        kind = rng.choice(kinds)
        question, code, answer = PROBLEMS[kind](rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": str(answer), "info": {"kind": kind, "code": code, "output": str(answer)}})
    return rows


# --------------------------------------------------------------------------- hub and file rows


def row_from_file_or_hub(row: dict[str, Any], index: int) -> dict[str, Any] | None:
    """A MATH row (``problem`` + ``solution``, the answer its last ``\\boxed{}``) or a
    ``question`` + ``answer`` row -> ``question``, ``answer``, ``info``; None when a MATH
    solution has no boxed answer."""
    info = dict(row["info"]) if isinstance(row.get("info"), dict) else {}
    if "problem" in row and "solution" in row:
        answer = last_boxed(str(row["solution"]))
        if answer is None or not answer.strip():
            return None
        info.update(solution=str(row["solution"]), **{k: str(row[k]) for k in ("level", "type") if k in row})
        return {"question": str(row["problem"]), "answer": answer.strip(), "info": info}
    if "question" in row and "answer" in row:
        return {"question": str(row["question"]), "answer": str(row["answer"]).strip(), "info": info}
    raise ValueError(f"{ENV}: row {index} needs `problem` + `solution` or `question` + `answer` columns, it has {sorted(row)}")


def _converted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in (row_from_file_or_hub(row, i) for i, row in enumerate(rows)) if r is not None]


def held_out_split(rows: list[dict[str, Any]], num_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval) of one file: a seeded shuffle picks the eval rows (a tenth when -1)."""
    n_eval = max(1, len(rows) // 10) if num_eval == -1 else num_eval
    if len(rows) <= n_eval:
        raise ValueError(f"{ENV}: the data file has {len(rows)} usable rows, not more than num_eval_examples={n_eval}")
    order = list(range(len(rows)))
    random.Random(f"{ENV}/split/{seed}").shuffle(order)
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


# --------------------------------------------------------------------------- environment


class MathPythonEnv(StatefulToolEnv):
    """Tool loop with one tool, ``python``, whose hidden arguments are the rollout's scratch
    directory and its run log; the scratch directory lives from ``setup_state`` to
    ``teardown_state``."""

    def __init__(self, sandbox: Sandbox, **kwargs: Any):
        super().__init__(**kwargs)
        self.sandbox = sandbox
        self.add_tool(self.python, args_to_skip=["scratch", "runs"])

    async def python(self, code: str, scratch: str, runs: list) -> str:
        """Run a Python program and return what it prints (stdout, then stderr).

        Each call is a new process: variables do not persist between calls, files in the
        working directory do. sympy and numpy are available; there is no network; time and
        memory are limited.

        Args:
            code: the complete program; print() every result you want to see.
        """
        result = await self.sandbox.run_python(code, scratch)
        runs.append(result.ok)
        return result.text()

    def setup_state(self, state: State) -> State:
        state["scratch"] = str(self.sandbox.new_scratch())
        state["python_runs"] = []
        return state

    async def teardown_state(self, state: State) -> None:
        if state.get("scratch"):
            await asyncio.to_thread(self.sandbox.remove_scratch, state["scratch"])

    def update_tool_args(self, tool_name: str, tool_args: dict[str, Any], messages: Messages, state: State) -> dict[str, Any]:
        return {**tool_args, "scratch": state["scratch"], "runs": state["python_runs"]}

    def rollout_metrics(self, state: State) -> dict[str, float]:
        failures = sum(not ok for ok in state.get("python_runs", []))
        return {**super().rollout_metrics(state), "python_failures": float(failures)}


def make_rubric(parser: Parser) -> Rubric:
    def correct_answer(completion, answer, parser) -> float:
        return float(answers_match(parser.parse_answer(completion), answer))

    def format_reward(completion) -> float:
        replies = [str(m.get("content") or "") for m in completion if m.get("role") == "assistant"]
        found = last_boxed(replies[-1]) if replies else None
        return float(bool(found and found.strip()))

    rubric = Rubric(funcs=[correct_answer], parser=parser)
    rubric.add_metric(format_reward)
    return rubric


def demonstration(example: Example) -> Messages | None:
    """The SFT trace of a generated example: a ``python`` call running its program, the tool's
    output (what the sandbox prints for it: tested), then the boxed answer. None for an
    example without a program."""
    code, output = example.info.get("code"), example.info.get("output")
    if not code or output is None:
        return None
    call = {"id": "call_0", "type": "function", "function": {"name": "python", "arguments": json.dumps({"code": code})}}
    return [
        *[dict(m) for m in example.prompt],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(output)},
        {"role": "assistant", "content": f"The program prints {output}.\n\\boxed{{{example.answer}}}"},
    ]


def _check_args(
    num_train_examples: Any, num_eval_examples: Any, max_turns: Any, seed: Any, source: Any, system_prompt: Any
) -> None:
    count_arg("num_train_examples", num_train_examples, 1, ENV)
    count_arg("num_eval_examples", num_eval_examples, 0, ENV)
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 2:
        raise ValueError(f"{ENV}: max_turns must be an integer >= 2 (a tool call, then the answer), got {max_turns!r}")
    check_common_args(seed, source, system_prompt, ENV)


def load_splits(num_train: int, num_eval: int, seed: int, source: str, data_path: str | None) -> tuple[list[dict], list[dict]]:
    """(train, eval) rows from the file, the hub or the generator (module docstring)."""

    def size(split: str) -> int:
        n = num_train if split == "train" else num_eval
        return GENERATED_SIZES[split] if n == -1 else n

    offline: dict[str, list[dict]] = {}

    def generate() -> list[dict]:  # eval first, so that train can leave its problems out
        offline["test"] = generated_rows(size("test"), f"{seed}/test") if num_eval else []
        return generated_rows(size("train"), f"{seed}/train", {r["question"] for r in offline["test"]})

    train, _ = load_rows(source=source, data_path=data_path, hub_id=HUB_ID, split="train", generate=generate)
    if data_path is not None:
        return held_out_split(_converted(train), num_eval, seed)
    if "test" in offline:
        return train, offline["test"]
    test = [] if num_eval == 0 else load_rows(source="hub", hub_id=HUB_ID, split="test")[0]
    return _converted(train), _converted(test)


def load_environment(
    num_train_examples: int = -1,
    num_eval_examples: int = -1,
    max_turns: int = 5,
    system_prompt: str | None = None,
    seed: int = 0,
    source: str = "auto",
    data_path: str | None = None,
    timeout_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 1024,
    call_memory_mb: int = 1024,
    scratch_mb: int = 64,
    total_memory_mb: int = 8192,
    max_open_files: int = 64,
    max_output_chars: int = 4000,
    max_concurrent_sandboxes: int = 4,
) -> MathPythonEnv:
    """``num_train_examples`` / ``num_eval_examples`` (-1: all; 7500 / 5000 when generated),
    ``max_turns`` (model turns, the final answer's included), ``system_prompt``, ``seed``,
    ``source`` (`auto`, `hub`, `generated`), ``data_path``; the sandbox's limits per call:
    ``timeout_s`` (wall clock), ``cpu_s``, ``memory_mb`` (each process), ``call_memory_mb``
    (all of the call's processes, memfds and scratch writes together), ``scratch_mb`` (the
    rollout's scratch directory in all), ``total_memory_mb`` (the running calls and the scratch
    of every live rollout together: what the host holds at most), ``max_open_files`` (each
    process), ``max_output_chars`` (of stdout and of stderr), and ``max_concurrent_sandboxes``
    (programs running at once; the others wait). Raises
    ``SandboxUnavailable`` when the sandbox cannot run here with all its bounds."""
    _check_args(num_train_examples, num_eval_examples, max_turns, seed, source, system_prompt)
    limits = SandboxLimits(
        wall_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, call_memory_mb=call_memory_mb,
        scratch_mb=scratch_mb, total_memory_mb=total_memory_mb, max_open_files=max_open_files,
        max_output_chars=max_output_chars,
    )  # fmt: skip
    sandbox = Sandbox(limits, max_concurrent=max_concurrent_sandboxes)
    train, eval_rows = load_splits(num_train_examples, num_eval_examples, seed, source, data_path)
    train = train if num_train_examples == -1 else train[:num_train_examples]
    eval_rows = eval_rows if num_eval_examples == -1 else eval_rows[:num_eval_examples]
    for row in (*train, *eval_rows):
        row["task"] = ENV
    parser = Parser(extract_fn=final_answer)
    return MathPythonEnv(
        sandbox,
        dataset=train,
        eval_dataset=eval_rows or None,
        system_prompt=SYSTEM_PROMPT if system_prompt is None else system_prompt,
        parser=parser,
        rubric=make_rubric(parser),
        max_turns=max_turns,
        tool_timeout_s=None,  # the sandbox bounds each run; waiting for a free sandbox is not the model's fault
    )
