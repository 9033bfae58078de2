"""Frames between the orchestrator and an environment worker: msgpack maps over a local socket.

A frame is a 4-byte big-endian length, then a msgpack map with an ``op`` key. Never pickle:
a frame holds only maps, lists, strings, numbers, booleans and None. Both ends import this
module: the orchestrator as ``orchestrator.worker.vfworker_wire``, the worker (which runs in
the environment's own Python, where prime-rl is not installed) as ``vfworker_wire``, from
its own folder. So it needs nothing but the standard library and msgpack, which verifiers
depends on (the file name is unusual so that it never shadows a user's module).
"""

from __future__ import annotations

import asyncio
import socket
import struct
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


def unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for garbage
        raise WireError(f"not a msgpack frame ({type(e).__name__}: {e})") from None
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


def recv_blocking(sock: socket.socket, timeout_s: float | None) -> dict[str, Any]:
    """One frame; ``socket.timeout`` (a TimeoutError) when nothing arrives in ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        length = _length(_recv_exactly(sock, HEADER.size))
        return unpack(_recv_exactly(sock, length))
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
