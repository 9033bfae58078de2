"""wordle: hand-checked feedback (repeated letters), full scripted games (a win in three,
a loss with invalid guesses) with their rewards, word lists, determinism, argument errors."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prime_rl.config import EnvConfig
from prime_rl.envs import DatasetUnavailable, Example, ModelReply, Turn

from orchestrator.envs import load_env
from orchestrator.envs.wordle import INSTRUCTIONS, SYSTEM_PROMPT, common_words, feedback, load_environment
from orchestrator.envs.wordle import OPENER, demonstration


class ScriptedClient:
    """Replies with the scripted texts in order (``n`` copies on a call asking for ``n``);
    records the messages of every call."""

    def __init__(self, texts):
        self.texts, self.calls = list(texts), []

    async def reply(self, messages, context, n=1):
        self.calls.append([dict(m) for m in messages])
        text = self.texts.pop(0)
        return [ModelReply(text, "stop", Turn([1, 2], [3, 4], [-0.5, -0.25])) for _ in range(n)]


@pytest.fixture(scope="module")
def env():
    return load_environment()


def game(env, secret):
    return Example(0, env.dataset[0].prompt, secret)


def env_messages(rollout):
    return [m["content"] for m in rollout.completion if m["role"] == "user"]


@pytest.mark.parametrize(
    ("guess", "secret", "marks"),
    [
        ("crane", "crane", "GGGGG"),
        ("slate", "crane", "XXGXG"),
        ("trace", "crane", "XGGYG"),  # c is in crane, at another place
        ("speed", "abide", "XXYXY"),  # abide has one e: the first e is yellow, the second gray
        ("eerie", "there", "YXYXG"),  # the green e takes one of there's two e's, the first e the other
        ("allee", "apple", "GYXXG"),  # one l in apple: only the first l is yellow
        ("lolly", "hello", "XYGGX"),  # both l's of hello are green, the first l is gray
        ("geese", "eerie", "XGYXG"),
    ],
)
def test_feedback_with_repeated_letters(guess, secret, marks):
    assert feedback(guess, secret) == marks


def test_win_in_three_guesses(env):
    client = ScriptedClient([
        "I start with common letters.\n<guess>slate</guess>",
        "a and e are right.\n<guess>[trace]</guess>",  # TextArena's bracketed form is read too
        "<guess>crane</guess>",
    ])
    rollout = asyncio.run(env.rollout(client, game(env, "crane")))
    assert env_messages(rollout) == [
        "s l a t e\nX X G X G\nYou have 5 guesses left.",
        "t r a c e\nX G G Y G\nYou have 4 guesses left.",
    ]  # nothing after the winning guess
    assert client.calls[1][-1]["content"] == "s l a t e\nX X G X G\nYou have 5 guesses left."
    assert rollout.stop_condition == "completed" and rollout.num_turns == 3
    assert rollout.state["guesses"] == ["slate", "trace", "crane"] and rollout.state["solved"]
    # correct 1, partial 0 (solved), length bonus 1/3, format: every reply has the tag once
    # and ends with it -> 0.6 + 0.2 + 0.2 = 1 each, weight 0.2
    assert rollout.metrics == pytest.approx({"correct_answer": 1.0, "partial_answer": 0.0, "length_bonus": 1 / 3, "format_reward": 1.0})
    assert rollout.reward == pytest.approx(1 + 1 / 3 + 0.2)


def test_first_guess_win(env):
    rollout = asyncio.run(env.rollout(ScriptedClient(["<guess>CRANE</guess>"]), game(env, "crane")))
    # correct 1 + length bonus 1/1 + 0.2 * format 1
    assert rollout.reward == pytest.approx(2.2) and rollout.completion[1:] == []


def test_loss_with_invalid_guesses(env):
    client = ScriptedClient([
        "<guess>cran</guess>",  # 4 letters: invalid, uses a guess
        "I think it is crane",  # no guess tag: invalid, uses a guess
        "<guess>slate</guess>",
        "<guess>audio</guess>",
        "<guess>xxxxx</guess>",  # not a word, but check_words is off: 5 letters a-z are enough
        "<guess>[TRACE]</guess>",  # the sixth guess: no message comes back, the game is over
    ])
    rollout = asyncio.run(env.rollout(client, game(env, "crane")))
    assert env_messages(rollout) == [
        "Invalid guess 'cran': a guess is 5 letters a-z.\nYou have 5 guesses left.",
        "No guess found: write it as <guess>word</guess>.\nYou have 4 guesses left.",
        "s l a t e\nX X G X G\nYou have 3 guesses left.",
        "a u d i o\nY X X X X\nYou have 2 guesses left.",
        "x x x x x\nX X X X X\nYou have 1 guesses left.",
    ]
    assert rollout.num_turns == 6 and rollout.stop_condition == "completed" and not rollout.state["solved"]
    assert rollout.state["feedback"] == ["XXGXG", "YXXXX", "XXXXX", "XGGYG"]
    # not solved: correct 0, length bonus 0; partial from the last valid guess (trace, XGGYG):
    # 0.2 * 3 + 0.1 * 1 = 0.7; format: five replies score 1, the untagged one 0 -> 5/6
    assert rollout.metrics == pytest.approx({"correct_answer": 0.0, "partial_answer": 0.7, "length_bonus": 0.0, "format_reward": 5 / 6})
    assert rollout.reward == pytest.approx(0.7 + 0.2 * 5 / 6)


def test_malformed_game_scores_zero(env):
    rollout = asyncio.run(env.rollout(ScriptedClient(["no idea"] * 6), game(env, "crane")))
    assert rollout.num_turns == 6 and rollout.reward == 0.0
    assert env_messages(rollout)[-1] == "No guess found: write it as <guess>word</guess>.\nYou have 1 guesses left."


def test_check_words_rejects_unknown_words():
    strict = load_environment(check_words=True, num_train_examples=10, num_eval_examples=2)
    client = ScriptedClient(["<guess>zzzzz</guess>", "<guess>about</guess>", "<guess>crane</guess>"])
    rollout = asyncio.run(strict.rollout(client, game(strict, "crane")))
    assert env_messages(rollout)[0] == "Invalid guess 'zzzzz': not in the word list.\nYou have 5 guesses left."
    assert env_messages(rollout)[1].startswith("a b o u t\n")
    # solved on the third guess: 1 + 1/3 + 0.2 * 1
    assert rollout.state["solved"] and rollout.reward == pytest.approx(1 + 1 / 3 + 0.2)


def test_group_of_games_share_the_first_request(env):
    client = ScriptedClient(["<guess>crane</guess>"])
    rollouts = asyncio.run(env.rollout_group(client, game(env, "crane"), 4))
    assert len(client.calls) == 1 and [r.reward for r in rollouts] == pytest.approx([2.2] * 4)


def test_secret_words_are_seeded_disjoint_and_common(env):
    assert len(env.dataset) == 2000 and len(env.eval_dataset) == 20
    train, evals = [e.answer for e in env.dataset], [e.answer for e in env.eval_dataset]
    assert len(set(train)) == 2000 and not set(train) & set(evals)
    words = set(common_words())
    assert 3000 < len(words) < 4500 and set(train) <= words and set(evals) <= words
    assert env.dataset[0].prompt == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": INSTRUCTIONS}]
    again = load_environment()
    assert [e.answer for e in again.dataset] == train and [e.answer for e in again.eval_dataset] == evals
    assert [e.answer for e in load_environment(seed=1).eval_dataset] != evals
    assert env.max_turns == 6


def test_words_path_and_data_path(tmp_path):
    words = tmp_path / "words.txt"
    words.write_text("crane\nslate\nTRACE\nabout\nmoist\n")
    env = load_environment(words_path=str(words), num_train_examples=8, num_eval_examples=1)
    assert len(env.dataset) == 8 and {e.answer for e in env.dataset} | {env.eval_dataset[0].answer} == {"crane", "slate", "trace", "about", "moist"}
    assert env.eval_dataset[0].answer not in {e.answer for e in env.dataset}  # train cycles over the other 4
    (tmp_path / "bad.txt").write_text("crane\ncranes\n")
    with pytest.raises(ValueError, match="wordle: words_path .*'cranes'"):
        load_environment(words_path=str(tmp_path / "bad.txt"))

    rows = tmp_path / "secrets.jsonl"
    rows.write_text("".join(json.dumps({"answer": w}) + "\n" for w in ["crane", "slate", "trace", "about"]))
    env = load_environment(data_path=str(rows), num_eval_examples=1)
    assert sorted([e.answer for e in env.dataset] + [env.eval_dataset[0].answer]) == ["about", "crane", "slate", "trace"]
    rows.write_text(json.dumps({"answer": "cat"}) + "\n")
    with pytest.raises(ValueError, match="wordle: data_path .* row 0"):
        load_environment(data_path=str(rows))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"num_train_examples": 0}, "num_train_examples"),
        ({"num_eval_examples": -1}, "num_eval_examples"),
        ({"check_words": "yes"}, "check_words"),
        ({"seed": "a"}, "seed"),
        ({"source": "web"}, "source"),
        ({"num_eval_examples": 5000}, "num_eval_examples=5000"),
    ],
)
def test_bad_args_name_the_environment_and_the_arg(args, match):
    with pytest.raises(ValueError, match=f"wordle: .*{match}"):
        load_environment(**args)


def test_no_hub_dataset():
    with pytest.raises(DatasetUnavailable, match="data_path"):
        load_environment(source="hub")


def test_load_env_by_id():
    env = load_env(EnvConfig(id="primeintellect/wordle", args={"num_train_examples": 30, "num_eval_examples": 5}))
    assert len(env.dataset) == 30 and len(env.eval_dataset) == 5


# --------------------------------------------------------------------------- demonstrations (SFT data)


def replay(env, example, demo):
    """The demonstration's assistant messages played through the env's own rollout loop."""
    client = ScriptedClient([m["content"] for m in demo[len(example.prompt):] if m["role"] == "assistant"])
    rollout = asyncio.run(env.rollout(client, example))
    assert client.texts == []  # every scripted guess was asked for, none more
    return rollout


@pytest.mark.parametrize("index", range(12))
def test_demonstration_replays_exactly_and_wins(env, index):
    example = env.dataset[index]
    demo = demonstration(example)
    if demo is None:
        pytest.skip(f"the strategy loses {example.answer!r}")
    rollout = replay(env, example, demo)
    # the same conversation: the env's prompt, then exactly the env's feedback messages
    assert demo[: len(example.prompt)] == example.prompt
    assert rollout.completion == demo[len(example.prompt):]
    assert env_messages(rollout) == [m["content"] for m in demo[len(example.prompt):] if m["role"] == "user"]
    k = rollout.num_turns
    assert rollout.state["solved"] and rollout.stop_condition == "completed" and 1 <= k <= 6
    assert rollout.state["guesses"][-1] == example.answer and rollout.state["guesses"][0] == OPENER
    # correct 1 + length bonus 1/k + 0.2 * format 1
    assert rollout.metrics == pytest.approx({"correct_answer": 1.0, "partial_answer": 0.0, "length_bonus": 1 / k, "format_reward": 1.0})
    assert rollout.reward == pytest.approx(1 + 1 / k + 0.2)


def test_demonstration_plays_consistent_guesses(env):
    words = common_words()
    demo = demonstration(game(env, "crane"))
    guesses = [m["content"] for m in demo if m["role"] == "assistant"]
    assert guesses == ["<guess>slate</guess>", "<guess>peace</guess>", "<guess>crane</guess>"]
    assert [m["content"] for m in demo[3::2]] == [
        "s l a t e\nX X G X G\nYou have 5 guesses left.",
        "p e a c e\nX X G Y G\nYou have 4 guesses left.",
    ]
    # each guess: the first common word whose feedback agrees with every earlier guess's
    plain = [g[len("<guess>"):-len("</guess>")] for g in guesses]
    for i, guess in enumerate(plain[1:], start=1):
        consistent = [w for w in words if all(feedback(g, w) == feedback(g, "crane") for g in plain[:i])]
        assert guess == consistent[0]
    assert demonstration(game(env, "crane")) == demo  # deterministic
    assert demonstration(game(env, OPENER))[2:] == [{"role": "assistant", "content": "<guess>slate</guess>"}]


def test_demonstration_skips_lost_games_and_uses_the_given_words(env):
    assert demonstration(game(env, "hatch")) is None  # too many -atch words before it: six guesses lost
    # a word list that lacks the secret: the secret is appended, so it is found last;
    # trace is skipped (slate's t is gray for crane, trace has a t)
    demo = demonstration(game(env, "crane"), words=["slate", "trace", "brace"])
    assert [m["content"] for m in demo if m["role"] == "assistant"][1:] == ["<guess>brace</guess>", "<guess>crane</guess>"]
    # a check_words environment rejects a guess outside its list (zzaze agrees with slate's
    # feedback, so the strategy tries it): it uses a guess, gets no feedback, and is not tried again
    strict = load_environment(check_words=True, num_train_examples=10, num_eval_examples=2)
    demo = demonstration(game(strict, "crane"), words=["slate", "zzaze", "crane"], env=strict)
    assert [m["content"] for m in demo if m["role"] == "user"][1:] == [
        "s l a t e\nX X G X G\nYou have 5 guesses left.",
        "Invalid guess 'zzaze': not in the word list.\nYou have 4 guesses left.",
    ]
    rollout = replay(strict, game(strict, "crane"), demo)
    assert rollout.state["solved"] and rollout.reward == pytest.approx(1 + 1 / 3 + 0.2)


def test_make_sft_data_writes_winning_games(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "sft.jsonl"
    done = subprocess.run(
        [sys.executable, str(repo / "scripts" / "make_sft_data.py"), str(out), "--env", "wordle",
         "--num-examples", "40", "--args", json.dumps({"system_prompt": ""})],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(repo / "src")},
    )
    chats = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert done.stdout.startswith(f"wrote {len(chats)} chats") and 36 <= len(chats) <= 40
    env = load_environment(system_prompt="", num_train_examples=40)  # the same secrets (seed 0, as RL)
    secrets = [e.answer for e in env.dataset]
    for chat in chats:
        assert chat[0] == {"role": "user", "content": INSTRUCTIONS}  # no system prompt, as asked
        assert chat[1] == {"role": "assistant", "content": f"<guess>{OPENER}</guess>"}
        assert chat[-1]["role"] == "assistant" and chat[-1]["content"][len("<guess>"):-len("</guess>")] in secrets
