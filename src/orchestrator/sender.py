"""ZeroMQ transport to the trainer: one PUSH socket per rank, bound by the orchestrator.

Rank r's trainer connects a PULL socket to ``tcp://{host}:{port + r}``. A PUSH socket
with no connected peer holds the message, so ``SNDTIMEO`` turns "no trainer rank took
it" into a clear error instead of a hang. ``LINGER`` keeps queued frames going out
after ``close()`` (bounded by the same timeout), so the last step's batch is delivered
even though the orchestrator exits right after sending it.

With the launcher's per-run keys (``transport.curve_*``) every socket is a CURVE server:
frames are encrypted, and a ZAP handler on the context admits only the trainer's public
key, so a peer that can reach the port but lacks the trainer's secret key completes no
handshake and never becomes one of the PUSH sockets' peers (a PUSH socket hands a batch
to any peer it has). Without keys the sockets are plain, which is refused beyond
loopback. Frames above ``transport.max_message_bytes`` fail here, naming the setting,
rather than being dropped silently by the trainer's ``MAXMSGSIZE``.
"""

from __future__ import annotations

import hmac

import zmq
from zmq.auth.thread import ThreadAuthenticator

from prime_rl.config import TransportConfig
from prime_rl.wire import DEFAULT_MAX_FRAME_BYTES, TrainBatch, encode_batch


ZAP_DOMAIN = "prime-rl-transport"


class _OnlyKey:
    """ZAP credentials check (pyzmq's callback interface): the one allowed CURVE public key."""

    def __init__(self, z85_public: str):
        self._key = z85_public.encode()

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return hmac.compare_digest(z85_key, self._key)


class BatchSender:
    def __init__(self, config: TransportConfig, num_ranks: int):
        self.config = config
        self.timeout_ms = int(config.timeout_s * 1000)
        self.max_bytes = config.max_message_bytes or DEFAULT_MAX_FRAME_BYTES
        host = config.bind_host or config.host
        secret = config.curve_server_secret
        if secret is None and config.leaves_loopback():
            raise OSError(
                f"refusing to bind the trainer transport on {host} without CURVE keys: any host that reaches it "
                "could take the trainer's batches (the launcher generates per-run keys; or bind 127.0.0.1)"
            )
        self.addresses = [f"tcp://{host}:{config.port + rank}" for rank in range(num_ranks)]
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        if secret is not None:
            # A CURVE server admits every client key unless a ZAP handler says no, and libzmq
            # asks the handler only for sockets with a ZAP domain (measured with 4.3.5: without
            # one, any keypair completes the handshake); ZAP_ENFORCE_DOMAIN makes a missing
            # handler refuse too.
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, _OnlyKey(config.curve_client_public))
        self._sockets: list[zmq.Socket] = []
        for address in self.addresses:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.LINGER, self.timeout_ms)
            if secret is not None:
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret.encode())
                sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
                sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
            try:
                sock.bind(address)
            except zmq.ZMQError as e:
                for opened in [sock, *self._sockets]:
                    opened.close(linger=0)
                self._stop_auth()
                self._ctx.term()
                raise OSError(f"cannot bind the trainer transport at {address}: {e}") from None
            self._sockets.append(sock)

    def send(self, batch: TrainBatch) -> None:
        """Queue one rank's batch; fails if that rank has not taken it within the timeout."""
        self.send_frame(batch.rank, batch.step, encode_batch(batch))

    def send_frame(self, rank: int, step: int, frame: bytes) -> None:
        """Queue an encoded batch (``encode_batch``) for ``rank``; ``step`` names it in errors."""
        if len(frame) > self.max_bytes:
            raise ValueError(
                f"the batch for trainer rank {rank} at step {step} is {len(frame)} bytes, above "
                f"transport.max_message_bytes ({self.max_bytes}), which the trainer would refuse; raise it"
            )
        try:
            self._sockets[rank].send(frame, copy=False)
        except zmq.Again:
            raise TimeoutError(
                f"trainer rank {rank} did not take the batch for step {step} within "
                f"{self.config.timeout_s:.0f} s (no trainer connected to {self.addresses[rank]}?)"
            ) from None

    def close(self, flush: bool = True) -> None:
        """With ``flush``, blocks until queued batches are out or the linger timeout passes;
        without it (after an error), drops them at once."""
        for sock in self._sockets:
            sock.close(linger=None if flush else 0)
        self._sockets = []
        # A closed socket accepts no new connection, so lingering frames need no handshake:
        # the authenticator may stop first (ctx.term() would wait for its socket forever).
        self._stop_auth()
        self._ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
