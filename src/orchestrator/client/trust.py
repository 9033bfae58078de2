"""Who gets the API key: one of two policies, chosen once when a client is made.

- ``ProvenKey``, for a server this run started (``own_server``): each replica first answers
  the identity challenge of ``prime_rl.keys`` without the key, and only then gets the key on
  its requests, /health included. Something else on the port (any other answer) never sees
  the key. After any failed exchange with a replica (the pool says which: refused or dropped
  connection, timeout, a broken or undecodable answer, a 5xx, a 401/403, a 200 that is not
  JSON) it must prove itself again before the key goes out again: the server may have crashed
  and another program taken its port, and such an answer may already be that program's.
- ``SentKey``, for an external endpoint: its key (if any) is meant for whoever answers at its
  URL and goes on every request from the start.

Not covered: a server that dies while no request is in flight, and a program that takes its
port before the next request opens a new connection; nothing fails in between, so nothing
says to ask again (binding the proof to each connection needs TLS, ``prime_rl.keys``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx2
from prime_rl.keys import IDENTITY_PATH, new_nonce, proves_identity

from orchestrator.client.parse import InferenceError

if TYPE_CHECKING:
    from orchestrator.client.replica import Replica

DISTRUSTED_STATUS = frozenset({401, 403}) | frozenset(range(500, 600))
"""Answers after which a replica must prove itself again before it gets the key: a 5xx may
come from whatever took the port after a crash, and our server never refuses its own key."""


class SentKey:
    """The key (or none) on every request from the start: an endpoint's, meant for its URL."""

    def __init__(self, api_key: str | None):
        self.api_key = api_key

    def initial_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def ensure(self, replica: Replica, timeout: float) -> None:
        """Nothing to prove."""

    def forget(self, replica: Replica) -> None:
        """Nothing was proved."""


class ProvenKey:
    """The key only to a replica that proved it holds it, until an exchange with it fails."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    def initial_headers(self) -> dict[str, str]:
        return {}

    async def ensure(self, replica: Replica, timeout: float) -> None:
        """Return once ``replica`` may get the key: it answered the identity challenge (asked
        without the key). Raises InferenceError when something else answers; transport
        errors (nothing listening yet) propagate for the caller to retry."""
        if replica.trusted:
            return
        async with replica.identity_lock:
            if replica.trusted:
                return
            nonce = new_nonce()
            response = await replica.http.get(IDENTITY_PATH, params={"nonce": nonce}, timeout=timeout)
            why = identity_failure(response, self.api_key, nonce)
            if why is not None:
                raise InferenceError(not_this_run(replica.url, why))
            replica.http.headers["Authorization"] = f"Bearer {self.api_key}"
            replica.trusted = True

    def forget(self, replica: Replica) -> None:
        """An exchange with the replica failed: the port may have changed hands, so whatever
        answers there next must prove itself again before it gets the key. Requests already
        sent are not recalled."""
        replica.trusted = False
        replica.http.headers.pop("Authorization", None)


KeyTrust = SentKey | ProvenKey


def key_trust(api_key: str | None, own_server: bool) -> KeyTrust:
    """A server this run started proves it holds the key first; an endpoint's key is sent."""
    return ProvenKey(api_key) if api_key and own_server else SentKey(api_key)


def identity_failure(response: httpx2.Response, key: str, nonce: str) -> str | None:
    """None when ``response`` (to the identity challenge ``nonce``) proves knowledge of ``key``,
    else what was wrong with it."""
    if response.status_code != 200:
        return f"it answers the identity check with status {response.status_code}"
    try:
        answer = response.json()
    except ValueError:
        return "it answers the identity check with something other than JSON"
    return None if proves_identity(key, nonce, answer) else "its identity proof is wrong"


def not_this_run(url: str, why: str) -> str:
    host = urlsplit(url).netloc or url
    return f"something else answers on {host}, not this run's inference server ({why}); the API key was not sent to it"
