"""One server of a replica pool: its connections, request counts and key trust (a record the
pool routes over and ``trust`` marks; neither imports the other for it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx2


@dataclass(eq=False)
class Replica:
    """One server of the pool, with its own connections and request counts."""

    index: int
    url: str
    http: httpx2.AsyncClient
    in_flight: int = 0
    """Generation requests in flight here: routing picks the replica with the fewest, and a
    reload drains this replica first only when it has some."""

    requests: int = 0
    """Generation requests sent here so far (the metrics' `inference/requests/<index>`)."""

    trusted: bool = False
    """It proved it holds the key (identity challenge): its requests carry the key."""

    identity_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One identity challenge at a time, whatever the number of requests waiting on it."""
