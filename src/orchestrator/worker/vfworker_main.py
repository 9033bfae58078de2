"""The environment worker: runs one verifiers environment in its own Python for the orchestrator.

    python vfworker_main.py --fd N --parent PID        (started by ``orchestrator.worker``)

It runs in the interpreter an ``[[env]]`` entry names (a virtual environment holding the
environment package and its verifiers version), where prime-rl is not installed: it
imports only the standard library, msgpack (a dependency of verifiers) and the files of
its own folder, whose names start with ``vfworker_`` so that they never shadow a user's
module. The orchestrator talks to it over one end of a socket pair (``--fd``), in frames
of ``vfworker_wire``:

  orchestrator -> worker                     worker -> orchestrator
  load {id, module, args, api}               loaded {kind, verifiers, dataset, ...} | error
  run_group {group, split, index, prompt,    model {call, group, rollout, messages, tools}
             n, tokens}                      generate {call, group, rollout, prompt_ids}
  model_reply / model_error {call, ...}      group_done {group, rollouts} | group_failed
  cancel {group}, shutdown                   heartbeat (every HEARTBEAT_S)

Every model call of the environment becomes a ``model`` frame (a chat, from a classic
environment) or a ``generate`` frame (token ids a v1 taskset's client rendered itself): the
orchestrator answers it with its own exact-token client, so the tokens the trainer sees are
the ones sampled.
The worker dies with the orchestrator (PR_SET_PDEATHSIG, and the socket's end), and puts
back the SIGINT/SIGTERM handlers that loading a classic environment replaces.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
import socket
import sys
import traceback
from typing import Any

import vfworker_wire as wire
from vfworker_util import LoadError, cap_output, exit_process, log, one_line, plain

HEARTBEAT_S = 2.0
NETWORK_MODULES = ("datasets", "huggingface_hub", "nltk", "requests", "httpx", "urllib", "urllib3", "openai",
                   "aiohttp", "socket", "http.client", "fsspec", "textarena", "chromadb", "prime_sandboxes")


def die_with_parent(parent: int) -> None:
    """SIGTERM when the orchestrator dies; exit now if it is already gone."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        sys.exit(1)


# --------------------------------------------------------------------------- loading


def verifiers_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("verifiers")


