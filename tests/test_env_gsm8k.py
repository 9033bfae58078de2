"""gsm8k: answer extraction, math-verify rewards on scripted replies, the offline
generator's arithmetic, data files, determinism and argument errors."""

import asyncio
import json
import re
import threading

import pytest
from prime_rl.config import EnvConfig
from prime_rl.envs import DatasetUnavailable, ModelReply, Turn

from orchestrator.envs import load_env
from orchestrator.envs.gsm8k import BOXED_SYSTEM_PROMPT, HASH_SYSTEM_PROMPT, demonstration, load_environment
from orchestrator.envs.math_answers import answers_match, final_answer


class ScriptedClient:
    """Replies with the scripted texts in order (``n`` copies on a call asking for ``n``)."""

    def __init__(self, texts):
        self.texts, self.calls = list(texts), []

    async def reply(self, messages, context, n=1):
        self.calls.append([dict(m) for m in messages])
        text = self.texts.pop(0)
        return [ModelReply(text, "stop", Turn([1, 2], [3, 4], [-0.5, -0.25])) for _ in range(n)]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """The hub never answers in these tests, whatever the network does."""
    monkeypatch.setattr("prime_rl.envs.data.hub_unreachable", lambda hub_id: "offline (test)")


@pytest.fixture(scope="module")
def env():
    return load_environment(num_train_examples=50, num_eval_examples=10)


def play(env, example, text):
    return asyncio.run(env.rollout(ScriptedClient([text]), example))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 3 + 4 = 7.\n\\boxed{7}", "7"),
        ("\\boxed{5} no wait: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box, braces balanced
        ("3 + 4 = 7\n#### 7\n", "7"),
        ("#### 5\n#### 1,200 dollars\nthanks", "1,200 dollars"),  # the last ####, to the end of its line
        ("\\boxed{7} and #### 8", "7"),  # a box wins over ####
        ("the answer is 7", None),
        ("\\boxed{7", None),  # never closed
    ],
)
def test_final_answer(text, expected):
    assert final_answer(text) == expected


def test_correct_wrong_and_malformed_replies(env):
    example = env.dataset[0]
    answer = example.answer
    # correct, boxed: reward 1 (correct_answer, weight 1), format metric 1 (weight 0)
    rollout = play(env, example, f"Step by step.\n\\boxed{{{answer}}}")
    assert rollout.reward == 1.0 and rollout.metrics == {"correct_answer": 1.0, "format_reward": 1.0}
    # correct in GSM8K's #### form: still correct, but not the requested boxed format
    rollout = play(env, example, f"Step by step.\n#### {answer}")
    assert rollout.reward == 1.0 and rollout.metrics["format_reward"] == 0.0
    # wrong number in the right format: 0, format 1
    rollout = play(env, example, f"\\boxed{{{int(answer) + 1}}}")
    assert rollout.reward == 0.0 and rollout.metrics["format_reward"] == 1.0
    # malformed: the number without a final-answer marker scores nothing
    rollout = play(env, example, f"The answer is {answer}.")
    assert rollout.reward == 0.0 and rollout.metrics == {"correct_answer": 0.0, "format_reward": 0.0}
    assert rollout.errors == () and rollout.stop_condition == "max_turns" and rollout.num_turns == 1


def test_hash_answer_format(env):
    hashed = load_environment(num_train_examples=5, num_eval_examples=0, answer_format="hash")
    example = hashed.dataset[0]
    assert example.prompt[0] == {"role": "system", "content": HASH_SYSTEM_PROMPT}
    assert env.dataset[0].prompt[0] == {"role": "system", "content": BOXED_SYSTEM_PROMPT}
    rollout = play(hashed, example, f"reasoning\n#### {example.answer}")
    assert rollout.reward == 1.0 and rollout.metrics["format_reward"] == 1.0
    rollout = play(hashed, example, f"reasoning\n\\boxed{{{example.answer}}}")
    assert rollout.reward == 1.0 and rollout.metrics["format_reward"] == 0.0
    assert hashed.eval_dataset is None


@pytest.mark.parametrize(
    ("predicted", "reference", "match"),
    [
        ("72", "72", True),
        ("72.0", "72", True),
        ("1,000", "1000", True),
        ("$1,000.", "1000", True),
        ("\\$18", "18", True),
        ("\\frac{1}{2}", "0.5", True),
        ("x = 72", "72", True),
        ("-3", "-3", True),
        ("73", "72", False),
        ("", "72", False),
        ("\\frac{", "72", False),  # unparsable: 0, no exception
        ("7" * 101, "7" * 101, False),  # over 100 characters: not even parsed
    ],
)
def test_math_verify_comparison(predicted, reference, match):
    assert answers_match(predicted, reference) is match


def test_reward_works_outside_the_main_thread(env):
    example = env.dataset[1]
    results = []
    worker = threading.Thread(target=lambda: results.append(play(env, example, f"\\boxed{{{example.answer}}}").reward))
    worker.start()
    worker.join(timeout=30)
    assert results == [1.0]


def test_group_shares_the_first_request(env):
    example = env.dataset[2]
    client = ScriptedClient([f"\\boxed{{{example.answer}}}"])
    rollouts = asyncio.run(env.rollout_group(client, example, 3))
    assert len(client.calls) == 1 and [r.reward for r in rollouts] == [1.0, 1.0, 1.0]


