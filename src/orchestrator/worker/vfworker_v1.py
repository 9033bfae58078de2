"""A verifiers v1 taskset (verifiers 0.4.x: a module exporting a `vf.Taskset`) inside the worker.

Loading builds the v1 env config the way `vf-eval` does, ``vf.resolve_env_config({"taskset":
{"id": module, **args}, <role>: {"harness": ..., "runtime": ...}})``, and loads the env the
taskset names (its own exported `vf.Env`, else `SingleAgentEnv`) with ``vf.load_environment``.
Two `[[env]] args` keys are the worker's: `harness` (default: the taskset's bundled harness,
else `null`, the tool-less chat loop) and `runtime` (default `subprocess`; v1's default,
`prime`, needs a login). Every other key is a field of the taskset's config.

A group is ``n`` episodes of one task, ``env.run_slot`` each, inside ``env.serving()`` (entered
on the first group, held until the worker exits). v1 plays an episode the way it always does:
a harness program in its runtime talks to v1's interception server, which calls the model
through a v1 client. That client is pointed at a small HTTP endpoint this worker runs on
127.0.0.1 (the "shim", `Shim`), which forwards every model call to the orchestrator:

- training (``tokens``): a `TrainClientConfig` (v1 renders the prompt to token ids with the
  policy's tokenizer, ``$PRIME_RL_TOKENIZER``, bridging each turn onto the previous turn's
  sampled tokens) POSTs ``/inference/v1/generate``; the shim sends the ids as a `generate`
  frame and answers with the exact tokens and logprobs the orchestrator sampled;
- evaluation against a text-only endpoint: an `EvalClientConfig` POSTs ``/v1/chat/completions``;
  the shim sends the chat as a `model` frame and answers a chat completion (streamed when asked).

Every episode's calls reach the shim with v1's ``X-Session-ID`` header, the trace's id: the
shim finds the group and the trace by it (registered when v1 mints the trace), and that id is
the `rollout` key the orchestrator records the turns under. So all episodes share one client
config (v1 builds and keeps one client per distinct config), and an agent retry, which mints a
new trace, starts a fresh key rather than extending the failed attempt's turns.

When the orchestrator answers that the prompt no longer fits (`prompt_too_long`), the shim
stops the trace (`prompt_too_long`, scored as it stands, like classic environments) and answers
400 in the words harnesses read as a context overflow, so the program ends its run cleanly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vfworker_util import LoadError, log, one_line, plain

DEFAULT_HARNESS = "null"
DEFAULT_RUNTIME = "subprocess"
TOKENIZER_VAR = "PRIME_RL_TOKENIZER"
"""The policy's tokenizer (a local folder or a hub id) v1 renders training prompts with."""
KEY_VAR = "PRIME_RL_WORKER_SHIM_KEY"
"""The variable v1's clients read the shim's API key from (set by this worker)."""
MODEL = "policy"
"""The model name v1 puts in requests; the orchestrator samples its own policy whatever it says."""
OVERLONG = "This model's maximum context length is exceeded"
"""Starts the 400's message on prompt_too_long: v1's harness loops (`is_context_overflow`) read
"maximum context length" as a context overflow and end the run cleanly."""
MAX_BODY = 1 << 30


