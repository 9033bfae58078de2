"""Test helpers: free ports, process discovery by tag, tiny run configs."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free port whose successor is free too (trainer rank r uses base port + r)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def new_tag() -> str:
    """A value for PRIME_RL_TEST_TAG; every descendant of the launcher inherits it."""
    return uuid.uuid4().hex


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose environment carries this tag."""
    found = []
    needle = f"PRIME_RL_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] == "Z":  # zombie: already dead
                    continue
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(entry.name), cmd))
        except OSError:
            continue
    return found


def trio_toml(
    model: Path,
    run_dir: Path,
    max_steps: int = 3,
    async_level: int = 1,
    *,
    lr: float = 1e-3,
    batch_size: int = 16,
    rollouts_per_example: int = 4,
    extra: str = "",
    env: str = 'id = "reverse-text"',
    seq_len: int = 96,
    max_tokens: int = 8,
) -> str:
    """A tiny RL run: few short rollouts, free ports so tests never collide."""
    return f"""
model = "{model}"
output_dir = "{run_dir}"
max_steps = {max_steps}
seq_len = {seq_len}
async_level = {async_level}
batch_size = {batch_size}
rollouts_per_example = {rollouts_per_example}

[sampling]
max_tokens = {max_tokens}

[[env]]
{env}

[transport]
port = {free_port()}
timeout_s = 300

[trainer.optim]
lr = {lr}

[orchestrator]
micro_batch_size = 8

[inference]
port = {free_port()}
{extra}"""
