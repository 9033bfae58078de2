"""wordle: guess a secret 5-letter word in six tries, with per-letter feedback.

Multi-turn game, after verifiers' ``wordle`` environment (TextArena's ``Wordle-v0``), played
here without TextArena. The system prompt asks for each guess inside ``<guess>...</guess>``;
``<guess>crane</guess>`` and TextArena's bracketed ``<guess>[crane]</guess>`` are both read
(case-insensitive, the last guess tag of the message counts).

After each guess the environment answers with three lines::

    c r a n e
    X Y G X X
    You have 5 guesses left.

G: right letter, right place; Y: the letter is in the word elsewhere; X: not in the word
(or every copy of it is already accounted for: a repeated letter gets G/Y only as many
times as the secret word has it, greens first, then yellows from left to right).

Every assistant message uses one of the six guesses. A message without a guess, a guess
that is not 5 letters a-z, or (with ``check_words=True``) a word outside the word list is
an invalid guess: it is answered with a line saying why plus the guesses left, and gets no
feedback. The episode ends on a correct guess or when the six guesses are used (the game
state - guesses, feedback, solved - lives in ``state``).

Rewards (weights as the original): ``correct_answer`` (1.0) 1 when solved;
``partial_answer`` (1.0) only when not solved, 0.2 per G + 0.1 per Y of the latest valid
guess's feedback; ``length_bonus`` (1.0) solved / number of guesses used (invalid ones
included); ``format_reward`` (0.2) the ``XMLParser(["guess"])`` format reward.

Secret words: ``num_train_examples`` (2000) and ``num_eval_examples`` (20) words, disjoint,
drawn with ``seed`` (0) from the word list: ``words_path`` (a text file, one word a line) or
the 5-letter lowercase words among ``wordfreq``'s 30,000 most common English words (about
3,600; no download; the `wordle` extra). ``data_path`` gives the secret words instead (rows with ``answer``);
they are split into train and eval by a seeded shuffle.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from prime_rl.envs import Example, Messages, MultiTurnEnv, Rubric, State, XMLParser, load_rows
from prime_rl.extras import import_extra
from pydantic import Field

from orchestrator.envs.common import Source, TrainCountArgs

ENV = "wordle"
WORD_LENGTH = 5
MAX_GUESSES = 6
SYSTEM_PROMPT = (
    "You are a competitive game player. Make sure you read the game instructions carefully, "
    "and always follow the required format.\n\n"
    "In each turn, think step by step, then give your guess inside <guess>...</guess> tags."
)
INSTRUCTIONS = (
    "Let's play Wordle. Guess the secret 5-letter word in 6 tries.\n"
    "After each guess you get one letter per position: G = right letter, right place; "
    "Y = in the word, wrong place; X = not in the word.\n"
    "Give each guess as <guess>word</guess>."
)
_WORD = re.compile(rf"[a-z]{{{WORD_LENGTH}}}")


# --------------------------------------------------------------------------- the game


def feedback(guess: str, secret: str) -> str:
    """G/Y/X per letter of ``guess``: greens first, then yellows left to right while the
    secret still has an unmatched copy of the letter."""
    marks = ["X"] * len(guess)
    unmatched: dict[str, int] = {}
    for i, (g, s) in enumerate(zip(guess, secret)):
        if g == s:
            marks[i] = "G"
        else:
            unmatched[s] = unmatched.get(s, 0) + 1
    for i, g in enumerate(guess):
        if marks[i] != "G" and unmatched.get(g, 0) > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


def read_guess(text: str, parser: XMLParser) -> str | None:
    """The guess of a message (lowercased, square brackets dropped), None without a tag."""
    guess = parser.parse(text).guess
    if guess is None:
        return None
    guess = guess.strip()
    if guess.startswith("[") and guess.endswith("]"):
        guess = guess[1:-1].strip()
    return guess.lower()


def _left(used: int) -> str:
    return f"You have {MAX_GUESSES - used} guesses left."


class WordleEnv(MultiTurnEnv):
    """Game state in ``state``: ``secret``, ``guesses`` (every attempt's text, None when the
    message had no guess), ``feedback`` (G/Y/X of each valid guess), ``messages`` (the
    environment's answer to each attempt) and ``solved``."""

    runs_programs = False  # its episodes only exchange messages

    def __init__(self, allowed: frozenset[str] | None, **kwargs: Any):
        super().__init__(max_turns=MAX_GUESSES, **kwargs)
        self.allowed = allowed  # None: any 5 letters a-z

    def setup_state(self, state: State) -> State:
        state.update(secret=state["answer"], guesses=[], feedback=[], messages=[], solved=False)
        return state

    def _play_new_guesses(self, messages: Messages, state: State) -> None:
        """Score every assistant message not played yet (each one uses a guess)."""
        replies = [str(m.get("content") or "") for m in messages if m.get("role") == "assistant"]
        for text in replies[len(state["guesses"]) :]:
            guess = read_guess(text, self.parser)
            state["guesses"].append(guess)
            used = len(state["guesses"])
            if guess is None:
                state["messages"].append(f"No guess found: write it as <guess>word</guess>.\n{_left(used)}")
            elif not _WORD.fullmatch(guess):
                state["messages"].append(f"Invalid guess {guess!r}: a guess is {WORD_LENGTH} letters a-z.\n{_left(used)}")
            elif self.allowed is not None and guess not in self.allowed:
                state["messages"].append(f"Invalid guess {guess!r}: not in the word list.\n{_left(used)}")
            else:
                marks = feedback(guess, state["secret"])
                state["feedback"].append(marks)
                state["solved"] = state["solved"] or marks == "G" * WORD_LENGTH
                state["messages"].append(f"{' '.join(guess)}\n{' '.join(marks)}\n{_left(used)}")

    def is_completed(self, messages: Messages, state: State) -> bool:
        self._play_new_guesses(messages, state)
        return state["solved"] or len(state["guesses"]) >= MAX_GUESSES

    def env_response(self, messages: Messages, state: State) -> Messages:
        self._play_new_guesses(messages, state)
        return [{"role": "user", "content": state["messages"][-1]}]


# --------------------------------------------------------------------------- rewards


def correct_answer(state) -> float:
    """1 when the secret word was guessed."""
    return float(bool(state.get("solved")))


def partial_answer(state) -> float:
    """Unsolved games only: 0.2 per G and 0.1 per Y of the latest valid guess."""
    if state.get("solved") or not state.get("feedback"):
        return 0.0
    marks = state["feedback"][-1]
    return 0.2 * marks.count("G") + 0.1 * marks.count("Y")


def length_bonus(state) -> float:
    """Solved / number of guesses used: 1 for a first-guess win, 1/6 for a last-guess one."""
    return float(bool(state.get("solved"))) / max(1, len(state.get("guesses") or []))


def make_rubric(parser: XMLParser) -> Rubric:
    format_reward = parser.get_format_reward_func()
    format_reward.__name__ = "format_reward"
    return Rubric(
        funcs=[correct_answer, partial_answer, length_bonus, format_reward], weights=[1.0, 1.0, 1.0, 0.2], parser=parser
    )


# --------------------------------------------------------------------------- words


@lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """The 5-letter lowercase words among wordfreq's 30,000 most common English words."""
    wordfreq = import_extra("wordfreq", f"{ENV} (without words_path)")
    return tuple(dict.fromkeys(w for w in wordfreq.top_n_list("en", 30000) if _WORD.fullmatch(w)))


def read_words(path: str | Path) -> tuple[str, ...]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{ENV}: words_path {str(path)!r} does not exist (expected a text file, one word a line)")
    words = tuple(dict.fromkeys(w.strip().lower() for w in path.read_text().splitlines() if w.strip()))
    bad = [w for w in words if not _WORD.fullmatch(w)]
    if bad:
        raise ValueError(f"{ENV}: words_path {str(path)!r} has words that are not 5 letters a-z, e.g. {bad[0]!r}")
    return words


def _rows(words: list[str]) -> list[dict]:
    return [{"question": INSTRUCTIONS, "answer": w, "task": ENV} for w in words]


def secret_words(words: tuple[str, ...], num_train: int, num_eval: int, seed: int) -> tuple[list[str], list[str]]:
    """Disjoint (train, eval) secret words drawn with ``seed``; train cycles through the
    remaining words (reshuffled each round) when it asks for more than there are."""
    if len(words) <= num_eval:
        raise ValueError(f"{ENV}: the word list has {len(words)} words, not more than num_eval_examples={num_eval}")
    rng = random.Random(f"{ENV}/{seed}")
    order = list(words)
    rng.shuffle(order)
    eval_words, rest = order[:num_eval], order[num_eval:]
    train: list[str] = []
    while len(train) < num_train:
        train.extend(rest[: num_train - len(train)])
        rng.shuffle(rest)
    return train, eval_words


# --------------------------------------------------------------------------- environment


class WordleArgs(TrainCountArgs):
    """wordle's arguments: verifiers' wordle (``num_train_examples``, ``num_eval_examples``,
    ``system_prompt``, ``seed``) and prime-rl's own."""

    env: ClassVar[str] = ENV
    num_train_examples: int = Field(2000, ge=1)
    """Train games (secret words; train cycles through the word list when it asks for more)."""
    num_eval_examples: int = Field(20, ge=0)
    """Held-out games, with secret words no train game has."""
    system_prompt: str = SYSTEM_PROMPT
    """The instruction before the game's rules."""
    seed: int = 0
    """Draws the secret words."""
    check_words: bool = False
    """Only words of the list are valid guesses."""
    words_path: str | None = None
    """The word list: a text file, one 5-letter word a line (default: wordfreq's common words, the `wordle` extra)."""
    data_path: str | None = None
    """A file of rows with the secret word in `answer`, split into train and eval by a seeded shuffle."""
    source: Source = "auto"
    """`auto`/`generated`: the word list; `hub` fails (there is no hub dataset)."""
    num_examples: int | None = Field(None, ge=1)
    """Another name for `num_train_examples`."""


def load_environment(**args: Any) -> WordleEnv:
    """wordle with ``args`` (``WordleArgs``)."""
    a = WordleArgs.parse(args)
    words = read_words(a.words_path) if a.words_path is not None else None
    if a.data_path is None and a.source != "hub":
        words = words or common_words()
        train, evals = secret_words(words, a.train_count, a.num_eval_examples, a.seed)
        train_rows, eval_rows = _rows(train), _rows(evals)
    else:  # a file of secret words (or source="hub", which load_rows refuses clearly)
        rows, _ = load_rows(source=a.source, data_path=a.data_path, hub_id=None)
        found = []
        for i, row in enumerate(rows):
            secret = str(row.get("answer") or row.get("word") or "").strip().lower() if isinstance(row, dict) else ""
            if not _WORD.fullmatch(secret):
                raise ValueError(f"{ENV}: data_path {a.data_path!r} row {i}: `answer` must be a 5-letter word a-z, got {secret!r}")
            found.append(secret)
        found = list(dict.fromkeys(found))
        train, evals = secret_words(tuple(found), max(1, len(found) - a.num_eval_examples), a.num_eval_examples, a.seed)
        train_rows, eval_rows = _rows(train[: a.train_count]), _rows(evals)

    parser = XMLParser(["guess"], answer_field="guess")
    allowed = None
    if a.check_words:
        allowed = frozenset(words or common_words()) | {r["answer"] for r in (*train_rows, *eval_rows)}
    return WordleEnv(
        allowed,
        dataset=train_rows,
        eval_dataset=eval_rows or None,
        system_prompt=a.system_prompt,
        parser=parser,
        rubric=make_rubric(parser),
    )


# --------------------------------------------------------------------------- demonstrations

OPENER = "slate"
"""The demonstrations' first guess (with the strategy below it wins 97.7% of the common
words' games within six guesses, 3.9 guesses on average)."""


@lru_cache(maxsize=1)
def _referee() -> WordleEnv:
    """A bare wordle environment whose hooks play the demonstrations' games (no word check)."""
    return WordleEnv(None, dataset=[], parser=XMLParser(["guess"], answer_field="guess"))


def guess_message(word: str) -> str:
    """A demonstration's assistant message: the guess in the env's tag, nothing else."""
    return f"<guess>{word}</guess>"


def demonstration(
    example: Example, words: tuple[str, ...] | list[str] | None = None, env: WordleEnv | None = None
) -> Messages | None:
    """A whole winning game of ``example`` (SFT data): its prompt, then each guess as an
    assistant message and the environment's feedback message after every guess but the last;
    None when the strategy does not find the secret within six guesses.

    The strategy is deterministic: ``OPENER`` first, then always the first word of ``words``
    (default: the common words, most frequent first; the secret is appended when the list
    lacks it) whose feedback would be the same as the secret's for every guess so far
    (``feedback``: the env's own). The game is played by the environment's own hooks
    (``setup_state``, ``is_completed``, ``env_response``), in the order its rollout loop calls
    them, so the feedback messages are the ones a rollout shows. ``env`` (default: a bare
    wordle environment) only has to play by the same rules: a ``check_words`` environment
    rejects guesses outside its list."""
    env = env or _referee()
    candidates = list(dict.fromkeys(words if words is not None else common_words()))
    secret = example.answer
    if secret not in candidates:
        candidates.append(secret)
    state = env.setup_state(env.initial_state(example))
    messages: Messages = [dict(m) for m in example.prompt]
    history: list[tuple[str, str]] = []  # (guess, its G/Y/X) of every valid guess
    tried: set[str] = set()
    guess: str | None = OPENER
    for _ in range(MAX_GUESSES):
        messages.append({"role": "assistant", "content": guess_message(guess)})
        state["turn"] += 1
        tried.add(guess)
        scored = len(state["feedback"])
        if env.is_completed(messages, state):
            break
        messages.extend(env.env_response(messages, state))
        if len(state["feedback"]) > scored:  # an invalid guess (check_words) gets no feedback
            history.append((guess, state["feedback"][-1]))
        consistent = (w for w in candidates if w not in tried and all(feedback(g, w) == m for g, m in history))
        guess = next(consistent, None)
        if guess is None:  # only when the secret was already guessed and rejected
            return None
    return messages if state["solved"] else None