class TasksetRunner:
    def __init__(self, vf, env, env_id: str, config):
        self.vf = vf
        self.env = env
        self.env_id = env_id
        self.tasks = list(env.taskset)
        self.openings = [opening(task) for task in self.tasks]
        self.harnesses = [vf.load_harness(h) for h in config.agent_harnesses().values()]
        self.live: dict[str, Live] = {}
        """trace id -> the episode it belongs to, while its group runs."""

        self.shim: Shim | None = None
        self.contexts: dict[bool, Any] = {}
        self.starting = asyncio.Lock()
        self.holder: asyncio.Task | None = None
        """Holds the shim and ``env.serving()`` from the first group until the worker exits."""

        self.logged: set[str] = set()

    @classmethod
    def load(cls, env_id: str, module: str, args: dict[str, Any]) -> TasksetRunner:
        import verifiers.v1 as vf
        from pydantic import ValidationError

        show_verifiers_warnings()
        args = dict(args)
        harness = plugin(args.pop("harness", None), "id")
        runtime = plugin(args.pop("runtime", None), "type") or {"type": DEFAULT_RUNTIME}
        taskset_type = taskset_config_type(vf, module)
        if harness is None:  # the taskset's own harness if it ships one (v1 falls back to bash)
            bundled = vf.default_harness_id(module)
            harness = {"id": bundled if bundled != "bash" else DEFAULT_HARNESS}
        env_type = vf.env_config_type(module)
        raw: dict[str, Any] = {"taskset": {**args, "id": module}}
        for role, default in roles(vf, env_type).items():
            # A role the env pins its own harness or runtime for (a judge, say) keeps it.
            seat = {}
            if default.harness is None:
                seat["harness"] = harness
            if isinstance(default.runtime, vf.PrimeConfig):
                seat["runtime"] = runtime
            raw[role] = seat
        try:
            config = vf.resolve_env_config(raw)
        except ValidationError as e:
            raise LoadError(config_error(e, taskset_type, args)) from None
        except ModuleNotFoundError as e:  # an unknown harness id
            raise LoadError(" ".join(str(e).split())) from None
        env = vf.load_environment(config)
        if not env.taskset.bounded:
            raise LoadError(f"taskset {module!r} is infinite (INFINITE = True): the worker lists every task at load, "
                            "so only finite tasksets are supported")
        return cls(vf, env, env_id, config)

    def describe(self) -> dict[str, Any]:
        env = self.env
        prompts = {task.data.system_prompt for task in self.tasks}
        return {
            "kind": "verifiers v1 taskset",
            "env_class": f"{type(env).__name__}[{type(env.taskset).__name__}]",
            "system_prompt": prompts.pop() if len(prompts) == 1 else None,  # one the tasks share, if any
            "tools": [],
            "max_turns": 1 if self.single_turn() else -1,
            "dataset": [example_of(i, task, self.openings[i]) for i, task in enumerate(self.tasks)] or None,
            "eval_dataset": None,  # a v1 taskset has one split: evaluation uses it too
        }

    def single_turn(self) -> bool:
        """Certainly one model call per episode: the plain env, the tool-less chat loop, no tools."""
        env = self.env
        taskset = env.taskset
        return (
            type(env) is self.vf.SingleAgentEnv
            and all(h.config.id == "null" for h in self.harnesses)
            and not type(taskset).task_type().toolsets(taskset.config.task)
            and not taskset.toolsets(taskset.config)
        )

    # ----------------------------------------------------------------------- groups

    async def run_group(self, server, group: int, message: dict[str, Any]) -> list[dict[str, Any]]:
        """``n`` episodes of one task; every model call they make goes to the orchestrator."""
        tokens = bool(message.get("tokens"))
        ctx = await self.context(tokens)
        task = self.task_for(message)
        keys: list[str] = []

        def minted(trace) -> None:  # v1 calls it for every trace, before the trace's first model call
            self.live[trace.id] = Live(server, group, trace)
            keys.append(trace.id)

        try:
            episodes = await gather_all(self.env.run_slot(slot, ctx, on_trace=minted)
                                        for slot in self.env.slots(task, message["n"]))
        finally:
            for key in keys:
                live = self.live.pop(key, None)
                if live is not None:
                    live.cancel_calls()
        return [self.result(episode, tokens) for episode in episodes]

    async def context(self, tokens: bool):
        """The `ModelContext` every episode of this kind runs with (serving starts on first use)."""
        async with self.starting:
            if self.shim is None:
                started = asyncio.get_running_loop().create_future()
                self.holder = asyncio.create_task(self.hold(started))
                await started
            if tokens not in self.contexts:
                self.contexts[tokens] = await self.make_context(tokens)
        return self.contexts[tokens]

    async def hold(self, started: asyncio.Future) -> None:
        """Start the shim and enter ``env.serving()``, and hold both until the worker's loop ends.
        A task of its own: cancelled at shutdown, it leaves them in order (an async generator left
        open would be closed later by the loop, outside the task that entered it, and fail)."""
        shim = Shim(self)
        try:
            await shim.start()
            async with self.env.serving():
                self.shim = shim
                started.set_result(None)
                await asyncio.Event().wait()
        except Exception as e:  # noqa: BLE001 - the group that started serving fails with it
            if not started.done():
                started.set_exception(e)
        finally:
            self.shim = None
            await shim.stop()

    async def make_context(self, tokens: bool):
        vf = self.vf
        if not tokens:
            client = vf.EvalClientConfig(base_url=self.shim.url, api_key_var=KEY_VAR)
            return vf.ModelContext(model=MODEL, client=client, sampling=vf.SamplingConfig())
        tokenizer = os.environ.get(TOKENIZER_VAR)
        if not tokenizer:
            raise LoadError(f"a v1 taskset renders training prompts itself, with the policy's tokenizer: the worker "
                            f"needs ${TOKENIZER_VAR} (a local tokenizer folder or a hub id), which the orchestrator "
                            "did not set")
        # renderer None: v1 picks the model family's renderer (tool calls, reasoning), else its default one
        client = vf.TrainClientConfig(base_url=self.shim.url, api_key_var=KEY_VAR, renderer_model_name=tokenizer)
        await build_renderer(client)
        return vf.ModelContext(model=MODEL, client=client, sampling=vf.SamplingConfig())

    def task_for(self, message: dict[str, Any]):
        """The task, with the system prompt of the orchestrator's copy of its prompt when that was
        replaced (GEPA, `system_prompt_file`)."""
        index = message["index"]
        task = self.tasks[index]
        wanted, shown = system_text(message.get("prompt")), system_text(self.openings[index])
        if wanted is None or wanted == shown:
            return task
        data = task.data
        opens_with_system = isinstance(data.prompt, list) and bool(data.prompt) and data.prompt[0].role == "system"
        if data.system_prompt is None and opens_with_system:  # the task's own system message
            return task.with_data(prompt=[self.vf.SystemMessage(content=wanted), *data.prompt[1:]])
        if isinstance(data.prompt, str) or all(h.APPENDS_SYSTEM_PROMPT for h in self.harnesses):
            return task.with_system_prompt(wanted)
        self.log_once("system_prompt", "a replaced system prompt is ignored: the harness cannot place a system prompt "
                      "before this task's message prompt (logged once)")
        return task

    # ----------------------------------------------------------------------- results

    def result(self, episode, tokens: bool) -> dict[str, Any]:
        """The orchestrator's view of one episode: its one trainable trace."""
        traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        if len(traces) > 1:
            raise RuntimeError(f"episodes with {len(traces)} trainable traces (agents) are not supported yet "
                               f"({type(self.env).__name__})")
        if not traces:
            return self.failed(episode)
        trace = traces[0]
        # A trace forks into several branches where v1 re-rendered the conversation instead of
        # extending the sampled tokens. The orchestrator's own record of every call (keyed by
        # the trace id) is what it trains on, exactly, one sample per part (`Turn.restart`);
        # the last branch's tokens travel with the result only for inspection.
        branches = [b for b in trace.branches if b.trainable]
        branch = branches[-1] if branches else None
        errors, error = self.errors_of(episode, trace)
        metrics = {name: float(v) for name, v in trace.metrics.items() if v is not None}
        metrics.update({name: float(r.score) for name, r in trace.rewards.items() if r is not None})
        stop = trace.stop_condition or ""
        return {
            "rollout": trace.id,
            "reward": float(trace.reward or 0.0),
            "metrics": metrics,
            "errors": errors,
            "completion": completion_of(branch),
            "stop_condition": stop,
            "is_truncated": bool(trace.is_truncated) or stop == "prompt_too_long",
            "error": error,
            "branch": {
                "token_ids": list(branch.token_ids) if branch else [],
                "mask": [int(m) for m in branch.sampled_mask] if branch else [],
            },
        }

    def errors_of(self, episode, trace) -> tuple[list[str], str | None]:
        """(error names, the error's text). A scoring failure names the reward and metric
        functions that raised (v1 leaves the signals it could not score at None, and the
        traceback names the one that raised); any other failure is a `rollout_error`."""
        if not trace.ok and trace.errors:
            failure = trace.errors[-1]
        elif not episode.ok and episode.errors:
            failure = episode.errors[-1]
        elif not trace.ok:
            return ["rollout_error"], f"the trace did not complete (stop: {trace.stop_condition})"
        else:
            return [], None
        text = error_text(failure)
        unscored = [name for name, v in {**trace.metrics, **trace.rewards}.items() if v is None]
        raised = [name for name in unscored if f", in {name}\n" in (failure.traceback or "")]
        names = raised if failure.type == "TaskError" and raised else ["rollout_error"]
        for name in names:
            if name not in self.logged:
                self.logged.add(name)
                what = ("a rollout ended with an error" if name == "rollout_error"
                        else f"reward/metric function {name} raised")
                log(f"{what} (logged once; counted in errors/<env>/{name}): {text}\n{failure.traceback or ''}".rstrip())
        return names, text

    def failed(self, episode) -> dict[str, Any]:
        """An episode without a trainable trace: it failed before any agent ran (or ran none)."""
        failure = episode.errors[-1] if episode.errors else None
        text = error_text(failure) if failure else "the episode ran no trainable agent"
        self.log_once("rollout_error", f"an episode failed (logged once; counted in errors/<env>/rollout_error): "
                      f"{text}")
        return {"rollout": uuid.uuid4().hex, "reward": 0.0, "metrics": {}, "errors": ["rollout_error"],
                "completion": [], "stop_condition": "error", "is_truncated": False, "error": text,
                "branch": {"token_ids": [], "mask": []}}

    def log_once(self, key: str, message: str) -> None:
        if key not in self.logged:
            self.logged.add(key)
            log(message)


