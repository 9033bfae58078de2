"""Frames from an environment worker: decoding is bounded, shapes are checked, a bad frame
fails the environment at once in one line, and non-finite rewards score 0 with a counted error.

The serving tests drive a ``WorkerEnvironment`` over a socket pair whose other end the test
plays (no worker process, no verifiers); the loading tests start a stand-in worker script
in this Python. Every one is well under a second.
"""

from __future__ import annotations

import asyncio
import math
import socket
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
from prime_rl.envs import Example, ModelReply, Turn

from orchestrator import envframes as frames
from orchestrator import envworker
from orchestrator.envworker import EnvironmentWorkerError, WorkerEnvironment, WorkerProcess
from orchestrator.rollouts import function_figures
from orchestrator.worker import vfworker_wire as wire

LOADED = {"op": "loaded", "verifiers": "0.3.0", "api": "classic", "kind": "classic verifiers environment",
          "env_class": "SingleTurnEnv", "system_prompt": None, "tools": [], "max_turns": 1,
          "dataset": [{"index": 0, "prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "info": {},
                       "task": "default"}],
          "eval_dataset": None}


def result(rollout: str = "r0", **fields) -> dict:
    return {"rollout": rollout, "reward": 1.0, "metrics": {"correct": 1.0}, "errors": [], "completion": [],
            "stop_condition": "completed", "is_truncated": False, "error": None, **fields}


# --------------------------------------------------------------------------- decoding budget


def body_of(junk: bytes, count: int) -> bytes:
    """A map {op: "model", junk: [<count> copies of one tiny encoded object]}."""
    return (b"\x82" + msgpack.packb("op") + msgpack.packb("model") + msgpack.packb("junk")
            + b"\xdd" + count.to_bytes(4, "big") + junk * count)


