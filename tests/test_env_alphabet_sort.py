"""alphabet-sort: hand-checked per-turn scores and rewards with scripted model replies,
the follow-ups the environment sends, data determinism and argument errors."""

import asyncio
import json

import pytest
from prime_rl.config import EnvConfig
from prime_rl.envs import Example, ModelReply, PromptTooLong, Turn

from orchestrator.envs import load_env
from orchestrator.envs.alphabet_sort import (
    demonstration,
    first_name,
    last_name,
    load_environment,
    turn_similarities,
    turn_similarity,
)

NEW = " // new name!"


class ScriptedClient:
    """Replies with the scripted texts in order (``n`` copies on a call asking for ``n``);
    records the messages of every call. A PromptTooLong in the script is raised instead."""

    def __init__(self, texts):
        self.texts, self.calls = list(texts), []

    async def reply(self, messages, context, n=1):
        self.calls.append([dict(m) for m in messages])
        text = self.texts.pop(0)
        if isinstance(text, Exception):
            raise text
        return [ModelReply(text, "stop", Turn([1, 2], [3, 4], [-0.5, -0.25])) for _ in range(n)]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """The hub never answers in these tests, whatever the network does."""
    monkeypatch.setattr("prime_rl.envs.data.hub_unreachable", lambda hub_id: "offline (test)")


# The hub's row format: one list of "First Last" names. First-name and last-name order
# agree for these names, so the ground truth does not depend on the drawn sort key.
ROW = ["Dee Dunn", "Bob Baker", "Flo Ford", "Ann Adams", "Eve Ellis", "Cy Cole"]
TRUTH_1 = ["BobBaker", "DeeDunn"]
TRUTH_2 = ["AnnAdams" + NEW, "BobBaker", "DeeDunn", "FloFord" + NEW]
TRUTH_3 = ["AnnAdams", "BobBaker", "CyCole" + NEW, "DeeDunn", "EveEllis" + NEW, "FloFord"]


def block(tag, lines):
    return f"<{tag}>\n" + "\n".join(lines) + f"\n</{tag}>"


def three_turn_env(tmp_path, **args):
    """3 turns of 2 names each, from a one-row data file (taken in order: turn 1 gets
    DeeDunn and BobBaker, turn 2 FloFord and AnnAdams, turn 3 EveEllis and CyCole)."""
    path = tmp_path / "names.jsonl"
    path.write_text(json.dumps({"names": ROW}) + "\n")
    env = load_environment(
        data_path=str(path), min_turns=3, max_turns=3, min_names_per_turn=2, max_names_per_turn=2,
        num_eval_examples=0, **args,
    )
    (example,) = env.dataset
    return env, example


def test_names_split_at_the_second_capital():
    assert (first_name("VladimirDrinfeld"), last_name("VladimirDrinfeld")) == ("Vladimir", "Drinfeld")
    assert (first_name("Plato"), last_name("Plato")) == ("Plato", "")
    assert (first_name("AnnMarieSmith"), last_name("AnnMarieSmith")) == ("Ann", "MarieSmith")


def test_data_file_row_gives_the_expected_turns_and_prompts(tmp_path):
    env, example = three_turn_env(tmp_path)
    info = example.info
    assert info["num_turns"] == 3 and env.max_turns == 3 and example.task == "alphabet-sort"
    assert info["turn_names"] == [["DeeDunn", "BobBaker"], ["FloFord", "AnnAdams"], ["EveEllis", "CyCole"]]
    assert info["ground_truths"] == [TRUTH_1, TRUTH_2, TRUTH_3]
    key = "FIRST" if info["sort_by_first"] else "LAST"
    (user,) = example.prompt  # no system prompt, as in the original
    first, fmt = user["content"].split("\n\n")
    assert first.startswith(f"Sort these names in alphabetical order by {key} name: ")
    assert sorted(first.split(": ")[1].split(", ")) == ["BobBaker", "DeeDunn"]
    lines = fmt.split("\n")
    assert lines[0] == "Use exactly this format:" and lines[1] == "<alphabetical_sorted>" and lines[-1] == "</alphabetical_sorted>"
    assert lines[2:-1] == [f"Name{i}" for i in range(1, len(lines) - 2)] and 2 <= len(lines) - 3 <= 2
    assert json.loads(example.answer) == {"ground_truths": info["ground_truths"], "turn_names": info["turn_names"]}


