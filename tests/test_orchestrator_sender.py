"""BatchSender: per-rank PUSH sockets, send timeout, delivery after close (linger)."""


import pytest
import zmq
from prime_rl.config import TransportConfig
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch, decode_batch, make_sample

from orchestrator.sender import BatchSender

from helpers import free_port_pair


def batch(rank, step=1):
    sample = make_sample(
        [1, 2, 3], [0, 1, 1], [0, -0.5, -0.5], advantage=0.5, reward=1.0, policy_version=0, example_id=4
    )
    return TrainBatch(SCHEMA_VERSION, step, rank, 1.0, [MicroBatch([sample])])


def pull(ctx, port):
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def test_each_rank_gets_its_batch_even_after_close():
    port = free_port_pair()
    sender = BatchSender(TransportConfig(port=port, timeout_s=5), num_ranks=2)
    ctx = zmq.Context()
    try:
        socks = [pull(ctx, port), pull(ctx, port + 1)]
        sender.send(batch(0))
        sender.send(batch(1))
        sender.close()  # lingers until both frames are out
        for rank, sock in enumerate(socks):
            got = decode_batch(sock.recv(), expected_step=1, expected_rank=rank)
            assert got == batch(rank)
            sock.close()
    finally:
        ctx.term()


def test_send_times_out_when_no_trainer_rank_connects():
    port = free_port_pair()
    sender = BatchSender(TransportConfig(port=port, timeout_s=0.2), num_ranks=1)
    with pytest.raises(TimeoutError, match=rf"trainer rank 0 did not take the batch for step 1 within .*{port}"):
        sender.send(batch(0))
    sender.close(flush=False)


def test_port_in_use_fails_clearly():
    port = free_port_pair()
    first = BatchSender(TransportConfig(port=port, timeout_s=1), num_ranks=1)
    try:
        with pytest.raises(OSError, match=f"cannot bind the trainer transport at tcp://127.0.0.1:{port}"):
            BatchSender(TransportConfig(port=port, timeout_s=1), num_ranks=1)
    finally:
        first.close(flush=False)