def load(message: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(runner, the `loaded` frame) for the environment the `load` frame names, through the API
    (`classic` or `v1`) the orchestrator chose from this Python's verifiers version."""
    version, api = verifiers_version(), message["api"]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if api == "classic":
            import vfworker_classic

            runner = vfworker_classic.ClassicRunner.load(message["id"], message["module"], message.get("args") or {})
        else:
            import vfworker_v1

            runner = vfworker_v1.TasksetRunner.load(message["id"], message["module"], message.get("args") or {})
    finally:
        for sig, handler in handlers.items():  # a classic Environment replaces both at construction
            signal.signal(sig, handler)
    loaded = {"op": "loaded", "verifiers": version, "api": api, **runner.describe()}
    return runner, loaded


def explain_load_failure(env_id: str, error: BaseException) -> str:
    """One line: what failed while loading, and for a network call, what to pass instead."""
    frames = traceback.extract_tb(error.__traceback__)
    modules = [_frame_module(error.__traceback__, i) for i in range(len(frames))]
    what = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    for i, module in enumerate(modules):
        if module and module.split(".")[0] in NETWORK_MODULES and module != "vfworker_main":
            caller = next((frames[j] for j in range(i - 1, -1, -1) if not (modules[j] or "").startswith(("vfworker", "verifiers"))), None)
            where = f" (called at {caller.filename}:{caller.lineno})" if caller else ""
            call = f"{module}.{frames[i].name}" if not module.startswith(frames[i].name) else module
            return (
                f"load_environment() reached for the network and failed in {call}{where}: {what}. This machine "
                "cannot download at run time: pass a local copy instead (a data path or other args the environment "
                "takes, in [[env]] args or -a), or pre-fill the library's cache"
            )
    last = frames[-1] if frames else None
    where = f" at {last.filename}:{last.lineno}" if last else ""
    return f"load_environment() raised {what}{where}"


def _frame_module(tb, index: int) -> str | None:
    for _ in range(index):
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__") if tb is not None else None


# --------------------------------------------------------------------------- serving


class Server:
    """The worker's side of the socket: groups run concurrently, each model call is a frame."""

    def __init__(self, runner, reader: asyncio.StreamReader, writer: wire.FrameWriter):
        self.runner = runner
        self.reader = reader
        self.writer = writer
        self.calls: dict[int, asyncio.Future] = {}
        self.groups: dict[int, asyncio.Task] = {}
        self.next_call = 0

    async def model_call(self, group: int, rollout: str, messages: list, tools: list | None) -> dict[str, Any]:
        """The orchestrator's answer to one chat turn: a `model_reply` or `model_error` frame."""
        return await self.call("model", group, rollout, messages=messages, tools=tools)

    async def generate_call(self, group: int, rollout: str, prompt_ids: list[int]) -> dict[str, Any]:
        """The orchestrator's answer to a prompt the environment rendered to token ids itself."""
        return await self.call("generate", group, rollout, prompt_ids=prompt_ids)

    async def call(self, op: str, group: int, rollout: str, **fields: Any) -> dict[str, Any]:
        call, self.next_call = self.next_call, self.next_call + 1
        future = asyncio.get_running_loop().create_future()
        self.calls[call] = future
        try:
            await self.writer.send({"op": op, "call": call, "group": group, "rollout": rollout, **fields})
            return await future
        finally:
            self.calls.pop(call, None)

    async def run_group(self, message: dict[str, Any]) -> None:
        group = message["group"]
        try:
            rollouts = await self.runner.run_group(self, group, message)
            await self.writer.send({"op": "group_done", "group": group, "rollouts": plain(rollouts)})
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - the environment's own code failed: tell the orchestrator
            log(f"group {group} failed:\n{traceback.format_exc()}")
            await self.writer.send({"op": "group_failed", "group": group, "message": one_line(e)})
        finally:
            self.groups.pop(group, None)

    async def heartbeat(self) -> None:
        while True:
            await self.writer.send({"op": "heartbeat"})
            await asyncio.sleep(HEARTBEAT_S)

    async def serve(self) -> None:
        beat = asyncio.create_task(self.heartbeat())
        try:
            while True:
                message = await wire.read_frame(self.reader)
                op = message["op"]
                if op == "run_group":
                    self.groups[message["group"]] = asyncio.create_task(self.run_group(message))
                elif op in ("model_reply", "model_error"):
                    future = self.calls.get(message["call"])
                    if future is not None and not future.done():
                        future.set_result(message)
                elif op == "cancel":
                    task = self.groups.get(message["group"])
                    if task is not None:
                        task.cancel()
                elif op == "shutdown":
                    return
                else:
                    log(f"unknown frame {op!r} ignored")
        finally:
            beat.cancel()
            for task in list(self.groups.values()):
                task.cancel()


async def serve(sock: socket.socket, runner) -> None:
    reader, raw_writer = await asyncio.open_unix_connection(sock=sock)
    writer = wire.FrameWriter(raw_writer)
    try:
        await Server(runner, reader, writer).serve()
    except wire.WireError:
        pass  # the orchestrator is gone: so are we
    finally:
        writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    cap_output()  # before the environment's modules make their loggers, which keep sys.stderr
    sock = socket.socket(fileno=args.fd)
    message = wire.recv_blocking(sock, timeout_s=60)
    if message.get("op") != "load":
        log(f"expected a load frame, got {message.get('op')!r}")
        return 1
    env_id = message["id"]
    log(f"loading {env_id!r} (module {message['module']!r}) in {sys.executable}")
    try:
        runner, loaded = load(message)
    except LoadError as e:
        wire.send_blocking(sock, {"op": "error", "message": str(e)})
        return 1
    except Exception as e:  # noqa: BLE001 - the environment's own code: explain it in one line
        log(f"loading failed:\n{traceback.format_exc()}")
        wire.send_blocking(sock, {"op": "error", "message": explain_load_failure(env_id, e)})
        return 1
    wire.send_blocking(sock, loaded)
    log(f"loaded a {loaded['kind']} ({loaded.get('env_class')}) with verifiers {loaded['verifiers']}: "
        f"{len(loaded['dataset'] or [])} training, {len(loaded['eval_dataset'] or [])} eval examples")
    asyncio.run(serve(sock, runner))
    return 0


if __name__ == "__main__":
    exit_process(main())
