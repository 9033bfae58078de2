"""math-python: scripted tool-using episodes whose code really runs in the sandbox (a correct
answer, a wrong one, a malformed call, an unknown tool, bad arguments, crashing code, the
sandbox's limits, running out of turns) with hand-checked rewards and metrics; the generated
problems' programs checked in the sandbox; demonstrations replayed; data files; arguments."""

import asyncio
import json
from pathlib import Path

import pytest
from prime_rl.envs import DatasetUnavailable, ModelReply, ToolCall, Turn
from prime_rl.envs.sandbox import Sandbox

from helpers import sandbox_unavailable

from orchestrator.envs.math_python import PROBLEMS, SYSTEM_PROMPT, demonstration, generated_rows, load_environment


pytestmark = pytest.mark.skipif(sandbox_unavailable() is not None, reason=f"no python sandbox here: {sandbox_unavailable()}")


class ScriptedClient:
    """Replies with the scripted (text, tool calls) in order; records messages and tools."""

    def __init__(self, *replies):
        self.replies, self.calls = list(replies), []

    async def reply(self, messages, context, n=1, tools=None):
        self.calls.append(([dict(m) for m in messages], tools))
        text, calls = self.replies.pop(0)
        return [ModelReply(text, "stop", Turn([1, 2], [3, 4], [-0.5, -0.25]), tuple(calls)) for _ in range(n)]


def python_call(code: str, i: int = 0) -> ToolCall:
    return ToolCall(f"call_{i}", "python", json.dumps({"code": code}))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """The hub never answers in these tests, whatever the network does."""
    monkeypatch.setattr("prime_rl.envs.data.hub_unreachable", lambda hub_id: "offline (test)")


@pytest.fixture(scope="module")
def env():
    return load_environment(num_train_examples=40, num_eval_examples=10, timeout_s=4, cpu_s=2, max_output_chars=300)


def play(env, example, *replies):
    client = ScriptedClient(*replies)
    return asyncio.run(env.rollout(client, example)), client


def tool_messages(rollout):
    return [m["content"] for m in rollout.completion if m["role"] == "tool"]


@pytest.mark.timeout(60)
def test_correct_episode_runs_the_code_in_the_sandbox(env):
    example = env.dataset[0]
    code = "import os\nprint(os.getuid() != 0, os.getcwd())\nprint(6 * 7)"
    rollout, client = play(env, example, ("Let me compute.", [python_call(code)]), (f"So it is \\boxed{{{example.answer}}}.", []))
    assert tool_messages(rollout) == ["True /tmp/work\n42"]  # really run: not root, in the scratch dir
    assert rollout.completion[0]["tool_calls"][0]["function"] == {"name": "python", "arguments": json.dumps({"code": code})}
    assert rollout.completion[1] == {"role": "tool", "tool_call_id": "call_0", "content": "True /tmp/work\n42"}
    assert rollout.stop_condition == "completed" and rollout.num_turns == 2
    assert rollout.reward == 1.0
    assert rollout.metrics == {
        "correct_answer": 1.0, "format_reward": 1.0, "total_tool_calls": 1.0, "made_tool_call": 1.0, "tool_errors": 0.0,
        "malformed_calls": 0.0, "python_calls": 1.0, "python_errors": 0.0, "turns": 2.0, "python_failures": 0.0,
    }  # fmt: skip
    # the model sees one tool, `python(code)`: the scratch dir and run log are hidden
    (schema,) = client.calls[0][1]
    assert schema["function"]["name"] == "python" and schema["function"]["parameters"]["required"] == ["code"]
    assert list(schema["function"]["parameters"]["properties"]) == ["code"]
    assert example.prompt[0] == {"role": "system", "content": SYSTEM_PROMPT}


@pytest.mark.timeout(60)
def test_scratch_dir_persists_within_a_rollout_and_is_removed_after(env):
    example = env.dataset[1]
    rollout, _ = play(
        env, example,
        ("", [python_call("open('x.txt', 'w').write('41')")]),
        ("", [python_call("print(int(open('x.txt').read()) + 1)", 1)]),
        ("\\boxed{0}", []),
    )  # fmt: skip
    assert tool_messages(rollout) == ["(no output)", "42"]
    assert not Path(rollout.state["scratch"]).exists()  # teardown_state removed it
    # another rollout starts with an empty scratch dir
    other, _ = play(env, example, ("", [python_call("import os; print(os.listdir('.'))")]), ("\\boxed{0}", []))
    assert tool_messages(other) == ["[]"]


