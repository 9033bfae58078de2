"""A classic verifiers environment (verifiers 0.3.x: `vf.Environment`) inside the worker.

``vf.load_environment(id, **args)`` loads it exactly as verifiers does. A group runs with
``env.run_group`` and a client object of our own (``ProxyClient``, a subclass of verifiers'
legacy ``Client``): verifiers calls it for every model turn, with the rollout's state, and
it forwards the chat to the orchestrator, which samples it with its exact-token client and
answers with the reply text, the tool calls vLLM's parser read, and the tokens. The
environment's loop, stop conditions, parsers and rubric are verifiers' own.

Reward functions that raise score 0, as verifiers has it; to count them per function (as
prime-rl counts its own, `errors/<env>/<fn>`), every rubric function is wrapped so that the
rollouts it raised for are recorded.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
import json
import sys
import time
import traceback
import uuid
from typing import Any

from vfworker_util import LoadError, import_module, log, plain

current_group: contextvars.ContextVar[int] = contextvars.ContextVar("current_group")


class ClassicRunner:
    def __init__(self, vf, env, env_id: str):
        self.vf = vf
        self.env = env
        self.env_id = env_id
        self.errors: dict[str, set[str]] = {}
        """trajectory_id -> names of the rubric functions that raised for that rollout."""

        self.logged: set[str] = set()
        self.rows = {"train": rows_of(env.build_dataset()), "eval": rows_of(env.build_eval_dataset())}
        self.client = make_proxy_client(vf)
        for rubric in rubrics(env.rubric):
            rubric.funcs = [self.instrument(rubric, f) for f in rubric.funcs]

    @classmethod
    def load(cls, env_id: str, module: str, args: dict[str, Any]) -> ClassicRunner:
        import verifiers as vf

        loaded = import_module(module)
        load = getattr(loaded, "load_environment", None)
        if not callable(load):
            raise LoadError(f"module {module!r} has no load_environment()")
        try:
            inspect.signature(load).bind(**args)
        except TypeError as e:
            raise LoadError(f"load_environment(**{args!r}) does not take these arguments: {e}") from None
        env = load(**args)  # as vf.load_environment does, without wrapping the error
        if not isinstance(env, vf.Environment):
            raise LoadError(f"load_environment() returned {type(env).__name__}, expected a verifiers Environment")
        env.env_id = getattr(env, "env_id", None) or env_id
        env.env_args = getattr(env, "env_args", None) or args
        return cls(vf, env, env_id)

    def describe(self) -> dict[str, Any]:
        env = self.env
        tools = [openai_tool(t) for t in (getattr(env, "tool_defs", None) or [])]
        return {
            "kind": "classic verifiers environment",
            "env_class": type(env).__name__,
            "system_prompt": env.system_prompt,
            "tools": tools,
            "max_turns": int(getattr(env, "max_turns", 1) or -1),
            "dataset": [example_of(i, row) for i, row in enumerate(self.rows["train"] or [])] or None,
            "eval_dataset": [example_of(i, row) for i, row in enumerate(self.rows["eval"] or [])] or None,
        }

    # ----------------------------------------------------------------------- groups

    async def run_group(self, server, group: int, message: dict[str, Any]) -> list[dict[str, Any]]:
        """``n`` rollouts of one example, scored by the environment's rubric (group functions too)."""
        rows = self.rows[message["split"]]
        row = dict(rows[message["index"]])
        row["prompt"] = message["prompt"]  # the orchestrator's (with a replaced system prompt, if any)
        current_group.set(group)
        self.client.server = server
        outputs = await self.env.run_group(
            [copy.deepcopy(row) for _ in range(message["n"])],
            client=self.client,
            model="policy",
            sampling_args={},
            state_columns=["trajectory_id"],
        )
        return [self.result(output) for output in outputs]

    def result(self, output: dict[str, Any]) -> dict[str, Any]:
        key = output.get("trajectory_id")
        errors = sorted(self.errors.pop(key, set()))
        error = output.get("error")
        if error:
            errors.append("rollout_error")
            text = error.get("message") if isinstance(error, dict) else str(error)
            if "rollout_error" not in self.logged:
                self.logged.add("rollout_error")
                log(f"a rollout ended with an error (logged once; counted in errors/<env>/rollout_error): {text}")
        return {
            "rollout": key,
            "reward": float(output.get("reward") or 0.0),
            "metrics": {k: float(v) for k, v in (output.get("metrics") or {}).items() if isinstance(v, int | float)},
            "errors": errors,
            "completion": [openai_message(m) for m in (output.get("completion") or [])],
            "stop_condition": output.get("stop_condition") or "",
            "is_truncated": bool(output.get("is_truncated")),
            "error": None if not error else (error.get("message") if isinstance(error, dict) else str(error)),
        }

    # ----------------------------------------------------------------------- rubric errors

    def instrument(self, rubric, func):
        """``func`` as verifiers sees it (same name, parameters and return annotation), plus the
        rollout's state (or the group's states) so that an exception is counted for them."""
        group = rubric._is_group_func(func)
        key = "states" if group else "state"
        sig = inspect.signature(func)
        params = list(sig.parameters.values())
        takes_key = key in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in params)
        if not takes_key:
            extra = inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None)
            at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
            params.insert(at, extra)
        name = getattr(func, "__name__", type(func).__name__)

        async def wrapper(**kwargs):
            target = kwargs.get(key)
            call = kwargs if takes_key else {k: v for k, v in kwargs.items() if k != key}
            try:
                value = func(**call)
                return await value if inspect.isawaitable(value) else value
            except Exception:
                states = target if group else [target]
                for state in states or []:
                    if state is not None:
                        self.errors.setdefault(state.get("trajectory_id"), set()).add(name)
                if name not in self.logged:
                    self.logged.add(name)
                    log(f"reward function {name} raised (it scores 0; logged once, counted in errors/<env>/{name}):\n"
                        f"{traceback.format_exc()}")
                raise

        wrapper.__name__ = name
        wrapper.__qualname__ = getattr(func, "__qualname__", name)
        wrapper.__signature__ = sig.replace(parameters=params)
        return wrapper


