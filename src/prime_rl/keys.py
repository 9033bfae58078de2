"""Secrets of a run: how a server proves it holds the run's API key before the key is sent
to it, and how secrets are kept out of anything logged (W&B configs, printed settings).

Identity proof (shared by `inference.auth`, which answers it, and `orchestrator.client`,
which asks): the client sends ``GET /prime-rl/identity?nonce=<64 hex digits>`` without the
key; the server answers ``{"proof": hex(HMAC-SHA256(key, b"prime-rl identity v1|" + nonce
bytes))}``. Only a server that knows the key can answer, so a program that happens to hold
the port (another user's server, a stale process) never sees the key, not even in a /health
poll. The fixed prefix keeps the proof from meaning anything else; the random nonce keeps an
old answer from being replayed.

Limitation: a program that holds the port *and* can reach the real server may relay the
challenge to it and forward the proof back (a man in the middle). The proof shows that the
key holder answered, not that it answered on this socket; it stops a stranger on the port,
not an attacker who also reaches the real server (that needs TLS, out of scope here).

This module imports neither vLLM nor httpx: it is part of the contracts every process shares.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Any

IDENTITY_PATH = "/prime-rl/identity"
NONCE_BYTES = 32
MAX_NONCE_BYTES = 64
"""The server refuses longer nonces (and shorter than 16 bytes): its work stays bounded."""

_DOMAIN = b"prime-rl identity v1|"
REDACTED = "<redacted>"

API_KEY_ENV = "PRIME_RL_INFERENCE_API_KEY"
"""Where the inference server's middleware (`inference.auth`) reads the run's API key: the
environment ``prime_rl.vllm_command`` gives vLLM, never its command line, where `ps` shows it."""


# --------------------------------------------------------------------------- identity proof


def new_nonce() -> str:
    """A fresh challenge: NONCE_BYTES random bytes, hex."""
    return secrets.token_hex(NONCE_BYTES)


def nonce_bytes(nonce: str) -> bytes | None:
    """The nonce's bytes, or None when it is not hex of 16 to MAX_NONCE_BYTES bytes."""
    if not 32 <= len(nonce) <= 2 * MAX_NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(nonce)
    except ValueError:
        return None


def identity_proof(key: str, nonce: bytes) -> str:
    """What a server holding ``key`` answers to the challenge ``nonce``."""
    return hmac.new(key.encode(), _DOMAIN + nonce, hashlib.sha256).hexdigest()


def proves_identity(key: str, nonce: str, answer: Any) -> bool:
    """Whether ``answer`` (the identity route's parsed JSON) proves knowledge of ``key``."""
    proof = answer.get("proof") if isinstance(answer, dict) else None
    raw = nonce_bytes(nonce)
    if not isinstance(proof, str) or raw is None:
        return False
    return hmac.compare_digest(proof.encode(), identity_proof(key, raw).encode())


# --------------------------------------------------------------------------- redaction

# A field holds a secret when one of the words of its name says so (`api_key`, `hf_token`,
# `curve_secret_key`, `password`); `max_tokens` or `tokenizer` do not. `*_var` fields name an
# environment variable that holds a key, not the key itself. `curve_*`: ZMQ CURVE keys of the
# transport, all of them (public ones included: redacting those costs nothing).
_SECRET_WORDS = frozenset({"key", "keys", "token", "secret", "secrets", "password", "passwd", "credentials"})


def is_secret_name(name: str) -> bool:
    words = [w for w in re.split(r"[_\-.\s]+", str(name).lower()) if w]
    if not words or words[-1] == "var":
        return False
    return words[0] == "curve" or any(w in _SECRET_WORDS for w in words) or "secret" in name.lower()


def redact(value: Any) -> Any:
    """A copy of ``value`` (dicts and lists, nested) with every secret-named field's value,
    when set, replaced by REDACTED. Whatever is logged or sent to W&B goes through this."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_name(k) and v not in (None, "") else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


def holds_secret(value: Any) -> bool:
    """Whether ``redact`` would hide anything in ``value``."""
    if isinstance(value, dict):
        return any((is_secret_name(k) and v not in (None, "")) or holds_secret(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(holds_secret(v) for v in value)
    return False