@pytest.mark.timeout(60)
def test_wrong_answer(env):
    example = env.dataset[2]
    wrong = str(int(example.answer) + 1)
    rollout, _ = play(env, example, ("", [python_call(example.info["code"])]), (f"\\boxed{{{wrong}}}", []))
    assert tool_messages(rollout) == [example.info["output"]]
    assert rollout.reward == 0.0 and rollout.metrics["correct_answer"] == 0.0 and rollout.metrics["format_reward"] == 1.0
    # the right number without a box: no answer
    rollout, _ = play(env, example, (f"It is {example.answer}.", []))
    assert rollout.reward == 0.0 and rollout.metrics["format_reward"] == 0.0 and rollout.metrics["total_tool_calls"] == 0


@pytest.mark.timeout(60)
def test_malformed_unknown_and_bad_calls_are_errors_the_model_sees(env):
    example = env.dataset[3]
    rollout, _ = play(
        env, example,
        ("", [ToolCall("call_0", "python", '{"code": "print(1)"')]),  # not JSON
        ("", [ToolCall("call_1", "bash", '{"cmd": "ls"}')]),  # no such tool
        ("", [ToolCall("call_2", "python", '{"source": "print(1)"}')]),  # wrong argument
        ("", [ToolCall("call_3", "python", '{"code": "print(1)", "scratch": "/"}')]),  # a hidden argument
        (f"\\boxed{{{example.answer}}}", []),
    )  # fmt: skip
    errors = tool_messages(rollout)
    assert errors[0].startswith("Error: the arguments of python are not a JSON object")
    assert errors[1] == "Error: unknown tool 'bash'; the tools are: python"
    assert errors[2].startswith("Error: bad arguments for python:")
    assert errors[3] == "Error: python takes no argument(s) ['scratch']"
    m = rollout.metrics
    assert rollout.reward == 1.0 and rollout.stop_condition == "completed"  # the errors cost nothing but turns
    assert (m["total_tool_calls"], m["tool_errors"], m["python_calls"], m["python_errors"]) == (4, 4, 3, 3)
    assert (m["malformed_calls"], m["python_failures"], m["turns"]) == (1, 0, 5)


@pytest.mark.timeout(60)
def test_crashing_code_returns_its_traceback(env):
    example = env.dataset[4]
    rollout, _ = play(env, example, ("", [python_call("print('start')\nx = 1 / 0")]), ("\\boxed{0}", []))
    (text,) = tool_messages(rollout)
    assert text.startswith("start\nTraceback (most recent call last):")
    assert text.endswith("ZeroDivisionError: division by zero")
    m = rollout.metrics
    assert (m["python_calls"], m["python_errors"], m["python_failures"]) == (1, 0, 1)  # the tool ran; the program failed


@pytest.mark.timeout(60)
def test_sandbox_limits_reach_the_model_as_error_text(env):
    example = env.dataset[5]
    rollout, _ = play(
        env, example,
        ("", [python_call("while True:\n    pass")]),
        ("", [python_call("x = bytearray(8 * 2**30)", 1)]),
        ("", [python_call("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", 2)]),
        ("", [python_call("for i in range(10**5):\n    print(i)", 3)]),
        ("\\boxed{0}", []),
    )  # fmt: skip
    loop, memory, network, chatty = tool_messages(rollout)
    assert loop.endswith(("Error: CPU time limit of 2 s exceeded", "Error: timed out after 4 s (wall-clock limit)"))
    assert memory.endswith("MemoryError\nError: memory limit of 1024 MB reached (MemoryError)")
    assert "OSError: [Errno 101] Network is unreachable" in network
    assert chatty.startswith("0\n1\n2\n") and "characters cut] ..." in chatty and chatty.endswith("99999")
    assert len(chatty) < 400
    assert rollout.metrics["python_failures"] == 3 and rollout.metrics["python_errors"] == 0


@pytest.mark.timeout(60)
def test_running_out_of_turns():
    env = load_environment(num_train_examples=5, num_eval_examples=0, max_turns=2, timeout_s=4)
    example = env.dataset[0]
    rollout, _ = play(env, example, ("", [python_call("print(1)")]), ("", [python_call("print(2)", 1)]))
    assert rollout.stop_condition == "max_turns" and rollout.reward == 0.0
    assert rollout.metrics["python_calls"] == 1  # the last turn's call is not run: the episode is over
    assert tool_messages(rollout) == ["1"]


