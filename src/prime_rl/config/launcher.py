"""The launcher's config: an RL run's root (`prime-rl CONFIG.toml`: the shared fields, the three processes' sections) and
the sections only the launcher reads (`[deployment]`, `[slurm]`, `[teacher]`, `[watchdog]`, `[status]`, `[dashboard]`).

Never imports torch or vLLM (the launcher validates configs before any process starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from prime_rl import registry
from prime_rl.config.shared import CheckpointConfig, EnvConfig, SamplingConfig, StrictModel, TransportConfig, WandbConfig, WeightTransferConfig
from prime_rl.config.trainer import TrainerConfig, VLLM_LORA_RANKS, vllm_lora_rank
from prime_rl.config.orchestrator import EvalConfig, OrchestratorConfig, PreflightConfig
from prime_rl.config.inference import InferenceConfig


class DeploymentConfig(StrictModel):
    """How one node's GPUs are split between inference and the trainer (`[deployment]`). The
    launcher gives each process its GPUs through CUDA_VISIBLE_DEVICES: inference the first
    `inference_gpus`, the trainer the next `trainer_gpus`. On a machine without GPUs the same
    numbers select CPU processes: vLLM-CPU replicas and gloo trainer ranks."""

    inference_gpus: int = Field(1, ge=1)
    """GPUs for inference: one vLLM server (replica) per `inference.tensor_parallel_size` of them, on ports `inference.port`, +1, ...; the orchestrator spreads requests over all of them."""

    trainer_gpus: int = Field(1, ge=1)
    """GPUs for the trainer: `torchrun --nproc-per-node`, one FSDP2 rank each (1 = a plain process)."""

    teacher_gpus: int = Field(1, ge=1)
    """GPUs for a local `[teacher]`'s vLLM server (tensor parallel over them), after the trainer's; unused without one."""

    cpu_vllm_first: bool = True
    """On a CPU machine of two cores, with a vLLM server of the run's own: the trainer and the orchestrator start on one core, each taking back both once it is ready, so that vLLM's API server, whose imports are the longest start-up and the one the first step waits for, has the other core to itself instead of two thirds of one (the first trained step ~2.5 s sooner here: docs/benchmarks.md, "vLLM's start-up first"). False: the three share both cores from the start."""


class SlurmConfig(StrictModel):
    """`prime-rl CONFIG.toml --slurm`: the sbatch job that runs this config (`[slurm]`)."""

    nodes: int = Field(1, ge=1)
    """Nodes of the job. One: the whole trio on it, GPUs split by `[deployment]`. Several: the first `inference_nodes` run vLLM replicas on all their GPUs, the rest run the trainer (multi-node torchrun on all their GPUs) and, on the first of them, the orchestrator."""

    inference_nodes: int = Field(0, ge=0)
    """With nodes > 1: how many (the first ones) run inference; at least 1, fewer than `nodes`."""

    gpus_per_node: int = Field(8, ge=0)
    """GPUs to request per node (`--gpus-per-node`); 0 = CPU nodes (one replica or trainer rank per node)."""

    partition: str | None = None
    """`--partition`; None = the cluster's default."""

    account: str | None = None
    """`--account`; None = the user's default."""

    time: str = "24:00:00"
    """`--time` limit of the job."""

    job_name: str | None = None
    """`--job-name`; None = `prime-rl-<output_dir's name>`."""

    cpus_per_node: int | None = Field(None, ge=1)
    """`--cpus-per-task` of each node's one task; None = the cluster's default."""

    bind_host: str | None = None
    """Address vLLM and the orchestrator's ZeroMQ sockets bind on their node in a multi-node job; None = the node's own address as SLURM knows it (`NodeAddr`). Single-node jobs stay on 127.0.0.1. (torchrun's rendezvous and the trainer's gloo/NCCL sockets follow torch's own settings, e.g. `GLOO_SOCKET_IFNAME`/`NCCL_SOCKET_IFNAME` in `setup`.)"""

    rdzv_port: int = Field(29500, ge=1024, le=65535)
    """Port of torchrun's c10d rendezvous on the first trainer node."""

    setup: list[str] = []
    """Shell lines run on every node before the job starts (`module load ...`, `source .venv/bin/activate`)."""

    exclusive: bool = True
    """Whole nodes: `#SBATCH --exclusive` and `--mem=0` (all of each node's memory), since vLLM and the trainer size themselves to the node's GPUs and memory, and another job on it would take them. false = share nodes as the cluster allows. An option `sbatch_args` already sets (`--exclusive=...`, `--mem`, `--mem-per-cpu`, `--mem-per-gpu`) is left as written there."""

    sbatch_args: list[str] = []
    """Extra `#SBATCH` options as written, e.g. `--constraint=h100` or `--qos=high`."""

    @model_validator(mode="after")
    def _split(self) -> SlurmConfig:
        if self.nodes > 1 and not 1 <= self.inference_nodes < self.nodes:
            raise ValueError(
                f"inference_nodes: with nodes = {self.nodes}, expected 1 to {self.nodes - 1} inference nodes "
                f"(the rest train), got {self.inference_nodes}"
            )
        if self.nodes == 1 and self.inference_nodes:
            raise ValueError("inference_nodes: a single-node job runs inference beside the trainer; set nodes > 1 or leave it 0")
        return self

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


