"""my-env: guess a secret number between 1 and `high`, with higher/lower hints.

An example of a user's environment for prime-rl (see docs/environments.md). Install it
into prime-rl's environment and name it by its id:

    uv pip install -e examples/my-env
    [[env]]
    id = "my-env"                 # dashes -> the module my_env
    args = { high = 20, max_turns = 5 }

It shows the whole protocol: a dataset of rows, a multi-turn loop (`env_response` gives a
hint, `is_completed` ends the game), a parser for tagged answers, and a rubric with a
reward, an async reward and a metric.
"""

from __future__ import annotations

import random

from prime_rl.envs import MultiTurnEnv, Rubric, XMLParser

SYSTEM_PROMPT = "Guess the secret number. Answer with <guess>N</guess> and nothing else."


class GuessTheNumber(MultiTurnEnv):
    def setup_state(self, state):
        state["guesses"] = []
        return state

    def is_completed(self, messages, state) -> bool:
        guess = self.parser.parse(messages[-1]["content"]).guess  # this turn's guess only
        state["guesses"].append(guess)
        return guess is not None and guess.strip() == state["answer"]

    def env_response(self, messages, state):
        guess = state["guesses"][-1]
        if guess is None or not guess.strip().isdigit():
            hint = "Answer with <guess>N</guess>, N a whole number."
        else:
            hint = "Higher." if int(guess) < int(state["answer"]) else "Lower."
        return [{"role": "user", "content": hint}]


def solved(completion, answer, parser) -> float:
    """1 when the last guess is the secret number."""
    return float((parser.parse_answer(completion) or "").strip() == answer)


async def fewer_guesses(state) -> float:
    """1 / number of guesses when solved (an async reward function: awaited by the rubric)."""
    guesses = state["guesses"]
    return float(bool(guesses) and (guesses[-1] or "").strip() == state["answer"]) / max(len(guesses), 1)


def num_guesses(state) -> float:
    """A metric only (weight 0)."""
    return float(len(state["guesses"]))


def load_environment(num_examples: int = 1000, high: int = 100, max_turns: int = 7, seed: int = 0) -> GuessTheNumber:
    if high < 1 or num_examples < 1:
        raise ValueError(f"my-env: need high >= 1 and num_examples >= 1, got high={high}, num_examples={num_examples}")
    rng = random.Random(seed)
    rows = [
        {"question": f"I am thinking of a number from 1 to {high}.", "answer": str(rng.randint(1, high))}
        for _ in range(num_examples)
    ]
    parser = XMLParser(["guess"], answer_field="guess")
    rubric = Rubric(funcs=[solved, fewer_guesses], weights=[1.0, 0.5], parser=parser)
    rubric.add_metric(num_guesses)
    return GuessTheNumber(dataset=rows, system_prompt=SYSTEM_PROMPT, parser=parser, rubric=rubric, max_turns=max_turns)
