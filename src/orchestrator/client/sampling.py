"""The three kinds of server the orchestrator asks for tokens, one client class each, every
one a ``ReplicaPool`` (routing, key trust, retries) plus its own calls:

- ``InferenceClient``: the policy's vLLM replicas (RL; a local model under eval or GEPA).
  Completions of token-id prompts with exact token ids and logprobs, tool calls parsed by
  vLLM's own parser, and the admin calls (``admin.VllmAdmin``: reload, resume, probe).
- ``TeacherClient``: a distillation teacher's vLLM server. Prompt logprobs (and the top k at
  every position) of token-id sequences, and its tokenizer, to check it is the student's.
- ``ChatClient``: a text-only OpenAI-compatible chat API (an endpoint's model under eval, or
  GEPA's reflection model): text in, text out, no tokens.

Training samples through ``/v1/completions`` with the prompt as token ids (the orchestrator
renders chats itself, ``prime_rl.chat``, so vLLM never re-tokenizes text and a multi-turn
prompt extends the exact tokens of the turns before it). vLLM-specific request fields:
``return_token_ids`` makes it return ``choices[i].prompt_token_ids`` and
``choices[i].token_ids``; ``logprobs: 0`` gives the sampled tokens'
``choices[i].logprobs.token_logprobs``. No per-request ``seed``: it can crash the CPU engine
(docs/machine_facts.md). Tool calls in those completions are parsed through
``/v1/chat/completions/derender`` (a vLLM server started with ``--enable-scale-out`` and
``--tool-call-parser``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from prime_rl.config import ClientConfig, WeightTransferConfig
from prime_rl.envs import ToolCall
from prime_rl.transfer import Announcement

from orchestrator.client.admin import FullWeights, LoraAdapter, MemoryWeights, Served, VllmAdmin
from orchestrator.client.parse import (
    FULL_DISTRIBUTION,
    Completion,
    InferenceError,
    cache_salt,
    chat_choice,
    parse_completion_choices,
    parse_prompt_logprobs,
    parse_prompt_top_k,
)
from orchestrator.client.pool import HEALTH_POLL_S, ReplicaPool
from orchestrator.client.trust import key_trust


class _PoolClient:
    """What every kind shares: its pool, made once with the key's policy (``trust``): a
    server this run started (``own_server``) proves it holds the key before it gets it; an
    endpoint's key goes with every request."""

    def __init__(self, config: ClientConfig, *, own_server: bool):
        self.config = config
        self.pool = ReplicaPool(config, key_trust(config.api_key, own_server))
        self.base_url = self.pool.base_url

    async def close(self) -> None:
        await self.pool.close()

    async def wait_healthy(self, timeout_s: float, poll_s: float = HEALTH_POLL_S) -> None:
        await self.pool.wait_healthy(timeout_s, poll_s)


