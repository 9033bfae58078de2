"""Where each process runs: GPUs on one node, and nodes of a SLURM job.

One node (`[deployment]`): inference takes GPUs 0..I-1, one vLLM server (replica) per
`inference.tensor_parallel_size` of them, on ports `inference.port`, +1, ...; the trainer
takes the next T GPUs under `torchrun --nproc-per-node T` (FSDP2); the orchestrator needs
no GPU. Each process sees only its own GPUs (CUDA_VISIBLE_DEVICES). On a machine without
GPUs the same numbers mean CPU processes: vLLM-CPU replicas and gloo trainer ranks.

Several nodes (`[slurm]` with nodes > 1): the first `inference_nodes` nodes run replicas
on all their GPUs, the others run one multi-node torchrun (c10d rendezvous on the first
trainer node), and the first trainer node also runs the orchestrator. Every socket binds
the address the config names (`slurm.bind_host`, default the node's own address); on
one node everything stays on 127.0.0.1.

This module plans and writes each process's config; ``prime_rl.launch.launcher`` runs them.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


from prime_rl.config import InferenceConfig, RLConfig
from prime_rl.keys import holds_secret
from prime_rl.launch.launcher import ProcessSpec
from prime_rl.launch.ports import Binding
from prime_rl.observe.dashboard import DASHBOARD_TOKEN_ENV, is_loopback, page_url
from prime_rl.rundir import config_path, write_json_atomic
from prime_rl.launch.teacher import teacher_inference
from prime_rl.vllm_command import TMP_DIR_ENV, server_env, shell_line

# One thread per process: the processes share the cores (docs/machine_facts.md), and
# OMP_WAIT_POLICY=PASSIVE stops idle OpenMP threads from spinning.
QUIET = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}


class PlacementError(ValueError):
    """The config asks for GPUs or nodes this machine or job does not have."""


@dataclass(frozen=True)
class Replica:
    index: int
    node: int
    host: str
    """Address the server binds."""

    url: str
    """Address the orchestrator reaches it at."""

    port: int
    gpus: tuple[int, ...]
    """CUDA devices of the node it sees (empty on CPU)."""


@dataclass(frozen=True)
class TrainerPlacement:
    nnodes: int
    nproc_per_node: int
    gpus: tuple[int, ...]
    rdzv_endpoint: str | None = None
    """`host:port` of the c10d rendezvous in a multi-node job; None on one node."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class NodePlan:
    node: int
    host: str
    replicas: tuple[Replica, ...]
    trainer: TrainerPlacement | None
    trainer_node_rank: int | None
    orchestrator: bool


@dataclass(frozen=True)
class Placement:
    device: str
    """`cuda` or `cpu`."""

    nodes: tuple[NodePlan, ...]
    orchestrator_host: str
    bind_host: str | None
    """What sockets bind beyond their own defaults (multi-node); None = stay on the config's hosts."""

    teacher: Replica | None = None
    """A local distillation teacher's vLLM server (`[teacher] model`), on the first node."""

    @property
    def replicas(self) -> list[Replica]:
        return [r for node in self.nodes for r in node.replicas]

    @property
    def trainer(self) -> TrainerPlacement:
        return next(node.trainer for node in self.nodes if node.trainer is not None)


# --------------------------------------------------------------------------- planning


def count_gpus() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def gpu_memory_bytes() -> int | None:
    """Memory of the smallest GPU this process may use (`nvidia-smi`), None without one."""
    if count_gpus() == 0 or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ours = {d.strip() for d in visible.split(",")} if visible else None
    sizes = [int(mib) * 2**20 for index, mib in (line.split(",") for line in out.splitlines() if "," in line)
             if mib.strip().isdigit() and (ours is None or index.strip() in ours)]
    return min(sizes) if sizes else None


