"""The client's trust in its own inference server ends with the first failed exchange.

A raw-socket server first plays the run's server (it proves the key, answers /health), then
fails one request in some way (a dropped connection, garbage, a cut body, an undecodable
body, a 5xx, a 401, no answer in time) and from then on plays another program that took the
port: it answers everything with 200 "ok" and records what it was sent. The client must ask
that program for the identity proof again, fail on its answer, and never send it the key."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from urllib.parse import parse_qs, urlsplit

import pytest
from prime_rl.config import ClientConfig
from prime_rl.keys import identity_proof, nonce_bytes

from orchestrator.client import InferenceClient, InferenceError

KEY = "sk-trust-test"
PROMPT = [1, 2, 3]


def http_answer(status: int, body: bytes, *headers: str) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


COMPLETION = (b'{"choices": [{"index": 0, "token_ids": [5], "prompt_token_ids": [1, 2, 3], "text": "x", '
              b'"finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5]}}]}')

# How the run's server fails the request on which it "crashes" (the port then changes hands).
FAULTS = {
    "dropped": b"",  # the connection closes without an answer
    "garbage": b"\x00\x16\x03 not http at all\r\n\r\n",
    "cut-body": b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\nConnection: close\r\n\r\n{\"choices\": [",
    "bad-gzip": http_answer(200, b"definitely not gzip", "Content-Encoding: gzip"),
    "502": http_answer(502, b"bad gateway"),
    "401": http_answer(401, b'{"error": "Unauthorized"}'),
    "timeout": None,  # no answer within the client's timeout
}


class PortThatChangesHands:
    """One listening socket; ``impostor`` flips when the run's server fails ``fault_path``."""

    def __init__(self, fault: str, fault_path: str):
        self.fault, self.fault_path, self.impostor = fault, fault_path, False
        self.seen: list[tuple[str, str, dict[str, str]]] = []  # (who, request line, headers)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = dict(h.split(": ", 1) for h in header_lines)
            length = int(headers.get("Content-Length", headers.get("content-length", 0)))
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(self._answer(line, headers))

    def _answer(self, line: str, headers: dict[str, str]) -> bytes:
        method, target, _ = line.split(" ")
        url = urlsplit(target)
        if self.impostor:
            self.seen.append(("impostor", line, headers))
            return http_answer(200, b"ok")
        self.seen.append(("server", line, headers))
        if url.path == "/prime-rl/identity":
            proof = identity_proof(KEY, nonce_bytes(parse_qs(url.query)["nonce"][0]))
            return http_answer(200, f'{{"proof": "{proof}"}}'.encode())
        if url.path == self.fault_path:
            self.impostor = True  # whatever comes next on this port is another program
            if FAULTS[self.fault] is None:
                time.sleep(1.0)
                return b""
            return FAULTS[self.fault]
        return http_answer(200, COMPLETION if url.path == "/v1/completions" else b"{}")


def run_client(port: PortThatChangesHands, fn) -> None:
    async def go():
        config = ClientConfig(base_url=port.url, api_key=KEY, timeout_s=0.4, max_retries=2, retry_backoff_s=0.01)
        client = InferenceClient(config, "tiny")
        try:
            await client.wait_healthy(timeout_s=5, poll_s=0.02)
            await fn(client)
        finally:
            await client.close()

    asyncio.run(go())


def sample(client: InferenceClient):
    return client.complete_n(PROMPT, n=1, max_tokens=4, temperature=1.0)


async def sample_again_after_a_failure(client: InferenceClient) -> None:
    """A request, then the run's next one (a 401 is not retried: the next request meets the port's new owner)."""
    with contextlib.suppress(InferenceError):
        await sample(client)
    await sample(client)


def assert_the_impostor_never_saw_the_key(port: PortThatChangesHands) -> None:
    served = [(line, headers) for who, line, headers in port.seen if who == "server"]
    assert any("Authorization" in headers for _, headers in served), "the run's server got the key once it proved itself"
    impostor = [(line, headers) for who, line, headers in port.seen if who == "impostor"]
    assert impostor, "the retry reached the port's new owner"
    assert all(line.startswith("GET /prime-rl/identity?nonce=") for line, _ in impostor), impostor
    assert not any(k.lower() == "authorization" for _, headers in impostor for k in headers), impostor


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_request_drops_trust_and_the_next_owner_of_the_port_never_gets_the_key(fault):
    port = PortThatChangesHands(fault, "/v1/completions")
    try:
        with pytest.raises(InferenceError) as e:
            run_client(port, sample_again_after_a_failure)
    finally:
        port.close()
    assert "something else answers on" in str(e.value) and KEY not in str(e.value), e.value
    assert_the_impostor_never_saw_the_key(port)


@pytest.mark.parametrize("fault", ["dropped", "502", "timeout"])
def test_a_failed_health_poll_drops_trust_too(fault):
    """The health wait polls again after a failure: the new owner of the port is asked the proof."""
    port = PortThatChangesHands(fault, "/health")
    try:
        with pytest.raises(InferenceError, match="something else answers on"):
            run_client(port, lambda client: asyncio.sleep(0))
    finally:
        port.close()
    assert_the_impostor_never_saw_the_key(port)


def test_a_healthy_server_is_proved_once():
    """No failure, no new proof: one identity challenge for the wait and every request after it."""
    port = PortThatChangesHands("dropped", "/never")

    async def three(client):
        for _ in range(3):
            await sample(client)

    try:
        run_client(port, three)
    finally:
        port.close()
    lines = [line for _, line, _ in port.seen]
    assert sum(line.startswith("GET /prime-rl/identity") for line in lines) == 1, lines
    assert sum(line.startswith("POST /v1/completions") for line in lines) == 3, lines