# --------------------------------------------------------------------------- the shim


@dataclass
class Live:
    """A trace whose group is running: where its model calls go."""

    server: Any
    group: int
    trace: Any
    calls: set[asyncio.Task] = field(default_factory=set)

    async def ask(self, call) -> dict[str, Any]:
        """The orchestrator's answer frame; cancelled with the group (see `cancel_calls`)."""
        task = asyncio.current_task()
        self.calls.add(task)
        try:
            return await call
        finally:
            self.calls.discard(task)

    def cancel_calls(self) -> None:
        # An HTTP handler still waiting for a frame when its group ends (cancelled) would wait forever.
        for task in list(self.calls):
            task.cancel()


class Shim:
    """The inference endpoint v1's clients call, on 127.0.0.1 (a random port) in the worker's loop."""

    def __init__(self, runner: TasksetRunner):
        self.runner = runner
        self.key = os.environ.setdefault(KEY_VAR, secrets.token_urlsafe(16))
        self.url = ""
        self.app_runner = None

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.app_runner = web.AppRunner(app, access_log=None)
        await self.app_runner.setup()
        site = web.TCPSite(self.app_runner, "127.0.0.1", 0)
        await site.start()
        port = self.app_runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1"
        log(f"v1 model endpoint for the orchestrator's sampler: {self.url}")

    async def stop(self) -> None:
        if self.app_runner is not None:
            await self.app_runner.cleanup()

    async def models(self, request):
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return error_response(401, "unauthorized", "unauthorized")
        # No max_model_len: the orchestrator enforces the context (prompt_too_long), and a window
        # here would turn on the renderer's pre-flight check and the harnesses' compaction.
        card = {"id": MODEL, "object": "model", "owned_by": "prime-rl"}
        return web.json_response({"object": "list", "data": [card]})

    async def generate(self, request):
        """vLLM's token-in/token-out route, as `renderers.client.generate` calls it."""
        live, refusal = self.episode(request)
        if refusal is not None:
            return refusal
        body = await request.json()
        prompt_ids = [int(t) for t in body["token_ids"]]
        answer = await live.ask(live.server.generate_call(live.group, live.trace.id, prompt_ids))
        if answer["op"] == "model_error":
            return self.model_error(live, answer)
        reply = answer["reply"]
        ids = [int(t) for t in reply["completion_ids"]]
        logprobs = [float(lp) for lp in reply["completion_logprobs"]]
        return web.json_response({
            "request_id": f"prime-rl-{uuid.uuid4().hex}",
            "prompt_token_ids": prompt_ids,
            "choices": [{
                "index": 0,
                "token_ids": ids,
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(ids, logprobs)]},
                "finish_reason": reply.get("finish_reason") or "stop",
            }],
        })

    async def chat(self, request):
        """The chat completions route (evaluation against a text-only endpoint)."""
        live, refusal = self.episode(request)
        if refusal is not None:
            return refusal
        body = await request.json()
        answer = await live.ask(live.server.model_call(live.group, live.trace.id, body.get("messages") or [],
                                                       body.get("tools") or None))
        if answer["op"] == "model_error":
            return self.model_error(live, answer)
        completion = chat_completion(answer["reply"], body.get("model") or MODEL)
        if not body.get("stream"):
            return web.json_response(completion)
        from verifiers.v1.dialects.chat import ChatDialect

        # Served whole as a stream, the way v1 serves its own train client's replies.
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in ChatDialect().stream_events(completion):
            await response.write(event)
        await response.write_eof()
        return response

    def episode(self, request) -> tuple[Live | None, Any]:
        """(the live trace the call is for, None), or (None, the error response)."""
        from verifiers.v1.clients.client import SESSION_ID_HEADER

        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return None, error_response(401, "unauthorized", "unauthorized")
        key = request.headers.get(SESSION_ID_HEADER, "")
        live = self.runner.live.get(key)
        if live is None:
            return None, error_response(409, f"no running episode has trace id {key!r} (its group ended)",
                                        "rollout_concluded")
        return live, None

    def model_error(self, live: Live, answer: dict[str, Any]):
        message = answer.get("message") or "the model call failed"
        if answer.get("kind") == "prompt_too_long":
            # Stopped, not failed: v1 scores the trajectory so far, and the harness, told its
            # context is full, ends its run without an error.
            live.trace.stop("prompt_too_long")
            return error_response(400, f"{OVERLONG}: {message}", "context_length_exceeded")
        return error_response(502, message, "model_error")


