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
from typing import Any, ClassVar

from prime_rl.envs import Example, Messages, Parser, Rubric, State, StatefulToolEnv, load_rows
from prime_rl.envs.sandbox import Sandbox, SandboxLimits
from pydantic import Field

from orchestrator.envs.common import CountOrAll, EnvArgs, EvalCountOrAll, Source, held_out_split
from orchestrator.envs.math_answers import answers_match, final_answer, last_boxed, load_math_verify

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


class MathPythonArgs(EnvArgs):
    """math-python's arguments: the data, then the sandbox's limits per call."""

    env: ClassVar[str] = ENV
    num_train_examples: CountOrAll = -1
    """Train examples; -1: all (every hub or file row, 7500 when generated)."""
    num_eval_examples: EvalCountOrAll = -1
    """Held-out examples; -1: all (the hub's test split, 5000 when generated, a tenth of a `data_path` file)."""
    max_turns: int = Field(5, ge=2)
    """Model turns, the final answer's included (at least a tool call, then the answer)."""
    system_prompt: str | None = None
    """Replaces the default instruction."""
    seed: int = 0
    """Seeds the generated problems and the held-out split of a file."""
    source: Source = "auto"
    """`auto` (the hub when it answers, else generated), `hub` or `generated`."""
    data_path: str | None = None
    """A file of `problem` + `solution` (MATH's format) or `question` + `answer` rows instead of the hub."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall clock of one call, in seconds."""
    cpu_s: int = Field(5, ge=1)
    """CPU seconds of each of the call's processes."""
    memory_mb: int = Field(1024, ge=1)
    """Address space of each process, in MiB."""
    call_memory_mb: int = Field(1024, ge=1)
    """All of the call's processes, memfds and scratch writes together, in MiB."""
    scratch_mb: int = Field(64, ge=1)
    """The rollout's scratch directory in all, in MiB (below `call_memory_mb`)."""
    total_memory_mb: int = Field(8192, ge=1)
    """The running calls and the scratch of every live rollout together: what the host holds at most, in MiB."""
    max_open_files: int = Field(64, ge=1)
    """Open files of each process."""
    max_output_chars: int = Field(4000, ge=1)
    """Characters kept of stdout and of stderr."""
    max_concurrent_sandboxes: int = Field(4, ge=1)
    """Programs running at once; the others wait."""


def load_splits(a: MathPythonArgs) -> tuple[list[dict], list[dict]]:
    """(train, eval) rows from the file, the hub or the generator (module docstring)."""

    def size(split: str) -> int:
        n = a.num_train_examples if split == "train" else a.num_eval_examples
        return GENERATED_SIZES[split] if n == -1 else n

    offline: dict[str, list[dict]] = {}

    def generate() -> list[dict]:  # eval first, so that train can leave its problems out
        offline["test"] = generated_rows(size("test"), f"{a.seed}/test") if a.num_eval_examples else []
        return generated_rows(size("train"), f"{a.seed}/train", {r["question"] for r in offline["test"]})

    train, _ = load_rows(source=a.source, data_path=a.data_path, hub_id=HUB_ID, split="train", generate=generate)
    if a.data_path is not None:
        return held_out_split(_converted(train), a.num_eval_examples, a.seed, ENV, "usable rows in the data file")
    if "test" in offline:
        return train, offline["test"]
    test = [] if a.num_eval_examples == 0 else load_rows(source="hub", hub_id=HUB_ID, split="test")[0]
    return _converted(train), _converted(test)


def load_environment(**args: Any) -> MathPythonEnv:
    """math-python with ``args`` (``MathPythonArgs``). Raises ``SandboxUnavailable`` when the
    sandbox cannot run here with all its bounds."""
    a = MathPythonArgs.parse(args)
    load_math_verify(ENV)  # the reward needs it: say so now, not at the first score
    limits = SandboxLimits(
        wall_s=a.timeout_s, cpu_s=a.cpu_s, memory_mb=a.memory_mb, call_memory_mb=a.call_memory_mb,
        scratch_mb=a.scratch_mb, total_memory_mb=a.total_memory_mb, max_open_files=a.max_open_files,
        max_output_chars=a.max_output_chars,
    )  # fmt: skip
    sandbox = Sandbox(limits, max_concurrent=a.max_concurrent_sandboxes)
    train, eval_rows = load_splits(a)
    train = train if a.num_train_examples == -1 else train[: a.num_train_examples]
    eval_rows = eval_rows if a.num_eval_examples == -1 else eval_rows[: a.num_eval_examples]
    for row in (*train, *eval_rows):
        row["task"] = ENV
    parser = Parser(extract_fn=final_answer)
    return MathPythonEnv(
        sandbox,
        dataset=train,
        eval_dataset=eval_rows or None,
        system_prompt=SYSTEM_PROMPT if a.system_prompt is None else a.system_prompt,
        parser=parser,
        rubric=make_rubric(parser),
        max_turns=a.max_turns,
        tool_timeout_s=None,  # the sandbox bounds each run; waiting for a free sandbox is not the model's fault
    )
