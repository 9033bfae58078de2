"""reverse-text: reward math with hand-computed values, dataset determinism, registry."""

import asyncio
import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
from prime_rl.config import EnvConfig
from prime_rl.envs import ModelReply, Turn

from orchestrator.envs import load_env
from orchestrator.envs.reverse_text import SYSTEM_PROMPT, XML_SYSTEM_PROMPT, lcs_length, lcs_ratio, load_environment


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


def reference_lcs_length(a: str, b: str) -> int:
    """The implementation rapidfuzz replaced (the classic table, one row kept): the reference
    its scores must equal."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for ca in a:
        prev_diag = 0  # row[j - 1] of the previous row
        for j, cb in enumerate(b, start=1):
            above = row[j]
            row[j] = prev_diag + 1 if ca == cb else max(row[j], row[j - 1])
            prev_diag = above
    return row[-1]


def test_lcs_equals_the_reference_table_on_random_strings():
    """Same lengths and the same float ratios as the table implementation, on strings like the
    task's (a few letters) and longer ones over small and large alphabets (non-ASCII included)."""
    import random

    rng = random.Random(20261204)
    alphabets = ["ab", "abc", string.ascii_lowercase, "aé漢🙂 \n"]
    for trial in range(3000):
        alphabet = alphabets[trial % len(alphabets)]
        longest = 8 if trial < 2000 else 90  # past 64: rapidfuzz's multi-word bit vectors
        a, b = ("".join(rng.choices(alphabet, k=rng.randint(0, longest))) for _ in range(2))
        if trial % 7 == 0:
            b = a[::-1]  # the task's pairs: a reply against the reversed text
        expected = reference_lcs_length(a, b)
        assert lcs_length(a, b) == expected, (a, b)
        reference_ratio = 1.0 if not a and not b else 2 * expected / (len(a) + len(b))
        assert lcs_ratio(a, b) == reference_ratio, (a, b)


class ScriptedClient:
    """A ModelClient that answers with fixed texts and tokens; records what it was asked."""

    def __init__(self, *texts):
        self.texts, self.asked = list(texts), []

    async def reply(self, messages, context, n=1):
        self.asked.append((list(messages), list(context), n))
        text = self.texts.pop(0)
        return [ModelReply(text, "stop", Turn([1, 2, 3], [4, 5], [-0.5, -1.0])) for _ in range(n)]


def score(env, example, text):
    return asyncio.run(env.rollout(ScriptedClient(text), example)).reward


def test_reward_is_the_lcs_ratio_of_the_stripped_answer():
    env = load_environment(num_examples=1)
    example = env.dataset[0]
    assert score(env, example, f"  {example.answer}\n") == 1.0
    assert score(env, example, "") == 0.0
    assert score(env, example, example.answer[:-1]) == pytest.approx(lcs_ratio(example.answer[:-1], example.answer))


def test_xml_answer_format_reads_the_tag():
    env = load_environment(num_examples=1, answer_format="xml")
    example = env.dataset[0]
    assert example.prompt[0] == {"role": "system", "content": XML_SYSTEM_PROMPT}
    rollout = asyncio.run(env.rollout(ScriptedClient(f"<reversed_text>\n{example.answer}\n</reversed_text>"), example))
    assert rollout.reward == 1.0 and rollout.metrics["format_reward"] == 1.0
    assert score(env, example, example.answer) == 0.0  # no tag, no answer


def test_system_prompt_replaces_the_instruction_and_empty_drops_the_system_message():
    assert load_environment(num_examples=1).dataset[0].prompt[0] == {"role": "system", "content": SYSTEM_PROMPT}
    custom = load_environment(num_examples=1, num_eval_examples=1, system_prompt="Mirror it.")
    assert custom.dataset[0].prompt[0] == custom.eval_dataset[0].prompt[0] == {"role": "system", "content": "Mirror it."}
    bare = load_environment(num_examples=1, num_eval_examples=1, system_prompt="")
    assert [m["role"] for m in bare.dataset[0].prompt] == [m["role"] for m in bare.eval_dataset[0].prompt] == ["user"]
    with pytest.raises(ValueError, match="system_prompt must be a string"):
        load_environment(num_examples=1, system_prompt=3)


