"""ZeroMQ transport to the trainer: one PUSH socket per rank, bound by the orchestrator.

Rank r's trainer connects a PULL socket to ``tcp://{host}:{port + r}``. A PUSH socket
with no connected peer holds the message, so ``SNDTIMEO`` turns "no trainer rank took
it" into a clear error instead of a hang. ``LINGER`` keeps queued frames going out
after ``close()`` (bounded by the same timeout), so the last step's batch is delivered
even though the orchestrator exits right after sending it.
"""

from __future__ import annotations

import zmq
from prime_rl.config import TransportConfig
from prime_rl.wire import TrainBatch, encode_batch


class BatchSender:
    def __init__(self, config: TransportConfig, num_ranks: int):
        self.config = config
        self.timeout_ms = int(config.timeout_s * 1000)
        host = config.bind_host or config.host
        self.addresses = [f"tcp://{host}:{config.port + rank}" for rank in range(num_ranks)]
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        for address in self.addresses:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.LINGER, self.timeout_ms)
            try:
                sock.bind(address)
            except zmq.ZMQError as e:
                for opened in [sock, *self._sockets]:
                    opened.close(linger=0)
                self._ctx.term()
                raise OSError(f"cannot bind the trainer transport at {address}: {e}") from None
            self._sockets.append(sock)

    def send(self, batch: TrainBatch) -> None:
        """Queue one rank's batch; fails if that rank has not taken it within the timeout."""
        self.send_frame(batch.rank, batch.step, encode_batch(batch))

    def send_frame(self, rank: int, step: int, frame: bytes) -> None:
        """Queue an encoded batch (``encode_batch``) for ``rank``; ``step`` names it in errors."""
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
        self._ctx.term()