def test_full_sort_with_follow_ups_and_hand_checked_rewards(tmp_path):
    env, example = three_turn_env(tmp_path)
    key = "FIRST" if example.info["sort_by_first"] else "LAST"
    replies = [
        # turn 1, correct: ratio 1
        block("alphabetical_sorted", TRUTH_1),
        # turn 2, FloFord's mark missing: the reply is the truth minus its last 13 characters
        # (" // new name!"): 46 vs 59 characters, all 46 matching -> 2*46/105 = 92/105
        block("combined_alphabetical_sorted", ["AnnAdams" + NEW, "BobBaker", "DeeDunn", "FloFord"]),
        # turn 3, two blocks, the second better than the first: the last one counts -> 1
        block("combined_alphabetical_sorted", ["AnnAdams"]) + "\nwait, all of them:\n"
        + block("combined_alphabetical_sorted", TRUTH_3),
    ]
    client = ScriptedClient(replies)
    rollout = asyncio.run(env.rollout(client, example))

    # the environment's follow-ups: turn 2 shows the format, turn 3 refers to it
    assert len(client.calls) == 3 and client.calls[0] == example.prompt
    follow_2, follow_3 = client.calls[1][-1], client.calls[2][-1]
    assert follow_2["role"] == follow_3["role"] == "user"
    head, note, fmt = follow_2["content"].split("\n\n")
    assert head.startswith(f"Now sort ALL of these names alphabetically by {key} name: ")
    assert sorted(head.split(": ")[1].split(", ")) == ["AnnAdams", "FloFord"]
    assert note == ("These are in addition to the prior list. Mark any NEW names (that weren't in the prior list) "
                    "with `// new name!` at the end.")
    assert fmt.startswith("Use exactly this format:\n<combined_alphabetical_sorted>\nName1")
    assert fmt.endswith(NEW + "\n</combined_alphabetical_sorted>")  # the last placeholder is always marked
    head, note = follow_3["content"].split("\n\n")
    assert sorted(head.split(": ")[1].split(", ")) == ["CyCole", "EveEllis"]
    assert note.endswith("at the end. Follow the same format as before.")
    assert [m["role"] for m in rollout.completion] == ["assistant", "user", "assistant", "user", "assistant"]

    ratios = turn_similarities(rollout.completion, example.info)
    assert ratios == pytest.approx([1.0, 92 / 105, 1.0])
    # power_per_turn: mean of ratio**4 = (1 + (92/105)**4 + 1) / 3 = 0.8631...
    assert rollout.reward == pytest.approx((2 + (92 / 105) ** 4) / 3)
    assert rollout.metrics["mean_similarity"] == pytest.approx((2 + 92 / 105) / 3)
    assert rollout.stop_condition == "completed" and rollout.num_turns == 3 and len(rollout.turns) == 3

    # same replies, power_per_turn=False: (mean ratio)**4 = ((2 + 92/105) / 3)**4 = 0.8387...
    env, example = three_turn_env(tmp_path, power_per_turn=False)
    rollout = asyncio.run(env.rollout(ScriptedClient(replies), example))
    assert rollout.reward == pytest.approx(((2 + 92 / 105) / 3) ** 4)


