"""Weights in memory (`weight_transfer.mode = "memory"`, ``prime_rl.transfer``): the trainer's
sender (``trainer.transfer``) and the receiving engine vLLM runs in each worker
(``inference.weight_transfer``) over a real gloo group: here the engine's model is a test
double that records what it loads, and a peer that dies is a real process. The trio in memory
mode is in ``test_trio_memory``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from helpers import REPO
from prime_rl import transfer
from trainer.transfer import WeightSender

TIMEOUT_S = 20.0


def test_chunks_are_cut_by_dtype_and_size():
    params = [("a", "float32", [2, 2]), ("b", "float32", [4]), ("c", "bfloat16", [3]), ("d", "bfloat16", [100]), ("e", "bfloat16", [1])]
    # 32 bytes a chunk: a and b (16 + 16); c starts a bfloat16 chunk (6); d (200) cannot join it
    # and goes alone; e (2) would overflow d's chunk
    assert transfer.chunk_plan(params, limit=32) == [[0, 1], [2], [3], [4]]
    assert transfer.chunk_plan(params) == [[0, 1], [2, 3, 4]]


def test_the_announcement_round_trips_and_a_torn_one_reads_as_none(tmp_path):
    assert transfer.read_announcement(tmp_path) is None
    transfer.announce(tmp_path, transfer.Announcement(3, "/x/store", 2))
    announced = transfer.read_announcement(tmp_path)
    assert announced == transfer.Announcement(3, "/x/store", 2, "gloo")
    assert announced.init_info(1, 1, 5.0) == {"store": "/x/store", "world_size": 3, "rank_offset": 2, "timeout_s": 5.0, "backend": "gloo"}
    transfer.announcement_path(tmp_path).write_text('{"version": 4, "sto')
    assert transfer.read_announcement(tmp_path) is None
    transfer.clear_announcement(tmp_path)
    assert not transfer.announcement_path(tmp_path).exists()


def states(versions):
    """One state dict a version, as the trainer hands them over: HF names, contiguous host
    tensors of two dtypes, one larger than a chunk would hold alone."""
    gen = torch.Generator().manual_seed(0)
    base = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(16),
    }
    return {v: {name: (t + v).contiguous() for name, t in base.items()} for v in versions}


def engine_class(backend: str):
    """The class vLLM's factory builds for the engine name of ``backend`` (registered as the
    vLLM plugin registers them)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from inference.weight_transfer import register

    register()
    register()  # vLLM may call a plugin more than once
    return WeightTransferEngineFactory._registry[transfer.ENGINES[backend]]()


class Receiver:
    """vLLM's side: the real engine, its model a double that records each loaded tensor."""

    def __init__(self, announced: transfer.Announcement, replica: int = 0, device: str = "cpu"):
        self.loaded: dict[str, torch.Tensor] = {}
        model = types.SimpleNamespace(load_weights=lambda pairs: self.loaded.update((n, t.cpu()) for n, t in pairs))
        parallel = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        vllm_config = types.SimpleNamespace(parallel_config=parallel, model_config=None)
        backend = transfer.group_backend(cuda=device != "cpu")
        self.engine = engine_class(backend)(None, vllm_config, torch.device(device), model)
        self.engine.init_transfer_engine(self.engine.parse_init_info(announced.init_info(replica, 1, TIMEOUT_S)))

    def receive(self, version: int) -> dict[str, torch.Tensor]:
        self.loaded = {}
        self.engine.update_weights({"version": version})
        return self.loaded


NCCL = pytest.param(
    "nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU for each of two ranks (not on this machine)")
)


@pytest.mark.parametrize("backend", ["gloo", NCCL])
def test_each_version_arrives_exactly_and_the_newest_asked_wins(tmp_path, backend):
    """gloo on CPU; with two GPUs the same run over NCCL (trainer on GPU 0, worker on GPU 1)."""
    (tmp_path / "weights").mkdir()
    sent = states([1, 2, 3])
    trainer, worker = ("cuda:0", "cuda:1") if backend == "nccl" else ("cpu", "cpu")
    if backend == "nccl":
        torch.cuda.set_device(worker)  # as vLLM sets its worker's device
    sender = WeightSender(tmp_path, workers=1, timeout_s=TIMEOUT_S, device=torch.device(trainer))
    try:
        sender.offer(1, sent[1])
        assert transfer.read_announcement(tmp_path).backend == backend
        receiver = Receiver(transfer.read_announcement(tmp_path), device=worker)
        got = receiver.receive(1)
        assert got.keys() == sent[1].keys()
        assert all(torch.equal(got[n], sent[1][n]) and got[n].dtype == sent[1][n].dtype for n in got)
        # two versions before the orchestrator asks again: it asks for the newest it saw
        sender.offer(2, sent[2])
        sender.offer(3, sent[3])
        assert transfer.read_announcement(tmp_path).version == 3
        got = receiver.receive(3)
        assert all(torch.equal(got[n], sent[3][n]) for n in got)
        wait_for(lambda: sender.sent == 3)
        assert sender.held == {}, "versions older than the one sent are dropped"
        sender.check()
    finally:
        sender.close()
    assert not transfer.announcement_path(tmp_path).exists()