def error_response(status: int, message: str, code: str):
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


def chat_completion(reply: dict[str, Any], model: str) -> dict[str, Any]:
    """An OpenAI chat completion of the orchestrator's reply."""
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in reply.get("tool_calls") or []]
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("text") or ""}
    if calls:
        message["tool_calls"] = calls
    finish = reply.get("finish_reason") or "stop"
    if calls and finish == "stop":
        finish = "tool_calls"  # what chat completions says when the turn ends in tool calls
    prompt, completion = len(reply.get("prompt_ids") or []), len(reply.get("completion_ids") or [])
    return {
        "id": f"prime-rl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


# --------------------------------------------------------------------------- loading helpers


def plugin(value, key: str) -> dict[str, Any] | None:
    """A `harness` / `runtime` arg: an id (type) string, or the plugin's whole config."""
    if value is None:
        return None
    if isinstance(value, str):
        return {key: value}
    if isinstance(value, dict):
        return dict(value)
    name = "harness" if key == "id" else "runtime"
    raise LoadError(f"[[env]] args {name} must be a string or a table, got {value!r}")


def taskset_config_type(vf, module: str):
    """The taskset's config class; LoadError when the module is missing or exports no taskset."""
    try:
        return vf.taskset_config_type(module)
    except ModuleNotFoundError as e:
        missing = getattr(e.__cause__, "name", None) or ""
        if missing.rsplit(".", 1)[-1] == module.replace("-", "_").lower():
            raise LoadError(f"module {module!r} is not importable in {sys.executable}") from None
        raise  # the module is there; one of its own imports is not
    except (AttributeError, TypeError, ValueError) as e:  # v1's own words: no `__all__`, no Taskset, several
        raise LoadError(f"module {module!r} is not a verifiers v1 taskset: {' '.join(str(e).split())}") from None


def roles(vf, env_type) -> dict[str, Any]:
    """The env config's agent seats (role name -> its declared default `AgentConfig`)."""
    return {name: f.default for name, f in env_type.model_fields.items() if isinstance(f.default, vf.AgentConfig)}


def config_error(error, taskset_type, args: dict[str, Any]) -> str:
    """One line: what did not validate, and what the taskset's config takes."""
    problems = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item.get("loc", ()))
        if where.startswith("taskset.") and where.split(".")[1] in args:
            where = f"taskset arg {where.split('.', 1)[1]!r}"
        problems.append(f"{where}: {item.get('msg')}")
    text = f"the v1 env config does not validate: {'; '.join(problems)}"
    if any(p.startswith("taskset") for p in problems):
        fields = sorted(f for f in taskset_type.model_fields if f != "id")
        text += (f" ({taskset_type.__name__} takes {', '.join(fields)}; the [[env]] args `harness` and `runtime` "
                 "choose the agent's harness and runtime)")
    return text