class TeacherConfig(StrictModel):
    """The teacher of on-policy distillation (`[teacher]`, with `[trainer.loss.distill]`): it
    scores every token the student samples (prompt logprobs over the student's exact token
    ids, never re-tokenized), so it must use the student's tokenizer."""

    model: str | None = None
    """An HF model folder (or hub id), or a run's `weights/step_N` (full weights): served by a vLLM process of its own, which the launcher starts and stops with the run in its own pane (or, with `placement = "trainer"`, loaded in the trainer)."""

    placement: Literal["server", "trainer"] = "server"
    """Where the teacher scores: `server` = a vLLM server (a local one for `model`, started with the run; or the `endpoint`); `trainer` = `model`'s weights loaded frozen in the trainer beside the student, scoring each micro-batch in a forward of its own over the same packed rows (no second server, no scores on the wire; for teachers that fit beside the student, docs/distillation.md). The server's keys (`port`, `seq_len`, `max_num_seqs`, ...) apply to `server` only."""

    endpoint: str | None = None
    """Instead of `model`: the name of an endpoint in `endpoints_path` whose server returns prompt logprobs over token ids (a vLLM server: its URL ending in `/v1`)."""

    endpoints_path: Path = Path("configs/endpoints.toml")
    """The endpoints file `endpoint` is looked up in."""

    system_prompt: str | None = None
    """Context distillation: the teacher scores the student's completions under the conversation with this system message (replacing the conversation's own, or put first), the student trains under its own prompt. None = the student's exact prompt."""

    system_prompt_file: Path | None = None
    """The same, read from a file (e.g. the `best_prompt.txt` of `prime-rl gepa`)."""

    port: int = Field(8100, ge=1024, le=65535)
    """Port of a local teacher's server (on `inference.host`)."""

    seq_len: int | None = Field(None, ge=8)
    """A local teacher's context (vLLM `--max-model-len`); None = the run's `seq_len` + 1, plus `prompt_room` with a system prompt."""

    prompt_room: int = Field(1024, ge=0)
    """With a system prompt and `seq_len` unset: tokens the teacher's prompt may add to the student's."""

    max_num_seqs: int = Field(256, ge=1)
    """A local teacher's most sequences batched at once."""

    kv_cache_gb: int = Field(1, ge=1)
    """A local teacher's KV cache on CPU (GiB)."""

    timeout_s: float = Field(300.0, gt=0)
    """Timeout of one scoring request."""

    max_concurrency: int = Field(64, ge=1)
    """Most scoring requests in flight at once."""

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        if (self.model is None) == (self.endpoint is None):
            raise ValueError("teacher: set exactly one of `model` (served locally) and `endpoint` (a running server)")
        if self.system_prompt is not None and self.system_prompt_file is not None:
            raise ValueError("teacher: set `system_prompt` or `system_prompt_file`, not both")
        if self.placement == "trainer" and self.model is None:
            raise ValueError('teacher.placement = "trainer" loads `model` in the trainer; an endpoint is served elsewhere (placement = "server")')
        return self

    @property
    def local_server(self) -> bool:
        """A vLLM server of the teacher's own, started with the run."""
        return self.model is not None and self.placement == "server"


class StatusConfig(StrictModel):
    """What the launcher shows of a run (`[status]`), from `RUN/metrics.jsonl`
    (``prime_rl.observe.status``): a `status` pane in the tmux session, or a summary on stdout."""

    every_steps: int = Field(10, ge=0)
    """A headless run (`--no-tmux`) prints the status every this many steps; 0 = never (so does `--quiet`)."""

    interval_s: float = Field(3.0, gt=0)
    """Seconds between redraws of the tmux session's `status` pane."""


