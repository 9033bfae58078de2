"""Bearer-key check on every route of the vLLM server, admin routes included.

vLLM's own `--api-key` guards only paths under /v1, /v2, /inference and /cohere, which
leaves the dev-mode admin routes open (`/collective_rpc` loads any folder as weights,
`/pause` stops generation) as well as `/health` and `/metrics`. The server's command line
(``prime_rl.vllm_command``) adds this middleware (`--middleware inference.auth.RequireApiKey`)
in place of `--api-key` whenever `api_key` is set; vLLM constructs it with the app alone, so
the key comes from the environment (`PRIME_RL_INFERENCE_API_KEY`, ``prime_rl.keys.API_KEY_ENV``),
never from the command line, where `ps` would show it.

One route answers without the key: `GET /prime-rl/identity?nonce=<hex>`, the proof that
this server holds the key (HMAC of the nonce, `prime_rl.keys`). The orchestrator asks it
before it sends the key anywhere, so a program that holds the port instead of this server
never receives the key. The proof reveals nothing about the key; see `prime_rl.keys` for
what it does not protect against (a relay to the real server).

Pure ASGI (no starlette base class): it must see websocket scopes too, and it knows
nothing about vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from prime_rl.keys import API_KEY_ENV, IDENTITY_PATH, identity_proof, nonce_bytes

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_UNAUTHORIZED = json.dumps({"error": "Unauthorized"}).encode()


class RequireApiKey:
    """Refuses (401, JSON) every HTTP or websocket request without `Authorization: Bearer
    <key>`, on every path but the identity route, which it answers itself. OPTIONS passes:
    CORS preflights never carry credentials. Lifespan events pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(API_KEY_ENV)
        if not key:
            raise RuntimeError(f"{API_KEY_ENV} is not set: the inference server would run without its API key")
        self.app = app
        self._key = key
        self._digest = _digest(key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == IDENTITY_PATH:
            await self._prove_identity(scope, send)
            return
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # Closing before accepting makes the server answer the handshake with 403.
            await send({"type": "websocket.close", "code": 1008})
            return
        await _answer(send, 401, _UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])

    async def _prove_identity(self, scope: Scope, send: Send) -> None:
        """`GET ?nonce=<hex>` -> {"proof": ...}; a missing or malformed nonce -> 400."""
        nonces = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("nonce", [])
        nonce = nonce_bytes(nonces[0]) if len(nonces) == 1 and scope.get("method") == "GET" else None
        if nonce is None:
            body = json.dumps({"error": "expected GET with one nonce: 32 to 128 hex digits"}).encode()
            await _answer(send, 400, body)
            return
        await _answer(send, 200, json.dumps({"proof": identity_proof(self._key, nonce)}).encode())

    def _authorized(self, scope: Scope) -> bool:
        """Compare digests, not strings: compare_digest then runs in time independent of the key."""
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(_digest(token.strip()), self._digest)


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