def rubrics(rubric) -> list:
    """The rubric and, for a RubricGroup, every rubric inside it."""
    inner = getattr(rubric, "rubrics", None)
    if not inner:
        return [rubric]
    return [r for child in inner for r in rubrics(child)]


# --------------------------------------------------------------------------- data


def rows_of(dataset) -> list[dict[str, Any]] | None:
    if dataset is None:
        return None
    return [dict(row) for row in dataset]


def example_of(index: int, row: dict[str, Any]) -> dict[str, Any]:
    """The fields the orchestrator keeps of a row (the worker keeps the row itself)."""
    info = row.get("info")
    return {
        "index": index,
        "prompt": [openai_message(m) for m in row.get("prompt") or []],
        "answer": "" if row.get("answer") is None else str(row["answer"]),
        "info": plain(info) if isinstance(info, dict) else ({} if info in (None, "") else {"info": plain(info)}),
        "task": "default" if row.get("task") is None else str(row["task"]),
    }


# --------------------------------------------------------------------------- messages and tools


def openai_message(message) -> dict[str, Any]:
    """A verifiers message (pydantic or dict) as an OpenAI chat message dict."""
    data = plain(message)
    out: dict[str, Any] = {"role": data.get("role", "user"), "content": text_of(data.get("content"))}
    calls = [json.loads(c) if isinstance(c, str) else c for c in data.get("tool_calls") or []]  # outputs hold JSON text
    if calls:
        out["tool_calls"] = [
            call if "function" in call else
            {"id": call.get("id", ""), "type": "function", "function": {"name": call.get("name", ""), "arguments": call.get("arguments", "")}}
            for call in calls
        ]
    if data.get("tool_call_id") is not None:
        out["tool_call_id"] = data["tool_call_id"]
    if data.get("name") is not None and out["role"] == "tool":
        out["name"] = data["name"]
    return out


def text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def openai_tool(tool) -> dict[str, Any]:
    data = plain(tool)
    if "function" in data:
        return data
    return {"type": "function", "function": {k: data[k] for k in ("name", "description", "parameters") if k in data}}


def make_proxy_client(vf):
    """A verifiers client whose every response comes from the orchestrator (no HTTP here)."""
    from verifiers.legacy.clients.client import Client
    from verifiers.legacy.types import Response, ResponseMessage, ResponseTokens, ToolCall, Usage

    class ProxyClient(Client):
        server = None

        def __init__(self):
            super().__init__(object())

        def setup_client(self, config):
            return object()

        async def to_native_tool(self, tool):
            return openai_tool(tool)

        async def to_native_prompt(self, messages):
            return [openai_message(m) for m in messages], {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            raise NotImplementedError  # get_response is answered by the orchestrator

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            raise NotImplementedError

        async def close(self):
            return None

        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            state = kwargs.get("state") or {}
            rollout = state.get("trajectory_id") or uuid.uuid4().hex
            messages = [openai_message(m) for m in prompt]
            native_tools = [openai_tool(t) for t in tools] if tools else None
            answer = await self.server.model_call(current_group.get(), rollout, messages, native_tools)
            if answer["op"] == "model_error":
                if answer.get("kind") == "prompt_too_long":
                    raise vf.OverlongPromptError(answer.get("message", "the prompt does not fit the context"))
                raise vf.ModelError(answer.get("message", "the model call failed"))
            reply = answer["reply"]
            prompt_ids, completion_ids = list(reply["prompt_ids"]), list(reply["completion_ids"])
            calls = [ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]) for c in reply.get("tool_calls") or []]
            finish = reply.get("finish_reason")
            message = ResponseMessage(
                content=reply["text"],
                tool_calls=calls or None,
                finish_reason=finish if finish in ("stop", "length", "tool_calls") else None,
                is_truncated=finish == "length",
                tokens=ResponseTokens(
                    prompt_ids=prompt_ids,
                    prompt_mask=[0] * len(prompt_ids),
                    completion_ids=completion_ids,
                    completion_mask=[1] * len(completion_ids),
                    completion_logprobs=list(reply["completion_logprobs"]),
                ),
            )
            usage = Usage(prompt_tokens=len(prompt_ids), reasoning_tokens=0, completion_tokens=len(completion_ids),
                          total_tokens=len(prompt_ids) + len(completion_ids))
            return Response(id=f"prime-rl-{rollout}-{time.monotonic_ns()}", created=int(time.time()), model=model,
                            usage=usage, message=message)

    return ProxyClient()


if __name__ == "__main__":  # not a program: the worker imports it
    sys.exit("vfworker_classic is imported by vfworker_main.py")
