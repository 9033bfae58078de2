"""A fake vLLM server for tests: the response shapes of vLLM's OpenAI-compatible server,
without a model. Lets the orchestrator (or anyone) run without vLLM.

- ``POST /v1/chat/completions``: byte-level "tokenizer" (ids 0-255 are bytes, 257/258
  are <|im_start|>/<|im_end|>, as for the tiny test model), a ChatML prompt, and a completion chosen by
  ``responder(messages, request_index)`` followed by the <|im_end|> stop token, as vLLM
  returns it. Honors ``max_tokens`` (finish_reason `length`). Returns
  ``prompt_token_ids``, ``choices[i].token_ids`` and ``choices[i].logprobs.content`` for ``n`` choices.
- ``POST /v1/completions`` with a token-id ``prompt`` (what the orchestrator sends): the
  ChatML prompt is decoded back into messages for ``responder``; the choices carry
  ``prompt_token_ids``, ``token_ids``, ``text`` and ``logprobs.token_logprobs``. With
  ``prompt_logprobs`` (any prompt), ``choices[0].prompt_logprobs`` gives every prompt token
  after the first the logprob ``prompt_logprob`` (set it per server to fake a replica on
  other weights).
- ``POST /v1/chat/completions/derender``: tool calls read from completions' text as
  hermes does (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`).
- ``GET /health``, ``POST /pause``, ``/collective_rpc``, ``/reset_prefix_cache``,
  ``/resume``: answered like vLLM's dev-mode server and recorded in ``calls`` in order.
- with ``api_key``: every request without ``Authorization: Bearer <key>`` answers 401, as
  behind ``inference.auth``, except ``GET /prime-rl/identity?nonce=...``, which answers the
  proof that the server holds the key (``prime_rl.keys``); ``wrong_proof=True`` makes that
  proof wrong (a server that only pretends to be the run's).
- fault injection: ``fail`` ({path: status}) makes that path answer the status, ``delay``
  ({path: seconds}) makes it answer late; with ``faults_first=k`` only the first k
  requests to such a path are affected (a transient fault), else all of them.

Standalone (from tests/): ``python fake_inference.py --port 8000``.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prime_rl.keys import IDENTITY_PATH, identity_proof, nonce_bytes

IM_START, IM_END = 257, 258  # as in scripts/build_tiny_model.py (256 is <|endoftext|>)
LOGPROB = -0.25  # every sampled token gets this logprob


def encode_chat(messages: list[dict[str, Any]]) -> list[int]:
    ids: list[int] = []
    for message in messages:
        ids += [IM_START, *f"{message['role']}\n{message['content']}".encode(), IM_END, *b"\n"]
    return ids + [IM_START, *b"assistant\n"]


def decode_chat(ids: list[int]) -> list[dict[str, Any]]:
    """The messages of a ChatML token-id prompt (the inverse of ``encode_chat``; the open
    generation prompt at the end is dropped)."""
    messages, current = [], None
    for t in ids:
        if t == IM_START:
            current = []
        elif t == IM_END and current is not None:
            role, _, content = bytes(current).decode(errors="replace").partition("\n")
            messages.append({"role": role, "content": content})
            current = None
        elif current is not None and t < 256:
            current.append(t)
    return messages


def reverse_half_the_time(messages: list[dict[str, Any]], index: int) -> str:
    """Even requests answer the reversed user text (reward 1), odd ones echo it."""
    text = str(messages[-1]["content"])
    return text[::-1] if index % 2 == 0 else text


class FakeInferenceServer:
    def __init__(
        self,
        port: int = 0,
        responder: Callable[[list[dict[str, Any]], int], str] = reverse_half_the_time,
        fail: dict[str, int] | None = None,
        delay: dict[str, float] | None = None,
        faults_first: int | None = None,
        prompt_logprob: float = LOGPROB,
        api_key: str | None = None,
        wrong_proof: bool = False,
    ):
        self.responder = responder
        self.api_key = api_key
        self.wrong_proof = wrong_proof
        self.prompt_logprob = prompt_logprob
        """Logprob of each prompt token asked for with ``prompt_logprobs``: the fake's "weights"."""

        self.fail = dict(fail or {})
        self.delay = dict(delay or {})
        self.faults_first = faults_first
        self._route_counts: dict[str, int] = {}
        self.calls: list[tuple[str, str, Any]] = []
        """(method, path with query, JSON body or None) of every request, in arrival order."""

        self.auth_headers: list[str | None] = []
        """Authorization header of every request, in arrival order."""

        self.loaded_weights: str | None = None
        self.paused = False
        self._lock = threading.Lock()
        self._requests = 0
        self._httpd = _QuietHTTPServer(("127.0.0.1", port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def admin_calls(self) -> list[str]:
        return [path for method, path, _ in self.calls if not path.startswith("/v1/")]

    def start(self) -> FakeInferenceServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.02,), name="fake-inference", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop as a server process that exits does: its kept-alive connections close too (a
        client's next request then connects anew, and is refused)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.close_connections()

    def __enter__(self) -> FakeInferenceServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------- responses

    def guard(self, method: str, path: str, authorization: str | None) -> tuple[int, Any] | None:
        """With ``api_key``, the answer of inference.auth's middleware when it answers itself
        (the identity route, a missing or wrong key); None lets ``handle`` answer."""
        if self.api_key is None:
            return None
        if urlsplit(path).path == IDENTITY_PATH:
            return self.identity(method, path)
        return None if authorization == f"Bearer {self.api_key}" else (401, {"error": "Unauthorized"})

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        route = urlsplit(path).path
        with self._lock:
            self.calls.append((method, path, body))
            index = self._requests
            if route in ("/v1/chat/completions", "/v1/completions") and not _scores_prompt(body):
                self._requests += 1
            seen = self._route_counts[route] = self._route_counts.get(route, 0) + 1
        faulty = self.faults_first is None or seen <= self.faults_first
        if faulty and route in self.delay:
            time.sleep(self.delay[route])
        if faulty and route in self.fail:
            return self.fail[route], {"error": f"injected failure of {route}"}
        if method == "GET" and route == "/health":
            return 200, None
        if method == "POST" and route == "/v1/chat/completions":
            return 200, self.chat_completion(body, index)
        if method == "POST" and route == "/v1/completions" and _scores_prompt(body):
            return 200, self.prompt_scores(body)
        if method == "POST" and route == "/v1/completions":
            return 200, self.completion(body, index)
        if method == "POST" and route == "/v1/chat/completions/derender":
            return 200, self.derender(body)
        if method == "POST" and route == "/pause":
            self.paused = True
            return 200, {"status": "paused"}
        if method == "POST" and route == "/resume":
            self.paused = False
            return 200, {"status": "resumed"}
        if method == "POST" and route == "/collective_rpc":
            self.loaded_weights = body["kwargs"]["weights_path"]
            return 200, {"results": [None]}
        if method == "POST" and route == "/reset_prefix_cache":
            return 200, {"success": True}
        return 404, {"detail": "Not Found"}

    def identity(self, method: str, path: str) -> tuple[int, Any]:
        """The identity route as inference.auth answers it (not recorded in ``calls``)."""
        nonces = parse_qs(urlsplit(path).query).get("nonce", [])
        nonce = nonce_bytes(nonces[0]) if method == "GET" and len(nonces) == 1 else None
        if nonce is None:
            return 400, {"error": "expected GET with one nonce"}
        key = self.api_key + "-not" if self.wrong_proof else self.api_key
        return 200, {"proof": identity_proof(key, nonce)}

    def chat_completion(self, body: dict[str, Any], index: int) -> dict[str, Any]:
        n = int(body.get("n") or 1)
        choices = [self._choice(body, index * n + i, i) for i in range(n)]
        prompt_ids = encode_chat(body["messages"])
        completion_tokens = sum(len(c["token_ids"] or []) for c in choices)
        return {
            "id": f"chatcmpl-{index}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "prompt_token_ids": prompt_ids if body.get("return_token_ids") else None,
        }

    def completion(self, body: dict[str, Any], index: int) -> dict[str, Any]:
        n = int(body.get("n") or 1)
        prompt_ids = [int(t) for t in body["prompt"]]
        messages = decode_chat(prompt_ids)
        choices = []
        for i in range(n):
            ids, finish = self._sample(messages, index * n + i, body)
            choices.append({
                "index": i,
                "text": bytes(t for t in ids if t < 256).decode(errors="replace"),
                "logprobs": {"token_logprobs": [LOGPROB] * len(ids), "tokens": [], "top_logprobs": [], "text_offset": []},
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": ids if body.get("return_token_ids") else None,
                "prompt_token_ids": prompt_ids if body.get("return_token_ids") else None,
            })
        return {"id": f"cmpl-{index}", "object": "text_completion", "created": 0, "model": body.get("model"), "choices": choices}

    def derender(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's derender route with a hermes-style parser: every `<tool_call>{"name": ...,
        "arguments": {...}}</tool_call>` in a completion's text (its bytes) becomes a tool call,
        the rest is the content."""
        choices = []
        for choice in body["generate_response"]["choices"]:
            text = bytes(t for t in choice["token_ids"] if t < 256).decode(errors="replace")
            calls = []
            for i, match in enumerate(re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.S)):
                try:
                    call = json.loads(match.group(1))
                    calls.append({"id": f"call_{i}", "type": "function",
                                  "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
                except (ValueError, KeyError, TypeError):
                    continue
            content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip() if calls else text
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            choices.append({"index": choice["index"], "message": message, "finish_reason": "tool_calls" if calls else "stop"})
        return {"id": "derender", "object": "chat.completion", "choices": choices}

    def prompt_scores(self, body: dict[str, Any]) -> dict[str, Any]:
        """A completion asked for ``prompt_logprobs`` (the client's weights probe): vLLM's shape,
        None for the first prompt token, then {"<id>": {"logprob", "rank", "decoded_token"}}.
        The prompt need not be a chat, and the one sampled token is not modelled."""
        prompt_ids = [int(t) for t in body["prompt"]]
        scores = [{str(t): {"logprob": self.prompt_logprob, "rank": 1, "decoded_token": ""}} for t in prompt_ids[1:]]
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "prompt_logprobs": [None, *scores]}
        return {"id": "cmpl-probe", "object": "text_completion", "created": 0, "model": body.get("model"), "choices": [choice]}

    def _sample(self, messages: list[dict[str, Any]], sample_index: int, body: dict[str, Any]) -> tuple[list[int], str]:
        """The responder's text as byte ids + <|im_end|>, cut at max_tokens."""
        text = self.responder(messages, sample_index)
        ids = [*text.encode(), IM_END]
        max_tokens = int(body.get("max_tokens") or len(ids))
        finish = "length" if len(ids) > max_tokens else "stop"
        return ids[:max_tokens], finish

    def _choice(self, body: dict[str, Any], sample_index: int, choice_index: int) -> dict[str, Any]:
        ids, finish = self._sample(body["messages"], sample_index, body)
        content = [
            {"token": f"token_id:{t}", "logprob": LOGPROB, "bytes": [t] if t < 256 else [], "top_logprobs": []}
            for t in ids
        ]
        return {
            "index": choice_index,
            "message": {"role": "assistant", "content": bytes(t for t in ids if t < 256).decode(errors="replace")},
            "logprobs": {"content": content} if body.get("logprobs") else None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": ids if body.get("return_token_ids") else None,
        }


def _scores_prompt(body: Any) -> bool:
    """A request for prompt logprobs, not a sample: it leaves the responder's request index alone."""
    return isinstance(body, dict) and body.get("prompt_logprobs") is not None


class _QuietHTTPServer(ThreadingHTTPServer):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End every connection still open (a handler waiting on a kept-alive one sees EOF)."""
        with self._open_lock:
            connections = list(self._open)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by its handler
                pass

    def handle_error(self, request, client_address) -> None:
        # A client that hung up before its answer (a test that interrupts a run) is not the
        # fake's error: no traceback for that.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler_for(server: FakeInferenceServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn
        disable_nagle_algorithm = True  # else headers and body wait on delayed ACKs (40 ms per request)

        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            authorization = self.headers.get("Authorization")
            server.auth_headers.append(authorization)
            status, payload = server.guard(method, self.path, authorization) or server.handle(method, self.path, body)
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, *args: object) -> None:  # quiet
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    port = parser.parse_args().port
    server = FakeInferenceServer(port=port)
    print(f"fake inference server on {server.url}", flush=True)
    server._httpd.serve_forever()


if __name__ == "__main__":
    main()