def test_wrong_malformed_and_non_improving_turns(tmp_path):
    truth = TRUTH_1
    # one name missing: "bobbaker" (8) against "bobbaker\ndeedunn" (16) -> 2*8/24 = 2/3
    assert turn_similarity(block("alphabetical_sorted", ["BobBaker"]), truth, "alphabetical_sorted") == pytest.approx(2 / 3)
    # case and surrounding spaces do not matter; blank lines are dropped
    assert turn_similarity("<alphabetical_sorted>\n  bobbaker \n\nDEEDUNN\n</alphabetical_sorted>", truth, "alphabetical_sorted") == 1.0
    # no block, an empty block, or the other turn's tag: 0
    assert turn_similarity("BobBaker\nDeeDunn", truth, "alphabetical_sorted") == 0.0
    assert turn_similarity("<alphabetical_sorted>\n</alphabetical_sorted>", truth, "alphabetical_sorted") == 0.0
    assert turn_similarity(block("alphabetical_sorted", truth), truth, "combined_alphabetical_sorted") == 0.0
    # two blocks that do not strictly improve (equal, or worse): 0
    assert turn_similarity(block("alphabetical_sorted", truth) * 2, truth, "alphabetical_sorted") == 0.0
    twice = block("alphabetical_sorted", truth) + block("alphabetical_sorted", ["BobBaker"])
    assert turn_similarity(twice, truth, "alphabetical_sorted") == 0.0

    env, example = three_turn_env(tmp_path)
    # a malformed reply on every turn: reward 0
    rollout = asyncio.run(env.rollout(ScriptedClient(["no tags here"] * 3), example))
    assert rollout.reward == 0.0 and rollout.num_turns == 3
    # turns never reached score 0: ratio 1 on turn 1, the context is full after it -> (1 + 0 + 0) / 3
    client = ScriptedClient([block("alphabetical_sorted", truth), PromptTooLong("full")])
    rollout = asyncio.run(env.rollout(client, example))
    assert rollout.stop_condition == "prompt_too_long" and rollout.reward == pytest.approx(1 / 3)


def test_sort_by_last_name_differs_from_first(tmp_path):
    # by first name: AmyZhu, BoMiller, ZedAdams; by last name: ZedAdams, BoMiller, AmyZhu
    path = tmp_path / "names.jsonl"
    path.write_text("".join(json.dumps({"names": ["Zed Adams", "Amy Zhu", "Bo Miller"]}) + "\n" for _ in range(40)))
    env = load_environment(
        data_path=str(path), min_turns=1, max_turns=1, min_names_per_turn=3, max_names_per_turn=3, num_eval_examples=10
    )
    assert len(env.dataset) == 30 and len(env.eval_dataset) == 10  # a seeded held-out split of the 40 rows
    seen = set()
    for example in [*env.dataset, *env.eval_dataset]:
        by_first = example.info["sort_by_first"]
        seen.add(by_first)
        expected = ["AmyZhu", "BoMiller", "ZedAdams"] if by_first else ["ZedAdams", "BoMiller", "AmyZhu"]
        assert example.info["ground_truths"] == [expected]
        assert ("by FIRST name" if by_first else "by LAST name") in example.prompt[0]["content"]
    assert seen == {True, False}


def test_too_few_rows_for_the_eval_split_fails_clearly(tmp_path):
    path = tmp_path / "names.jsonl"
    path.write_text(json.dumps({"names": ROW}) + "\n")
    with pytest.raises(ValueError, match="alphabet-sort.*num_eval_examples=100"):
        load_environment(data_path=str(path))


def test_demonstration_replays_to_a_perfect_score():
    env = load_environment(min_turns=3, max_turns=5, num_examples=20, num_eval_examples=5)
    for example in env.dataset[:5]:
        demo = demonstration(example)
        assert demo[: len(example.prompt)] == example.prompt
        replies = [m["content"] for m in demo if m["role"] == "assistant"]
        assert len(replies) == example.info["num_turns"]
        client = ScriptedClient(replies)
        rollout = asyncio.run(env.rollout(client, example))
        assert rollout.reward == 1.0
        assert [*rollout.prompt, *rollout.completion] == demo  # the env sent exactly the demo's follow-ups