async def build_renderer(client) -> None:
    """Build the renderer now, in v1's shared pool (the client takes it from there): a tokenizer
    that cannot load fails the group with one line instead of every episode's model call."""
    from verifiers.v1.clients.train import ElasticRendererPool

    pool = ElasticRendererPool(client.renderer_model_name, client.renderer, multiplex=client.multiplex)
    try:
        await pool.grow()
    except Exception as e:  # noqa: BLE001 - a missing folder, an offline hub id, an unknown template
        raise LoadError(f"${TOKENIZER_VAR}={client.renderer_model_name!r}: v1 cannot build its renderer from it: "
                        f"{one_line(e)}") from None


class _QuietOverlong(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return OVERLONG not in record.getMessage()  # an expected stop, reported as prompt_too_long


def show_verifiers_warnings() -> None:
    """v1 logs nothing until an app adds a handler: its warnings go to the worker's log."""
    logger = logging.getLogger("verifiers")
    if any(getattr(h, "_vfworker", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._vfworker = True
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("[env-worker] %(name)s %(levelname)s: %(message)s"))
    handler.addFilter(_QuietOverlong())
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


# --------------------------------------------------------------------------- data and messages


def opening(task) -> list[dict[str, Any]]:
    """The messages the task starts with, as the harness will send them (OpenAI chat)."""
    from verifiers.v1.dialects.chat import message_to_wire

    data = task.data
    head = [{"role": "system", "content": data.system_prompt}] if data.system_prompt is not None else []
    if data.prompt is None:
        return head
    if isinstance(data.prompt, str):
        return head + [{"role": "user", "content": data.prompt}]
    return head + [message_to_wire(m) for m in data.prompt]


def example_of(index: int, task, prompt: list[dict[str, Any]]) -> dict[str, Any]:
    data = task.data
    answer = getattr(data, "answer", None)
    info = data.model_dump(mode="json", exclude_defaults=True, exclude={"prompt", "system_prompt"})
    return {"index": index, "prompt": prompt, "answer": "" if answer is None else str(answer),
            "info": plain(info), "task": "default"}


def error_text(error) -> str:
    """A recorded v1 `Error` in one line."""
    return f"{error.type}: {' '.join(error.message.split())}"[:1000]


def system_text(messages) -> str | None:
    if not messages or messages[0].get("role") != "system":
        return None
    content = messages[0].get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def completion_of(branch) -> list[dict[str, Any]]:
    """The branch's messages from the first assistant message on (the prompt is what comes
    before). Not "from the first sampled node": in a branch v1 forked by re-rendering the
    conversation, the earlier assistant messages are re-rendered, not sampled, nodes."""
    from verifiers.v1.dialects.chat import message_to_wire

    if branch is None:
        return []
    messages = [message_to_wire(node.message) for node in branch.nodes]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return messages[first:]


async def gather_all(calls) -> list[Any]:
    """Every call's result; if one raises, the others are cancelled (no orphaned episodes)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


if __name__ == "__main__":  # not a program: the worker imports it
    sys.exit("vfworker_v1 is imported by vfworker_main.py")
