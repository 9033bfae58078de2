"""Inference client: completions of token-id prompts with exact token ids and logprobs,
chat completions for text-only endpoints, and the admin calls of a vLLM server (health,
weight reload, LoRA adapter loading).

Speaks plain HTTP (httpx) to vLLM's OpenAI-compatible server. Training samples through
``/v1/completions`` with the prompt as token ids (the orchestrator renders chats itself,
``prime_rl.chat``, so vLLM never re-tokenizes text and a multi-turn prompt extends the
exact tokens of the turns before it). vLLM-specific request fields: ``return_token_ids``
makes it return ``choices[i].prompt_token_ids`` and ``choices[i].token_ids``;
``logprobs: 0`` gives the sampled tokens' ``choices[i].logprobs.token_logprobs``. No
per-request ``seed``: it can crash the CPU engine (docs/machine_facts.md). Tool calls in those
completions are parsed by vLLM's own parser through ``/v1/chat/completions/derender``
(a vLLM server started with ``--enable-scale-out`` and ``--tool-call-parser``).

With several replicas (one URL each in ``ClientConfig.base_url``) a request goes to the
one with the fewest generation requests in flight, under one concurrency cap over all of
them, and the admin calls (health, reload, probe) go to every replica, concurrently.

The API key goes only to a server that proved it holds it: for a server this run started
(``own_server``, the default) each replica first answers the identity challenge of
``prime_rl.keys`` without the key, and only then gets the key on its requests, /health
included. Something else on the port (any other answer) never sees the key, and the start-up
wait fails naming it. After any failed exchange with a replica (refused or dropped connection,
timeout, a broken or undecodable answer, a 5xx, a 401/403) it must prove itself again before
the key goes out again: the server may have crashed and another program taken its port, and
such an answer may already be that program's. An external endpoint's key (``own_server=False``)
is meant for whoever answers at its URL and is sent from the start.

Not covered: a server that dies while no request is in flight, and a program that takes its
port before the next request opens a new connection; nothing fails in between, so nothing
says to ask again (binding the proof to each connection needs TLS, ``prime_rl.keys``).

The client knows nothing about environments, steps or the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import numpy as np
from prime_rl.config import ClientConfig
from prime_rl.envs import ToolCall
from prime_rl.keys import IDENTITY_PATH, new_nonce, proves_identity

# /reset_prefix_cache answers 200 with {"success": false} while KV blocks are still held;
# vLLM's docs say to retry. After /pause?mode=wait nothing runs, so a few tries suffice.
_RESET_RETRIES = 20
_RESET_RETRY_S = 0.05
# The fixed prompt whose logprobs fingerprint a replica's weights (verify_reload): ids below
# 256 exist in every vocabulary (bytes, in the tiny test model's). 1e-3 absolute on the sum:
# on vLLM-CPU in float32 the same weights score bit-identically, call after call, under load
# and after a reload back, while two seeds of the tiny model differ by 0.5 (measured).
PROBE_PROMPT_IDS = tuple(range(1, 17))
PROBE_TOLERANCE = 1e-3
# Server-side errors worth another try: overloaded, restarting, or behind a failing proxy.
TRANSIENT_STATUS = frozenset({500, 502, 503, 504})
# Answers after which a replica must prove itself again before it gets the key: a 5xx may come
# from whatever took the port after a crash, and our server never refuses its own key (401/403).
DISTRUSTED_STATUS = frozenset({401, 403}) | frozenset(range(500, 600))

FULL_DISTRIBUTION: dict[str, float | int] = {
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
"""Every field of vLLM's sampling that reshapes the distribution, set to off on every
training request: a field left out takes the server's default, which a model's
generation_config.json can set (Qwen3: top_k 20, top_p 0.8), and the logprobs would then
come from a truncated distribution while the trainer scores the full softmax."""


_T = TypeVar("_T")


class InferenceError(RuntimeError):
    """The inference server answered something unusable, or not at all."""


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    """Sampler logprob of each completion token, same length as ``completion_ids``."""

    text: str
    finish_reason: str | None
    versions: tuple[int, int] = (0, 0)
    """Policy versions served when the request was sent and when its answer came: equal
    unless a reload landed while it was in flight (its tokens then come from both)."""


@dataclass(eq=False)
class Replica:
    """One vLLM server of the pool, with its own connections and request counts."""

    index: int
    url: str
    http: httpx.AsyncClient
    in_flight: int = 0
    """Generation requests in flight here: routing picks the replica with the fewest, and a
    reload drains this replica first only when it has some."""

    requests: int = 0
    """Generation requests sent here so far (the metrics' `inference/requests/<index>`)."""

    trusted: bool = False
    """It proved it holds the key (identity challenge): its requests carry the key."""

    identity_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One identity challenge at a time, whatever the number of requests waiting on it."""


class InferenceClient:
    def __init__(self, config: ClientConfig, model_name: str, lora_adapter: str | None = None, *, own_server: bool = True):
        self.config = config
        self.model_name = model_name
        """The model requests name: the served model, or once one is loaded, the LoRA adapter."""
        self.lora_adapter = lora_adapter
        self.prove_first = bool(config.api_key) and own_server
        """Each replica must prove it holds the key before it gets it (a server this run
        started); False: the key goes on every request from the start (an endpoint's key)."""
        with_key = bool(config.api_key) and not self.prove_first
        self.replicas = [Replica(i, url, _http_client(url, config, with_key)) for i, url in enumerate(config.urls)]
        self.base_url = self.replicas[0].url
        """The first replica's URL (the only one, outside multi-replica RL runs)."""
        self._slots = asyncio.Semaphore(config.max_concurrency)
        """Requests in flight over all replicas together."""
        self._turn = 0
        """Where the round robin among equally loaded replicas starts next."""
        self.retries = 0
        """Requests retried after a transient transport error (reported in the metrics)."""
        self.answered = 0
        """Generation requests answered so far (all replicas): progress, for the watchdog."""
        self.version = 0
        """Policy version the replicas serve (0 = the model they started with); set by
        ``reload_weights``. It salts the prefix cache of every request (``cache_salt``)."""
        self._serving = asyncio.Event()
        self._serving.set()
        """Clear while a reload is under way: new generation requests wait for it, so that each
        one is sent entirely before or entirely after the new weights."""

    async def close(self) -> None:
        for replica in self.replicas:
            await replica.http.aclose()

    def requests_per_replica(self) -> list[int]:
        """Generation requests sent to each replica so far, in replica order."""
        return [replica.requests for replica in self.replicas]

    # ----------------------------------------------------------------------- sampling

    async def chat_text_n(
        self,
        messages: list[dict[str, Any]],
        *,
        n: int,
        max_tokens: int | None,
        temperature: float | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[tuple[str, str | None, tuple[ToolCall, ...]]]:
        """``n`` replies of a text-only OpenAI-compatible chat API (an API model under eval):
        ``(content, finish_reason, tool_calls)`` of every choice, in order; no tokens, no vLLM
        fields. Settings left at None are the server's. The base URL may end in ``/v1`` (an
        endpoint's, as written in endpoints.toml) or not (a vLLM server's)."""
        body: dict[str, Any] = {"model": self.model_name, "messages": messages, "n": n}
        if tools:
            body["tools"] = tools
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if temperature is not None:
            body["temperature"] = temperature
        async with self._generation() as replica:
            path = "/chat/completions" if replica.url.endswith("/v1") else "/v1/chat/completions"
            response = await self._post(replica, path, json=body)
        payload = self._json(replica, response, path)
        choices = sorted(payload.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise InferenceError(
                f"POST {replica.url}{path}: asked for {n} choices, got {len(choices)} (does the server support `n`?)"
            )
        return [_chat_choice(c) for c in choices]

    async def complete_n(
        self, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float
    ) -> list[Completion]:
        """``n`` samples continuing the token-id prompt ``prompt_ids`` (one request)."""
        body = {
            "model": self.model_name,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            **FULL_DISTRIBUTION,
            "logprobs": 0,
            "return_token_ids": True,
            "n": n,
        }
        async with self._generation() as replica:
            sent = self.version
            body["cache_salt"] = cache_salt(sent)
            response = await self._post(replica, "/v1/completions", json=body)
        versions = (sent, self.version)
        results = parse_completion_choices(self._json(replica, response, "/v1/completions"), list(prompt_ids), versions)
        if len(results) != n:
            raise InferenceError(f"{replica.url}: asked for {n} choices, the server returned {len(results)}")
        return results

    async def prompt_logprobs(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """For each token-id prompt, the model's logprob of every token given the ones before
        it (vLLM's prompt logprobs, raw: temperature 1), float32 [len(prompt)], 0 at position
        0 (nothing to condition on): one request, one prefill per prompt of the exact ids,
        nothing re-tokenized. Raises InferenceError when the server returns none (not a
        vLLM completions API)."""
        choices, url = await self._prompt_choices(prompts, 0)
        return [parse_prompt_logprobs(choice, prompt, url) for choice, prompt in zip(choices, prompts)]

    async def prompt_top_logprobs(self, prompts: list[list[int]], k: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """As ``prompt_logprobs``, with the model's ``k`` most likely tokens at every position:
        for each prompt (logprobs float32 [T], top ids int32 [T, k], their logprobs float32
        [T, k], most likely first; row 0 zeros). The server must allow k (vLLM `--max-logprobs`)."""
        choices, url = await self._prompt_choices(prompts, k)
        out = []
        for choice, prompt in zip(choices, prompts):
            out.append((parse_prompt_logprobs(choice, prompt, url), *parse_prompt_top_k(choice, prompt, k, url)))
        return out

    async def _prompt_choices(self, prompts: list[list[int]], k: int) -> tuple[list[Any], str]:
        """The completion choices of one request scoring ``prompts`` with ``prompt_logprobs = k``, and the URL asked."""
        body = {"model": self.model_name, "prompt": [list(p) for p in prompts], "max_tokens": 1, "prompt_logprobs": k}
        async with self._generation() as replica:
            response = await self._post(replica, "/v1/completions", json=body)
        payload = self._json(replica, response, "/v1/completions")
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise InferenceError(f"{replica.url}: sent {len(prompts)} prompts, got {len(choices or [])} choices back")
        return choices, replica.url

    async def tokenize(self, text: str) -> tuple[list[int], int | None]:
        """(token ids of ``text`` without special tokens added, the server's max_model_len) by
        the server's own tokenizer (vLLM's ``/tokenize``)."""
        async with self._slots:
            replica = self._pick_replica()
            response = await self._post(
                replica, "/tokenize", json={"model": self.model_name, "prompt": text, "add_special_tokens": False}
            )
        payload = self._json(replica, response, "/tokenize")
        if not isinstance(payload, dict) or not isinstance(payload.get("tokens"), list):
            raise InferenceError(f"POST {replica.url}/tokenize answered no token ids: {str(payload)[:200]}")
        limit = payload.get("max_model_len")
        return [int(t) for t in payload["tokens"]], int(limit) if isinstance(limit, int) else None

    async def parse_tool_calls(
        self, prompt_ids: list[int], completions: list[list[int]], tools: list[dict[str, Any]]
    ) -> list[tuple[str, tuple[ToolCall, ...]]]:
        """``(content, tool_calls)`` of each sampled completion, parsed by the server's own
        tool-call parser (vLLM's ``/v1/chat/completions/derender``: the parser chosen with
        ``--tool-call-parser``, here run on the exact tokens we sampled). Pass completions
        without their end-of-turn token, which is not content."""
        generated = [{"index": i, "finish_reason": "stop", "token_ids": ids or [0]} for i, ids in enumerate(completions)]
        body = {
            "generate_response": {"choices": generated},
            "prompt_token_ids": list(prompt_ids[-16:]),  # seeds detokenization only
            "chat_request": {"model": self.model_name, "messages": [{"role": "user", "content": ""}], "tools": tools},
        }
        # Parsing runs no model: it goes to the least loaded replica but is not counted as
        # generation (a reload need not drain it).
        async with self._slots:
            replica = self._pick_replica()
            response = await self._post(replica, "/v1/chat/completions/derender", json=body)
        payload = self._json(replica, response, "/v1/chat/completions/derender")
        choices = sorted((payload.get("choices") if isinstance(payload, dict) else None) or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(completions):
            raise InferenceError(
                f"{replica.url}: tool-call parsing: sent {len(completions)} completions, got {len(choices)} back"
            )
        parsed = []
        for choice, ids in zip(choices, completions):
            content, _, calls = _chat_choice(choice)
            parsed.append((content, calls) if ids else ("", ()))
        return parsed

    # ----------------------------------------------------------------------- admin

    async def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll every replica's GET /health until each answers 200 (they may still be starting).
        With ``prove_first``, each replica first answers the identity challenge, without the key;
        a replica that answers it wrongly (another program on the port) fails the wait at once."""
        deadline = time.monotonic() + timeout_s
        await self._on_every_replica(lambda replica: self._wait_replica_healthy(replica, deadline, timeout_s, poll_s))

    async def reload_weights(self, weights_path: Path | str, version: int | None = None, *, keep: bool = False) -> None:
        """Load an HF safetensors folder into every replica, in place and concurrently; with
        ``lora_adapter``, a PEFT adapter folder, loaded in place under that name, which
        requests name from then on. Returns once every replica is done; any replica's
        error is raised, naming it (the others still finish their reload first).

        ``version`` is the policy version the folder holds (requests from now on carry it).
        ``keep`` is the in-flight update: requests in flight stay in the engine, frozen by
        ``/pause?mode=keep``, and continue on the new weights after ``/resume`` (their KV
        cache, computed with the old ones, is kept); without it they first finish on the old
        weights (``mode=wait``). New requests wait until the reload is done either way."""
        path = str(Path(weights_path).resolve())
        self._serving.clear()
        try:
            # A LoRA adapter is swapped with its sequences drained (measured with mode=wait only)
            mode = "keep" if keep and self.lora_adapter is None else "wait"
            await self._on_every_replica(lambda replica: self._reload_replica(replica, path, mode))
            if version is not None:
                self.version = version
        finally:
            self._serving.set()
        if self.lora_adapter is not None:
            self.model_name = self.lora_adapter

    async def resume(self) -> None:
        """Resume every replica's engine: a server that outlived a run (`prime-rl inference`)
        may have been left paused by a run killed mid-reload. A no-op on one that runs."""
        await self._on_every_replica(lambda replica: self._post(replica, "/resume"))

    async def probe_replicas(self) -> list[float]:
        """Score one fixed prompt on every replica: the sum of its tokens' logprobs, a number
        that depends only on the weights (the same on every call: measured bit-identical on
        vLLM-CPU, under load and after reloading the same folder). Raises when replicas
        disagree by more than ``PROBE_TOLERANCE``: one kept other weights than the rest."""
        values = await self._on_every_replica(self._probe_replica)
        if max(values) - min(values) > PROBE_TOLERANCE:
            listed = ", ".join(f"{replica.url}: {value:.6f}" for replica, value in zip(self.replicas, values))
            raise InferenceError(
                f"replicas serve different weights after the reload (probe logprob sums differ by more than "
                f"{PROBE_TOLERANCE:g}): {listed}"
            )
        return values

    async def _wait_replica_healthy(self, replica: Replica, deadline: float, timeout_s: float, poll_s: float) -> None:
        last = "no answer"
        timeout = min(poll_s * 10, self.config.timeout_s)
        while True:
            try:
                await self._ensure_trusted(replica, timeout)
                response = await replica.http.get("/health", timeout=timeout)
                if response.status_code == 200:
                    return
                self._forget_trust(replica)  # not our healthy server: the next poll asks the proof again
                last = f"status {response.status_code}"
            except httpx.RequestError as e:
                self._forget_trust(replica)
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"inference server at {replica.url}/health not healthy after {timeout_s:.0f} s (last: {last})"
                )
            await asyncio.sleep(poll_s)

    async def _reload_replica(self, replica: Replica, path: str, mode: str = "wait") -> None:
        """Reload one replica. With generation requests in flight on this replica it first
        pauses its engine (``mode`` wait: they finish on the old weights; keep: they are
        frozen and go on with the new ones) and resumes it after; with none, as between the
        orchestrator's steps, it skips both: vLLM's pause alone costs ~25 ms (a fixed 20 ms
        sleep), a third of a reload (docs/machine_facts.md). KV computed with the old
        weights is never served to a request of the new version: requests salt the prefix
        cache with their version (``cache_salt``), and the cache is reset too when no
        sequence holds blocks (vLLM refuses a reset while frozen sequences hold them)."""
        drain = replica.in_flight > 0
        try:
            if drain:
                await self._post(replica, "/pause", params={"mode": mode})
            if self.lora_adapter is None:
                # Not re-sent after a timeout or a broken connection: the first may still be running
                # in the engine, and a second would load behind its back (sent again only when it
                # never reached the server, or the server answered 5xx: then nothing is running).
                await self._post(
                    replica,
                    "/collective_rpc",
                    json={"method": "reload_weights", "kwargs": {"weights_path": path}},
                    resend_unanswered=False,
                )
            else:
                # Idempotent: a second in-place load of the same folder (after a lost answer) is harmless.
                await self._post(
                    replica,
                    "/v1/load_lora_adapter",
                    json={"lora_name": self.lora_adapter, "lora_path": path, "load_inplace": True},
                )
            if not (drain and mode == "keep"):
                await self._reset_prefix_cache(replica)
        except BaseException:
            # Leave the server serving rather than paused forever, also when the run stops
            # mid-reload (a warm server outlives it; a reload still running in the engine
            # finishes before the resume is handled); the error still propagates.
            if drain:
                await asyncio.shield(self._post(replica, "/resume", check=False))
            raise
        if drain:
            await self._post(replica, "/resume")

    async def _probe_replica(self, replica: Replica) -> float:
        # prompt_logprobs=0: the logprob of each prompt token given the ones before it (the
        # first has none); one sampled token, as vLLM refuses max_tokens=0.
        body = {
            "model": self.model_name,
            "prompt": list(PROBE_PROMPT_IDS),
            "max_tokens": 1,
            "temperature": 1.0,
            **FULL_DISTRIBUTION,
            "prompt_logprobs": 0,
            "cache_salt": cache_salt(self.version),
        }
        async with self._slots:
            response = await self._post(replica, "/v1/completions", json=body)
        return _prompt_logprob_sum(self._json(replica, response, "/v1/completions"), replica.url)

    async def _on_every_replica(self, fn: Callable[[Replica], Awaitable[_T]]) -> list[_T]:
        """``fn`` on every replica concurrently; waits for all of them (a reload is never
        abandoned halfway, which could leave a replica paused), then raises the first
        error, if any."""
        results = await asyncio.gather(*(fn(replica) for replica in self.replicas), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    @contextlib.asynccontextmanager
    async def _generation(self):
        """A slot for one generation request and the replica it goes to, counted in flight
        there; never while a reload is under way."""
        await self._serving.wait()
        async with self._slots:
            while not self._serving.is_set():  # a reload began while this one waited for a slot
                await self._serving.wait()
            replica = self._pick_replica()
            replica.in_flight += 1
            replica.requests += 1
            try:
                yield replica
                self.answered += 1
            finally:
                replica.in_flight -= 1

    def _pick_replica(self) -> Replica:
        """The replica with the fewest generation requests in flight; ties go round robin, so
        requests sent one at a time still alternate."""
        count = len(self.replicas)
        candidates = [self.replicas[(self._turn + i) % count] for i in range(count)]
        chosen = min(candidates, key=lambda replica: replica.in_flight)
        self._turn = (chosen.index + 1) % count
        return chosen

    async def _reset_prefix_cache(self, replica: Replica) -> None:
        for _ in range(_RESET_RETRIES):
            response = await self._post(replica, "/reset_prefix_cache")
            if _reset_succeeded(response):
                return
            await asyncio.sleep(_RESET_RETRY_S)
        raise InferenceError(
            f"POST {replica.url}/reset_prefix_cache kept answering success=false ({_RESET_RETRIES} tries): "
            "the server would serve KV computed with the old weights"
        )

    # ----------------------------------------------------------------------- the key

    async def _ensure_trusted(self, replica: Replica, timeout: float | None = None) -> None:
        """Return once ``replica`` may get the key: it answered the identity challenge (asked
        without the key). Raises InferenceError when something else answers; transport
        errors (nothing listening yet) propagate for the caller to retry."""
        if not self.prove_first or replica.trusted:
            return
        async with replica.identity_lock:
            if replica.trusted:
                return
            nonce = new_nonce()
            response = await replica.http.get(IDENTITY_PATH, params={"nonce": nonce}, timeout=timeout or self.config.timeout_s)
            why = _identity_failure(response, self.config.api_key, nonce)
            if why is not None:
                raise InferenceError(not_this_run(replica.url, why))
            replica.http.headers["Authorization"] = f"Bearer {self.config.api_key}"
            replica.trusted = True

    def _forget_trust(self, replica: Replica) -> None:
        """An exchange with the replica failed (``_post_with_retries`` and the health wait say
        which): the port may have changed hands, so whatever answers there next must prove
        itself again before it gets the key. Requests already sent are not recalled."""
        if self.prove_first:
            replica.trusted = False
            replica.http.headers.pop("Authorization", None)

    def _json(self, replica: Replica, response: httpx.Response, path: str) -> Any:
        """The JSON of a 200 answer; one that is not JSON was not our server's (it may be what
        took the port): the replica's trust is dropped and InferenceError names the call."""
        try:
            return response.json()
        except ValueError:
            self._forget_trust(replica)
            raise InferenceError(f"POST {replica.url}{path} answered non-JSON: {response.text[:200]!r}") from None

    def _check_answer(self, replica: Replica, response: httpx.Response) -> httpx.Response:
        """``response``, after dropping the replica's trust when its status is one our server
        would not give its own client while healthy (``DISTRUSTED_STATUS``)."""
        if response.status_code in DISTRUSTED_STATUS:
            self._forget_trust(replica)
        return response

    # ----------------------------------------------------------------------- plumbing

    async def _post(
        self, replica: Replica, path: str, *, check: bool = True, resend_unanswered: bool = True, **kwargs: Any
    ) -> httpx.Response | None:
        """POST to one replica with retries (``_post_with_retries``). ``resend_unanswered=False``
        for calls that must not run twice: a request the server may have received but not
        answered (timeout, dropped connection) is then not sent again."""
        url = f"{replica.url}{path}"
        tries = f"{self.config.max_retries + 1} tries" if resend_unanswered else "not sent again: it may still be running"
        try:
            response = await self._post_with_retries(replica, path, resend_unanswered, **kwargs)
        except httpx.TimeoutException:
            if not check:
                return None
            raise InferenceError(f"POST {url}: no answer within {self.config.timeout_s:g} s ({tries})") from None
        except httpx.RequestError as e:  # transport errors, and answers that cannot be decoded
            if not check:
                return None
            raise InferenceError(f"POST {url} failed: {type(e).__name__}: {e} ({tries})") from None
        if check and response.status_code != 200:
            raise InferenceError(f"POST {url} answered status {response.status_code}: {response.text[:500]}")
        return response

    async def _post_with_retries(
        self, replica: Replica, path: str, resend_unanswered: bool = True, **kwargs: Any
    ) -> httpx.Response:
        """Retry transient failures with exponential backoff: a dropped or refused connection
        (vLLM restarting), a timeout, an HTTP 5xx. The last failure is returned or raised.
        Without ``resend_unanswered`` only a refused connection (never received) and a 5xx
        (answered) are retried. Retries stay on the same replica: a reload must reach it. Any
        failure drops the replica's trust first, so a retry re-proves it before the key goes out."""
        for attempt in range(self.config.max_retries + 1):
            last = attempt == self.config.max_retries
            try:
                await self._ensure_trusted(replica)
                response = self._check_answer(replica, await replica.http.post(path, **kwargs))
                if response.status_code not in TRANSIENT_STATUS or last:
                    return response
            except httpx.RequestError as e:  # connect/read/write/protocol errors, timeouts, undecodable bodies
                self._forget_trust(replica)
                if last or not (resend_unanswered or isinstance(e, httpx.ConnectError)):
                    raise
            self.retries += 1
            await asyncio.sleep(self.config.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable")


def _http_client(url: str, config: ClientConfig, with_key: bool) -> httpx.AsyncClient:
    """Connections to one replica; ``with_key``: the key on every request from the start (else
    it is added once the replica proved it holds it; the server's middleware then wants it
    on every route, /health included, inference.auth)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if with_key else {}
    return httpx.AsyncClient(
        base_url=url,
        headers=headers,
        timeout=httpx.Timeout(config.timeout_s),
        # One connection per concurrent request, so the semaphore is the only limit.
        # keepalive_expiry below uvicorn's 5 s keep-alive: a pooled connection the server
        # is closing must not be reused (that shows up as a ReadError mid-run).
        limits=httpx.Limits(
            max_connections=config.max_concurrency,
            max_keepalive_connections=config.max_concurrency,
            keepalive_expiry=2.0,
        ),
    )


def _identity_failure(response: httpx.Response, key: str, nonce: str) -> str | None:
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


def _prompt_logprob_sum(payload: dict[str, Any], url: str) -> float:
    """Sum of the prompt tokens' logprobs in a completion asked with ``prompt_logprobs``:
    ``choices[0].prompt_logprobs`` is [None, {"<token id>": {"logprob": ...}}, ...]."""
    choices = payload.get("choices") or [{}]
    entries = choices[0].get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(PROBE_PROMPT_IDS):
        raise InferenceError(f"{url}: the probe's answer lacks prompt_logprobs for its {len(PROBE_PROMPT_IDS)} tokens")
    try:
        total = sum(float(entry[str(token)]["logprob"]) for token, entry in zip(PROBE_PROMPT_IDS[1:], entries[1:]))
    except (KeyError, TypeError, ValueError):
        raise InferenceError(f"{url}: unreadable prompt_logprobs in the probe's answer: {str(entries)[:200]}") from None
    if not math.isfinite(total):
        raise InferenceError(f"{url}: the probe's prompt logprobs are not finite")
    return total


def _reset_succeeded(response: httpx.Response) -> bool:
    # Older servers answer an empty 200; newer ones {"success": bool}.
    try:
        payload = response.json()
    except ValueError:
        return True
    return not isinstance(payload, dict) or payload.get("success", True) is not False


_NO_TOKEN_IDS = (
    "completion lacks choices[i].token_ids: the server must be vLLM and honour `return_token_ids`"
)


def _chat_choice(choice: dict[str, Any]) -> tuple[str, str | None, tuple[ToolCall, ...]]:
    """(content, finish_reason, tool calls) of one chat completion choice."""
    message = choice.get("message") or {}
    calls = []
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            try:
                arguments = json.dumps(arguments if arguments is not None else {})
            except RecursionError:  # the model nested them too deeply: the tool's error message says so
                arguments = "<arguments nested too deeply to encode>"
        calls.append(ToolCall(str(call.get("id") or f"call_{i}"), str(function.get("name") or ""), arguments))
    return message.get("content") or "", choice.get("finish_reason"), tuple(calls)


def cache_salt(version: int) -> str:
    """The prefix-cache salt of requests of policy ``version``: a request only ever reuses
    KV that requests of its own version computed, i.e. with the same weights."""
    return f"prime-rl-policy-{version}"


def parse_prompt_logprobs(choice: Any, token_ids: list[int], url: str) -> np.ndarray:
    """float32 [len(token_ids)] from a completion choice answered with ``prompt_logprobs``: at
    each position i > 0 the logprob of token_ids[i] (vLLM lists it among the top ones: key = the id)."""
    entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    if not isinstance(entries, list):
        raise InferenceError(
            f"{url}: the completion carries no prompt_logprobs: a teacher must be a vLLM server (its completions API "
            "returns the logprob of every prompt token)"
        )
    if len(entries) != len(token_ids):
        raise InferenceError(f"{url}: {len(entries)} prompt logprobs for a prompt of {len(token_ids)} tokens")
    out = np.zeros(len(token_ids), dtype=np.float32)
    for i in range(1, len(token_ids)):
        entry = entries[i] if isinstance(entries[i], dict) else {}
        scored = entry.get(str(token_ids[i]))
        logprob = scored.get("logprob") if isinstance(scored, dict) else None
        if not isinstance(logprob, int | float) or not math.isfinite(logprob):
            raise InferenceError(f"{url}: no finite prompt logprob for token {token_ids[i]} at position {i}")
        out[i] = logprob
    return out


def parse_prompt_top_k(choice: Any, token_ids: list[int], k: int, url: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [T, k], logprobs float32 [T, k]): the k most likely tokens at each position i > 0
    of a choice answered with ``prompt_logprobs = k``, most likely first (vLLM lists them beside
    the prompt's own token, which may rank lower); row 0 zeros."""
    entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        raise InferenceError(f"{url}: no prompt logprobs for each of the {len(token_ids)} prompt tokens")
    ids, logprobs = np.zeros((len(token_ids), k), np.int32), np.zeros((len(token_ids), k), np.float32)
    for i in range(1, len(token_ids)):
        entry = entries[i] if isinstance(entries[i], dict) else {}
        ranked = []
        for key, scored in entry.items():
            logprob = scored.get("logprob") if isinstance(scored, dict) else None
            if isinstance(logprob, int | float) and math.isfinite(logprob) and str(key).lstrip("-").isdigit():
                ranked.append((-float(logprob), int(key)))
        if len(ranked) < k:
            raise InferenceError(f"{url}: {len(ranked)} of the {k} most likely tokens at prompt position {i}")
        ranked.sort()
        ids[i] = [token for _, token in ranked[:k]]
        logprobs[i] = [-negative for negative, _ in ranked[:k]]
    return ids, logprobs


def parse_completion_choices(
    payload: dict[str, Any], prompt_ids: list[int], versions: tuple[int, int] = (0, 0)
) -> list[Completion]:
    """Every choice of a vLLM completion of a token-id prompt, in choice order."""
    choices = sorted(payload.get("choices") or [], key=lambda c: c.get("index", 0))
    if not choices:
        raise InferenceError(f"completion has no choices: {str(payload)[:300]}")
    results = []
    for choice in choices:
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and [int(t) for t in echoed] != prompt_ids:
            raise InferenceError("the server's prompt_token_ids differ from the token ids sent")
        completion_ids = choice.get("token_ids")
        if completion_ids is None:
            raise InferenceError(_NO_TOKEN_IDS)
        logprobs = [float(lp) for lp in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(logprobs) != len(completion_ids):
            raise InferenceError(
                f"completion has {len(completion_ids)} completion token ids but {len(logprobs)} logprobs; "
                "they must match one to one"
            )
        if not all(math.isfinite(lp) for lp in logprobs):
            raise InferenceError("completion has a non-finite logprob")
        ids = [int(t) for t in completion_ids]
        results.append(Completion(prompt_ids, ids, logprobs, choice.get("text") or "", choice.get("finish_reason"), versions))
    return results