class DashboardConfig(StrictModel):
    """The run's web page (`[dashboard]`, `prime-rl dashboard`): metrics, status and the traced rollouts, live."""

    enabled: bool = False
    """Start the page beside the run (a process of its own, with a tmux pane; the launcher prints its URL)."""

    port: int = Field(8265, ge=1, le=65535)
    """Port it listens on."""

    host: str = "127.0.0.1"
    """Address it listens on; any other than loopback needs the token the launcher prints in the URL."""


class WatchdogConfig(StrictModel):
    """The launcher's watchdog (`[watchdog]`): it reads every process's heartbeat
    (`RUN/logs/<process>.heartbeat.json`) and speaks up when none of them makes progress."""

    report_s: float = Field(120.0, ge=0)
    """Seconds without progress in any process before the launcher prints what each one waits for (again at most this often); 0 = never report."""

    timeout_s: float = Field(1800.0, ge=0)
    """Seconds without progress in any process before the launcher stops the run (exit 1); 0 = never, only report."""

    @model_validator(mode="after")
    def _report_before_timeout(self) -> WatchdogConfig:
        if self.report_s and self.timeout_s and self.report_s > self.timeout_s:
            raise ValueError(f"report_s ({self.report_s:g}) must not exceed timeout_s ({self.timeout_s:g})")
        return self


# shared field -> the section fields it fills ("section.path.to.field").
SHARED_FIELDS: dict[str, tuple[str, ...]] = {
    "model": ("trainer.model.name", "orchestrator.model", "inference.model"),
    "max_steps": ("trainer.max_steps", "orchestrator.max_steps"),
    "seq_len": ("trainer.seq_len", "orchestrator.seq_len", "inference.seq_len"),
    "output_dir": ("trainer.output_dir", "orchestrator.output_dir", "inference.output_dir"),
    "async_level": ("orchestrator.async_level",),
    "seed": ("trainer.seed", "orchestrator.seed", "inference.seed"),
    "batch_size": ("orchestrator.batch_size",),
    "rollouts_per_example": ("orchestrator.rollouts_per_example",),
    "sampling": ("orchestrator.sampling",),
    "env": ("orchestrator.env",),
    "wandb": ("trainer.wandb", "orchestrator.wandb"),
    "transport": ("trainer.transport", "orchestrator.transport"),
    "weight_transfer": ("trainer.weight_transfer", "orchestrator.weight_transfer", "inference.weight_transfer"),
    "ckpt": ("trainer.ckpt", "orchestrator.ckpt"),
    "preflight": ("orchestrator.preflight",),
    "eval": ("orchestrator.eval",),
}


