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

The client knows nothing about environments, steps or the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prime_rl.config import ClientConfig
from prime_rl.envs import ToolCall

# /reset_prefix_cache answers 200 with {"success": false} while KV blocks are still held;
# vLLM's docs say to retry. After /pause?mode=wait nothing runs, so a few tries suffice.
_RESET_RETRIES = 20
_RESET_RETRY_S = 0.05
# Server-side errors worth another try: overloaded, restarting, or behind a failing proxy.
TRANSIENT_STATUS = frozenset({500, 502, 503, 504})

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


class InferenceClient:
    def __init__(self, config: ClientConfig, model_name: str, lora_adapter: str | None = None):
        self.config = config
        self.model_name = model_name
        """The model requests name: the served model, or once one is loaded, the LoRA adapter."""
        self.lora_adapter = lora_adapter
        self.base_url = config.base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
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
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._generating = 0
        """Generation requests in flight (a reload drains them first; none: it need not pause)."""
        self.retries = 0
        """Requests retried after a transient transport error (reported in the metrics)."""

    async def close(self) -> None:
        await self._http.aclose()

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
        path = "/chat/completions" if self.base_url.endswith("/v1") else "/v1/chat/completions"
        async with self._generation():
            response = await self._post(path, json=body)
        try:
            payload = response.json()
        except ValueError:
            raise InferenceError(f"POST {self.base_url}{path} answered non-JSON: {response.text[:200]!r}") from None
        choices = sorted(payload.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise InferenceError(
                f"POST {self.base_url}{path}: asked for {n} choices, got {len(choices)} (does the server support `n`?)"
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
        async with self._generation():
            response = await self._post("/v1/completions", json=body)
        results = parse_completion_choices(response.json(), list(prompt_ids))
        if len(results) != n:
            raise InferenceError(f"asked for {n} choices, the server returned {len(results)}")
        return results

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
        async with self._slots:
            response = await self._post("/v1/chat/completions/derender", json=body)
        choices = sorted(response.json().get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(completions):
            raise InferenceError(f"tool-call parsing: sent {len(completions)} completions, got {len(choices)} back")
        parsed = []
        for choice, ids in zip(choices, completions):
            content, _, calls = _chat_choice(choice)
            parsed.append((content, calls) if ids else ("", ()))
        return parsed

    # ----------------------------------------------------------------------- admin

    async def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll GET /health until it answers 200 (the server may still be starting)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                response = await self._http.get("/health", timeout=min(poll_s * 10, self.config.timeout_s))
                if response.status_code == 200:
                    return
                last = f"status {response.status_code}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"inference server at {self.base_url}/health not healthy after {timeout_s:.0f} s (last: {last})"
                )
            await asyncio.sleep(poll_s)

    async def reload_weights(self, weights_path: Path | str) -> None:
        """Load an HF safetensors folder into the running server, in place; with
        ``lora_adapter``, a PEFT adapter folder, loaded in place under that name, which
        requests name from then on.

        The order matters: reload, then reset the prefix cache (else KV computed with the
        old weights is served silently). With generation requests of this client in flight
        it first pauses the engine (they finish on the old weights) and resumes it after;
        with none, as between the orchestrator's steps, it skips both: vLLM's pause alone
        costs ~25 ms (a fixed 20 ms sleep), a third of a reload (docs/machine_facts.md).
        """
        path = str(Path(weights_path).resolve())
        drain = self._generating > 0
        if drain:
            await self._post("/pause", params={"mode": "wait"})
        try:
            if self.lora_adapter is None:
                # Not re-sent after a timeout or a broken connection: the first may still be running
                # in the engine, and a second would load behind its back (sent again only when it
                # never reached the server, or the server answered 5xx: then nothing is running).
                await self._post(
                    "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}}, resend_unanswered=False
                )
            else:
                # Idempotent: a second in-place load of the same folder (after a lost answer) is harmless.
                await self._post(
                    "/v1/load_lora_adapter", json={"lora_name": self.lora_adapter, "lora_path": path, "load_inplace": True}
                )
                self.model_name = self.lora_adapter
            await self._reset_prefix_cache()
        except Exception:
            # Leave the server serving rather than paused forever; the error still propagates.
            if drain:
                await self._post("/resume", check=False)
            raise
        if drain:
            await self._post("/resume")

    @contextlib.asynccontextmanager
    async def _generation(self):
        """A slot for one generation request, counted while it is in flight."""
        async with self._slots:
            self._generating += 1
            try:
                yield
            finally:
                self._generating -= 1

    async def _reset_prefix_cache(self) -> None:
        for _ in range(_RESET_RETRIES):
            response = await self._post("/reset_prefix_cache")
            if _reset_succeeded(response):
                return
            await asyncio.sleep(_RESET_RETRY_S)
        raise InferenceError(
            f"POST {self.base_url}/reset_prefix_cache kept answering success=false ({_RESET_RETRIES} tries): "
            "the server would serve KV computed with the old weights"
        )

    # ----------------------------------------------------------------------- plumbing

    async def _post(
        self, path: str, *, check: bool = True, resend_unanswered: bool = True, **kwargs: Any
    ) -> httpx.Response | None:
        """POST with retries (``_post_with_retries``). ``resend_unanswered=False`` for calls
        that must not run twice: a request the server may have received but not answered
        (timeout, dropped connection) is then not sent again."""
        url = f"{self.base_url}{path}"
        tries = f"{self.config.max_retries + 1} tries" if resend_unanswered else "not sent again: it may still be running"
        try:
            response = await self._post_with_retries(path, resend_unanswered, **kwargs)
        except httpx.TimeoutException:
            if not check:
                return None
            raise InferenceError(f"POST {url}: no answer within {self.config.timeout_s:g} s ({tries})") from None
        except httpx.TransportError as e:
            if not check:
                return None
            raise InferenceError(f"POST {url} failed: {type(e).__name__}: {e} ({tries})") from None
        if check and response.status_code != 200:
            raise InferenceError(f"POST {url} answered status {response.status_code}: {response.text[:500]}")
        return response

    async def _post_with_retries(self, path: str, resend_unanswered: bool = True, **kwargs: Any) -> httpx.Response:
        """Retry transient failures with exponential backoff: a dropped or refused connection
        (vLLM restarting), a timeout, an HTTP 5xx. The last failure is returned or raised.
        Without ``resend_unanswered`` only a refused connection (never received) and a 5xx
        (answered) are retried."""
        for attempt in range(self.config.max_retries + 1):
            last = attempt == self.config.max_retries
            try:
                response = await self._http.post(path, **kwargs)
                if response.status_code not in TRANSIENT_STATUS or last:
                    return response
            except httpx.TransportError as e:  # connect/read/write errors and timeouts
                if last or not (resend_unanswered or isinstance(e, httpx.ConnectError)):
                    raise
            self.retries += 1
            await asyncio.sleep(self.config.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable")


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
            arguments = json.dumps(arguments if arguments is not None else {})
        calls.append(ToolCall(str(call.get("id") or f"call_{i}"), str(function.get("name") or ""), arguments))
    return message.get("content") or "", choice.get("finish_reason"), tuple(calls)


def parse_completion_choices(payload: dict[str, Any], prompt_ids: list[int]) -> list[Completion]:
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
        results.append(Completion(prompt_ids, ids, logprobs, choice.get("text") or "", choice.get("finish_reason")))
    return results