def test_dataset_is_deterministic_and_well_formed():
    a, b = load_environment(num_examples=200), load_environment(num_examples=200)
    assert a.dataset == b.dataset
    assert load_environment(num_examples=200, seed=1).dataset != a.dataset
    for i, example in enumerate(a.dataset):
        system, user = example.prompt
        assert example.id == i
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        assert user["role"] == "user" and 3 <= len(user["content"]) <= 8
        assert set(user["content"]) <= set(string.ascii_lowercase)
        assert example.answer == user["content"][::-1]
    assert {len(e.answer) for e in a.dataset} == set(range(3, 9))  # every length occurs in 200 draws
    held_out = {e.answer for e in a.eval_examples()}
    assert len(a.eval_examples()) == 100 and held_out != {e.answer for e in a.dataset[:100]}


def test_bad_lengths_fail_clearly():
    with pytest.raises(ValueError, match="min_len"):
        load_environment(min_len=5, max_len=2)


def test_one_registry_names_every_builtin_module_for_launcher_and_orchestrator():
    """registry.toml is the only list (the contracts' ids and the orchestrator's modules are
    built from it, so they are not compared here): every module it names defines
    load_environment (checked by import), with or without the hub prefix."""
    import importlib

    from prime_rl.registry import builtins, resolve

    for env_id, entry in builtins().items():
        assert resolve(env_id) == resolve(f"primeintellect/{env_id}") == entry.module
        assert callable(importlib.import_module(entry.module).load_environment)
    assert {e for e, b in builtins().items() if b.tools} == {"wiki-search", "math-python"}
    assert resolve("org/my-env") == "my_env"


def test_load_env_by_id_with_and_without_hub_prefix():
    env = load_env(EnvConfig(id="primeintellect/reverse-text", args={"num_examples": 5, "seed": 3}))
    assert len(env.dataset) == 5
    assert load_env(EnvConfig(id="reverse-text", args={"num_examples": 5, "seed": 3})).dataset == env.dataset


def test_load_env_bad_args_names_the_environment():
    with pytest.raises(ValueError, match="reverse-text.*num_exampels"):
        load_env(EnvConfig(id="reverse-text", args={"num_exampels": 5}))


def test_load_env_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_echo_env.py").write_text(
        "from prime_rl.envs import Rubric, SingleTurnEnv\n"
        "def exact(completion, answer):\n"
        "    return float(completion[-1]['content'] == answer)\n"
        "def load_environment(n=3):\n"
        "    rows = [{'question': str(i), 'answer': str(i)} for i in range(n)]\n"
        "    return SingleTurnEnv(dataset=rows, rubric=Rubric([exact]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_env(EnvConfig(id="my-echo-env", args={"n": 4}))  # dashes name the module my_echo_env
    assert [e.answer for e in env.dataset] == ["0", "1", "2", "3"]


def test_single_turn_rollout_returns_tokens_and_reward():
    env = load_environment(num_examples=1)
    example = env.dataset[0]
    client = ScriptedClient(example.answer)
    rollout = asyncio.run(env.rollout(client, example))
    assert client.asked == [(example.prompt, [], 1)]
    assert rollout.reward == 1.0 and rollout.example_id == 0 and rollout.finish_reason == "stop"
    assert rollout.stop_condition == "max_turns" and rollout.metrics == {"lcs_reward": 1.0}
    (turn,) = rollout.turns
    assert (turn.prompt_ids, turn.completion_ids, turn.completion_logprobs) == ([1, 2, 3], [4, 5], [-0.5, -1.0])
    assert rollout.completion_tokens == 2 and rollout.total_tokens == 5
    assert rollout.completion == [{"role": "assistant", "content": example.answer}]


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
    rl = load_environment(num_examples=5, seed=1).dataset  # the script's default seed is 1
    for chat, example in zip(chats, rl, strict=True):
        system, user, assistant = chat["messages"]
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        assert user == {"role": "user", "content": example.info["text"]}
        assert assistant == {"role": "assistant", "content": user["content"][::-1]}


def test_the_registry_says_tools_exactly_for_the_builtins_whose_own_definitions_have_tools():
    """`tools` in registry.toml is what the launcher checks before any process starts
    (`prime_rl.registry.tool_parser_problem`); each environment's loaded tool schemas decide."""
    from prime_rl.registry import builtins

    small = {"gsm8k": {"source": "generated", "num_train_examples": 4, "num_eval_examples": 0}}
    for env_id, entry in builtins().items():
        env = load_env(EnvConfig(id=env_id, args=small.get(env_id, {})))
        try:
            assert bool(env.tool_defs) == entry.tools, env_id
        finally:
            env.close()
