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

    sequences: int = 0
    """The sequences those requests generate (a request asks for `n`; vLLM runs each apart)."""

    requests: int = 0
    """Generation requests sent here so far (the metrics' `inference/requests/<index>`)."""

    frozen: int = 0
    """Sequences in flight here when a reload froze them (a pause with `keep`), in all. vLLM's
    pause then resets its prefix cache with the running sequences' KV, counting each as
    preempted (they recompute on the new weights): the episode limiter takes these out of
    vLLM's preemption counter, an upper bound (sequences still queued are not preempted)."""

    trusted: bool = False
    """It proved it holds the key (identity challenge): its requests carry the key."""

    identity_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One identity challenge at a time, whatever the number of requests waiting on it."""