def plan_single_node(config: RLConfig, gpus_available: int) -> Placement:
    """The trio on this machine, GPUs split by `[deployment]` (CPU processes without GPUs)."""
    deployment, inference = config.deployment, config.inference
    local_teacher = config.teacher is not None and config.teacher.local_server
    teacher_gpus = deployment.teacher_gpus if local_teacher else 0
    needed = deployment.inference_gpus + deployment.trainer_gpus + teacher_gpus
    if 0 < gpus_available < needed:
        teacher = f" + teacher_gpus {teacher_gpus}" if teacher_gpus else ""
        raise PlacementError(
            f"deployment: needs {needed} GPUs (inference_gpus {deployment.inference_gpus} + trainer_gpus "
            f"{deployment.trainer_gpus}{teacher}), this machine shows {gpus_available}"
        )
    cuda = gpus_available > 0
    tp = inference.tensor_parallel_size
    replicas = tuple(
        Replica(
            index=i, node=0, host=inference.host, url=url, port=inference.port + i,
            gpus=tuple(range(i * tp, (i + 1) * tp)) if cuda else (),
        )
        for i, url in enumerate(config.replica_urls())
    )
    first = deployment.inference_gpus
    trainer = TrainerPlacement(
        nnodes=1, nproc_per_node=deployment.trainer_gpus,
        gpus=tuple(range(first, first + deployment.trainer_gpus)) if cuda else (),
    )
    node = NodePlan(0, "localhost", replicas, trainer, 0, orchestrator=True)
    teacher = None
    if local_teacher:
        first += deployment.trainer_gpus
        port = config.teacher.port
        teacher = Replica(index=0, node=0, host=inference.host, url=f"http://{inference.host}:{port}", port=port,
                          gpus=tuple(range(first, first + teacher_gpus)) if cuda else ())
    return Placement("cuda" if cuda else "cpu", (node,), config.orchestrator.transport.host, bind_host=None, teacher=teacher)