class RLConfig(StrictModel):
    """`prime-rl CONFIG.toml`: the whole RL run (shared fields + one section per process)."""

    model: str | None = None
    """Model to start from (HF id or local path); fills every section."""

    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps of the run."""

    seq_len: int | None = Field(None, ge=8)
    """Maximum tokens (prompt + completion) per sample."""

    output_dir: Path | None = None
    """Run directory shared by the three processes."""

    async_level: int | None = Field(None, ge=0)
    """Most policy versions a batch may lag behind its step."""

    seed: int | None = None
    """Random seed."""

    batch_size: int | None = Field(None, ge=1)
    """Rollouts per step (flat hosted-training form)."""

    rollouts_per_example: int | None = Field(None, ge=1)
    """Samples per prompt (flat hosted-training form)."""

    sampling: SamplingConfig | None = None
    """Sampling settings (flat hosted-training form)."""

    env: list[EnvConfig] | None = None
    """Environments (flat hosted-training form: `[[env]]`)."""

    wandb: WandbConfig | None = None
    """W&B logging for trainer and orchestrator; off when absent."""

    transport: TransportConfig | None = None
    """Rollout transport settings for trainer and orchestrator."""

    weight_transfer: WeightTransferConfig | None = None
    """How each new policy reaches the vLLM servers (`[weight_transfer]`, for all three processes)."""

    ckpt: CheckpointConfig | None = None
    """Checkpoint settings for trainer and orchestrator."""

    preflight: PreflightConfig | None = None
    """Difficulty check before RL (orchestrator)."""

    eval: EvalConfig | None = None
    """Evaluation during RL (orchestrator)."""

    trainer: TrainerConfig = TrainerConfig()
    """Trainer process."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """Orchestrator process."""

    inference: InferenceConfig = InferenceConfig()
    """Inference process."""

    deployment: DeploymentConfig = DeploymentConfig()
    """GPUs for inference and for the trainer on one node."""

    slurm: SlurmConfig | None = None
    """The SLURM job for `prime-rl CONFIG.toml --slurm`; None = no SLURM settings."""

    watchdog: WatchdogConfig = WatchdogConfig()
    """Launcher's stall watchdog over the processes' heartbeats."""

    status: StatusConfig = StatusConfig()
    """The run's status: the tmux session's `status` pane, a headless run's periodic summary."""

    dashboard: DashboardConfig = DashboardConfig()
    """The run's web page (off unless enabled)."""

    teacher: TeacherConfig | None = None
    """The teacher of on-policy distillation (`[teacher]`, with `[trainer.loss.distill]`); None = none."""

    @model_validator(mode="before")
    @classmethod
    def _propagate_shared(cls, data: Any) -> Any:
        if isinstance(data, dict):
            propagate_shared(data)
        return data

    @property
    def num_replicas(self) -> int:
        """vLLM servers of the run: per node `[deployment]`'s split, or whole inference nodes."""
        tp = self.inference.tensor_parallel_size
        if self.slurm is not None and self.slurm.multi_node:
            return self.slurm.inference_nodes * max(1, self.slurm.gpus_per_node // tp)
        return self.deployment.inference_gpus // tp

    @property
    def num_trainer_ranks(self) -> int:
        """Trainer ranks: `[slurm]`'s trainer nodes, else `[deployment]` (or, on one node,
        `orchestrator.num_trainer_ranks`, the older spelling)."""
        if self.slurm is not None and self.slurm.multi_node:
            return (self.slurm.nodes - self.slurm.inference_nodes) * max(1, self.slurm.gpus_per_node)
        if self.older_ranks_spelling:
            return self.orchestrator.num_trainer_ranks
        return self.deployment.trainer_gpus

    @property
    def older_ranks_spelling(self) -> bool:
        """`orchestrator.num_trainer_ranks` was written on a single-node run (it sets
        `deployment.trainer_gpus`; ``prime_rl.launch.resolve``)."""
        return "num_trainer_ranks" in self.orchestrator.model_fields_set and not (self.slurm and self.slurm.multi_node)

    @property
    def lora_rank_served(self) -> int | None:
        """The adapter rank vLLM serves up to: `inference.max_lora_rank`, else the next rank vLLM
        accepts above `trainer.lora.rank`; None without LoRA."""
        if self.trainer.lora is None:
            return None
        return self.inference.max_lora_rank or vllm_lora_rank(self.trainer.lora.rank)

    def replica_urls(self, hosts: list[str] | None = None) -> list[str]:
        """One URL per replica: ports `inference.port`, +1, ... on each host (default: inference.host)."""
        hosts = hosts or [self.inference.host]
        per_host = self.num_replicas // len(hosts)
        return [f"http://{host}:{self.inference.port + i}" for host in hosts for i in range(per_host)]

    def _placement(self) -> None:
        """Trainer ranks and replicas come from `[deployment]` (or `[slurm]`'s nodes);
        `orchestrator.num_trainer_ranks`, the older spelling, still works on one node, unless
        it contradicts `deployment.trainer_gpus`."""
        deployment, orchestrator, tp = self.deployment, self.orchestrator, self.inference.tensor_parallel_size
        if deployment.inference_gpus % tp:
            raise ValueError(
                f"deployment.inference_gpus ({deployment.inference_gpus}) must be a multiple of "
                f"inference.tensor_parallel_size ({tp}): each replica takes {tp} GPUs"
            )
        needed = deployment.inference_gpus + deployment.trainer_gpus
        if self.slurm is not None and not self.slurm.multi_node and 0 < self.slurm.gpus_per_node < needed:
            raise ValueError(
                f"slurm.gpus_per_node ({self.slurm.gpus_per_node}) is less than the {needed} GPUs [deployment] "
                f"splits on one node (inference_gpus {deployment.inference_gpus} + trainer_gpus {deployment.trainer_gpus})"
            )
        if self.slurm is not None and self.slurm.multi_node and 0 < self.slurm.gpus_per_node < tp:
            raise ValueError(f"inference.tensor_parallel_size ({tp}) exceeds slurm.gpus_per_node ({self.slurm.gpus_per_node})")
        if self.older_ranks_spelling and "trainer_gpus" in deployment.model_fields_set \
                and deployment.trainer_gpus != orchestrator.num_trainer_ranks:
            raise ValueError(
                f"conflicting values: `deployment.trainer_gpus` = {deployment.trainer_gpus} but "
                f"`orchestrator.num_trainer_ranks` = {orchestrator.num_trainer_ranks}; set deployment.trainer_gpus only"
            )
        if orchestrator.batch_size < self.num_trainer_ranks:
            raise ValueError(
                f"batch_size ({orchestrator.batch_size}) must be at least the trainer's ranks "
                f"({self.num_trainer_ranks}): every rank needs a sample"
            )

    @model_validator(mode="after")
    def _consistent(self) -> RLConfig:
        """Checks only: what is derived from these settings (each process's own copy of them)
        is filled in by ``prime_rl.launch.resolve``, once, after validation."""
        self._placement()
        for env in self.orchestrator.env:
            if problem := registry.tool_parser_problem(env.id, registry.declares_tools(env.id), self.inference.tool_call_parser):
                raise ValueError(problem)
        self._lora()
        self._teacher()
        if self.trainer.weight_transfer.mode == "memory" and self.slurm is not None and self.slurm.multi_node:
            raise ValueError('weight_transfer.mode = "memory" runs on one node for now (its group binds to loopback); '
                             'use "directory" in a multi-node job')
        # One checkpoint schedule for both processes: the orchestrator follows the trainer's.
        if "ckpt" in self.orchestrator.model_fields_set and self.orchestrator.ckpt != self.trainer.ckpt:
            raise ValueError(
                "conflicting values: `orchestrator.ckpt` differs from `trainer.ckpt`; set `[ckpt]` once for both"
            )
        return self

    def _lora(self) -> None:
        """`[trainer.lora]` turns on adapter serving in inference and adapter loading in the
        orchestrator; either one set without the trainer training adapters is a mistake."""
        lora, inference, orchestrator = self.trainer.lora, self.inference, self.orchestrator
        if lora is None:
            if orchestrator.lora_adapter is not None:
                raise ValueError("orchestrator.lora_adapter is set but `[trainer.lora]` is not: the trainer would write full weights")
            return
        if inference.max_lora_rank is not None and inference.max_lora_rank < lora.rank:
            raise ValueError(f"inference.max_lora_rank ({inference.max_lora_rank}) is below trainer.lora.rank ({lora.rank})")
        if self.lora_rank_served not in VLLM_LORA_RANKS:
            raise ValueError(f"inference.max_lora_rank: vLLM accepts one of {list(VLLM_LORA_RANKS)}, got {self.lora_rank_served}")
        served = inference.served_model_name or inference.model
        if (orchestrator.lora_adapter or LORA_ADAPTER_NAME) in (served, orchestrator.model):
            raise ValueError(f"orchestrator.lora_adapter {orchestrator.lora_adapter or LORA_ADAPTER_NAME!r} must differ from the served model's name")


    def _teacher(self) -> None:
        """A teacher and the distillation loss come together: one without the other would
        score tokens for nothing, or train toward logprobs nobody sends."""
        distill = self.trainer.loss.distill
        if self.teacher is None and distill is not None:
            raise ValueError("trainer.loss.distill is set but there is no `[teacher]` (model = a folder, or endpoint = a name)")
        if self.teacher is not None and distill is None:
            raise ValueError("`[teacher]` is set but `[trainer.loss.distill]` is not: the teacher's logprobs would not be trained on")
        if self.teacher is not None and self.teacher.local_server and self.slurm is not None and self.slurm.multi_node:
            raise ValueError("teacher.model: a local teacher runs on one node; in a multi-node job serve it yourself and set teacher.endpoint")


LORA_ADAPTER_NAME = "policy-lora"
"""The name each step's adapter is loaded under (in place) unless `orchestrator.lora_adapter` says otherwise."""


def propagate_shared(data: dict[str, Any]) -> None:
    """Copy each shared field set at the top level into its section fields (in place).

    A section that sets the same field explicitly to a different value is a conflict.
    """
    for shared, targets in SHARED_FIELDS.items():
        if shared not in data or data[shared] is None:
            continue
        value = data[shared]
        for target in targets:
            *parents, leaf = target.split(".")
            node = data
            for part in parents:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                if not isinstance(child, dict):  # wrong type: let pydantic report it
                    break
                node = child
            else:
                if leaf in node and _normalized(node[leaf]) != _normalized(value):
                    raise ValueError(
                        f"conflicting values: `{shared}` = {value!r} but `{target}` = {node[leaf]!r}; set one of them"
                    )
                node[leaf] = value


def _normalized(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, dict | list):
        return value
    return str(value)  # CLI flags arrive as strings: `--max-steps 3` equals `max_steps = 3`
