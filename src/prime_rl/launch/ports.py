"""The TCP ports a local run binds, checked free before any process starts.

The launcher binds nothing itself. Its processes do: each inference replica's vLLM server
binds `inference.host:inference.port + i`, and the orchestrator binds one ZeroMQ PUSH
socket per trainer rank at `transport.port + r`. A port another program holds makes that
process fail minutes into start-up or, worse, makes the orchestrator talk to the other
program; so the launcher tries to bind each port first and names what holds a taken one.

Not checked, deliberately: torchrun on one node (`--standalone`) rendezvouses on a port
the OS picks (`localhost:0`), vLLM's internal ports are its own business, and a `--slurm`
job binds on other nodes. A port free now may still be taken before the process binds it;
the check catches the common case (a server left running), not every race.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Binding:
    host: str
    port: int
    setting: str
    """The setting that chose the port, for messages (`inference.port`, `transport.port + 1`)."""


def port_problems(bindings: list[Binding]) -> list[str]:
    """One line per port the run could not bind: chosen twice, in use, or not bindable."""
    lines, seen = [], {}
    for b in bindings:
        if b.port in seen:
            lines.append(f"port {b.port} is chosen twice, by {seen[b.port]} and {b.setting}: choose another port for one of them")
            continue
        seen[b.port] = b.setting
        error = try_bind(b.host, b.port)
        if error is not None:
            lines.append(describe_error(b, error))
    return lines


def try_bind(host: str, port: int) -> OSError | None:
    """Bind ``host:port`` and let it go at once; the error when that fails."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return e
    with socket.socket(family, kind, proto) as s:
        # SO_REUSEADDR as vLLM (uvicorn) and ZeroMQ set it: a connection in TIME_WAIT left by an
        # earlier run does not stop them, so it must not stop the check; a listener still does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return e
    return None


def describe_error(b: Binding, error: OSError) -> str:
    where = f"port {b.port} on {b.host} ({b.setting})"
    if isinstance(error, socket.gaierror):
        return f"{where}: cannot resolve the host {b.host!r} ({error.strerror}): choose an address of this machine"
    if error.errno == errno.EADDRINUSE:
        return f"{where} is in use by {holder(b.port)}: stop it or choose another port"
    return f"{where} cannot be bound ({error.strerror or error}): choose another address or port"


def holder(port: int) -> str:
    """`pid N (command)` of the process listening on ``port``, or `another program` when it
    cannot be seen (another user's process without root)."""
    try:
        connections = [c for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port and c.pid]
    except Exception:  # noqa: BLE001 - AccessDenied (macOS without root), ...
        return "another program"
    if not connections:
        return "another program"
    connections.sort(key=lambda c: c.status != psutil.CONN_LISTEN)  # the listener, if there is one
    pid = connections[0].pid
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return f"pid {pid}"
    command = " ".join(" ".join([os.path.basename(argv[0]), *argv[1:]]).split()) if argv else ""  # one line
    if len(command) > 120:
        command = command[:117] + "..."
    return f"pid {pid} ({command})" if command else f"pid {pid}"
