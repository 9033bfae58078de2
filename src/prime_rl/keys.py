"""Secrets of a run: how a server proves it holds the run's API key before the key is sent
to it, and how secrets are kept out of anything logged or saved beside results (W&B configs,
printed settings, an environment's load error, eval and GEPA metadata).

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

import contextlib
import hashlib
import hmac
import json
import os
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

# A name is read as words, however it is written: snake_case, kebab-case, dotted, camelCase,
# PascalCase, capitals, digits apart ("X-Api-Key", "apiKey", "clientSecret", "AUTHORIZATION",
# "aws2AccessKey" -> x api key, api key, client secret, authorization, aws 2 access key).
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

# A field holds a secret when one of its words says so. `tokens` is not one of them: in a
# language-model config it counts tokens (`max_tokens`, `num_tokens`); `token` is (`hf_token`,
# `accessToken`). `auth` as a word only: `author` is another word.
_SECRET_WORDS = frozenset({
    "key", "keys", "token", "secret", "secrets", "password", "passwords", "passwd", "pwd", "passphrase",
    "credential", "credentials", "creds", "auth", "authorization", "bearer", "cookie", "cookies", "jwt",
})
# The same, run together in one lowercase word ("apikey", "clientsecret", "xauthtoken").
_SECRET_PARTS = ("secret", "passw", "passphrase", "credential", "authorization", "bearer", "apikey", "accesskey",
                 "privatekey", "accesstoken", "authtoken", "refreshtoken", "sessiontoken")
# A name ending in one of these says where a secret is, or what kind, not the secret itself:
# `api_key_var` / `api_key_env` name an environment variable, `key_path` / `credentials_file`
# a file, `token_id` a vocabulary entry, `key_size` a length.
_ABOUT_A_SECRET = frozenset({"var", "env", "path", "file", "dir", "id", "ids", "type", "name", "field", "column",
                             "count", "size", "len", "length", "limit"})
# ... and a name starting with one of these counts something (`max_token_budget`, `num_keys`).
_COUNTS = frozenset({"max", "min", "num"})

# Secrets recognised by their value, whatever the field is called: a bearer credential
# ("Bearer <token>", as an Authorization header carries it), the user part of a URL
# ("https://user:pass@host", "https://<token>@host"), and the shapes of well-known API keys
# (OpenAI/Anthropic `sk-`, Hugging Face `hf_`, GitHub `ghp_` / `github_pat_`, Slack `xox?-`,
# AWS access key ids). A bearer word must look like a token (a digit or symbol, or 20+
# characters), so "bearer of bad news" in a prompt stays.
_BEARER = re.compile(r"(?i)\b(bearer)(\s+)([A-Za-z0-9._~+/=-]+)")
_URL_USER = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s@]+)@")
_KNOWN_KEYS = re.compile(r"\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
                         r"|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})")


def name_words(name: Any) -> list[str]:
    """The lowercase words of a field or header name (`X-Api-Key` -> ['x', 'api', 'key'])."""
    return [w.lower() for w in _WORDS.findall(str(name))]


def is_secret_name(name: Any) -> bool:
    """Whether a field called ``name`` holds a secret (its words, see above). `curve_*`: ZMQ
    CURVE keys of the transport, all of them (public ones included: redacting those costs nothing)."""
    words = name_words(name)
    if not words or words[-1] in _ABOUT_A_SECRET or words[0] in _COUNTS:
        return False
    joined = "".join(words)
    return words[0] == "curve" or any(w in _SECRET_WORDS for w in words) or any(p in joined for p in _SECRET_PARTS)


def _hides(value: Any) -> bool:
    """A secret-named field's value is hidden unless it is unset or a flag (one bit is no secret)."""
    return value not in (None, "") and not isinstance(value, bool)


def redact_text(text: str) -> str:
    """``text`` with what looks like a secret by its value (bearer tokens, a URL's user part,
    well-known API keys) replaced by REDACTED."""
    def bearer(m: re.Match) -> str:
        word = m.group(3)
        looks_like_token = len(word) >= 20 or (len(word) >= 6 and re.search(r"[0-9._~+/=-]", word))
        return f"{m.group(1)}{m.group(2)}{REDACTED}" if looks_like_token else m.group(0)

    text = _BEARER.sub(bearer, text)
    text = _URL_USER.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    return _KNOWN_KEYS.sub(REDACTED, text)


def redact(value: Any) -> Any:
    """A copy of ``value`` (dicts and lists, nested) with every secret-named field's value,
    when set, replaced by REDACTED, and every string passed through ``redact_text``.
    Whatever is logged, sent to W&B or saved next to results goes through this."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_name(k) and _hides(v) else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def holds_secret(value: Any) -> bool:
    """Whether ``redact`` would hide anything in ``value``."""
    if isinstance(value, dict):
        return any((is_secret_name(k) and _hides(v)) or holds_secret(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(holds_secret(v) for v in value)
    return isinstance(value, str) and redact_text(value) != value


def secret_values(value: Any, secret: bool = False) -> list[str]:
    """The texts ``redact`` hides in ``value`` (as ``str`` gives them): what must not appear
    in a message that may quote them."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in secret_values(v, secret or (is_secret_name(k) and _hides(v)))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in secret_values(v, secret)]
    if secret and _hides(value):
        return [str(value)]
    return []


def scrub(text: str, *sources: Any) -> str:
    """``text`` (an error message, a log line) with every secret of ``sources`` (e.g. an
    environment's args) replaced by REDACTED, as written raw, by ``repr`` or by JSON, and
    whatever ``redact_text`` recognises. Secrets under 4 characters are left: replacing them
    would garble the message, and no key is that short."""
    return scrub_found(text, scrubbed_secrets(*sources))


def scrubbed_secrets(*sources: Any) -> tuple[str, ...]:
    """The secrets ``scrub`` replaces for ``sources``, longest first: to find once and hand to
    ``scrub_found`` for many texts (every trace row of a run)."""
    return tuple(sorted({s for source in sources for s in secret_values(source) if len(s) >= 4}, key=len, reverse=True))


def scrub_found(text: str, secrets: tuple[str, ...]) -> str:
    """``scrub`` with its secrets already found (``scrubbed_secrets``)."""
    for secret in secrets:
        for shown in {secret, repr(secret)[1:-1], json.dumps(secret)[1:-1]}:
            text = text.replace(shown, REDACTED)
    return redact_text(text)


def private_opener(path: str, flags: int) -> int:
    """``open(path, mode, opener=private_opener)``: a file only its owner can read, a log or
    results that may quote a secret. A file left by an earlier run is made private too."""
    fd = os.open(path, flags, 0o600)
    with contextlib.suppress(OSError):  # not ours: its owner decides (we could open it anyway)
        os.fchmod(fd, 0o600)
    return fd