@pytest.mark.parametrize("engine", ["gloo", "nccl"])
def test_an_engine_refuses_a_group_of_the_other_backend_in_one_line(tmp_path, engine):
    """A trainer on CPU with vLLM on GPUs (or the reverse) cannot share a group: the worker
    says so before it joins, and nothing waits."""
    other = {"gloo": "nccl", "nccl": "gloo"}[engine]
    announced = transfer.Announcement(1, str(tmp_path / "store"), 1, other)
    start = time.monotonic()
    with pytest.raises(transfer.TransferError, match=rf"the trainer's group is {other}, this server's engine \({transfer.ENGINES[engine]}\) joins {engine} groups") as e:
        Receiver(announced, device="cpu" if engine == "gloo" else "cuda:0")
    assert "\n" not in str(e.value) and time.monotonic() - start < 5
    assert not (tmp_path / "store").exists()


def test_a_version_is_sent_as_it_was_offered_though_the_trainer_trained_on(tmp_path):
    """On CPU the gathered state dict is the live parameters themselves (float32 to float32
    copies nothing): the optimizer's next step must not change a version already offered."""
    (tmp_path / "weights").mkdir()
    live = states([1])[1]
    offered = {name: t.clone() for name, t in live.items()}
    sender = WeightSender(tmp_path, workers=1, timeout_s=TIMEOUT_S)
    try:
        sender.offer(1, live)
        for t in live.values():  # the next optimizer step, in place
            t.add_(1.0)
        got = Receiver(transfer.read_announcement(tmp_path)).receive(1)
        assert all(torch.equal(got[n], offered[n]) for n in offered)
    finally:
        sender.close()


def test_a_version_asked_for_by_one_worker_waits_for_the_other(tmp_path):
    """Two replicas (a group of 3): the trainer sends only once both asked; each gets it."""
    import threading

    (tmp_path / "weights").mkdir()
    sent = states([1])
    sender = WeightSender(tmp_path, workers=2, timeout_s=TIMEOUT_S)
    try:
        sender.offer(1, sent[1])
        announced = transfer.read_announcement(tmp_path)
        receivers: list[Receiver] = []
        joined = [threading.Thread(target=lambda i=i: receivers.append(Receiver(announced, replica=i))) for i in range(2)]
        for t in joined:
            t.start()
        for t in joined:
            t.join(TIMEOUT_S)
        got: list[dict] = []
        first = threading.Thread(target=lambda: got.append(receivers[0].receive(1)))
        first.start()
        time.sleep(0.3)
        assert sender.sent is None and not got, "sent before every worker asked"
        got.append(receivers[1].receive(1))
        first.join(TIMEOUT_S)
        assert len(got) == 2 and all(torch.equal(g[n], sent[1][n]) for g in got for n in sent[1])
    finally:
        sender.close()


PEER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {src!r})
    from prime_rl import transfer
    store = transfer.open_store({store!r}, 20)
    group = transfer.join_group(store, 1, 2, 20)
    store.set(transfer.ready_key(1, 1), "1")
    os._exit(0)  # a worker gone once it asked: the trainer's broadcast finds no one
""")


def test_a_worker_gone_mid_transfer_fails_the_trainer_naming_the_stage(tmp_path):
    (tmp_path / "weights").mkdir()
    sender = WeightSender(tmp_path, workers=1, timeout_s=TIMEOUT_S)
    try:
        sender.offer(1, states([1])[1])
        peer = subprocess.run([sys.executable, "-c", PEER.format(src=str(REPO / "src"), store=sender.store_path)], timeout=60)
        assert peer.returncode == 0
        wait_for(lambda: sender.error is not None)
        with pytest.raises(transfer.TransferError, match=r"weight transfer failed (starting to send|sending) version 1"):
            sender.offer(2, states([2])[2])
    finally:
        sender.close()


TRAINER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {src!r})
    from prime_rl import transfer
    store = transfer.open_store({store!r}, 20)
    transfer.put_meta(store, [("w", "float32", [4])])
    group = transfer.join_group(store, 0, 2, 20)
    while not store.check([transfer.ready_key(1, 1)]):
        time.sleep(0.01)
    os._exit(0)  # the trainer killed once the worker asked
""")


def test_a_trainer_gone_mid_transfer_fails_the_worker_within_seconds(tmp_path):
    store = str(tmp_path / "store")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER.format(src=str(REPO / "src"), store=store)])
    try:
        receiver = Receiver(transfer.Announcement(1, store, 1))
        start = time.monotonic()
        with pytest.raises(transfer.TransferError, match=r"weight transfer failed waiting for the trainer to send version 1 \(rank 1\)"):
            receiver.receive(1)
        assert time.monotonic() - start < 10
    finally:
        trainer.wait(timeout=60)


def wait_for(condition, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
