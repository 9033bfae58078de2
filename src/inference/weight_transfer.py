"""The receiving side of weights in memory, inside each vLLM worker: an engine for vLLM's native
weight-transfer API (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``), registered with vLLM's factory by name
(``transfer.ENGINES``: ``prime_rl`` over gloo, ``prime_rl_nccl`` over NCCL, one class apart from
the group's backend) through a `vllm.general_plugins` entry point, so every vLLM process has
them from its start. The protocol is ``prime_rl.transfer``'s; the server runs it when started
with ``--weight-transfer-config '{"backend": "prime_rl"}'`` (``prime_rl_nccl`` on GPUs;
``prime_rl.vllm_command``, memory mode).

A version's tensors are loaded with vLLM's layerwise reload, as its own ``reload_weights`` and
NCCL engine load them (``start``/``finish`` wrap the loading; weights arrive in the checkpoint's
HF format). They are received into host buffers made once per group and reused by every
version (``transfer.chunk_buffers``): a fresh buffer a version spent more on first touching
its pages than on the transfer (docs/scaling.md, "Weights in memory"). Over NCCL the buffers
are on the worker's GPU, and loading is a copy on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from prime_rl import transfer
from prime_rl.settings import one_line

def register() -> None:
    """vLLM's general-plugin hook (every vLLM process calls it, maybe more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    classes = {"gloo": "PrimeRLWeightTransferEngine", "nccl": "PrimeRLNCCLWeightTransferEngine"}
    for backend, name in transfer.ENGINES.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, "inference.weight_transfer", classes[backend])


@dataclass
class InitInfo:
    store: str
    world_size: int
    rank_offset: int
    timeout_s: float
    backend: str = "gloo"


@dataclass
class UpdateInfo:
    version: int


class PrimeRLWeightTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False
    backend = "gloo"

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.rank = 0
        self.timeout_s = 0.0
        self.params: list[tuple[str, str, list[int]]] = []
        self.plan: list[list[int]] = []
        self.buffers: list[torch.Tensor] = []

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Join the trainer's group (a new trainer start's: the previous group is left)."""
        self.shutdown()
        if init_info.backend != self.backend:
            raise transfer.TransferError(
                f"weights in memory: the trainer's group is {init_info.backend}, this server's engine "
                f"({transfer.ENGINES[self.backend]}) joins {self.backend} groups: the trainer and vLLM must both run on "
                "GPUs (nccl) or both on CPU (gloo)"
            )
        parallel = self.parallel_config
        self.rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.timeout_s = init_info.timeout_s
        self.store = transfer.open_store(init_info.store, init_info.timeout_s)
        try:
            self.group = transfer.join_group(self.store, self.rank, init_info.world_size, init_info.timeout_s, self.backend)
        except RuntimeError as e:
            raise transfer.TransferError(
                f"worker rank {self.rank}: the trainer's transfer group did not form within {init_info.timeout_s:g} s "
                f"({init_info.store}): {one_line(e)}"
            ) from e
        self.params = transfer.get_meta(self.store)
        self.plan = transfer.chunk_plan(self.params)
        self.buffers = transfer.chunk_buffers(self.params, self.plan, self.wire_device)

    @property
    def wire_device(self) -> torch.device:
        """Where received tensors land: the host for gloo, this worker's GPU for NCCL."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default ends with torch.accelerator.synchronize(), which a CPU has none of
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        if self.group is None:
            raise transfer.TransferError("weights in memory: /update_weights before /init_weight_transfer_engine")
        version = update_info.version
        self.store.set(transfer.ready_key(version, self.rank), "1")
        header = torch.zeros(1, dtype=torch.int64, device=self.wire_device)
        transfer.broadcast(self.group, header, self.timeout_s, f"waiting for the trainer to send version {version} (rank {self.rank})")
        if int(header.item()) != version:
            raise transfer.TransferError(f"asked for weights version {version}, the trainer sent {int(header.item())}")
        for chunk, flat in zip(self.plan, self.buffers):
            transfer.broadcast(self.group, flat, self.timeout_s, f"receiving version {version} (rank {self.rank})")
            tensors = flat.split([torch.Size(self.params[i][2]).numel() for i in chunk])
            self.model.load_weights([(self.params[i][0], t.view(self.params[i][2])) for i, t in zip(chunk, tensors)])

    def shutdown(self) -> None:
        self.group = None  # its sockets close with it
        self.store = None
        self.buffers = []


class PrimeRLNCCLWeightTransferEngine(PrimeRLWeightTransferEngine):
    """The same engine over NCCL, for vLLM on GPUs: buffers on the worker's GPU."""

    backend = "nccl"