class InferenceClient(_PoolClient):
    """The policy's vLLM replicas: token-id sampling, tool-call parsing, and the admin calls."""

    def __init__(
        self, config: ClientConfig, model_name: str, lora_adapter: str | None = None, *, own_server: bool = True,
        weight_transfer: WeightTransferConfig | None = None,
    ):
        super().__init__(config, own_server=own_server)
        self.served = Served(model_name)
        weights = FullWeights() if lora_adapter is None else LoraAdapter(lora_adapter)
        memory = MemoryWeights(weight_transfer, len(self.pool.replicas)) if weight_transfer is not None else None
        self.admin = VllmAdmin(self.pool, self.served, weights, memory)

    @property
    def version(self) -> int:
        """Policy version the replicas serve (``Served.version``)."""
        return self.served.version

    @version.setter
    def version(self, version: int) -> None:  # a warm server already serves a later policy
        self.served.version = version

    @property
    def retries(self) -> int:
        return self.pool.retries

    @property
    def answered(self) -> int:
        return self.pool.answered

    def requests_per_replica(self) -> list[int]:
        return self.pool.requests_per_replica()

    async def server_metrics(self, timeout_s: float = 5.0) -> list[str | None]:
        """``ReplicaPool.metrics_texts``: vLLM's own figures, for the episode limiter."""
        return await self.pool.metrics_texts(timeout_s)

    def frozen_by_reloads(self) -> int:
        """Sequences in flight when reloads froze them, over all replicas (``Replica.frozen``)."""
        return sum(replica.frozen for replica in self.pool.replicas)

    async def reload_weights(self, weights: Path | str | Announcement, version: int | None = None, *, keep: bool = False) -> None:
        """``VllmAdmin.reload_weights``."""
        await self.admin.reload_weights(weights, version, keep=keep)

    async def resume(self) -> None:
        """``VllmAdmin.resume``."""
        await self.admin.resume()

    async def probe_replicas(self) -> list[float]:
        """``VllmAdmin.probe_replicas``."""
        return await self.admin.probe_replicas()

    async def complete_n(
        self, prompt_ids: list[int], *, n: int, max_tokens: int, temperature: float
    ) -> list[Completion]:
        """``n`` samples continuing the token-id prompt ``prompt_ids`` (one request)."""
        body = {
            "model": self.served.model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            **FULL_DISTRIBUTION,
            "logprobs": 0,
            "return_token_ids": True,
            "n": n,
        }
        async with self.pool.generation(n) as replica:
            sent = self.served.version
            body["cache_salt"] = cache_salt(sent)
            response = await self.pool.post(replica, "/v1/completions", json=body)
        versions = (sent, self.served.version)
        payload = self.pool.json(replica, response, "/v1/completions")
        results = parse_completion_choices(payload, list(prompt_ids), versions)
        if len(results) != n:
            raise InferenceError(f"{replica.url}: asked for {n} choices, the server returned {len(results)}")
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
            "chat_request": {"model": self.served.model, "messages": [{"role": "user", "content": ""}], "tools": tools},
        }
        async with self.pool.any_replica() as replica:  # parsing runs no model
            response = await self.pool.post(replica, "/v1/chat/completions/derender", json=body)
        payload = self.pool.json(replica, response, "/v1/chat/completions/derender")
        choices = sorted((payload.get("choices") if isinstance(payload, dict) else None) or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(completions):
            raise InferenceError(
                f"{replica.url}: tool-call parsing: sent {len(completions)} completions, got {len(choices)} back"
            )
        parsed = []
        for choice, ids in zip(choices, completions):
            content, _, calls = chat_choice(choice)
            parsed.append((content, calls) if ids else ("", ()))
        return parsed


class TeacherClient(_PoolClient):
    """A distillation teacher's vLLM server: scores token-id sequences, tokenizes text."""

    def __init__(self, config: ClientConfig, model_name: str, *, own_server: bool = True):
        super().__init__(config, own_server=own_server)
        self.model_name = model_name

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
        async with self.pool.generation(len(prompts)) as replica:
            response = await self.pool.post(replica, "/v1/completions", json=body)
        payload = self.pool.json(replica, response, "/v1/completions")
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise InferenceError(f"{replica.url}: sent {len(prompts)} prompts, got {len(choices or [])} choices back")
        return choices, replica.url

    async def tokenize(self, text: str) -> tuple[list[int], int | None]:
        """(token ids of ``text`` without special tokens added, the server's max_model_len) by
        the server's own tokenizer (vLLM's ``/tokenize``)."""
        body = {"model": self.model_name, "prompt": text, "add_special_tokens": False}
        async with self.pool.any_replica() as replica:
            response = await self.pool.post(replica, "/tokenize", json=body)
        payload = self.pool.json(replica, response, "/tokenize")
        if not isinstance(payload, dict) or not isinstance(payload.get("tokens"), list):
            raise InferenceError(f"POST {replica.url}/tokenize answered no token ids: {str(payload)[:200]}")
        limit = payload.get("max_model_len")
        return [int(t) for t in payload["tokens"]], int(limit) if isinstance(limit, int) else None


class ChatClient(_PoolClient):
    """A text-only OpenAI-compatible chat API: an endpoint's model, or GEPA's reflection model."""

    def __init__(self, config: ClientConfig, model_name: str, *, own_server: bool = True):
        super().__init__(config, own_server=own_server)
        self.model_name = model_name

    async def chat_text_n(
        self,
        messages: list[dict[str, Any]],
        *,
        n: int,
        max_tokens: int | None,
        temperature: float | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[tuple[str, str | None, tuple[ToolCall, ...]]]:
        """``n`` replies: ``(content, finish_reason, tool_calls)`` of every choice, in order; no
        tokens, no vLLM fields. Settings left at None are the server's. The base URL may end in
        ``/v1`` (an endpoint's, as written in endpoints.toml) or not (a vLLM server's)."""
        body: dict[str, Any] = {"model": self.model_name, "messages": messages, "n": n}
        if tools:
            body["tools"] = tools
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if temperature is not None:
            body["temperature"] = temperature
        async with self.pool.generation(n) as replica:
            path = "/chat/completions" if replica.url.endswith("/v1") else "/v1/chat/completions"
            response = await self.pool.post(replica, path, json=body)
        payload = self.pool.json(replica, response, path)
        choices = sorted(payload.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise InferenceError(
                f"POST {replica.url}{path}: asked for {n} choices, got {len(choices)} (does the server support `n`?)"
            )
        return [chat_choice(c) for c in choices]
