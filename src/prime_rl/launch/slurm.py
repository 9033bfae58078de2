"""`prime-rl CONFIG.toml --slurm`: the run as one SLURM job.

At submission the launcher validates the config, prepares the run directory as for a
local run, writes the resolved config to ``RUN/slurm/rl.json`` and renders
``RUN/slurm/job.sbatch`` from `[slurm]`. The script resolves the job's nodes and their
addresses from SLURM (``scontrol``), then starts ``prime-rl slurm-node`` on every node
with ``srun``. Each node's launcher starts that node's processes (``prime_rl.launch.deployment``)
in a tmux session of its own, exactly like a local run:

- one node: the whole trio, GPUs split by `[deployment]`;
- several: inference nodes first, then trainer nodes (multi-node torchrun) with the
  orchestrator on the first of them. The job ends with the trainer side; if either side
  fails, the script stops the other and exits non-zero, so no allocation outlives a
  failure.

The run directory must be on a filesystem every node shares.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from prime_rl.config import RLConfig, SlurmConfig
from prime_rl.launch.deployment import (
    Placement, count_gpus, describe, plan_multi_node, plan_single_node, process_specs,
)
from prime_rl.launch.launcher import run, tmux_available, tmux_session_name
from prime_rl.rundir import write_json_atomic
from prime_rl.launch.resolve import placed, resolve, with_server_key, with_transport
from prime_rl.settings import ConfigError
from prime_rl.observe.status import StatusOptions

HOSTS_VAR = "PRIME_RL_SLURM_HOSTS"
ADDRS_VAR = "PRIME_RL_SLURM_ADDRS"


def slurm_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "slurm"


def job_name(config: RLConfig, run_dir: Path) -> str:
    return config.slurm.job_name or f"prime-rl-{run_dir.name}"


def session_name(run_dir: Path, node: str) -> str:
    """A tmux session per node (two SLURM nodes may share a machine), named as tmux accepts."""
    return tmux_session_name(f"prime-rl-{run_dir.name}", node)


# --------------------------------------------------------------------------- submission


def prepare(config: RLConfig, run_dir: Path, tmux: bool = True) -> tuple[Path, Path]:
    """Write RUN/slurm/rl.json (resolved config with the run's keys, readable by the user only) and job.sbatch."""
    folder = slurm_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    # Every route of the job's vLLM servers, admin ones included, needs a key (inference.auth):
    # beyond loopback on several nodes, and any user of a shared node reaches loopback.
    config = with_server_key(config)
    # Transport keys drawn once, here: every node resolves its own processes from rl.json.
    config = with_transport(config)
    resolved = folder / "rl.json"
    write_json_atomic(resolved, config.model_dump(mode="json"), private=True)
    script = folder / "job.sbatch"
    script.write_text(render(config, run_dir, resolved, python=sys.executable, workdir=Path.cwd(), tmux=tmux))
    return resolved, script


def render(config: RLConfig, run_dir: Path, resolved: Path, *, python: str, workdir: Path, tmux: bool = True) -> str:
    """The sbatch script: directives from `[slurm]`, node discovery, one srun per side."""
    slurm: SlurmConfig = config.slurm
    run_dir = Path(run_dir).resolve()
    directives = [
        f"--job-name={job_name(config, run_dir)}",
        f"--nodes={slurm.nodes}",
        "--ntasks-per-node=1",
        f"--time={slurm.time}",
        f"--output={slurm_dir(run_dir) / 'job-%j.log'}",
    ]
    if slurm.gpus_per_node:
        directives.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.cpus_per_node:
        directives.append(f"--cpus-per-task={slurm.cpus_per_node}")
    directives += exclusive_directives(slurm)
    if slurm.partition:
        directives.append(f"--partition={slurm.partition}")
    if slurm.account:
        directives.append(f"--account={slurm.account}")
    directives += slurm.sbatch_args
    check_one_line(run_dir, directives)
    node_cmd = [python, "-m", "prime_rl.cli", "slurm-node", str(resolved.resolve())] + ([] if tmux else ["--no-tmux"])
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives)]
    lines += [
        f"# Rendered by `prime-rl --slurm` for {run_dir}; the resolved config is {resolved.resolve()}.",
        "set -uo pipefail",
        f"cd {shlex.quote(str(workdir))}",
        *slurm.setup,
        "export PYTHONUNBUFFERED=1",
        "# The job's nodes in SLURM's order, and the address each is reached at (NodeAddr).",
        'HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
        'ADDRS=""',
        'for host in ${HOSTS//,/ }; do',
        "    addr=$(scontrol show node \"$host\" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)",
        '    ADDRS="${ADDRS:+$ADDRS,}${addr:-$host}"',
        "done",
        f'export {HOSTS_VAR}="$HOSTS" {ADDRS_VAR}="$ADDRS"',
        'echo "[prime-rl] job $SLURM_JOB_ID: nodes $HOSTS (addresses $ADDRS)"',
        f"NODE=({shlex.join(node_cmd)})",
    ]
    if not slurm.multi_node:
        lines += ['srun --nodes=1 --ntasks=1 "${NODE[@]}"', "exit $?"]
        return "\n".join(lines) + "\n"
    n_inf, n_train = slurm.inference_nodes, slurm.nodes - slurm.inference_nodes
    lines += [
        f'INFERENCE_HOSTS=$(echo "$HOSTS" | cut -d, -f1-{n_inf})',
        f'TRAINER_HOSTS=$(echo "$HOSTS" | cut -d, -f{n_inf + 1}-)',
        f'srun --nodes={n_inf} --ntasks={n_inf} --nodelist="$INFERENCE_HOSTS" --kill-on-bad-exit=1 "${{NODE[@]}}" &',
        "INFERENCE=$!",
        f'srun --nodes={n_train} --ntasks={n_train} --nodelist="$TRAINER_HOSTS" --kill-on-bad-exit=1 "${{NODE[@]}}" &',
        "TRAINER=$!",
        "# The run ends with the trainer side; whichever side ends first, the other is stopped.",
        'while kill -0 "$TRAINER" 2>/dev/null && kill -0 "$INFERENCE" 2>/dev/null; do sleep 2; done',
        'if kill -0 "$TRAINER" 2>/dev/null; then',
        '    echo "[prime-rl] inference ended before the run finished; stopping the trainer nodes" >&2',
        '    kill -TERM "$TRAINER"; wait "$TRAINER"; exit 1',
        "fi",
        'wait "$TRAINER"; code=$?',
        'kill -TERM "$INFERENCE" 2>/dev/null; wait "$INFERENCE"',
        'echo "[prime-rl] trainer nodes exited with code $code"',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def check_one_line(run_dir: Path, directives: list[str]) -> None:
    """The script names the run directory in a comment and `#SBATCH` lines, where quoting does
    not help: a line break there would end the line and bash would run the rest as a command."""
    if any(c in str(run_dir) for c in "\r\n"):
        raise ConfigError(f"trainer.output_dir: {str(run_dir)!r} holds a line break; a SLURM job script cannot name it safely")
    for directive in directives:
        if any(c in directive for c in "\r\n"):
            raise ConfigError(f"slurm: the #SBATCH option {directive!r} holds a line break; give each option on one line")


MEMORY_OPTIONS = frozenset({"--mem", "--mem-per-cpu", "--mem-per-gpu"})
"""sbatch refuses two of them together: one in `sbatch_args` replaces our `--mem=0`."""


def exclusive_directives(slurm: SlurmConfig) -> list[str]:
    """`--exclusive` and `--mem=0` with `exclusive`, each unless `sbatch_args` sets that option itself."""
    if not slurm.exclusive:
        return []
    given = {arg.split(maxsplit=1)[0].split("=", 1)[0] for arg in slurm.sbatch_args if arg.strip()}
    return [*([] if "--exclusive" in given else ["--exclusive"]), *([] if given & MEMORY_OPTIONS else ["--mem=0"])]


def submit(script: Path) -> str:
    """`sbatch` the script; returns the job id."""
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigError("--slurm: `sbatch` is not on PATH (is this a SLURM login node?)") from None
    if out.returncode != 0:
        raise ConfigError(f"--slurm: sbatch refused {script}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def how_to_follow(config: RLConfig, run_dir: Path, job_id: str) -> list[str]:
    run_dir = Path(run_dir).resolve()
    first_trainer = config.slurm.inference_nodes if config.slurm.multi_node else 0
    return [
        f"submitted job {job_id} ({config.slurm.nodes} node(s)); cancel with `scancel {job_id}`",
        f"job log: {slurm_dir(run_dir) / f'job-{job_id}.log'}; process logs: {run_dir / 'logs'}/",
        f"follow: tail -F {run_dir / 'logs'}/orchestrator.log",
        f"attach to a node's tmux session (node = one of `squeue -j {job_id} -o %N`; the orchestrator's is node "
        f"{first_trainer} of the list): srun --jobid {job_id} --overlap --nodelist NODE --pty tmux attach -t "
        f"{session_name(run_dir, 'NODE')}",
    ]


# --------------------------------------------------------------------------- on each node


def node_placement(config: RLConfig) -> tuple[Placement, int, str]:
    """(the job's placement, this node's index in it, this node's name) from SLURM's environment."""
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    hosts = [h for h in os.environ.get(HOSTS_VAR, "").split(",") if h]
    addrs = [a for a in os.environ.get(ADDRS_VAR, "").split(",") if a]
    if not config.slurm.multi_node:
        return plan_single_node(config, count_gpus()), 0, name
    if name not in hosts or len(addrs) != len(hosts):
        raise ConfigError(f"slurm-node: node {name!r} is not in {HOSTS_VAR}={hosts} (addresses {addrs}); run it from the job script")
    return plan_multi_node(config, addrs), hosts.index(name), name


def node_main(argv: list[str]) -> int:
    """`prime-rl slurm-node RUN/slurm/rl.json [--no-tmux]`: this node's processes, until done."""
    if not argv or argv[0].startswith("-"):
        raise ConfigError("usage: prime-rl slurm-node RUN/slurm/rl.json [--no-tmux] (started by the job script)")
    config = resolve(RLConfig.model_validate_json(Path(argv[0]).read_text()))  # resolved already: it stays as it is
    if config.slurm is None:
        raise ConfigError(f"{argv[0]}: no [slurm] section")
    run_dir = Path(config.trainer.output_dir)
    placement, index, name = node_placement(config)
    config = placed(config, placement)
    specs = process_specs(config, run_dir, placement, node=index, job_id=os.environ.get("SLURM_JOB_ID", ""))
    mine = [line for line in describe(placement) if len(placement.nodes) == 1 or line.startswith(f"node {index} ")]
    for line in mine:
        print(f"[prime-rl] {name}: {line}", flush=True)
    use_tmux = "--no-tmux" not in argv and tmux_available()
    status = StatusOptions.of(config) if placement.nodes[index].orchestrator else None  # where the steps are logged
    return run(run_dir, specs, use_tmux, session_name=session_name(run_dir, name), status=status)
