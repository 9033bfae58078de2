"""Tool-using environments: plain Python functions become tools the model can call.

    def search(query: str, limit: int = 3) -> str:
        '''Search the notes for a query.

        Args:
            query: words to look for.
            limit: how many results to return.
        '''

    env = ToolEnv(tools=[search], dataset=rows, rubric=rubric, max_turns=6)

A function's type hints and docstring become its OpenAI tool schema (``tool_schema``):
the docstring's first paragraph is the description, its ``Args:`` section describes the
parameters, parameters without a default are required. The schemas go to the model with
every call (``tools=``); the model server's tool-call parser (vLLM's, chosen in
``[inference]``) turns the model's text into ``ModelReply.tool_calls``.

The loop (``Environment``'s) then runs here:
- the model's reply is appended with its tool calls; a reply without any tool call is the
  final answer and ends the episode (so does ``max_turns``);
- each call runs (concurrently when a reply makes several; sync functions in a worker
  thread, so a slow tool never blocks other rollouts), and its result is appended as a
  ``tool`` message. A tool that raises, times out, is unknown, or gets arguments that are
  not a JSON object (nested too deeply to parse included) or do not fit its signature
  returns ``Error: ...`` text to the model instead: it is counted, never crashes the rollout;
- a reply that holds the tool-call marker (``<tool_call>`` by default) but no parsable
  call gets an error message back and the episode goes on (``malformed_calls``).

Tool messages are in the training sequence and out of the loss (the sampler's bridge).
Metrics per rollout: ``total_tool_calls``, ``made_tool_call`` (0/1: its mean is the
tool-call rate), ``<tool>_calls``, ``<tool>_errors``, ``tool_errors``, ``malformed_calls``,
``turns``.

``StatefulToolEnv`` adds arguments the model must not see (a sandbox handle, a corpus):
``add_tool(fn, args_to_skip=[...])`` hides them from the schema and
``update_tool_args(tool_name, tool_args, messages, state)`` fills them in per call.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from prime_rl.envs.env import MultiTurnEnv, maybe_await
from prime_rl.envs.types import Messages, State

Tool = Callable[..., Any]

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


# --------------------------------------------------------------------------- schemas


def tool_schema(fn: Tool, args_to_skip: Sequence[str] = ()) -> dict[str, Any]:
    """The OpenAI tool schema of ``fn``: name, description (docstring's first paragraph),
    parameters from its signature (type hints -> JSON types, ``Args:`` lines -> descriptions,
    no default -> required). ``args_to_skip`` are left out (the environment injects them)."""
    name = getattr(fn, "__name__", None)
    if not name or not callable(fn):
        raise TypeError(f"a tool must be a named function, got {fn!r}")
    description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.name in args_to_skip or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(param.name, str))
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    unknown = set(args_to_skip) - set(inspect.signature(fn).parameters)
    if unknown:
        raise ValueError(f"tool {name!r}: args_to_skip names parameters it does not have: {sorted(unknown)}")
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _json_type(hint: Any) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        return _json_type(present[0]) if len(present) == 1 else {"type": "string"}
    if origin in (list, tuple, set, Sequence) or hint in (list, tuple):
        schema: dict[str, Any] = {"type": "array"}
        if args:
            schema["items"] = _json_type(args[0])
        return schema
    if origin is dict or hint is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES.get(hint, "string")}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {arg: description}) from a Google-style docstring: the first paragraph,
    and the ``Args:`` section's ``name: text`` lines (deeper-indented lines continue them)."""
    first = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    description = "" if first.startswith("Args:") else " ".join(first.split())
    arg_docs: dict[str, str] = {}
    section = re.search(r"^Args:[ \t]*\n((?:[ \t]+\S.*(?:\n|$))+)", doc, re.MULTILINE)
    if section:
        lines = section.group(1).splitlines()
        indent = min(len(line) - len(line.lstrip()) for line in lines)
        current = None
        for line in lines:
            match = re.match(r"(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line.strip())
            if match and len(line) - len(line.lstrip()) == indent:
                current = match.group(1)
                arg_docs[current] = match.group(2).strip()
            elif current is not None:
                arg_docs[current] = f"{arg_docs[current]} {line.strip()}".strip()
    return description, arg_docs


# --------------------------------------------------------------------------- environments


class ToolEnv(MultiTurnEnv):
    """A multi-turn environment whose environment turn runs the model's tool calls."""

    call_marker: str | None = "<tool_call>"
    """Text that shows the model tried to call a tool (Qwen/Hermes format); a reply holding it
    with no parsed call is a malformed call. None: such a reply is a final answer."""

    def __init__(
        self,
        tools: Sequence[Tool] = (),
        max_turns: int = 10,
        tool_timeout_s: float | None = 60.0,
        max_tool_output_chars: int | None = None,
        error_formatter: Callable[[Exception], str] | None = None,
        **kwargs: Any,
    ):
        super().__init__(max_turns=max_turns, **kwargs)
        self.tools: dict[str, Tool] = {}
        self.tool_defs = []
        self.skipped_args: dict[str, tuple[str, ...]] = {}
        self.tool_timeout_s = tool_timeout_s
        self.max_tool_output_chars = max_tool_output_chars
        self.error_formatter = error_formatter or (lambda e: f"Error: {type(e).__name__}: {e}")
        for tool in tools:
            self.add_tool(tool)

    def add_tool(self, tool: Tool, args_to_skip: Sequence[str] = ()) -> None:
        schema = tool_schema(tool, args_to_skip)
        name = schema["function"]["name"]
        if name in self.tools:
            raise ValueError(f"{type(self).__name__}: two tools are named {name!r}")
        self.tools[name] = tool
        self.skipped_args[name] = tuple(args_to_skip)
        self.tool_defs = [*self.tool_defs, schema]

    # ----------------------------------------------------------------------- hooks

    def update_tool_args(self, tool_name: str, tool_args: dict[str, Any], messages: Messages, state: State) -> dict[str, Any]:
        """The arguments the tool is called with: the model's, plus whatever the environment
        injects (``StatefulToolEnv`` subclasses override this)."""
        return tool_args

    def is_completed(self, messages: Messages, state: State) -> bool:
        last = messages[-1]
        return not last.get("tool_calls") and not self._malformed(last)

    async def env_response(self, messages: Messages, state: State) -> Messages:
        last = messages[-1]
        stats = self._stats(state)
        calls = last.get("tool_calls") or []
        if not calls:  # a malformed call (is_completed let it through)
            stats["malformed_calls"] += 1
            return [{"role": "user", "content": self._malformed_message()}]
        results = await asyncio.gather(*(self._run_call(call, messages, state) for call in calls))
        return [{"role": "tool", "tool_call_id": call.get("id", ""), "content": text} for call, text in zip(calls, results)]

    def rollout_metrics(self, state: State) -> dict[str, float]:
        stats = self._stats(state)
        metrics = {"total_tool_calls": float(stats["total"]), "tool_errors": float(stats["errors"])}
        metrics["made_tool_call"] = float(stats["total"] > 0)  # its mean is the tool-call rate
        metrics["malformed_calls"] = float(stats["malformed_calls"])
        for name in self.tools:
            metrics[f"{name}_calls"] = float(stats["calls"].get(name, 0))
            metrics[f"{name}_errors"] = float(stats["errors_by_tool"].get(name, 0))
        metrics["turns"] = float(state.get("turn", 0))
        return metrics

    # ----------------------------------------------------------------------- one call

    async def _run_call(self, call: dict[str, Any], messages: Messages, state: State) -> str:
        stats = self._stats(state)
        function = call.get("function") or {}
        name, raw = str(function.get("name", "")), function.get("arguments") or "{}"
        stats["total"] += 1
        if name not in self.tools:
            stats["errors"] += 1
            return f"Error: unknown tool {name!r}; the tools are: {', '.join(self.tools)}"
        stats["calls"][name] = stats["calls"].get(name, 0) + 1
        try:
            args = _decode_arguments(raw)
        except ValueError as e:
            stats["malformed_calls"] += 1
            return self._failed(stats, name, f"Error: the arguments of {name} are not a JSON object ({e}): {_preview(raw)}")
        hidden = set(args) & set(self.skipped_args[name])
        if hidden:
            return self._failed(stats, name, f"Error: {name} takes no argument(s) {sorted(hidden)}")
        try:
            args = await maybe_await(self.update_tool_args(name, args, messages, state))
            inspect.signature(self.tools[name]).bind(**args)
        except TypeError as e:
            return self._failed(stats, name, f"Error: bad arguments for {name}: {e}")
        try:
            result = await asyncio.wait_for(self._call(self.tools[name], args), self.tool_timeout_s)
        except asyncio.TimeoutError:
            return self._failed(stats, name, f"Error: {name} timed out after {self.tool_timeout_s} s")
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's feedback, never the rollout's end
            return self._failed(stats, name, self.error_formatter(e))
        return self._truncate(result if isinstance(result, str) else _as_text(result))

    async def _call(self, tool: Tool, args: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(tool):
            return await tool(**args)
        return await maybe_await(await asyncio.to_thread(tool, **args))

    def _failed(self, stats: dict[str, Any], name: str, text: str) -> str:
        stats["errors"] += 1
        stats["errors_by_tool"][name] = stats["errors_by_tool"].get(name, 0) + 1
        return self._truncate(text)

    def _truncate(self, text: str) -> str:
        limit = self.max_tool_output_chars
        if limit is not None and len(text) > limit:
            return text[:limit] + f"\n... ({len(text) - limit} more characters cut)"
        return text

    def _malformed(self, message: dict[str, Any]) -> bool:
        return bool(self.call_marker) and self.call_marker in str(message.get("content") or "")

    def _malformed_message(self) -> str:
        return (
            f"Error: your reply contains {self.call_marker} but no tool call could be parsed from it. "
            f"Call a tool with a valid JSON object of its name and arguments, or answer without {self.call_marker}."
        )

    @staticmethod
    def _stats(state: State) -> dict[str, Any]:
        return state.setdefault(
            "tool_stats", {"total": 0, "errors": 0, "malformed_calls": 0, "calls": {}, "errors_by_tool": {}}
        )


class StatefulToolEnv(ToolEnv):
    """A ``ToolEnv`` whose tools take arguments the model must not see: register them with
    ``add_tool(fn, args_to_skip=[...])`` and fill them in ``update_tool_args``."""

    def update_tool_args(self, tool_name: str, tool_args: dict[str, Any], messages: Messages, state: State) -> dict[str, Any]:
        raise NotImplementedError(
            f"{type(self).__name__} must implement update_tool_args(tool_name, tool_args, messages, state) "
            "to inject the hidden arguments"
        )


def _decode_arguments(raw: Any) -> dict[str, Any]:
    """The model's arguments as a dict; ValueError (the model's mistake, told to it) when they
    are not a JSON object. Nesting deeper than the parser's recursion limit (``[[[[...]]]]``
    written by the model) is such a mistake too, not a crash of the rollout."""
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(args, dict):
        raise ValueError(f"expected a JSON object, got {type(args).__name__}")
    return args


def _preview(raw: Any, limit: int | None = 200) -> str:
    """The start of ``raw`` for an error message; never raises (``str`` of a deeply nested
    object hits the recursion limit)."""
    try:
        return str(raw)[:limit]
    except RecursionError:
        return f"<a {type(raw).__name__} nested too deeply to show>"


def _as_text(value: Any) -> str:
    """A tool's non-string result as text: JSON where it encodes, else ``str``; a result nested
    too deeply for either is named, not shown (the rollout goes on)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return _preview(value, limit=None)
