"""The sending side of weights in memory (`weight_transfer.mode = "memory"`), on rank 0: the
protocol is ``prime_rl.transfer``'s.

The training loop hands each new policy version over (``offer``: the gathered state dict, HF
names, serving dtype, on the host), which copies it into flat chunk buffers of its own (the
state dict may be the live parameters themselves: on CPU, float32 to float32, gathering copies
nothing) and goes on; a thread of this process sends a version when every vLLM worker has
asked for it. The versions offered and not yet sent are kept (the newest is always the one
asked for next; older ones are dropped once a newer one was sent, their buffers reused): with
the orchestrator at most ``async_level`` versions behind, at most ``async_level + 2`` copies of
the weights are held here at once.

An error of the thread (a worker gone mid-transfer, a group that did not form) is raised in
the training loop at the next ``offer`` or ``check``: one line, naming the stage.

On a GPU the group is NCCL's (``transfer.ENGINES``): the held copies stay in page-locked host
memory (async_level + 2 copies of a model do not fit beside it on the GPU), and each chunk is
copied to the GPU as it goes.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch

from prime_rl import transfer
from prime_rl.settings import one_line


class WeightSender:
    def __init__(self, run_dir: Path, workers: int, timeout_s: float, device: torch.device = torch.device("cpu")):
        self.run_dir, self.workers, self.timeout_s = Path(run_dir), workers, timeout_s
        self.backend = transfer.group_backend(cuda=device.type == "cuda")
        self.wire_device = device if self.backend == "nccl" else torch.device("cpu")
        self.store_path = transfer.private_store_path()
        self.store = transfer.open_store(self.store_path, timeout_s)
        transfer.clear_announcement(self.run_dir)
        self.held: dict[int, list[torch.Tensor]] = {}  # version -> its chunks, flat
        self.free: list[list[torch.Tensor]] = []  # the chunks of versions sent or dropped, for reuse
        self.params: list[tuple[str, str, list[int]]] = []
        self.plan: list[list[int]] = []
        self.sent: int | None = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def offer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Copy ``version`` (``state``: name -> host tensor) into chunks held for the workers, and announce it."""
        self.check()
        params = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in state.items()]
        if self.thread is None:  # the parameter list, once: every version holds the same
            self.params, self.plan = params, transfer.chunk_plan(params)
            transfer.put_meta(self.store, params)
            self.thread = threading.Thread(target=self._serve, name="weight-sender", daemon=True)
            self.thread.start()
        elif params != self.params:
            raise transfer.TransferError(f"weights version {version} holds other parameters than version 1's")
        with self.lock:
            chunks = self.free.pop() if self.free else transfer.chunk_buffers(self.params, self.plan, pin=self.backend == "nccl")
        tensors = list(state.values())
        for chunk, flat in zip(self.plan, chunks):
            torch.cat([tensors[i].reshape(-1) for i in chunk], out=flat)
        with self.lock:
            self.held[version] = chunks
        transfer.announce(self.run_dir, transfer.Announcement(version, self.store_path, self.workers, self.backend))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=self.timeout_s)
        transfer.clear_announcement(self.run_dir)
        shutil.rmtree(Path(self.store_path).parent, ignore_errors=True)

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        try:
            if self.backend == "nccl":
                torch.cuda.set_device(self.wire_device)  # NCCL's communicator forms on this thread's device
            joined = [f"joined/{rank}" for rank in range(1, self.workers + 1)]
            while not self.store.check(joined):  # the orchestrator starts the workers' join
                if self.stopping.wait(transfer.POLL_S):
                    return
            try:
                group = transfer.join_group(self.store, 0, self.workers + 1, self.timeout_s, self.backend)
            except RuntimeError as e:
                raise transfer.TransferError(f"weight transfer: the group did not form: {one_line(e)}") from e
            while not self.stopping.is_set():
                version = self._asked()
                if version is None:
                    time.sleep(transfer.POLL_S)
                    continue
                self._send(group, version)
        except BaseException as e:  # noqa: BLE001 - raised in the training loop
            self.error = e if isinstance(e, transfer.TransferError) else transfer.TransferError(f"weight transfer: {one_line(e)}")

    def _asked(self) -> int | None:
        """The newest held version every worker asked for."""
        with self.lock:
            versions = sorted(self.held, reverse=True)
        for version in versions:
            if self.store.check([transfer.ready_key(version, rank) for rank in range(1, self.workers + 1)]):
                return version
        return None

    def _send(self, group, version: int) -> None:
        with self.lock:
            chunks = self.held[version]
        header = torch.tensor([version], dtype=torch.int64, device=self.wire_device)
        transfer.broadcast(group, header, self.timeout_s, f"starting to send version {version}")
        for flat in chunks:  # .to: the same tensor on CPU, a copy to the GPU over NCCL
            wire = flat.to(self.wire_device, non_blocking=True)
            transfer.broadcast(group, wire, self.timeout_s, f"sending version {version} to the vLLM workers")
        if self.backend == "nccl":
            torch.cuda.synchronize(self.wire_device)  # the copies are done with the host chunks before they are reused
        with self.lock:
            self.free += [c for v, c in self.held.items() if v <= version]
            self.held = {v: c for v, c in self.held.items() if v > version}
            self.sent = version
