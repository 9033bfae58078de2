"""Environments that run in a worker process: verifiers environments, in their own Python.

A verifiers environment (classic 0.3.x or a v1 taskset, 0.4.x) lives in the Python its
``[[env]]`` entry names (`python = ".../bin/python"`), where prime-rl is not installed. The
orchestrator starts one worker process there per entry (``worker/vfworker_main.py``, its
output in ``RUN/logs/env-<name>.log``), and talks to it in msgpack frames over a socket pair.
To the rest of the orchestrator, eval and GEPA the worker is an ``Environment`` like any
other (``WorkerEnvironment``): it has the examples the worker sent at start-up, and its
``rollout_group`` asks the worker to play a group. Every model call the environment makes
comes back here and is answered by the caller's ``ModelClient``: exact tokens and logprobs
per turn (the orchestrator's sampler), tool calls parsed by vLLM, the prompt's tokens
extending the previous turns' sampled tokens.

Lifecycle: the worker is in the orchestrator's process group (the launcher's stop reaches
it) and dies with it (PR_SET_PDEATHSIG, the socket's end). A worker that exits, or sends
nothing, not even its heartbeat, for ``worker_timeout_s``, fails the run with one line that
names the environment and its log.

What the worker sends is the user's code talking: every frame is decoded under a size budget
(``vfworker_wire``) and checked against its op's shape (``orchestrator.envframes``) before
anything acts on it. A bad frame kills the worker and fails every waiting group at once, in
one line naming the op and field; a non-finite reward or metric scores 0 and is counted as
its function's error (``errors/<env>/<fn>``), as the built-in rubric does.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_rl.envs import Environment, Example, ModelClient, ModelReply, PromptTooLong, Rollout, Turn
from prime_rl.keys import private_opener

from orchestrator import envframes as frames
from orchestrator.sampler import sequence_so_far
from orchestrator.worker import vfworker_wire as wire

WORKER_MAIN = Path(__file__).with_name("worker") / "vfworker_main.py"
LOAD_POLL_S = 0.5


class EnvironmentWorkerError(RuntimeError):
    """A worker failed (exited, hung, or its environment raised); one line naming the environment."""


@dataclass(frozen=True)
class WorkerExample(Example):
    split: str = "train"
    """Which of the worker's datasets the example is from (`train` or `eval`)."""


@dataclass
class _Group:
    client: ModelClient
    future: asyncio.Future
    n: int
    turns: dict[str, list[Turn]] = field(default_factory=dict)
    last: dict[str, ModelReply] = field(default_factory=dict)


