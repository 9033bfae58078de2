"""Frames between the orchestrator and an environment worker: msgpack maps over a local socket.

A frame is a 4-byte big-endian length, then a msgpack map with an ``op`` key. Never pickle:
a frame holds only maps, lists, strings, numbers, booleans and None. What a frame may take
once decoded is bounded (``DECODED_RATIO``), not only its size on the wire. Both ends import this
module: the orchestrator as ``orchestrator.worker.vfworker_wire``, the worker (which runs in
the environment's own Python, where prime-rl is not installed) as ``vfworker_wire``, from
its own folder. So it needs nothing but the standard library and msgpack, which verifiers
depends on (the file name is unusual so that it never shadows a user's module).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from sys import getsizeof
from typing import Any

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30
"""Largest frame either side accepts (1 GiB: a whole dataset travels in the `loaded` frame)."""


class WireError(ConnectionError):
    """The peer closed the socket, or sent something that is not a frame."""


CLOSED = "the peer closed the socket"


def pack(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise WireError(f"a {message.get('op')!r} frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


DECODED_FLOOR = 16 << 20
DECODED_RATIO = 16
"""A frame decodes to at most ``DECODED_FLOOR + DECODED_RATIO x`` its size in Python objects,
as charged below. Real frames are charged 5-13x (a dataset of short rows with nested info:
12.5x; a v1 group's token ids and masks: 9-10x); empty containers take 77x (8 MB of empty
maps decoded to 616 MB), so without a budget a frame under ``MAX_FRAME`` could take tens of
GiB."""

INT_SIZE, FLOAT_SIZE = 32, 24
"""What an int outside Python's shared -5..256 (28-36 bytes) and a float take."""


def _scalars(values) -> int:
    """Bytes the strings and numbers among ``values`` took to decode (containers charge
    themselves; None, booleans and small ints are shared, so a mask of 0s and 1s costs only
    its list's pointers)."""
    total = 0
    for x in values:
        t = type(x)
        if t is int:
            if not -5 <= x <= 256:
                total += INT_SIZE
        elif t is str or t is bytes:
            total += getsizeof(x)
        elif t is float:
            total += FLOAT_SIZE
    return total


class _OverBudget(Exception):
    pass


class _Budget:
    """msgpack's hooks see every map and array as it completes: each is charged its own size
    and that of the strings and numbers it holds, and decoding stops as soon as the budget
    is spent, not after the whole frame is built."""

    __slots__ = ("left",)

    def __init__(self, limit: int):
        self.left = limit

    def map(self, value: dict) -> dict:
        self.left -= getsizeof(value) + _scalars(value) + _scalars(value.values())
        if self.left < 0:
            raise _OverBudget
        return value

    def array(self, value: list) -> list:
        self.left -= getsizeof(value) + _scalars(value)
        if self.left < 0:
            raise _OverBudget
        return value


def decoded_limit(size: int) -> int:
    return DECODED_FLOOR + DECODED_RATIO * size


def unpack(body: bytes) -> dict[str, Any]:
    budget = _Budget(decoded_limit(len(body)))
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False, object_hook=budget.map, list_hook=budget.array)
    except _OverBudget:
        raise WireError(f"a frame of {len(body)} bytes decodes to more than {decoded_limit(len(body))} bytes of "
                        f"objects (the limit is {DECODED_FLOOR} + {DECODED_RATIO} x its size)") from None
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for garbage
        raise WireError(f"not a msgpack frame ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise WireError(f"a frame must be a map with an `op`, got {type(message).__name__}")
    return message


def _length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise WireError(f"frame of {length} bytes announced, more than the {MAX_FRAME}-byte limit")
    return length


# --------------------------------------------------------------------------- blocking (hand-shake)


def send_blocking(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(pack(message))


STALL_S = 60.0
"""Longest pause inside a frame, once its first byte arrived (a frame is sent whole)."""


def recv_blocking(sock: socket.socket, timeout_s: float | None) -> dict[str, Any]:
    """One frame; ``socket.timeout`` (a TimeoutError) when nothing arrives in ``timeout_s``.
    Only the wait for the first byte times out that way: a frame cut off half-way would leave
    the next read in the middle of it, so a stall inside one is a WireError."""
    sock.settimeout(timeout_s)
    try:
        first = sock.recv(1)
        if not first:
            raise WireError(CLOSED)
        sock.settimeout(STALL_S)
        try:
            length = _length(first + _recv_exactly(sock, HEADER.size - 1))
            return unpack(_recv_exactly(sock, length))
        except TimeoutError:
            raise WireError(f"the peer stopped sending for {STALL_S:.0f} s in the middle of a frame") from None
    except (ConnectionResetError, BrokenPipeError):  # a peer that died mid-way
        raise WireError(CLOSED) from None
    finally:
        sock.settimeout(None)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise WireError(CLOSED)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------- asyncio


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    try:
        length = _length(await reader.readexactly(HEADER.size))
        return unpack(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):  # a peer that died mid-way
        raise WireError(CLOSED) from None


class FrameWriter:
    """Writes whole frames; one at a time, so concurrent senders never interleave bytes."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.lock = asyncio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        data = pack(message)
        async with self.lock:
            try:
                self.writer.write(data)
                await self.writer.drain()
            except (ConnectionResetError, BrokenPipeError, RuntimeError) as e:  # RuntimeError: the transport is closed
                raise WireError(f"{CLOSED} ({type(e).__name__})") from None

    def close(self) -> None:
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass
