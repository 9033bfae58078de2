"""Bearer-key check on every route of the vLLM server, admin routes included.

vLLM's own `--api-key` guards only paths under /v1, /v2, /inference and /cohere, which
leaves the dev-mode admin routes open (`/collective_rpc` loads any folder as weights,
`/pause` stops generation) as well as `/health` and `/metrics`. `inference.server` adds
this middleware (`--middleware inference.auth.RequireApiKey`) in place of `--api-key`
whenever `api_key` is set; vLLM constructs it with the app alone, so the key comes from the environment
(`PRIME_RL_INFERENCE_API_KEY`), never from the command line, where `ps` would show it.

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

API_KEY_ENV = "PRIME_RL_INFERENCE_API_KEY"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_UNAUTHORIZED = json.dumps({"error": "Unauthorized"}).encode()


class RequireApiKey:
    """Refuses (401, JSON) every HTTP or websocket request without `Authorization: Bearer
    <key>`, on every path. OPTIONS passes: CORS preflights never carry credentials.
    Lifespan events pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(API_KEY_ENV)
        if not key:
            raise RuntimeError(f"{API_KEY_ENV} is not set: the inference server would run without its API key")
        self.app = app
        self._digest = _digest(key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # Closing before accepting makes the server answer the handshake with 403.
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        })
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})

    def _authorized(self, scope: Scope) -> bool:
        """Compare digests, not strings: compare_digest then runs in time independent of the key."""
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(_digest(token.strip()), self._digest)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