def plan_multi_node(config: RLConfig, addresses: list[str]) -> Placement:
    """A SLURM job's nodes (by address, in SLURM's order): inference nodes first, then trainers."""
    slurm = config.slurm
    assert slurm is not None and slurm.multi_node
    if len(addresses) != slurm.nodes:
        raise PlacementError(f"slurm.nodes is {slurm.nodes} but the job has {len(addresses)} nodes: {','.join(addresses)}")
    gpus, tp, port = slurm.gpus_per_node, config.inference.tensor_parallel_size, config.inference.port
    per_node = max(1, gpus // tp)
    trainer_hosts = addresses[slurm.inference_nodes :]
    trainer = TrainerPlacement(
        nnodes=len(trainer_hosts), nproc_per_node=max(1, gpus), gpus=tuple(range(gpus)),
        rdzv_endpoint=f"{trainer_hosts[0]}:{slurm.rdzv_port}",
    )
    nodes = []
    for n, address in enumerate(addresses):
        bind = slurm.bind_host or address
        if n < slurm.inference_nodes:
            replicas = tuple(
                Replica(
                    index=n * per_node + j, node=n, host=bind, url=f"http://{address}:{port + j}", port=port + j,
                    gpus=tuple(range(j * tp, (j + 1) * tp)) if gpus else (),
                )
                for j in range(per_node)
            )
            nodes.append(NodePlan(n, address, replicas, None, None, orchestrator=False))
        else:
            rank = n - slurm.inference_nodes
            nodes.append(NodePlan(n, address, (), trainer, rank, orchestrator=rank == 0))
    return Placement("cuda" if gpus else "cpu", tuple(nodes), trainer_hosts[0], bind_host=slurm.bind_host)


def describe(placement: Placement, config: RLConfig | None = None, replicas: bool = True) -> list[str]:
    """The placement in a few lines, for `--dry-run` and the start of a run. With ``config``,
    each vLLM server's command line under its line (`$ ...`, one line each, secrets redacted);
    without ``replicas``, no inference replica (a run attached to warm servers)."""

    def devices(gpus: tuple[int, ...]) -> str:
        return f"GPU {','.join(map(str, gpus))}" if gpus else "CPU"

    def command(where: str, server: Replica, inference: Callable[[RLConfig, Replica], InferenceConfig]) -> list[str]:
        if config is None:
            return []
        # rendered for the device the placement plans (the 8-GPU view of a CPU machine's dry run
        # too); the server itself renders for the vLLM installed on its node (vllm_command.on_cpu)
        return [f"{where}  $ {shell_line(inference(config, server), placement.device == 'cpu', visible(server.gpus))}"]

    lines = []
    multi = len(placement.nodes) > 1
    for node in placement.nodes:
        where = f"node {node.node} ({node.host}): " if multi else ""
        for r in node.replicas if replicas else ():
            lines.append(f"{where}inference replica {r.index}: vLLM on {devices(r.gpus)}, serving {r.url}")
            lines += command(where, r, replica_inference)
        if node.orchestrator:
            lines.append(f"{where}orchestrator: CPU, {len(placement.replicas)} replica(s), batches to trainer ranks at {placement.orchestrator_host}")
        if node.trainer is not None:
            t = node.trainer
            how = "one process" if t.world_size == 1 else f"torchrun, {t.nproc_per_node} rank(s) per node"
            if t.nnodes > 1:
                how += f", trainer node {node.trainer_node_rank + 1} of {t.nnodes}, rendezvous {t.rdzv_endpoint}"
            lines.append(f"{where}trainer: {how} on {devices(t.gpus)} ({t.world_size} FSDP2 rank(s) in all)")
    if (teacher := placement.teacher) is not None:
        lines.append(f"teacher: vLLM on {devices(teacher.gpus)}, serving {teacher.url}")
        lines += command("", teacher, teacher_server)
    return lines


# --------------------------------------------------------------------------- processes


def rl_bindings(config: RLConfig, placement: Placement, serve: bool = True) -> list[Binding]:
    """Every port this node's processes bind (``placement`` of one node, as planned); without
    ``serve`` not the inference ports (warm servers the run attaches to hold them)."""
    bindings = inference_bindings(placement) if serve else []
    transport = config.orchestrator.transport
    # as process_specs and the sender resolve it: the placement's bind host, else the config's, else the address
    host = placement.bind_host or transport.bind_host or placement.orchestrator_host
    for rank in range(config.num_trainer_ranks):
        bindings.append(Binding(host, transport.port + rank, "transport.port" + (f" + {rank} (trainer rank {rank})" if rank else "")))
    if placement.teacher is not None:
        bindings.append(Binding(placement.teacher.host, placement.teacher.port, "teacher.port"))
    if config.dashboard.enabled:
        bindings.append(Binding(config.dashboard.host, config.dashboard.port, "dashboard.port"))
    return bindings


def inference_bindings(placement: Placement) -> list[Binding]:
    """The port of each vLLM replica."""
    return [Binding(r.host, r.port, "inference.port" + (f" + {r.index}" if r.index else "")) for r in placement.replicas]


def process_specs(
    config: RLConfig, run_dir: Path, placement: Placement, node: int = 0, job_id: str = "", serve: bool = True
) -> list[ProcessSpec]:
    """Write the configs of ``node``'s processes to RUN/configs/ and return how to start them;
    without ``serve``, no inference replicas (a run attached to warm servers, ``prime_rl.launch.warm``).
    ``config`` is resolved and placed (``prime_rl.launch.resolve.placed``): this only serializes it."""
    if config.orchestrator.transport.curve_server_secret is None:
        raise PlacementError("process_specs: the config is not placed (prime_rl.launch.resolve.placed): no transport keys")
    plan = placement.nodes[node]
    python = sys.executable
    specs = replica_specs(config, run_dir, plan, multi=len(placement.replicas) > 1) if serve else []
    start_cores = vllm_first_cores(config, placement, plan, serve)
    if plan.orchestrator:
        path = write_config(run_dir, "orchestrator", config.orchestrator.model_dump(mode="json"))
        specs.append(ProcessSpec("orchestrator", [python, "-m", "orchestrator.main", "--config", str(path)],
                                 env={**QUIET, "OMP_NUM_THREADS": "1"}, start_cores=start_cores))
    if plan.trainer is not None:
        specs.append(dataclasses.replace(trainer_spec(config, run_dir, placement, plan, python, job_id), start_cores=start_cores))
    if placement.teacher is not None and node == 0:
        specs.append(teacher_spec(config, run_dir, placement.teacher, python))
    if config.dashboard.enabled and node == 0:
        specs.append(dashboard_spec(config, run_dir, python))
    return specs


def vllm_first_cores(config: RLConfig, placement: Placement, plan: NodePlan, serve: bool) -> frozenset[int] | None:
    """`deployment.cpu_vllm_first`: the core the trainer and the orchestrator start on
    (``prime_rl.cores``) where this node starts a vLLM server on CPU and the launcher has two
    cores: the second, which vLLM's worker leaves free when it binds itself (to the first).
    None (all cores from the start) otherwise: with more cores the three imports do not
    contend, with one there is no other core to leave vLLM."""
    cores = sorted(os.sched_getaffinity(0))
    if not (config.deployment.cpu_vllm_first and serve and plan.replicas and placement.device == "cpu" and len(cores) == 2):
        return None
    return frozenset(cores[1:])


def dashboard_spec(config: RLConfig, run_dir: Path, python: str) -> ProcessSpec:
    """`prime-rl dashboard RUN`: a server the run does not depend on (its exit is reported, the
    run goes on). Its token (on an address other than loopback) is new for every launch and
    travels in the environment, not in the command line other users can read."""
    dash = config.dashboard
    env = {} if is_loopback(dash.host) else {DASHBOARD_TOKEN_ENV: secrets.token_urlsafe(24)}
    return ProcessSpec("dashboard", [python, "-m", "prime_rl.cli", "dashboard", "--port", str(dash.port), "--host", dash.host,
                                     "--", str(run_dir)], env=env, required=False, essential=False)


def dashboard_url(config: RLConfig, specs: list[ProcessSpec]) -> str | None:
    """The page's URL (with its token) when the run starts one."""
    spec = next((s for s in specs if s.name == "dashboard"), None)
    return None if spec is None else page_url(config.dashboard.host, config.dashboard.port, spec.env.get(DASHBOARD_TOKEN_ENV))


def replica_specs(config: RLConfig, run_dir: Path, plan: NodePlan, multi: bool) -> list[ProcessSpec]:
    """The node's vLLM servers (a run's, or `prime-rl inference`'s: the same resolution)."""
    return [replica_spec(config, run_dir, r, sys.executable, multi) for r in plan.replicas]


def replica_spec(config: RLConfig, run_dir: Path, replica: Replica, python: str, multi: bool) -> ProcessSpec:
    name = f"inference-{replica.index}" if multi else "inference"
    return server_spec(run_dir, name, replica_inference(config, replica), replica.gpus, python, transfer_env(config, replica.gpus))


def transfer_env(config: RLConfig, gpus: tuple[int, ...]) -> dict[str, str]:
    """Memory mode on GPUs (one node: ``RLConfig`` refuses it across nodes): the NCCL transfer
    group's bootstrap sockets on loopback, as gloo's are (NCCL picks a network interface
    otherwise). An NCCL_SOCKET_IFNAME of the launcher's own environment is left to win."""
    if config.trainer.weight_transfer.mode != "memory" or not gpus or "NCCL_SOCKET_IFNAME" in os.environ:
        return {}
    return {"NCCL_SOCKET_IFNAME": "lo"}


def teacher_spec(config: RLConfig, run_dir: Path, teacher: Replica, python: str) -> ProcessSpec:
    """The local distillation teacher: a vLLM server of its own (``prime_rl.launch.teacher``)."""
    return server_spec(run_dir, "teacher", teacher_server(config, teacher), teacher.gpus, python)


def replica_inference(config: RLConfig, replica: Replica) -> InferenceConfig:
    """A replica's vLLM server: the run's `[inference]` on the replica's address."""
    return config.inference.model_copy(update={"host": replica.host, "port": replica.port})


def teacher_server(config: RLConfig, teacher: Replica) -> InferenceConfig:
    """The local teacher's vLLM server, tensor parallel over all of its GPUs (`deployment.teacher_gpus`)."""
    return teacher_inference(config).model_copy(update={"tensor_parallel_size": max(1, len(teacher.gpus))})


def server_spec(run_dir: Path, name: str, inference: InferenceConfig, gpus: tuple[int, ...], python: str,
                env: dict[str, str] | None = None) -> ProcessSpec:
    """A vLLM server (`inference.server`) on ``gpus``, its config in RUN/configs/<name>.json; a
    server, not required to exit (the run ends when its other processes are done), its IPC
    temporary files (IPC sockets, its init file) in a directory of its own that the launcher
    removes after it (``TMP_DIR_ENV``)."""
    path = write_config(run_dir, name, inference.model_dump(mode="json"))
    return ProcessSpec(name, [python, "-m", "inference.server", "--config", str(path)],
                       env={**server_env(), **visible(gpus), **(env or {})}, required=False, tmp_dir_env=TMP_DIR_ENV)


def trainer_spec(config: RLConfig, run_dir: Path, placement: Placement, plan: NodePlan, python: str, job_id: str) -> ProcessSpec:
    """One process, torchrun on one node, or this node's part of a multi-node torchrun."""
    t = plan.trainer
    name = "trainer" if not plan.trainer_node_rank else f"trainer-{plan.trainer_node_rank}"
    path = write_config(run_dir, name, config.trainer.model_dump(mode="json"))
    cmd = [python, "-m", "trainer.rl", "--config", str(path)]
    if t.nnodes > 1:
        # c10d hands out node ranks in the order the nodes join (torchrun ignores --node-rank
        # with it), so global rank 0 may run on any trainer node: every rank reaches the
        # orchestrator by address and the run directory is shared.
        cmd = [python, "-m", "torch.distributed.run", f"--nnodes={t.nnodes}", f"--nproc-per-node={t.nproc_per_node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={t.rdzv_endpoint}", f"--rdzv-id={job_id or 'prime-rl'}", *cmd[1:]]
    elif t.nproc_per_node > 1:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={t.nproc_per_node}", *cmd[1:]]
    env = {**QUIET, "OMP_NUM_THREADS": str(config.trainer.num_threads), **visible(t.gpus), **transfer_env(config, t.gpus)}
    # A private TMPDIR the launcher removes: torchrun makes a `torchelastic_*` log folder there and
    # leaves it; memory mode's transfer store lives there (a SIGKILLed trainer cannot remove it)
    torchrun = t.nnodes > 1 or t.nproc_per_node > 1
    private_tmp = torchrun or config.trainer.weight_transfer.mode == "memory"
    return ProcessSpec(name, cmd, env=env, tmp_dir_env=TMP_DIR_ENV if private_tmp else None)


def visible(gpus: tuple[int, ...]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a process's GPUs (nothing on CPU). ``gpus`` index the GPUs the
    launcher may use: its own CUDA_VISIBLE_DEVICES when set (SLURM sets it to the job's GPUs,
    which need not be 0..N-1), else all of the machine's."""
    if not gpus:
        return {}
    ours = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in ours.split(",") if d.strip()] if ours else [str(g) for g in range(max(gpus) + 1)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[g] for g in gpus)}


def write_config(run_dir: Path, name: str, data: dict) -> Path:
    """RUN/configs/<name>.json; readable by its owner only (0600) when it holds a secret: an
    API key or a transport key, in any section (the process reads it from there; whatever is
    logged gets it redacted, prime_rl.keys)."""
    path = config_path(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data, private=holds_secret(data))
    return path
