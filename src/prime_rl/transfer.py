"""Weights in memory (`weight_transfer.mode = "memory"`): the protocol between the trainer and
the vLLM workers, shared by both sides (``trainer.transfer`` sends, ``inference.weight_transfer``
receives inside vLLM through its native weight-transfer routes; the orchestrator drives those
routes and reads only the announcement).

One transfer group per trainer start: the trainer (rank 0) and every vLLM worker of every
replica (ranks 1..W), over ``torch.distributed`` (gloo on CPU, NCCL on CUDA: the same
protocol, under the vLLM engine names in ``ENGINES``), rendezvousing through a
``FileStore`` in the trainer's private temporary directory (0700: only this user's processes
reach it; the group's own sockets bind to 127.0.0.1). The protocol, in order:

1. the trainer announces each new policy version in ``RUN/weights/memory.json``
   (``{"version": v, "store": PATH, "workers": W}``) once it holds a copy of it;
2. the orchestrator, once it wants that version, asks each replica to receive it
   (``/init_weight_transfer_engine`` with the store the first time, then
   ``/start_weight_update``, ``/update_weights`` with ``{"version": v}``, ``/finish_weight_update``);
3. each worker sets ``ready/v/RANK`` in the store and waits in the group's first broadcast;
   the trainer, once all W did, broadcasts version ``v``: the
   version itself, then the tensors in the chunks ``chunk_plan`` cuts from the parameter list
   it put in the store at the start (``meta``), each chunk one flat buffer per dtype.

The trainer keeps every announced version newer than the last one sent (the orchestrator only
ever asks for the newest it saw, and never goes back), so a version is sent exactly as it was
announced. Every wait has a timeout: a peer that never comes, or dies mid-transfer, ends the
transfer with an error naming the stage and the peer.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prime_rl.rundir import weights_dir, write_json_atomic
from prime_rl.settings import one_line

if TYPE_CHECKING:
    import torch

ANNOUNCEMENT = "memory.json"
STORE_FILE = "weights-store"
CHUNK_BYTES = 64 << 20
"""Bytes of one broadcast buffer (at most; a larger tensor goes alone). Smaller chunks,
pipelined (one travelling while the next is copied or the last loaded), were no faster on
this machine's two cores (docs/scaling.md, "Weights in memory")."""
POLL_S = 0.002
ENGINES = {"gloo": "prime_rl", "nccl": "prime_rl_nccl"}
"""The vLLM engine (``inference.weight_transfer``) of each group backend: gloo where vLLM runs
on CPU, NCCL where it runs on GPUs. The trainer's backend follows its device; the announcement
says which, and an engine of the other refuses to join."""


def group_backend(cuda: bool) -> str:
    return "nccl" if cuda else "gloo"


def announcement_path(run_dir: Path) -> Path:
    return weights_dir(run_dir) / ANNOUNCEMENT


@dataclass(frozen=True)
class Announcement:
    version: int
    store: str
    """The FileStore of the trainer start that announced it: a new start, a new group."""
    workers: int
    backend: str = "gloo"
    """The group's: ``gloo`` or ``nccl`` (``ENGINES``)."""

    def init_info(self, replica: int, workers_per_replica: int, timeout_s: float) -> dict:
        """What ``/init_weight_transfer_engine`` gets for replica ``replica``'s workers."""
        return {"store": self.store, "world_size": 1 + self.workers, "rank_offset": 1 + replica * workers_per_replica,
                "timeout_s": timeout_s, "backend": self.backend}


def announce(run_dir: Path, announcement: Announcement) -> None:
    announcement_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(announcement_path(run_dir), asdict(announcement))


def read_announcement(run_dir: Path) -> Announcement | None:
    """The newest announced version, or None (none yet, or a file being replaced)."""
    try:
        data = json.loads(announcement_path(run_dir).read_text())
        return Announcement(int(data["version"]), str(data["store"]), int(data["workers"]), str(data.get("backend", "gloo")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_announcement(run_dir: Path) -> None:
    """A trainer start removes the previous start's announcement: its group is gone."""
    announcement_path(run_dir).unlink(missing_ok=True)


# --------------------------------------------------------------------------- the group (torch)


def ready_key(version: int, rank: int) -> str:
    """Set by worker ``rank`` once it waits for ``version`` (keys only set and checked: a
    FileStore appends every write to its file, so polling never writes)."""
    return f"ready/{version}/{rank}"


def open_store(path: str, timeout_s: float):
    import torch.distributed as dist

    store = dist.FileStore(path, -1)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def join_group(store, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"):
    """This process's place in the transfer group (blocks until all ``world_size`` joined, at
    most ``timeout_s``). gloo's sockets bind to 127.0.0.1; NCCL's communicator forms at the
    first broadcast, on the CUDA device current in the calling thread, and its operations time
    out through torch's NCCL watchdog (which ends the process: loud, never a hang)."""
    import torch.distributed as dist

    if rank > 0:
        store.set(f"joined/{rank}", "1")  # the trainer joins once every worker has begun to
    prefixed = dist.PrefixStore("group", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def put_meta(store, params: list[tuple[str, str, list[int]]]) -> None:
    """The parameters every version holds, in order: (HF name, dtype name, shape)."""
    store.set("meta", json.dumps(params))


def get_meta(store) -> list[tuple[str, str, list[int]]]:
    return [(name, dtype, list(shape)) for name, dtype, shape in json.loads(store.get("meta"))]


def chunk_plan(params: list[tuple[str, str, list[int]]], limit: int = CHUNK_BYTES) -> list[list[int]]:
    """Indices of ``params`` cut into consecutive chunks of one dtype and at most ``limit``
    bytes (a larger tensor alone): both sides cut the same list the same way."""
    import torch

    chunks: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, dtype_name, shape) in enumerate(params):
        nbytes = math.prod(shape) * getattr(torch, dtype_name).itemsize
        if not chunks or dtype_name != dtype or size + nbytes > limit:
            chunks.append([])
            size, dtype = 0, dtype_name
        chunks[-1].append(i)
        size += nbytes
    return chunks


def chunk_buffers(params: list[tuple[str, str, list[int]]], plan: list[list[int]], device="cpu", pin: bool = False) -> list[torch.Tensor]:
    """One flat buffer per chunk of ``plan`` on ``device`` (``pin``: page-locked host memory,
    for copies to a GPU that do not wait on the host), reused by every version."""
    import torch

    return [torch.empty(sum(math.prod(params[i][2]) for i in chunk), dtype=getattr(torch, params[chunk[0]][1]), device=device,
                        pin_memory=pin) for chunk in plan]


def broadcast(group, tensor: torch.Tensor, timeout_s: float, stage: str) -> None:
    """One broadcast from rank 0; an error names ``stage``."""
    try:
        group.broadcast(tensor, 0, datetime.timedelta(seconds=timeout_s)).wait()
    except RuntimeError as e:
        raise TransferError(f"weight transfer failed {stage}: {one_line(e)}") from e


class TransferError(RuntimeError):
    pass


def private_store_path() -> str:
    """The store file in this process's temporary directory (the launcher gives the trainer a
    private one in memory mode, which it removes at the end)."""
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="prime-rl-weights-"), STORE_FILE)  # mkdtemp: mode 0700
