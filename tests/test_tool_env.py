"""ToolEnv: schemas from signatures and docstrings, the call loop, every way a call fails
(unknown tool, bad JSON, wrong arguments, a raising or hanging tool, a malformed call), the
hidden arguments of StatefulToolEnv, teardown, and the per-rollout metrics."""

import asyncio
import time

import pytest
from prime_rl.envs import Example, ModelReply, Rubric, StatefulToolEnv, ToolCall, ToolEnv, Turn, tool_schema


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number,
            two by default.
    """
    return a + b


async def shout(text: str) -> str:
    """Upper-case some text."""
    await asyncio.sleep(0)
    return text.upper()


def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom: {reason}")


async def hang() -> str:
    """Never returns."""
    await asyncio.sleep(3600)
    return ""


def call(name, arguments, i=0):
    return ToolCall(f"call_{i}", name, arguments)


class Script:
    """Replies in order; records the messages and tools of every call."""

    def __init__(self, *replies):
        self.replies, self.calls = list(replies), []

    async def reply(self, messages, context, n=1, tools=None):
        self.calls.append(([dict(m) for m in messages], tools))
        text, calls = self.replies.pop(0)
        return [ModelReply(text, "stop", Turn([1], [2], [-0.1]), tuple(calls)) for _ in range(n)]


def correct(completion, answer) -> float:
    return float(completion[-1]["content"].strip() == answer)


def make_env(**kwargs):
    rows = [{"question": "What is 2 + 3?", "answer": "5"}]
    return ToolEnv(tools=[add, shout, explode, hang], dataset=rows, rubric=Rubric([correct]), **kwargs)


def play(env, script):
    return asyncio.run(env.rollout(script, env.dataset[0]))


def test_schema_from_type_hints_and_docstring():
    assert tool_schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first number."},
                    "b": {"type": "integer", "description": "the second number, two by default."},
                },
                "required": ["a"],
            },
        },
    }
    hidden = tool_schema(add, args_to_skip=["b"])["function"]["parameters"]
    assert list(hidden["properties"]) == ["a"]
    with pytest.raises(ValueError, match="args_to_skip"):
        tool_schema(add, args_to_skip=["c"])


def test_a_tool_using_episode_runs_the_calls_and_scores_the_answer():
    env = make_env()
    script = Script(("", [call("add", '{"a": 2, "b": 3}', 0), call("shout", '{"text": "ok"}', 1)]), ("5", []))
    rollout = play(env, script)
    assert rollout.reward == 1.0 and rollout.stop_condition == "completed"
    tools_msgs = [m for m in rollout.completion if m["role"] == "tool"]
    assert tools_msgs == [
        {"role": "tool", "tool_call_id": "call_0", "content": "5"},
        {"role": "tool", "tool_call_id": "call_1", "content": "OK"},
    ]
    assert rollout.completion[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert all(tools == env.tool_defs for _, tools in script.calls)  # the schemas go with every call
    m = rollout.metrics
    assert (m["total_tool_calls"], m["add_calls"], m["shout_calls"], m["tool_errors"], m["turns"]) == (2, 1, 1, 0, 2)
    assert m["made_tool_call"] == 1.0 and play(env, Script(("5", []))).metrics["made_tool_call"] == 0.0


def test_failed_calls_return_errors_to_the_model_and_are_counted():
    env = make_env(tool_timeout_s=0.5)
    script = Script(
        ("", [call("nope", "{}", 0)]),  # unknown tool
        ("", [call("add", '{"a": 1,', 1)]),  # not JSON
        ("", [call("add", '{"a": 1, "c": 1}', 2)]),  # does not fit the signature
        ("", [call("explode", '{"reason": "x"}', 3)]),  # raises
        ("", [call("hang", "{}", 4)]),  # times out
        ("4", []),
    )
    start = time.monotonic()
    rollout = play(env, script)
    assert time.monotonic() - start < 5
    errors = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert errors[0].startswith("Error: unknown tool 'nope'; the tools are: add, shout, explode, hang")
    assert errors[1].startswith("Error: the arguments of add are not a JSON object")
    assert errors[2].startswith("Error: bad arguments for add:") and "'c'" in errors[2]
    assert errors[3] == "Error: RuntimeError: boom: x"
    assert errors[4] == "Error: hang timed out after 0.5 s"
    m = rollout.metrics
    assert rollout.reward == 0.0 and rollout.stop_condition == "completed"
    assert (m["total_tool_calls"], m["tool_errors"], m["malformed_calls"]) == (5, 5, 1)
    assert (m["add_errors"], m["explode_errors"], m["hang_errors"], m["turns"]) == (2, 1, 1, 6)


def test_a_malformed_call_gets_feedback_and_the_episode_goes_on():
    env = make_env()
    script = Script(('<tool_call>\n{"name": "add", "arguments": {"a": </tool_call>', []), ("5", []))
    rollout = play(env, script)
    assert rollout.completion[1]["role"] == "user" and "no tool call could be parsed" in rollout.completion[1]["content"]
    assert rollout.reward == 1.0 and rollout.metrics["malformed_calls"] == 1 and rollout.metrics["turns"] == 2


def test_running_out_of_turns():
    env = make_env(max_turns=2)
    script = Script(("", [call("add", '{"a": 1}')]), ("", [call("add", '{"a": 2}')]))
    rollout = play(env, script)
    assert rollout.stop_condition == "max_turns" and rollout.reward == 0.0
    assert rollout.metrics["add_calls"] == 1  # the last turn's call is not run: the episode is over


def test_output_is_truncated():
    env = make_env(max_tool_output_chars=3)
    rollout = play(env, Script(("", [call("shout", '{"text": "abcdef"}')]), ("5", [])))
    assert rollout.completion[1]["content"] == "ABC\n... (3 more characters cut)"


class Notes(StatefulToolEnv):
    """A tool whose `notes` argument the model never sees; setup/teardown per rollout."""

    def __init__(self, **kwargs):
        super().__init__(dataset=[{"question": "q", "answer": "a"}], **kwargs)
        self.add_tool(self.lookup, args_to_skip=["notes"])
        self.torn_down = []

    @staticmethod
    def lookup(key: str, notes: dict) -> str:
        """Look up a note."""
        return notes[key]

    def setup_state(self, state):
        state["notes"] = {"k": "secret"}
        return state

    def update_tool_args(self, tool_name, tool_args, messages, state):
        return {**tool_args, "notes": state["notes"]}

    def teardown_state(self, state):
        self.torn_down.append(state["example_id"])


def test_stateful_tools_get_hidden_arguments():
    env = Notes()
    assert list(env.tool_defs[0]["function"]["parameters"]["properties"]) == ["key"]
    rollout = asyncio.run(env.rollout(Script(("", [call("lookup", '{"key": "k"}')]), ("a", [])), env.dataset[0]))
    assert rollout.completion[1]["content"] == "secret" and env.torn_down == [0]
    # the model cannot pass the hidden argument itself
    rollout = asyncio.run(env.rollout(Script(("", [call("lookup", '{"key": "k", "notes": {}}')]), ("a", [])), env.dataset[0]))
    assert rollout.completion[1]["content"] == "Error: lookup takes no argument(s) ['notes']"
    assert env.torn_down == [0, 0]


def test_teardown_runs_when_the_rollout_fails():
    env = Notes()

    class Broken:
        async def reply(self, messages, context, n=1, tools=None):
            if context or len(messages) > 2:
                raise ConnectionError("server gone")
            return [ModelReply("", "stop", Turn([1], [2], [-0.1]), (call("lookup", '{"key": "k"}'),))]

    with pytest.raises(ConnectionError):
        asyncio.run(env.rollout(Broken(), env.dataset[0]))
    assert env.torn_down == [0]


def test_envs_without_tools_do_not_pass_tools():
    from prime_rl.envs import SingleTurnEnv

    class OldClient:  # written before tools existed
        async def reply(self, messages, context, n=1):
            return [ModelReply("x", "stop")]

    env = SingleTurnEnv(dataset=[{"question": "q", "answer": "x"}])
    assert asyncio.run(env.rollout(OldClient(), Example(0, [{"role": "user", "content": "q"}], "x"))).turns == []
