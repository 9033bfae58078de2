"""The replicas of one server behind one client: routing, the concurrency cap, key trust
(``trust``) and retries. Every kind of client (``sampling``) and the vLLM admin calls
(``admin``) send their requests through a pool.

With several replicas (one URL each in ``ClientConfig.base_url``) a generation request goes
to the one with the fewest generation requests in flight, under one concurrency cap over all
of them; calls meant for every replica (the health wait, a reload, the probe) go to each,
concurrently. Each replica keeps one ``httpx2.AsyncClient`` (its connections) for the pool's
life, and every request and poll carries a timeout (``ClientConfig.timeout_s``).

Retries (tenacity): a dropped or refused connection (vLLM restarting), a timeout, an
undecodable answer or a 5xx is tried again on the same replica (a reload must reach it),
with exponential backoff, up to ``max_retries`` times. Every failed exchange drops the
replica's trust first (``trust.ProvenKey``), so a retry, or the next request, proves the
server again before the key goes out.

The pool knows nothing about models, sampling or weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import httpx2
from prime_rl.config import ClientConfig
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_fixed,
)

from orchestrator.client.parse import InferenceError
from orchestrator.client.replica import Replica
from orchestrator.client.trust import DISTRUSTED_STATUS, KeyTrust

TRANSIENT_STATUS = frozenset({500, 502, 503, 504})
"""Server-side errors worth another try: overloaded, restarting, or behind a failing proxy."""

HEALTH_POLL_S = 0.1
"""Seconds between polls of a starting server's /health: the run's first request waits half
of it on average (a refused connection costs a poll 0.6 ms of CPU here)."""

_T = TypeVar("_T")


class _TransientAnswer(Exception):
    """A 5xx worth another try, inside the retry loop; its answer is returned once the tries run out."""

    def __init__(self, response: httpx2.Response):
        self.response = response


class _NotHealthy(Exception):
    """A health poll answered, but not 200."""


class ReplicaPool:
    def __init__(self, config: ClientConfig, trust: KeyTrust):
        self.config = config
        self.trust = trust
        headers = trust.initial_headers()
        self.replicas = [Replica(i, url, _http_client(url, config, headers)) for i, url in enumerate(config.urls)]
        self.base_url = self.replicas[0].url
        """The first replica's URL (the only one, outside multi-replica RL runs)."""
        self.slots = asyncio.Semaphore(config.max_concurrency)
        """Requests in flight over all replicas together."""
        self._turn = 0
        """Where the round robin among equally loaded replicas starts next."""
        self.retries = 0
        """Requests retried after a transient failure (reported in the metrics)."""
        self.answered = 0
        """Generation requests answered so far (all replicas): progress, for the watchdog."""
        self._serving = asyncio.Event()
        self._serving.set()
        """Clear while generation is held (a reload): new generation requests wait for it, so
        that each one is sent entirely before or entirely after the new weights."""

    async def close(self) -> None:
        for replica in self.replicas:
            await replica.http.aclose()

    def requests_per_replica(self) -> list[int]:
        """Generation requests sent to each replica so far, in replica order."""
        return [replica.requests for replica in self.replicas]

    # ----------------------------------------------------------------------- routing

    @contextlib.asynccontextmanager
    async def generation(self, sequences: int = 1) -> AsyncIterator[Replica]:
        """A slot for one generation request of ``sequences`` sequences (its `n`, or its
        prompts) and the replica it goes to, counted in flight there; never while generation
        is held."""
        await self._serving.wait()
        async with self.slots:
            while not self._serving.is_set():  # a hold began while this one waited for a slot
                await self._serving.wait()
            replica = self._pick_replica()
            replica.in_flight += 1
            replica.sequences += sequences
            replica.requests += 1
            try:
                yield replica
                self.answered += 1
            finally:
                replica.in_flight -= 1
                replica.sequences -= sequences

    @contextlib.asynccontextmanager
    async def any_replica(self) -> AsyncIterator[Replica]:
        """A slot and the least loaded replica for a call that runs no model (tokenize, parse):
        not counted as generation, so a reload need not drain it."""
        async with self.slots:
            yield self._pick_replica()

    @contextlib.asynccontextmanager
    async def generation_held(self) -> AsyncIterator[None]:
        """New generation requests wait until the block ends (requests in flight go on)."""
        self._serving.clear()
        try:
            yield
        finally:
            self._serving.set()

    def _pick_replica(self) -> Replica:
        """The replica with the fewest generation requests in flight; ties go round robin, so
        requests sent one at a time still alternate."""
        count = len(self.replicas)
        candidates = [self.replicas[(self._turn + i) % count] for i in range(count)]
        chosen = min(candidates, key=lambda replica: replica.in_flight)
        self._turn = (chosen.index + 1) % count
        return chosen

    async def on_every_replica(self, fn: Callable[[Replica], Awaitable[_T]]) -> list[_T]:
        """``fn`` on every replica concurrently; waits for all of them (a reload is never
        abandoned halfway, which could leave a replica paused), then raises the first
        error, if any."""
        results = await asyncio.gather(*(fn(replica) for replica in self.replicas), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    # ----------------------------------------------------------------------- health

    async def wait_healthy(self, timeout_s: float, poll_s: float = HEALTH_POLL_S) -> None:
        """Poll every replica's GET /health until each answers 200 (they may still be starting).
        Where the key must be proved, each replica first answers the identity challenge,
        without the key; a replica that answers it wrongly (another program on the port) fails
        the wait at once. A poll that fails drops the replica's trust, like any exchange."""
        deadline = time.monotonic() + timeout_s
        await self.on_every_replica(lambda replica: self._wait_replica_healthy(replica, deadline, timeout_s, poll_s))

    async def _wait_replica_healthy(self, replica: Replica, deadline: float, timeout_s: float, poll_s: float) -> None:
        def still_unhealthy(state: RetryCallState) -> NoReturn:
            last = state.outcome.exception()
            why = str(last) if isinstance(last, _NotHealthy) else f"{type(last).__name__}: {last}"
            raise TimeoutError(
                f"inference server at {replica.url}/health not healthy after {timeout_s:.0f} s (last: {why})"
            )

        polling = AsyncRetrying(
            stop=lambda _: time.monotonic() >= deadline,
            wait=wait_fixed(poll_s),
            retry=retry_if_exception_type((httpx2.RequestError, _NotHealthy)),
            retry_error_callback=still_unhealthy,
        )
        await polling(self._poll_health, replica, min(poll_s * 10, self.config.timeout_s))

    async def _poll_health(self, replica: Replica, timeout: float) -> None:
        """One poll: the identity proof if the replica owes one, then GET /health."""
        try:
            await self.trust.ensure(replica, timeout)
            response = await replica.http.get("/health", timeout=timeout)
        except httpx2.RequestError:
            self.trust.forget(replica)
            raise
        if response.status_code != 200:
            self.trust.forget(replica)  # not our healthy server: the next poll asks the proof again
            raise _NotHealthy(f"status {response.status_code}")

    async def metrics_texts(self, timeout_s: float) -> list[str | None]:
        """Each replica's Prometheus text (GET /metrics), None where it could not be read
        (monitoring: never raises, never drops a replica's trust)."""

        async def one(replica: Replica) -> str | None:
            try:
                response = await replica.http.get("/metrics", timeout=timeout_s)
            except httpx2.HTTPError:
                return None
            return response.text if response.status_code == 200 else None

        return list(await asyncio.gather(*(one(replica) for replica in self.replicas)))

    # ----------------------------------------------------------------------- requests

    async def post(
        self, replica: Replica, path: str, *, check: bool = True, resend_unanswered: bool = True, retry: bool = True,
        **kwargs: Any,
    ) -> httpx2.Response | None:
        """POST to one replica, retried (``_post_with_retries``); with ``check``, anything but a
        200 in the end is an InferenceError naming the call, else None after a transport failure.
        ``resend_unanswered=False`` for calls that must not run twice: a request the server may
        have received but not answered (timeout, dropped connection) is then not sent again.
        ``retry=False``: one try, whatever the failure (a step of a protocol a failure ends)."""
        try:
            response = await self._post_with_retries(replica, path, resend_unanswered, kwargs, retry)
        except httpx2.TimeoutException:
            if not check:
                return None
            tries = self._tries(resend_unanswered)
            raise InferenceError(f"POST {replica.url}{path}: no answer within {self.config.timeout_s:g} s ({tries})") from None
        except httpx2.RequestError as e:  # transport errors, and answers that cannot be decoded
            if not check:
                return None
            tries = self._tries(resend_unanswered)
            raise InferenceError(f"POST {replica.url}{path} failed: {type(e).__name__}: {e} ({tries})") from None
        if check and response.status_code != 200:
            status, text = response.status_code, response.text[:500]
            raise InferenceError(f"POST {replica.url}{path} answered status {status}: {text}")
        return response

    def json(self, replica: Replica, response: httpx2.Response, path: str) -> Any:
        """The JSON of a 200 answer; one that is not JSON was not our server's (it may be what
        took the port): the replica's trust is dropped and InferenceError names the call."""
        try:
            return response.json()
        except ValueError:
            self.trust.forget(replica)
            raise InferenceError(f"POST {replica.url}{path} answered non-JSON: {response.text[:200]!r}") from None

    async def _post_with_retries(
        self, replica: Replica, path: str, resend_unanswered: bool, kwargs: dict[str, Any], retry: bool = True
    ) -> httpx2.Response:
        """The answer, after up to ``max_retries`` more tries of a transient failure; the last
        failure is returned (a 5xx) or raised. Without ``resend_unanswered`` only a refused
        connection (never received) and a 5xx (answered) are tried again."""
        # The first try goes out directly: nearly every request is answered at once, and
        # tenacity's per-call retry state costs ~25 µs (measured), so only a failure builds it.
        try:
            return await self._exchange(replica, path, kwargs)
        except (httpx2.RequestError, _TransientAnswer) as e:
            first = e
        if not (retry and self.config.max_retries and _worth_another_try(first, resend_unanswered)):
            return _last_outcome(first)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.config.max_retries),  # the tries after the first
            before=self._back_off,
            retry=retry_if_exception(lambda e: _worth_another_try(e, resend_unanswered)),
            retry_error_callback=lambda state: _last_outcome(state.outcome.exception()),
        )
        return await retrying(self._exchange, replica, path, kwargs)

    async def _exchange(self, replica: Replica, path: str, kwargs: dict[str, Any]) -> httpx2.Response:
        """One try: the identity proof if the replica owes one, then the POST. A transport
        error or an answer our server would not give (``DISTRUSTED_STATUS``) drops the
        replica's trust; a transient 5xx raises ``_TransientAnswer``."""
        try:
            await self.trust.ensure(replica, self.config.timeout_s)
            response = await replica.http.post(path, **kwargs)
        except httpx2.RequestError:  # connect/read/write/protocol errors, timeouts, undecodable bodies
            self.trust.forget(replica)
            raise
        if response.status_code in DISTRUSTED_STATUS:
            self.trust.forget(replica)
            if response.status_code in TRANSIENT_STATUS:
                raise _TransientAnswer(response)
        return response

    async def _back_off(self, state: RetryCallState) -> None:
        """Before retry k (1, 2, ...): ``retry_backoff_s * 2**(k-1)`` seconds, and count it."""
        self.retries += 1
        await asyncio.sleep(self.config.retry_backoff_s * 2 ** (state.attempt_number - 1))

    def _tries(self, resend_unanswered: bool) -> str:
        if not resend_unanswered:
            return "not sent again: it may still be running"
        return f"{self.config.max_retries + 1} tries"