@pytest.mark.timeout(120)
def test_generated_programs_print_their_answers_in_the_sandbox():
    rows = generated_rows(400, "check")
    by_kind = {kind: [r for r in rows if r["info"]["kind"] == kind][:2] for kind in PROBLEMS}
    assert all(len(found) == 2 for found in by_kind.values())
    sandbox = Sandbox()
    scratch = sandbox.new_scratch()

    async def run_all():
        picked = [row for found in by_kind.values() for row in found]
        results = await asyncio.gather(*(sandbox.run_python(r["info"]["code"], scratch) for r in picked))
        return picked, results

    try:
        picked, results = asyncio.run(run_all())
    finally:
        sandbox.remove_scratch(scratch)
    for row, result in zip(picked, results):
        assert result.ok and result.text() == row["info"]["output"] == row["answer"], (row, result)


@pytest.mark.timeout(60)
def test_demonstration_replays_to_a_correct_rollout(env):
    example = env.dataset[6]
    messages = demonstration(example)
    prompt, completion = messages[: len(example.prompt)], messages[len(example.prompt) :]
    assert prompt == example.prompt
    assert completion[0]["role"] == "assistant" and completion[0]["content"] == ""
    assert completion[0]["tool_calls"] == [{
        "id": "call_0", "type": "function",
        "function": {"name": "python", "arguments": json.dumps({"code": example.info["code"]})},
    }]  # fmt: skip
    assert completion[1] == {"role": "tool", "tool_call_id": "call_0", "content": example.answer}
    assert completion[2]["content"].endswith(f"\\boxed{{{example.answer}}}")
    # the same replies, played for real: the sandbox prints exactly the demonstrated output
    call = completion[0]["tool_calls"][0]["function"]
    rollout, _ = play(env, example, ("", [ToolCall("call_0", call["name"], call["arguments"])]), (completion[2]["content"], []))
    assert rollout.completion == completion and rollout.reward == 1.0
    # a row without a program has no demonstration
    hub_like = env.format_dataset([{"question": "1 + 1?", "answer": "2"}])[0]
    assert demonstration(hub_like) is None


def test_generated_data_is_deterministic_and_disjoint():
    a = load_environment(num_train_examples=200, num_eval_examples=50, seed=3)
    b = load_environment(num_train_examples=200, num_eval_examples=50, seed=3)
    c = load_environment(num_train_examples=200, num_eval_examples=50, seed=4)
    questions = lambda examples: [e.prompt[-1]["content"] for e in examples]  # noqa: E731
    assert questions(a.dataset) == questions(b.dataset) != questions(c.dataset)
    assert len(a.dataset) == 200 and len(a.eval_dataset) == 50
    assert not set(questions(a.dataset)) & set(questions(a.eval_dataset))
    assert {e.info["kind"] for e in a.dataset} == set(PROBLEMS) and all(e.task == "math-python" for e in a.dataset)


def test_data_file_rows(tmp_path):
    rows = [
        {"problem": f"What is ${i} + {i}$?", "solution": f"Add: $\\boxed{{{2 * i}}}$.", "level": "Level 1", "type": "Algebra"}
        for i in range(20)
    ]
    rows.append({"problem": "No boxed answer here", "solution": "none"})  # dropped
    rows.append({"question": "What is 7 * 6?", "answer": "42"})
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    env = load_environment(data_path=str(path), num_eval_examples=4)
    examples = [*env.dataset, *env.eval_dataset]
    assert len(env.dataset) == 17 and len(env.eval_dataset) == 4
    by_question = {e.prompt[-1]["content"]: e for e in examples}
    assert by_question["What is $3 + 3$?"].answer == "6" and by_question["What is $3 + 3$?"].info["level"] == "Level 1"
    assert by_question["What is 7 * 6?"].answer == "42" and demonstration(by_question["What is 7 * 6?"]) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match="needs `problem` \\+ `solution` or `question` \\+ `answer`"):
        load_environment(data_path=str(bad))


def test_hub_offline():
    with pytest.raises(DatasetUnavailable, match="chiayewken/competition_math is unreachable"):
        load_environment(source="hub")
    assert load_environment(source="auto", num_train_examples=3, num_eval_examples=1).dataset[0].info["code"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"num_train_examples": 0}, "num_train_examples must be an integer >= 1"),
        ({"num_eval_examples": -2}, "num_eval_examples must be an integer >= 0"),
        ({"max_turns": 1}, "max_turns must be an integer >= 2"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"source": "web"}, "source must be 'auto', 'hub' or 'generated'"),
        ({"timeout_s": 0}, "math-python: timeout_s must be a number > 0, got 0"),
        ({"scratch_mb": 2048}, "scratch_mb [(]2048[)] must be below call_memory_mb"),  # the sandbox's own check
        ({"timeout": 5}, "math-python: unknown argument 'timeout' [(]did you mean 'timeout_s'[?][)]"),
    ],
)
def test_argument_errors(args, message):
    with pytest.raises(ValueError, match=message):
        load_environment(**args)