def test_generated_data_is_deterministic_and_split():
    a = load_environment(num_examples=200, num_eval_examples=20)
    b = load_environment(num_examples=200, num_eval_examples=20)
    assert a.dataset == b.dataset and a.eval_dataset == b.eval_dataset
    assert len(a.dataset) == 200 and len(a.eval_dataset) == 20
    assert load_environment(num_examples=200, num_eval_examples=20, seed=1).dataset != a.dataset
    train = {e.prompt[0]["content"] for e in a.dataset}
    assert not train & {e.prompt[0]["content"] for e in a.eval_dataset}
    counts = set()
    for example in a.dataset:
        info = example.info
        assert 1 <= info["num_turns"] <= 3 and len(info["follow_ups"]) == info["num_turns"] - 1
        assert all(1 <= len(names) <= 5 for names in info["turn_names"])
        names = [n for turn in info["turn_names"] for n in turn]
        # generated names: CamelCase "FirstLast", first and last names unique in the example
        assert all(n.isalpha() and sum(c.isupper() for c in n) == 2 and n[0].isupper() for n in names)
        assert len({first_name(n) for n in names}) == len({last_name(n) for n in names}) == len(names)
        counts.add(info["num_turns"])
    assert counts == {1, 2, 3}
    default = load_environment()
    assert len(default.dataset) == 2000 and len(default.eval_dataset) == 100


def test_names_path(tmp_path):
    path = tmp_path / "names.txt"
    path.write_text("\n".join(["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov",
                               "Donald Knuth", "John Backus", "Niklaus Wirth"] * 2) + "\n")
    env = load_environment(names_path=str(path), max_turns=2, max_names_per_turn=4, num_examples=30, num_eval_examples=5)
    allowed = {"AdaLovelace", "AlanTuring", "GraceHopper", "EdsgerDijkstra", "BarbaraLiskov", "DonaldKnuth", "JohnBackus", "NiklausWirth"}
    for example in env.dataset:
        names = [n for turn in example.info["turn_names"] for n in turn]
        assert set(names) <= allowed and len(set(names)) == len(names)
    with pytest.raises(ValueError, match="names_path.*8 distinct names"):
        load_environment(names_path=str(path), max_turns=3, max_names_per_turn=5)
    with pytest.raises(ValueError, match="names_path.*does not exist"):
        load_environment(names_path=str(tmp_path / "missing.txt"))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"min_turns": 4, "max_turns": 3}, "min_turns <= max_turns"),
        ({"min_turns": 0}, "min_turns must be an integer >= 1"),
        ({"min_names_per_turn": 6}, "min_names_per_turn <= max_names_per_turn"),
        ({"similarity_power": 0}, "similarity_power"),
        ({"power_per_turn": "no"}, "power_per_turn"),
        ({"num_examples": 0}, "num_examples"),
        ({"num_eval_examples": -1}, "num_eval_examples"),
        ({"source": "web"}, "source"),
    ],
)
def test_bad_args_name_the_environment_and_the_arg(args, match):
    with pytest.raises(ValueError, match=f"alphabet-sort: .*{match}"):
        load_environment(**args)


def test_hub_source_offline_says_what_to_pass():
    with pytest.raises(ValueError, match="alphabet-sort.*unreachable.*source='generated' or data_path=FILE"):
        load_env(EnvConfig(id="alphabet-sort", args={"source": "hub"}))


def test_load_env_with_the_documented_config_works_offline():
    env = load_env(EnvConfig(id="primeintellect/alphabet-sort", args={"min_turns": 3, "max_turns": 5, "power_per_turn": False}))
    assert env.max_turns == 5 and len(env.dataset) == 2000 and env.eval_dataset
    assert {e.info["num_turns"] for e in env.dataset} == {3, 4, 5}
    assert isinstance(env.dataset[0], Example)


def test_make_sft_data_writes_whole_conversations(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "sft.jsonl"
    subprocess.run(
        [sys.executable, str(repo / "scripts" / "make_sft_data.py"), str(out), "--env", "alphabet-sort",
         "--num-examples", "6", "--args", json.dumps({"min_turns": 3, "max_turns": 5, "source": "generated"})],
        check=True, env={**os.environ, "PYTHONPATH": str(repo / "src")}, capture_output=True,
    )
    chats = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    # the script's default seed is RL's default + 1
    env = load_environment(min_turns=3, max_turns=5, num_examples=6, num_eval_examples=0, seed=1337421, source="generated")
    assert chats == [demonstration(example) for example in env.dataset]
    assert all(3 <= sum(m["role"] == "assistant" for m in chat) <= 5 for chat in chats)
    assert chats != [demonstration(e) for e in load_environment(min_turns=3, max_turns=5, num_examples=6).dataset]