@pytest.mark.parametrize("junk", [b"\x80", b"\x90", b"\x81\xa0\x90"], ids=["empty maps", "empty arrays", "maps of an empty array"])
def test_tiny_objects_that_decode_to_many_times_their_size_are_refused(junk):
    body = body_of(junk, (2 << 20) // len(junk))  # 2 MB: 48-150 MB once decoded
    started = time.monotonic()
    with pytest.raises(wire.WireError, match=r"decodes to more than \d+ bytes of objects") as caught:
        wire.unpack(body)
    assert "\n" not in str(caught.value)
    assert time.monotonic() - started < 5


def test_real_frames_decode_within_their_budget():
    tokens = list(range(300, 40_300))
    done = {"op": "group_done", "group": 0, "rollouts": [
        result(f"r{i}", branch={"token_ids": tokens, "mask": [i % 2] * len(tokens)}) for i in range(8)]}
    rows = [{**LOADED["dataset"][0], "index": i, "info": {"tests": [[1, 2], [3, 4]]}} for i in range(20_000)]
    for message in (done, {**LOADED, "dataset": rows}):
        assert wire.unpack(wire.pack(message)[wire.HEADER.size:]) == message


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("message, expected", [
    ({"op": "model", "call": 0, "group": 0, "messages": []}, "a bad `model` frame: rollout: Field required"),
    ({"op": "generate", "call": 0, "group": 0, "rollout": "r", "prompt_ids": ["1"]},
     "a bad `generate` frame: prompt_ids[0]: Input should be a valid integer"),
    ({"op": "model", "call": "0", "group": 0, "rollout": "r", "messages": {}},
     "a bad `model` frame: call: Input should be a valid integer (and 1 more)"),
    ({"op": "group_done", "group": 0, "rollouts": {"r": 1}}, "a bad `group_done` frame: rollouts: Input should be a valid list"),
    ({"op": "group_done", "group": 0, "rollouts": [result(reward="1")]},
     "a bad `group_done` frame: rollouts[0].reward: Input should be a valid number"),
    ({"op": "group_failed", "group": 0}, "a bad `group_failed` frame: message: Field required"),
    ({"op": "loaded"}, "a frame with op 'loaded', expected one of heartbeat, model, generate"),
])
def test_a_frame_that_is_not_what_its_op_says_is_named_by_field(message, expected):
    with pytest.raises(frames.FrameError) as caught:
        frames.parse(message, frames.SERVING)
    assert str(caught.value).startswith(expected)
    assert "\n" not in str(caught.value)


def test_a_bad_loaded_frame_names_the_row_and_field():
    rows = [LOADED["dataset"][0], {**LOADED["dataset"][0], "prompt": "2+2?"}]
    with pytest.raises(frames.FrameError, match=r"^a bad `loaded` frame: dataset\[1\]\.prompt: Input should be a valid list$"):
        frames.parse({**LOADED, "dataset": rows}, frames.LOADING)


# --------------------------------------------------------------------------- non-finite rewards


@pytest.mark.parametrize("reward, metrics, expected_errors", [
    (float("-inf"), {"correct": 1.0}, ("reward",)),
    (float("nan"), {"correct": float("nan"), "length": 0.5}, ("correct",)),
    (0.5, {"style": float("inf")}, ("style",)),
    (float("inf"), {"a": float("-inf"), "b": float("nan")}, ("a", "b")),
])
def test_non_finite_rewards_and_metrics_score_zero_and_are_counted(reward, metrics, expected_errors):
    value, clean, errors, counted = frames.finite_scores(reward, metrics, ["rollout_error"])
    assert math.isfinite(value) and all(math.isfinite(v) for v in clean.values())
    assert value == (reward if math.isfinite(reward) else 0.0)
    assert {k: v for k, v in clean.items() if math.isfinite(metrics[k])} == {k: v for k, v in metrics.items() if math.isfinite(v)}
    assert errors == ("rollout_error", *expected_errors) and counted == list(expected_errors)


def test_finite_scores_pass_through_unchanged():
    assert frames.finite_scores(None, {"a": 1.0}, ["a"]) == (0.0, {"a": 1.0}, ("a",), [])


# --------------------------------------------------------------------------- serving, against a stand-in worker


class FakeProcess:
    pid = 0

    def poll(self):
        return None


class FakeWorker:
    """What WorkerEnvironment needs of a WorkerProcess; the test holds the other end."""

    def __init__(self, log: Path):
        self.sock, self.peer = socket.socketpair()
        self.log, self.python, self.proc = log, sys.executable, FakeProcess()
        self.killed = False

    def kill(self):
        self.killed = True

    def close(self):
        self.sock.close()
        self.peer.close()


class Client:
    async def reply(self, messages, context, n=1, tools=None):
        return [ModelReply("4", "stop", Turn([1, 2], [3], [-0.5]))]


def environment(tmp_path) -> tuple[WorkerEnvironment, FakeWorker]:
    worker = FakeWorker(tmp_path / "env-x.log")
    env = WorkerEnvironment("x", "x-env", worker, frames.parse(LOADED, frames.LOADING), max_concurrent=4, timeout_s=600)
    return env, worker


async def play(env: WorkerEnvironment, worker: FakeWorker, answer, n: int = 2):
    """Run one group of ``n``; ``answer(run_group, send, recv)`` plays the worker's side."""
    reader, writer = await asyncio.open_unix_connection(sock=worker.peer)
    send = wire.FrameWriter(writer).send

    async def recv():
        return await wire.read_frame(reader)

    async def worker_side():
        await answer(await recv(), send, recv, writer)

    side = asyncio.create_task(worker_side())
    try:
        async with asyncio.timeout(3):  # a hang would be the watchdog's 1800 s
            return await env.rollout_group(Client(), Example(0, [{"role": "user", "content": "2+2?"}], "4"), n)
    finally:
        side.cancel()


def run_bad_frame(tmp_path, answer) -> str:
    env, worker = environment(tmp_path)
    started = time.monotonic()
    with pytest.raises(EnvironmentWorkerError) as caught:
        asyncio.run(play(env, worker, answer))
    assert time.monotonic() - started < 2
    assert worker.killed
    worker.close()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("environment 'x': ")
    return message


def test_a_model_frame_without_rollout_fails_the_group_at_once(tmp_path):
    async def answer(run, send, recv, writer):
        await send({"op": "model", "call": 0, "group": run["group"], "messages": []})

    assert "its worker sent a bad `model` frame: rollout: Field required" in run_bad_frame(tmp_path, answer)


def test_a_generate_frame_with_bad_token_ids_fails_the_group_at_once(tmp_path):
    async def answer(run, send, recv, writer):
        await send({"op": "generate", "call": 0, "group": run["group"], "rollout": "r", "prompt_ids": [[1]]})

    assert "prompt_ids[0]: Input should be a valid integer" in run_bad_frame(tmp_path, answer)


def test_garbage_from_the_worker_fails_the_group_at_once(tmp_path):
    async def answer(run, send, recv, writer):
        writer.write(wire.HEADER.pack(3) + b"\xc1\xc1\xc1")

    assert "a bad frame from its worker: not a msgpack frame" in run_bad_frame(tmp_path, answer)


def test_an_amplifying_frame_fails_the_group_at_once(tmp_path):
    async def answer(run, send, recv, writer):
        body = body_of(b"\x80", 1 << 20)
        writer.write(wire.HEADER.pack(len(body)) + body)

    assert "decodes to more than" in run_bad_frame(tmp_path, answer)


def test_a_group_with_the_wrong_number_of_rollouts_fails_at_once(tmp_path):
    async def answer(run, send, recv, writer):
        await send({"op": "group_done", "group": run["group"], "rollouts": [result()]})

    assert "its worker sent 1 rollouts for a group of 2" in run_bad_frame(tmp_path, answer)


def test_non_finite_rewards_from_the_worker_reach_no_figure(tmp_path, capsys):
    async def answer(run, send, recv, writer):
        await send({"op": "model", "call": 7, "group": run["group"], "rollout": "r0",
                    "messages": [{"role": "user", "content": "2+2?"}]})
        reply = await recv()
        assert reply["op"] == "model_reply" and reply["call"] == 7 and reply["reply"]["completion_ids"] == [3]
        await send({"op": "heartbeat"})
        await send({"op": "group_done", "group": run["group"], "rollouts": [
            result("r0", reward=float("-inf")),
            result("r1", reward=float("nan"), metrics={"correct": float("nan"), "format": 1.0}),
        ]})

    env, worker = environment(tmp_path)
    first, second = asyncio.run(play(env, worker, answer))
    worker.close()
    assert (first.reward, first.errors, len(first.turns)) == (0.0, ("reward",), 1)
    assert (second.reward, second.errors, second.metrics) == (0.0, ("correct",), {"correct": 0.0, "format": 1.0})
    figures = function_figures([first, second])
    assert all(math.isfinite(v) for v in figures.values())
    assert figures["errors/reward"] == 1 and figures["errors/correct"] == 1
    out = capsys.readouterr().out
    assert "environment 'x': its reward was -inf, not a finite number; it scores 0" in out
    assert "reward function 'correct' was nan" in out


# --------------------------------------------------------------------------- loading, against a stand-in worker script


def stand_in(tmp_path, monkeypatch, answer: bytes) -> WorkerProcess:
    """A worker that reads the `load` frame, writes ``answer`` (raw bytes) and waits."""
    script = tmp_path / "stand_in.py"
    script.write_text(textwrap.dedent(f"""
        import socket, sys, time
        sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--fd") + 1]))
        sock.recv(1 << 20)
        sock.sendall({answer!r})
        time.sleep(30)
    """))
    monkeypatch.setattr(envworker, "WORKER_MAIN", script)
    return WorkerProcess("x", sys.executable, tmp_path / "env-x.log")


@pytest.mark.parametrize("answer, expected", [
    (b"\x00\x00\x00\x03\xc1\xc1\xc1", "a bad frame from its worker while loading: not a msgpack frame"),
    (wire.HEADER.pack(5) + b"hello", "a bad frame from its worker while loading: not a msgpack frame"),
    (wire.pack({"op": "error"}), "answered the load with a bad `error` frame: message: Field required"),
    (wire.pack({**LOADED, "max_turns": "1"}), "a bad `loaded` frame: max_turns: Input should be a valid integer"),
    (wire.pack({"op": "heartbeat"}), "a frame with op 'heartbeat', expected one of loaded, error"),
], ids=["garbage", "not msgpack", "error without message", "bad loaded", "wrong op"])
def test_a_bad_answer_to_load_is_one_line_and_kills_the_worker(tmp_path, monkeypatch, answer, expected):
    worker = stand_in(tmp_path, monkeypatch, answer)
    started = time.monotonic()
    try:
        with pytest.raises(EnvironmentWorkerError) as caught:
            worker.load("x-env", "x_env", {}, "classic", timeout_s=20)
        assert time.monotonic() - started < 5
        assert expected in str(caught.value) and "\n" not in str(caught.value)
        assert worker.proc.poll() is not None  # killed, not left waiting
    finally:
        worker.kill()
        worker.sock.close()