STEP = re.compile(r"^(?:[A-Z][^:]*: )?(\d+) ([-+*/]) (\d+) = (\d+)$")


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_generated_problems_have_checked_arithmetic(difficulty):
    env = load_environment(difficulty=difficulty, num_train_examples=300, num_eval_examples=50)
    assert len(env.dataset) == 300 and len(env.eval_dataset) == 50
    templates = set()
    for example in [*env.dataset, *env.eval_dataset]:
        lines = example.info["solution"].split("\n")
        assert len(lines) == difficulty  # one arithmetic step per line
        for line in lines:
            a, op, b, c = STEP.match(line).groups()
            a, b, c = int(a), int(b), int(c)
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == c, line
        assert int(example.answer) > 0 and lines[-1].endswith(f"= {example.answer}")
        templates.add(example.prompt[1]["content"].split()[1])
    assert len(templates) >= 4  # varied templates, not one
    # the demonstration (solution + final answer) is what the reward accepts
    for example in env.dataset[:5]:
        demo = demonstration(example)
        assert demo[-1]["content"] == f"{example.info['solution']}\n\\boxed{{{example.answer}}}"
        assert play(env, example, demo[-1]["content"]).reward == 1.0
    assert demonstration(env.dataset[0], "hash")[-1]["content"].endswith(f"\n#### {env.dataset[0].answer}")


def test_generated_data_is_deterministic_and_disjoint():
    a = load_environment(difficulty=1, num_train_examples=500, num_eval_examples=200)
    assert a.dataset == load_environment(difficulty=1, num_train_examples=500, num_eval_examples=200).dataset
    assert load_environment(difficulty=1, num_train_examples=500, num_eval_examples=200, seed=1).dataset != a.dataset
    train = {e.prompt[1]["content"] for e in a.dataset}
    assert len(train) == 500 and not train & {e.prompt[1]["content"] for e in a.eval_dataset}
    full = load_environment(num_train_examples=-1, num_eval_examples=-1)
    assert (len(full.dataset), len(full.eval_dataset)) == (7473, 1319)  # GSM8K's split sizes


def test_data_path_in_gsm8k_format(tmp_path):
    rows = [
        {"question": "Natalia sold clips to 48 friends in April, and half as many in May. How many in all?",
         "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all: 48+24 = <<48+24=72>>72 clips.\n#### 72"},
        {"question": "A car costs 1200 dollars.\u2028How much?", "answer": "It costs 1,200.\n#### 1,200"},
        *({"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)),
    ]
    path = tmp_path / "gsm8k.jsonl"  # unescaped U+2028 in a value: a line separator to splitlines, not to JSONL
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    env = load_environment(data_path=str(path))
    assert len(env.dataset) == 9 and len(env.eval_dataset) == 1  # a seeded 10% held out
    by_question = {e.prompt[1]["content"]: e for e in [*env.dataset, *env.eval_dataset]}
    natalia = by_question[rows[0]["question"]]
    assert natalia.answer == "72"
    assert natalia.info["solution"] == "In May she sold 48/2 = 24 clips.\nIn all: 48+24 = 72 clips."
    assert by_question[rows[1]["question"]].answer == "1200"
    assert by_question["What is 3 + 1?"].answer == "4" and by_question["What is 3 + 1?"].info["solution"] == ""
    assert play(env, natalia, "48 + 24\n\\boxed{72}").reward == 1.0
    assert load_environment(data_path=str(path)).dataset == env.dataset
    (tmp_path / "bad.jsonl").write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n" * 3)
    with pytest.raises(ValueError, match="gsm8k: row 0 needs `question` and `answer`"):
        load_environment(data_path=str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"answer_format": "latex"}, "answer_format"),
        ({"difficulty": 4}, "difficulty"),
        ({"num_train_examples": 0}, "num_train_examples"),
        ({"num_eval_examples": -2}, "num_eval_examples"),
        ({"num_examples": 5, "num_train_examples": 6}, "num_examples"),
        ({"source": "web"}, "source"),
    ],
)
def test_bad_args_name_the_environment_and_the_arg(args, match):
    with pytest.raises(ValueError, match=f"gsm8k: .*{match}"):
        load_environment(**args)


def test_hub_source_offline_says_what_to_pass():
    with pytest.raises(DatasetUnavailable, match="openai/gsm8k is unreachable.*source='generated' or data_path=FILE"):
        load_environment(source="hub")
    with pytest.raises(ValueError, match="gsm8k.*unreachable"):
        load_env(EnvConfig(id="gsm8k", args={"source": "hub"}))


def test_load_env_offline():
    env = load_env(EnvConfig(id="primeintellect/gsm8k", args={"num_examples": 20, "difficulty": 1}))
    assert len(env.dataset) == 20 and len(env.eval_dataset) == 1319
    assert all(len(e.info["solution"].split("\n")) == 1 for e in env.dataset)


def test_make_sft_data_writes_worked_solutions(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "sft.jsonl"
    subprocess.run(
        [sys.executable, str(repo / "scripts" / "make_sft_data.py"), str(out), "--env", "gsm8k",
         "--num-examples", "5", "--args", json.dumps({"answer_format": "hash", "difficulty": 3})],
        check=True, env={**os.environ, "PYTHONPATH": str(repo / "src")}, capture_output=True,
    )
    chats = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    env = load_environment(answer_format="hash", difficulty=3, num_train_examples=5, num_eval_examples=0, seed=1)
    assert len(chats) == 5
    for (system, user, assistant), example in zip(chats, env.dataset, strict=True):
        assert system == {"role": "system", "content": HASH_SYSTEM_PROMPT}
        assert user == example.prompt[1]
        assert assistant["content"] == f"{example.info['solution']}\n#### {example.answer}"
        assert len(example.info["solution"].split("\n")) == 3
