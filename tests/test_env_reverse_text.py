"""reverse-text: reward math with hand-computed values, dataset determinism, registry."""

import asyncio
import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
from prime_rl.config import KNOWN_ENVIRONMENTS, EnvConfig, SamplingConfig

from orchestrator.client import ChatResult
from orchestrator.envs import REGISTRY, load_env
from orchestrator.envs.reverse_text import SYSTEM_PROMPT, ReverseTextEnv, lcs_length, lcs_ratio


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [("abc", "abc", 3), ("abc", "acb", 2), ("abcde", "ace", 3), ("ace", "abcde", 3), ("abc", "xyz", 0), ("", "", 0)],
)
def test_lcs_length(a, b, expected):
    assert lcs_length(a, b) == expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("abc", "abc", 1.0),
        ("ab", "ba", 0.5),  # LCS 1: 2*1/4
        ("abcd", "abdc", 0.75),  # LCS 3 (abc or abd): 2*3/8
        ("ace", "abcde", 0.75),  # LCS 3: 2*3/8
        ("abc", "xyz", 0.0),
        ("", "", 1.0),
        ("abc", "", 0.0),
        ("", "abc", 0.0),
    ],
)
def test_lcs_ratio(a, b, expected):
    assert lcs_ratio(a, b) == pytest.approx(expected)


def test_score_strips_the_answer():
    env = ReverseTextEnv(num_examples=1)
    example = env.dataset[0]
    assert env.score(example, f"  {example.answer}\n") == 1.0
    assert env.score(example, "") == 0.0


def test_dataset_is_deterministic_and_well_formed():
    a, b = ReverseTextEnv(num_examples=200), ReverseTextEnv(num_examples=200)
    assert a.dataset == b.dataset
    assert ReverseTextEnv(num_examples=200, seed=1).dataset != a.dataset
    for i, example in enumerate(a.dataset):
        system, user = example.prompt
        assert example.id == i
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        assert user["role"] == "user" and 3 <= len(user["content"]) <= 8
        assert set(user["content"]) <= set(string.ascii_lowercase)
        assert example.answer == user["content"][::-1]
    assert {len(e.answer) for e in a.dataset} == set(range(3, 9))  # every length occurs in 200 draws


def test_bad_lengths_fail_clearly():
    with pytest.raises(ValueError, match="min_len"):
        ReverseTextEnv(min_len=5, max_len=2)


def test_registry_matches_the_contracts():
    assert set(REGISTRY) == set(KNOWN_ENVIRONMENTS)


def test_load_env_by_id_with_and_without_hub_prefix():
    env = load_env(EnvConfig(id="primeintellect/reverse-text", args={"num_examples": 5, "seed": 3}))
    assert len(env.dataset) == 5
    assert load_env(EnvConfig(id="reverse-text", args={"num_examples": 5, "seed": 3})).dataset == env.dataset


def test_load_env_bad_args_names_the_environment():
    with pytest.raises(ValueError, match="reverse-text.*num_exampels"):
        load_env(EnvConfig(id="reverse-text", args={"num_exampels": 5}))


def test_load_env_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_echo_env.py").write_text(
        "from orchestrator.envs import Example, SingleTurnEnv\n"
        "class Echo(SingleTurnEnv):\n"
        "    def __init__(self, n):\n"
        "        self.dataset = [Example(i, [{'role': 'user', 'content': str(i)}], str(i)) for i in range(n)]\n"
        "    def score(self, example, text):\n"
        "        return float(text == example.answer)\n"
        "def load_environment(n=3):\n"
        "    return Echo(n)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_env(EnvConfig(id="my_echo_env", args={"n": 4}))
    assert [e.answer for e in env.dataset] == ["0", "1", "2", "3"]


class StubClient:
    """Answers every chat with fixed tokens; records what it was asked."""

    def __init__(self, text):
        self.text, self.asked = text, []

    async def chat_n(self, messages, *, n, max_tokens, temperature):
        self.asked.append((messages, max_tokens, temperature))
        return [ChatResult([1, 2, 3], [4, 5], [-0.5, -1.0], self.text, "stop") for _ in range(n)]


def test_single_turn_rollout_returns_tokens_and_reward():
    env = ReverseTextEnv(num_examples=1)
    example = env.dataset[0]
    client = StubClient(example.answer)
    rollout = asyncio.run(env.rollout(client, example, SamplingConfig(max_tokens=16, temperature=0.7)))
    assert client.asked == [(example.prompt, 16, 0.7)]
    assert rollout.reward == 1.0 and rollout.example_id == 0 and rollout.finish_reason == "stop"
    (turn,) = rollout.turns
    assert (turn.prompt_ids, turn.completion_ids, turn.completion_logprobs) == ([1, 2, 3], [4, 5], [-0.5, -1.0])
    assert rollout.completion_tokens == 2 and rollout.total_tokens == 5


def test_make_sft_data_script(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "data" / "sft.jsonl"
    subprocess.run(
        [sys.executable, str(repo / "scripts" / "make_sft_data.py"), str(out), "--num-examples", "5"],
        check=True,
        env={**os.environ, "PYTHONPATH": str(repo / "src")},
        capture_output=True,
    )
    chats = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(chats) == 5
    rl = ReverseTextEnv(num_examples=5, seed=1).dataset  # the script's default seed is 1
    for chat, example in zip(chats, rl, strict=True):
        system, user, assistant = chat["messages"]
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        assert user == {"role": "user", "content": example.info["text"]}
        assert assistant == {"role": "assistant", "content": user["content"][::-1]}