class WorkerProcess:
    """The worker process and the orchestrator's end of its socket."""

    def __init__(self, name: str, python: str, log: Path, tokenizer: str | None = None):
        self.name, self.python, self.log = name, python, log
        self.sock, child = socket.socketpair()
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
        if tokenizer is not None:  # a v1 taskset's client renders prompts with the policy's tokenizer
            env["PRIME_RL_TOKENIZER"] = str(tokenizer)
        with open(log, "ab", opener=private_opener) as out:  # the environment's own output may quote its args
            # Same process group as the orchestrator (no new session): the launcher's stop of
            # the orchestrator's group stops the worker too.
            self.proc = subprocess.Popen(
                [python, str(WORKER_MAIN), "--fd", str(child.fileno()), "--parent", str(os.getpid())],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**env, "PYTHONUNBUFFERED": "1"}, cwd=os.getcwd(),
            )
        child.close()

    def load(self, env_id: str, module: str, args: dict[str, Any], api: str, timeout_s: float) -> frames.Loaded:
        """Send `load` (``api``: `classic` or `v1`) and wait for `loaded`; EnvironmentWorkerError
        with the worker's reason, or naming what was wrong with its answer."""
        wire.send_blocking(self.sock, {"op": "load", "id": env_id, "module": module, "args": args, "api": api})
        answer = self._answer_to_load(env_id, timeout_s)
        try:
            loaded = frames.parse(answer, frames.LOADING)
        except frames.FrameError as e:
            self.kill()
            raise EnvironmentWorkerError(f"environment {env_id!r}: its worker answered the load with {e} "
                                         f"(killed; log: {self.log})") from None
        if isinstance(loaded, frames.LoadFailed):
            self.close()
            raise EnvironmentWorkerError(f"environment {env_id!r}: {loaded.message}")
        return loaded

    def _answer_to_load(self, env_id: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return wire.recv_blocking(self.sock, timeout_s=LOAD_POLL_S)
            except TimeoutError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise EnvironmentWorkerError(
                        f"environment {env_id!r}: loading took longer than {timeout_s:.0f} s in its worker (log: {self.log})"
                    ) from None
            except wire.WireError as e:
                if str(e) != wire.CLOSED:  # garbage: the worker is out of step, and may still be running
                    self.kill()
                    raise EnvironmentWorkerError(f"environment {env_id!r}: a bad frame from its worker while "
                                                 f"loading: {e} (killed; log: {self.log})") from None
                try:
                    how = f"exited with code {self.proc.wait(timeout=10)}"
                except subprocess.TimeoutExpired:
                    self.kill()
                    how = "closed its socket (killed)"
                raise EnvironmentWorkerError(
                    f"environment {env_id!r}: its worker {how} while loading; last line of its log "
                    f"{self.log}: {last_line(self.log)}"
                ) from None

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to stop, then make sure it did."""
        if self.proc.poll() is None:
            try:
                self.sock.setblocking(True)
                self.sock.settimeout(1.0)
                wire.send_blocking(self.sock, {"op": "shutdown"})
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.sock.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class WorkerEnvironment(Environment):
    """An environment played by a worker process; examples and tools as the worker reported them."""

    def __init__(self, name: str, env_id: str, worker: WorkerProcess, loaded: frames.Loaded, max_concurrent: int,
                 timeout_s: float):
        self.name, self.env_id, self.worker = name, env_id, worker
        self.kind, self.verifiers = loaded.kind, loaded.verifiers
        self.renders_prompts = loaded.api == "v1"
        """v1's client renders prompts to token ids itself (checked to extend the sampled turns
        on every call), so prime-rl's chat template check does not apply to it."""
        self.env_class = loaded.env_class
        self.timeout_s = timeout_s
        self.max_concurrent = max_concurrent
        self.tool_defs = list(loaded.tools)
        super().__init__(
            dataset=examples(loaded.dataset, "train"),
            eval_dataset=examples(loaded.eval_dataset, "eval"),
            system_prompt=loaded.system_prompt,
            max_turns=loaded.max_turns or 1,
        )
        self._counted: set[str] = set()
        """Names whose non-finite values were already explained in the log (once each)."""
        self._groups: dict[int, _Group] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected: asyncio.Task | None = None
        self._writer: wire.FrameWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._failure: BaseException | None = None

    def describe(self) -> str:
        return (f"a {self.kind} ({self.env_class}) of verifiers {self.verifiers}, in {self.worker.python} "
                f"(worker pid {self.worker.proc.pid}, log {self.worker.log})")

    # ----------------------------------------------------------------------- groups

    async def rollout_group(self, client: ModelClient, example: Example, n: int) -> list[Rollout]:
        await self._attach()
        async with self._semaphore:
            if self._failure is not None:
                raise self._failure
            gid = next(self._ids)
            group = self._groups[gid] = _Group(client, asyncio.get_running_loop().create_future(), n)
            split = example.split if isinstance(example, WorkerExample) else "train"
            try:
                await self._writer.send({"op": "run_group", "group": gid, "split": split, "index": example.id,
                                         "prompt": list(example.prompt), "n": n,
                                         "tokens": callable(getattr(client, "extend", None))})
                results = await group.future
            except BaseException:  # cancelled, or the client failed: the worker must stop the group's episodes
                await self._cancel(gid)
                raise
            finally:
                self._groups.pop(gid, None)
        return [self._rollout(example, group, result) for result in results]

    def _rollout(self, example: Example, group: _Group, result: frames.RolloutResult) -> Rollout:
        key = result.rollout
        turns = group.turns.get(key, [])
        last = group.last.get(key)
        reward, metrics, errors, counted = frames.finite_scores(result.reward, result.metrics, result.errors)
        self._explain(counted, result)
        if "rollout_error" in errors:
            metrics["rollout_error"] = 1.0
        state = {"answer": example.answer, "info": dict(example.info), "task": example.task, "turn": len(turns),
                 "stop_condition": result.stop_condition, "error": result.error, "rollout": key}
        return Rollout(
            example_id=example.id,
            turns=list(turns),
            reward=reward,
            prompt=list(example.prompt),
            completion=list(result.completion),
            metrics=metrics,
            errors=errors,
            stop_condition=result.stop_condition,
            finish_reason=last.finish_reason if last is not None else None,
            state=state,
        )

    def _explain(self, counted: list[str], result: frames.RolloutResult) -> None:
        """Say once per name why a rollout scored 0 for it, as the built-in rubric does."""
        for name in counted:
            if name in self._counted:
                continue
            self._counted.add(name)
            value = result.reward if name == frames.UNEXPLAINED else result.metrics.get(name)
            what = "its reward" if name == frames.UNEXPLAINED else f"reward function {name!r}"
            print(f"[orchestrator] environment {self.name!r}: {what} was {value}, not a finite number; it scores 0 "
                  f"for that rollout (counted in errors/{self.name}/{name}; said once)", flush=True)

    async def _cancel(self, gid: int) -> None:
        try:
            await asyncio.shield(self._writer.send({"op": "cancel", "group": gid}))
        except (OSError, wire.WireError, asyncio.CancelledError):
            pass

    # ----------------------------------------------------------------------- the socket

    async def _attach(self) -> None:
        """Connect the worker's socket to the running event loop, once per loop (concurrent
        groups wait for the same connection)."""
        loop = asyncio.get_running_loop()
        if self._failure is not None:
            raise self._failure
        if self._loop is not loop:
            self._loop = loop
            self._connected = loop.create_task(self._connect())
        await self._connected

    async def _connect(self) -> None:
        # A duplicate of the socket: a loop that ends closes its transport, never the worker's socket.
        reader, writer = await asyncio.open_unix_connection(sock=self.worker.sock.dup())
        self._writer = wire.FrameWriter(writer)
        self._semaphore = asyncio.Semaphore(self.max_concurrent)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        message = await wire.read_frame(reader)
                except TimeoutError:
                    self.worker.kill()
                    raise EnvironmentWorkerError(
                        f"environment {self.name!r}: its worker sent nothing for {self.timeout_s:.0f} s, not even its "
                        f"heartbeat: it hangs (killed; log: {self.worker.log})"
                    ) from None
                except wire.WireError as e:
                    if str(e) != wire.CLOSED:
                        raise EnvironmentWorkerError(f"environment {self.name!r}: a bad frame from its worker: {e} "
                                                     f"(killed; log: {self.worker.log})") from None
                    code = self.worker.proc.poll()
                    if code is None:
                        try:
                            code = self.worker.proc.wait(timeout=5)
                        except subprocess.TimeoutExpired:
                            code = None
                    how = "exited" if code is None else f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
                    raise EnvironmentWorkerError(
                        f"environment {self.name!r}: its worker process {how} (log: {self.worker.log}: {last_line(self.worker.log)})"
                    ) from None
                self._dispatch(message)
        except EnvironmentWorkerError as e:
            self._fail(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a frame we could not handle: fail loudly, never stall
            self._fail(EnvironmentWorkerError(f"environment {self.name!r}: bad frame from its worker: {type(e).__name__}: {e}"))

    def _fail(self, error: BaseException) -> None:
        """The worker cannot go on (it hangs, died, or is out of step): every waiting group
        fails now with ``error``, and so does every later one."""
        self._failure = error
        self.worker.kill()
        for group in self._groups.values():
            if not group.future.done():
                group.future.set_exception(error)

    def _dispatch(self, message: dict[str, Any]) -> None:
        try:
            frame = frames.parse(message, frames.SERVING)
        except frames.FrameError as e:
            raise EnvironmentWorkerError(f"environment {self.name!r}: its worker sent {e} (killed; log: "
                                         f"{self.worker.log})") from None
        if isinstance(frame, frames.Heartbeat):
            return
        group = self._groups.get(frame.group)
        if group is None or group.future.done():  # a group already cancelled or failed here
            return
        if isinstance(frame, frames.ModelCall | frames.GenerateCall):
            self._loop.create_task(self._answer(group, frame))
        elif isinstance(frame, frames.GroupDone):
            if len(frame.rollouts) != group.n:
                raise EnvironmentWorkerError(f"environment {self.name!r}: its worker sent {len(frame.rollouts)} "
                                             f"rollouts for a group of {group.n} (killed; log: {self.worker.log})")
            group.future.set_result(frame.rollouts)
        elif isinstance(frame, frames.GroupFailed):
            group.future.set_exception(EnvironmentWorkerError(f"environment {self.name!r}: {frame.message}"))

    async def _answer(self, group: _Group, message: frames.ModelCall | frames.GenerateCall) -> None:
        """One model call of the environment, sampled by the group's client. A worker that is
        gone by the time the answer is ready is the reader's to report; anything else that
        fails here fails the group now (a task nobody awaits would leave it waiting)."""
        try:
            await self._sample_and_answer(group, message)
        except wire.WireError as e:
            if not str(e).startswith(wire.CLOSED) and not group.future.done():
                group.future.set_exception(EnvironmentWorkerError(f"environment {self.name!r}: {e}"))
        except Exception as e:  # noqa: BLE001 - see above
            if not group.future.done():
                group.future.set_exception(e)

    async def _sample_and_answer(self, group: _Group, message: frames.ModelCall | frames.GenerateCall) -> None:
        key = message.rollout
        context = group.turns.setdefault(key, [])
        try:
            if isinstance(message, frames.GenerateCall):  # token ids the environment rendered itself (v1 tasksets)
                extend = getattr(group.client, "extend", None)
                if extend is None:
                    raise EnvironmentWorkerError(
                        f"environment {self.name!r} samples token ids, which a text-only endpoint cannot give"
                    )
                reply = await extend(list(message.prompt_ids), context)
            else:
                tools = message.tools or None
                (reply,) = await group.client.reply(message.messages, context, 1, **({"tools": tools} if tools else {}))
        except PromptTooLong as e:
            await self._writer.send({"op": "model_error", "call": message.call, "kind": "prompt_too_long", "message": str(e)})
            return
        except Exception as e:  # noqa: BLE001 - inference failed: the group fails as a built-in's would
            if not group.future.done():
                group.future.set_exception(e)
            return
        prompt_ids = list(reply.turn.prompt_ids) if reply.turn else []
        if reply.turn is not None and context and not reply.turn.restart and not getattr(group.client, "per_turn", True):
            prompt_ids = sequence_so_far(context) + prompt_ids
        if reply.turn is not None:
            context.append(reply.turn)
        group.last[key] = reply
        await self._writer.send({"op": "model_reply", "call": message.call, "reply": {
            "text": reply.text,
            "finish_reason": reply.finish_reason,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls],
            "prompt_ids": prompt_ids,
            "completion_ids": list(reply.turn.completion_ids) if reply.turn else [],
            "completion_logprobs": list(reply.turn.completion_logprobs) if reply.turn else [],
        }})

    def close(self) -> None:
        """Stop the worker. The reader ends with it: on a loop still open and idle it is let
        finish; on one already closed (eval's and GEPA's end first) it is dropped quietly."""
        task = self._reader_task
        if task is not None and not task.done():
            if self._loop.is_closed():
                task._log_destroy_pending = False  # asyncio's own switch for a task dropped on purpose
            else:
                task.cancel()
                if not self._loop.is_running():
                    self._loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        self.worker.close()


def examples(rows: list[frames.ExampleRow] | None, split: str) -> list[WorkerExample] | None:
    if not rows:
        return None
    return [WorkerExample(r.index, list(r.prompt), r.answer, dict(r.info), r.task or "default", split) for r in rows]


def last_line(log: Path) -> str:
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in deque(f, maxlen=20) if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty)"


def start_worker_env(name: str, env_id: str, module: str, args: dict[str, Any], api: str, python: str, log: Path,
                     max_concurrent: int, load_timeout_s: float, timeout_s: float, tokenizer: str | None = None
                     ) -> WorkerEnvironment:
    """Start the worker, load the environment there through ``api``, and wrap it as an Environment."""
    worker = WorkerProcess(name, python, log, tokenizer)
    try:
        loaded = worker.load(env_id, module, args, api, load_timeout_s)
        return WorkerEnvironment(name, env_id, worker, loaded, max_concurrent, timeout_s)
    except BaseException:
        worker.kill()
        worker.sock.close()
        raise
