"""The rollout transport: BatchSender's per-rank PUSH sockets (send timeout, delivery after
close), CURVE authentication against the trainer's BatchReceiver, and the frame-size cap."""

import pytest
import zmq
from prime_rl.config import TransportConfig
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch, decode_batch, encode_batch, make_sample

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


# --------------------------------------------------------------------------- authentication and size


def run_keys(port: int, **common) -> tuple[TransportConfig, TransportConfig]:
    """(orchestrator's, trainer's) transport configs with fresh per-run CURVE keys, as the launcher writes them."""
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    client_public, client_secret = (k.decode() for k in zmq.curve_keypair())
    orchestrator = TransportConfig(port=port, curve_server_secret=server_secret, curve_client_public=client_public, **common)
    trainer = TransportConfig(port=port, curve_client_secret=client_secret, curve_server_public=server_public, **common)
    return orchestrator, trainer


def wait_for_event(monitor, wanted: int, timeout_ms: int = 5000) -> None:
    from zmq.utils.monitor import recv_monitor_message

    while monitor.poll(timeout_ms):
        if recv_monitor_message(monitor)["event"] == wanted:
            return
    raise AssertionError(f"no socket event {wanted} within {timeout_ms} ms")


def test_a_peer_without_the_trainers_key_takes_no_batch():
    """Two rogues connect first: one with CURVE, the server's public key and a keypair of its
    own (the ZAP handler refuses its key), one plain. Without CURVE and ZAP the PUSH socket
    would hand them every other batch; here both batches reach the real trainer."""
    from trainer.data import BatchReceiver

    port = free_port_pair()
    orchestrator_cfg, trainer_cfg = run_keys(port, timeout_s=5)
    sender = BatchSender(orchestrator_cfg, num_ranks=1)
    ctx = zmq.Context()
    rogues = []
    try:
        keyed = ctx.socket(zmq.PULL)
        keyed.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        keyed.curve_serverkey, keyed.curve_publickey, keyed.curve_secretkey = trainer_cfg.curve_server_public.encode(), public, secret
        monitor = keyed.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        keyed.connect(f"tcp://127.0.0.1:{port}")
        plain = pull(ctx, port)
        rogues = [keyed, plain, monitor]
        wait_for_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # the orchestrator refused its key
        with BatchReceiver(trainer_cfg, 0) as receiver:
            for step in (1, 2):
                sender.send(batch(0, step=step))
                assert receiver.receive(step) == batch(0, step=step)
        assert not keyed.poll(200) and not plain.poll(0)
    finally:
        for sock in rogues:
            sock.close(linger=0)
        ctx.term()
        sender.close(flush=False)


def test_a_plain_transport_beyond_loopback_is_refused():
    with pytest.raises(OSError, match="refusing to bind the trainer transport on 0.0.0.0 without CURVE keys"):
        BatchSender(TransportConfig(port=free_port_pair(), bind_host="0.0.0.0"), num_ranks=1)
    from trainer.data import BatchReceiver

    with pytest.raises(OSError, match="refusing to take batches from 10.1.2.3 without CURVE keys"):
        BatchReceiver(TransportConfig(host="10.1.2.3"), 0)


def test_a_frame_above_the_cap_is_dropped_before_the_trainer_buffers_it():
    """libzmq reads the 64 MiB frame's length, drops the connection and reconnects: receive()
    never returns it, logs one line, and the next batch still arrives."""
    from trainer.data import BatchReceiver

    port = free_port_pair()
    cap = 2**20
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)  # a sender that ignores the cap (BatchSender refuses such frames itself)
    push.setsockopt(zmq.SNDTIMEO, 5000)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(f"tcp://127.0.0.1:{port}")
    lines: list[str] = []
    cfg = TransportConfig(port=port, timeout_s=5, first_batch_timeout_s=1.5, max_message_bytes=cap)
    try:
        with BatchReceiver(cfg, 0, log=lines.append) as receiver:
            push.send(b"\x00" * (64 * 2**20), copy=False)
            with pytest.raises(TimeoutError, match="no batch for step 1"):
                receiver.receive(1)
            assert len(lines) == 1 and f"above transport.max_message_bytes ({cap})" in lines[0], lines
            push.send(encode_batch(batch(0)))  # blocks until the trainer has reconnected
            assert receiver.receive(1) == batch(0)
    finally:
        push.close(linger=0)
        ctx.term()


def test_the_sender_names_the_cap_it_would_exceed():
    port = free_port_pair()
    sender = BatchSender(TransportConfig(port=port, timeout_s=1, max_message_bytes=2**16), num_ranks=1)
    try:
        with pytest.raises(ValueError, match=r"step 1 is \d+ bytes, above transport.max_message_bytes \(65536\)"):
            sender.send_frame(0, 1, b"\x00" * (2**16 + 1))
    finally:
        sender.close(flush=False)
