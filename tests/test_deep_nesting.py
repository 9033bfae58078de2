"""Nesting deep enough to hit Python's recursion limit, from the model (tool-call arguments)
or from the user (config files, flags, environment arguments), takes the existing error
path: an error message for the model as the tool's result, a one-line ConfigError. Before,
a RecursionError escaped: it ended the orchestrator's step, or the CLI with a traceback."""

import asyncio
import json

import pytest

from orchestrator.client.parse import chat_choice
from prime_rl.cli import load_eval_config
from prime_rl.envs import ModelReply, Rubric, ToolCall, ToolEnv, Turn
from prime_rl.config import RLConfig
from prime_rl.settings import ConfigError, load_config, read_config_file

DEEP_ARRAY = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a": ' * 1000 + "1" + "}" * 1000  # valid JSON, but deeper than json.loads recurses


def nested_dict(levels):
    value = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def add(a: int, b: int = 2) -> int:
    """Add two integers."""
    return a + b


def deep_result() -> list:
    """Returns a list nested far too deeply for json.dumps or str."""
    value: list = []
    for _ in range(100_000):
        value = [value]
    return value


class Script:
    """Replies in order: (text, tool calls)."""

    def __init__(self, *replies):
        self.replies = list(replies)

    async def reply(self, messages, context, n=1, tools=None):
        text, calls = self.replies.pop(0)
        return [ModelReply(text, "stop", Turn([1], [2], [-0.1]), tuple(calls)) for _ in range(n)]


def play(*replies):
    env = ToolEnv(tools=[add, deep_result], dataset=[{"question": "2 + 3?", "answer": "5"}],
                  rubric=Rubric([lambda completion, answer: float(completion[-1]["content"] == answer)]))
    rollout = asyncio.run(env.rollout(Script(*replies), env.dataset[0]))
    return rollout, [m["content"] for m in rollout.completion if m["role"] == "tool"]


# --------------------------------------------------------------------------- the model's tool calls


@pytest.mark.parametrize("arguments", [DEEP_ARRAY, DEEP_OBJECT, '{"a": ' + DEEP_ARRAY + "}"], ids=["array", "object", "inside"])
def test_deeply_nested_arguments_are_an_error_for_the_model(arguments):
    rollout, results = play(("", [ToolCall("call_0", "add", arguments)]), ("5", []))
    assert results[0].startswith("Error: the arguments of add are not a JSON object (nested too deeply): ")
    assert rollout.reward == 1.0 and rollout.stop_condition == "completed"  # the episode went on
    assert (rollout.metrics["tool_errors"], rollout.metrics["malformed_calls"], rollout.metrics["add_errors"]) == (1, 1, 1)


def test_arguments_given_as_a_deep_object_are_an_error_for_the_model():
    # ToolCall.arguments is JSON text; an object that bypassed encoding must not crash the error message
    rollout, results = play(("", [ToolCall("call_0", "add", deep_result())]), ("5", []))
    assert results[0] == (
        "Error: the arguments of add are not a JSON object (expected a JSON object, got list): "
        "<a list nested too deeply to show>"
    )
    assert rollout.stop_condition == "completed"


def test_a_tool_result_too_deep_to_encode_is_named_not_raised():
    rollout, results = play(("", [ToolCall("call_0", "deep_result", "{}")]), ("5", []))
    assert results == ["<a list nested too deeply to show>"]
    assert rollout.stop_condition == "completed" and rollout.metrics["tool_errors"] == 0


def test_server_tool_call_arguments_too_deep_to_encode_become_an_error_for_the_model():
    # a server that returns the arguments as an object (not JSON text) nested too deeply
    choice = {"message": {"content": "", "tool_calls": [{"id": "c0", "function": {"name": "add", "arguments": nested_dict(5000)}}]}}
    _, _, calls = chat_choice(choice)
    assert calls[0].name == "add" and isinstance(calls[0].arguments, str)
    _, results = play(("", calls), ("5", []))
    assert results[0].startswith("Error: the arguments of add are not a JSON object")


# --------------------------------------------------------------------------- the user's configs


def one_line_error(call):
    with pytest.raises(ConfigError) as e:
        call()
    message = str(e.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_deep_json_config_file_is_a_config_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"max_steps": ' + DEEP_ARRAY + "}")
    assert "not valid JSON: tables or arrays nested more than 64 levels deep" in one_line_error(lambda: read_config_file(deep))
    deep.write_text(json.dumps({"env": [{"args": nested_dict(100)}]}))
    message = one_line_error(lambda: load_config(RLConfig, [deep], []))
    assert "`env.0.args`: tables or arrays nested more than 64 levels deep" in message


def test_nesting_within_the_limit_is_accepted(tmp_path):
    config = tmp_path / "ok.toml"
    config.write_text("[[env]]\nid = 'reverse-text'\nargs = " + "{a = " * 60 + "1" + "}" * 60 + "\n")
    assert load_config(RLConfig, [config], []).orchestrator.env[0].args == nested_dict(60)


def test_deep_env_args_of_eval_are_a_config_error():
    # `prime-rl eval ENV -a JSON` reaches the config without read_config_file or parse_flags
    message = one_line_error(lambda: load_eval_config(["reverse-text", "-m", "fake", "-a", json.dumps(nested_dict(100))]))
    assert message.startswith("-a/--env-args: ") and "nested more than 64 levels deep" in message


def test_env_args_too_deep_for_json_are_a_config_error():
    # past ~1,000 levels the JSON parser itself recurses too deep, before any config check
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    message = one_line_error(lambda: load_eval_config(["reverse-text", "-m", "fake", "-a", deep]))
    assert message.startswith("-a/--env-args: not valid JSON") and "nested too deeply" in message


def test_a_json_config_that_is_not_an_object_is_a_config_error(tmp_path):
    config = tmp_path / "list.json"
    config.write_text("[1, 2]")
    assert "expected a JSON object of settings at the top level, got list" in one_line_error(lambda: load_config(RLConfig, [config], []))