def _worth_another_try(error: BaseException, resend_unanswered: bool) -> bool:
    if isinstance(error, _TransientAnswer):
        return True
    return isinstance(error, httpx2.RequestError) and (resend_unanswered or isinstance(error, httpx2.ConnectError))


def _last_outcome(error: BaseException) -> httpx2.Response:
    """The last try's outcome, once no other try follows: a 5xx's answer, or its error."""
    if isinstance(error, _TransientAnswer):
        return error.response
    raise error


def _http_client(url: str, config: ClientConfig, headers: dict[str, str]) -> httpx2.AsyncClient:
    """Connections to one replica; ``headers``: the key on every request from the start
    (``trust.SentKey``), or none until the replica proved it holds it (``trust.ProvenKey``:
    the server's middleware then wants it on every route, /health included, inference.auth)."""
    return httpx2.AsyncClient(
        base_url=url,
        headers=headers,
        timeout=httpx2.Timeout(config.timeout_s),
        # One connection per concurrent request, so the semaphore is the only limit.
        # keepalive_expiry below uvicorn's 5 s keep-alive: a pooled connection the server
        # is closing must not be reused (that shows up as a ReadError mid-run).
        limits=httpx2.Limits(
            max_connections=config.max_concurrency,
            max_keepalive_connections=config.max_concurrency,
            keepalive_expiry=2.0,
        ),
    )
