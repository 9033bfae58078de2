"""The `prime-rl` command.

    prime-rl CONFIG.toml [--dotted.flags ...] [--no-tmux] [--dry-run] [--clean]   RL run (the trio)
    prime-rl CONFIG.toml --resume | --resume-step N [...]                        continue a run
    prime-rl inference CONFIG.toml [--dotted.flags ...] [--no-tmux]               a warm vLLM server that runs attach to
    prime-rl sft CONFIG.toml [--dotted.flags ...]                                 supervised fine-tuning
    prime-rl eval ENV_ID|CONFIG.toml [-m MODEL] [-n N] [-r R] [-s] [...]          evaluate a model
    prime-rl gepa ENV_ID|CONFIG.toml [-m MODEL] [-M REFLECTION_MODEL] [...]       optimize a system prompt (GEPA)
    prime-rl export RUN_DIR [--step N] [--merge] [--output DIR]                   a run's weights, standalone
    prime-rl [inference|sft|eval|gepa] --help                                     every setting, with its doc

Configs are validated, and model paths checked, before any process starts; a bad
config exits with code 2 and one line per problem. The resolved config of each
process is written to RUN/configs/ and is what that process reads.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from prime_rl.config import (
    EvalRunConfig,
    EvalTarget,
    GepaRunConfig,
    RLConfig,
    SFTConfig,
    check_model_path,
    vllm_lora_rank,
)
from prime_rl.deployment import (
    Placement,
    PlacementError,
    count_gpus,
    describe,
    plan_single_node,
    process_specs,
    replica_specs,
    write_config,
)
from prime_rl.endpoints import Endpoint, load_endpoints
from prime_rl.registry import PASS_PARSER, declares_tools, tool_parser_problem
from prime_rl import warm
from prime_rl.launcher import ProcessSpec, run, tmux_available
from prime_rl.ports import Binding, inference_bindings, port_problems, rl_bindings
from prime_rl.resume import ResumeRefused, check_resumable, choose_resume_step, rewind
from prime_rl.rundir import (
    RUN_MARKER,
    checkpoints_dir,
    complete_steps,
    config_path,
    is_marked_run,
    logs_dir,
    metrics_path,
    output_dir_problem,
    rollouts_dir,
    weights_dir,
    weights_step_dir,
    write_json_atomic,
    write_run_marker,
)
from prime_rl.settings import (
    ConfigError,
    deep_merge,
    format_validation_error,
    help_text,
    load_config,
    parse_flags,
    read_config_file,
    split_argv,
)
from prime_rl.teacher import resolve_teacher

LAUNCHER_FLAGS = {
    "--no-tmux": "run headless: one log file per process under RUN/logs/ (default when tmux is missing)",
    "--dry-run": "write each process's resolved config to RUN/configs/ and exit",
    "--clean": "delete a previous run's weights, logs and metrics in the run directory first (only in a folder a prime-rl run marked: RUN/.prime-rl-run)",
    "--resume": "continue the run in output_dir from its newest complete checkpoint",
    "--resume-step N": "continue from checkpoint N (later weights, checkpoints and metrics rows are discarded)",
    "--slurm": "submit the run as a SLURM job from the config's [slurm] section (with --dry-run: print the sbatch script)",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["sft"]:
            sys.exit(sft(argv[1:]))
        if argv[:1] == ["inference"]:
            sys.exit(inference(argv[1:]))
        if argv[:1] == ["eval"]:
            sys.exit(evaluate(argv[1:]))
        if argv[:1] == ["export"]:
            sys.exit(export(argv[1:]))
        if argv[:1] == ["gepa"]:
            sys.exit(gepa(argv[1:]))
        if argv[:1] == ["slurm-node"]:
            from prime_rl.slurm import node_main

            sys.exit(node_main(argv[1:]))
        if argv[:1] == ["rl"]:
            argv = argv[1:]
        sys.exit(rl(argv))
    except ConfigError as e:
        print(f"prime-rl: {e}", file=sys.stderr)
        sys.exit(2)


# --------------------------------------------------------------------------- rl


def rl(argv: list[str]) -> int:
    if not argv or "--help" in argv or "-h" in argv:
        print_help("prime-rl CONFIG.toml [flags]   (also: prime-rl inference|sft|eval|gepa --help)", RLConfig, LAUNCHER_FLAGS)
        return 0
    argv, resume_step = take_resume_step(argv)
    launcher_flags = {flag for flag in LAUNCHER_FLAGS if flag in argv}
    dry_run, clean = "--dry-run" in launcher_flags, "--clean" in launcher_flags
    files, flags = split_argv([a for a in argv if a not in LAUNCHER_FLAGS])
    if not files:
        raise ConfigError("expected a config file: prime-rl CONFIG.toml [flags]")
    config = load_config(RLConfig, files, flags)
    checked_model_path(config.trainer.model.name, "trainer.model.name")
    checked_model_path(config.inference.model, "inference.model")
    if config.teacher is not None and config.teacher.model is not None:
        checked_model_path(config.teacher.model, "teacher.model")
    config = resolve_teacher(config)
    run_dir = checked_output_dir(config.trainer.output_dir, RL_OUTPUT_DIR, may_clean=True)

    # Every check first: nothing in the run directory is deleted until all of them passed.
    resuming = "--resume" in launcher_flags or resume_step is not None
    if resuming:
        if clean:
            raise ConfigError("--clean and --resume contradict each other: start over or continue, not both")
        step, leftovers = prepare_resume(config, run_dir, resume_step), []
        print(f"[prime-rl] resuming {run_dir} from checkpoint step {step}", flush=True)
    else:
        step, leftovers = None, check_run_dir(run_dir, clean, dry_run)
    start = partial(start_run_dir, run_dir, leftovers, step)  # the last step before launch, never in a dry run

    if "--slurm" in launcher_flags:  # its ports are bound on the job's nodes, not here
        if config.inference.attach:
            raise ConfigError("inference.attach: a --slurm job starts its own servers on its nodes; drop it")
        return submit_slurm(config, run_dir, dry_run=dry_run, tmux="--no-tmux" not in launcher_flags, start=start)
    gpus = count_gpus()
    placement = planned(config, gpus)
    servers = attached_servers(config, placement, run_dir, step)  # before the port check: they hold our ports
    check_ports(config, placement, dry_run, serve=not servers)
    make_dir(run_dir, RL_OUTPUT_DIR)
    specs = process_specs(config, run_dir, placement, serve=not servers)
    show_placement(config, placement, gpus, attached=bool(servers))
    if dry_run:
        print(f"[prime-rl] resolved configs written to {run_dir / 'configs'}/")
        return 0

    start()
    use_tmux = "--no-tmux" not in launcher_flags and tmux_available()
    workers = tuple(f"env-{env.metric_name}" for env in config.orchestrator.env if env.python is not None)
    with warm.leased(servers, run_dir):  # a warm server is left running, whatever the run's end
        return run(run_dir, specs, use_tmux, session_name=f"prime-rl-{run_dir.name}", follow=workers, watchdog=config.watchdog)


def attached_servers(config: RLConfig, placement: Placement, run_dir: Path, resume_step: int | None) -> list[warm.ServerState]:
    """The warm servers (`prime-rl inference`) the run attaches to, the orchestrator pointed at
    them; [] = the run starts its own (``prime_rl.warm`` says when and what is refused)."""
    found = warm.find_servers(placement.replicas)
    if not warm.attach_decision(config.inference.attach, found, config.inference.host):
        return []
    servers = [f.state for f in found]
    warm.check_attachable(config, servers)
    weights = warm.attach(config, servers, run_dir, resume_step)
    urls = ", ".join(s.url for s in servers)
    print(f"[prime-rl] attaching to the warm inference server at {urls} (`prime-rl inference`, pid {servers[0].pid}): "
          f"it loads this run's weights {weights} before sampling and keeps running after the run", flush=True)
    return servers


def submit_slurm(config: RLConfig, run_dir: Path, dry_run: bool, tmux: bool, start: Callable[[], None]) -> int:
    """Render the job script into RUN/slurm/ and submit it (print it with --dry-run); ``start``
    prepares the run directory just before the submission."""
    from prime_rl import slurm

    if config.slurm is None:
        raise ConfigError("--slurm: the config has no [slurm] section (nodes, gpus_per_node, partition, ...)")
    make_dir(run_dir, RL_OUTPUT_DIR)
    _, script = slurm.prepare(config, run_dir, tmux=tmux)
    if dry_run:
        print(script.read_text(), end="")
        print(f"[prime-rl] sbatch script written to {script} (not submitted)", flush=True)
        return 0
    if shutil.which("sbatch") is None:  # checked here too: nothing is deleted before the submission can work
        raise ConfigError("--slurm: `sbatch` is not on PATH (is this a SLURM login node?)")
    start()
    job_id = slurm.submit(script)
    for line in slurm.how_to_follow(config, run_dir, job_id):
        print(f"[prime-rl] {line}", flush=True)
    return 0


def planned(config: RLConfig, gpus: int) -> Placement:
    try:
        return plan_single_node(config, gpus)
    except PlacementError as e:
        raise ConfigError(str(e)) from None


def show_placement(config: RLConfig, placement: Placement, gpus: int, attached: bool = False) -> None:
    """Where each process runs; on a machine without GPUs, also where it would run on GPUs.
    ``attached``: warm servers serve, none of the run's own (their lines are left out)."""
    d = config.deployment
    both = gpus == 0 and (d.inference_gpus > 1 or d.trainer_gpus > 1)  # a GPU split, run on CPU here
    if both:
        needed = d.inference_gpus + d.trainer_gpus
        print(f"[prime-rl] placement on a node with {needed} GPUs (inference {d.inference_gpus}, trainer {d.trainer_gpus}):", flush=True)
        for line in describe(plan_single_node(config, needed)):
            print(f"[prime-rl]   {line}", flush=True)
        print("[prime-rl] this machine shows no GPU: here the same processes run on CPU "
              "(vLLM-CPU replicas, gloo trainer ranks):", flush=True)
    for line in describe(placement):
        if attached and line.startswith("inference replica"):
            continue
        print(f"[prime-rl]   {line}" if both else f"[prime-rl] {line}", flush=True)


def take_resume_step(argv: list[str]) -> tuple[list[str], int | None]:
    """Remove `--resume-step N` (or `--resume-step=N`) from argv; returns the rest and N."""
    rest, step = [], None
    args = iter(argv)
    for arg in args:
        if arg == "--resume-step" or arg.startswith("--resume-step="):
            value = arg.partition("=")[2] if "=" in arg else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--resume-step: expected a checkpoint step (an integer >= 1), got {value!r}")
            step = int(value)
        else:
            rest.append(arg)
    return rest, step


def prepare_resume(config: RLConfig, run_dir: Path, requested: int | None) -> int:
    """Pick and check the checkpoint and point every process at it (``start_run_dir`` rewinds
    the run directory to it, once every other check passed too)."""
    try:
        step = choose_resume_step(run_dir, requested)
        check_resumable(run_dir, step, config.trainer.max_steps)
    except ResumeRefused as e:
        raise ConfigError(str(e)) from None
    config.trainer.ckpt.resume_step = step
    config.orchestrator.ckpt.resume_step = step
    # Inference starts on the checkpoint's weights, served under the name requests use. With
    # LoRA it serves the base model, and the orchestrator loads the checkpoint's adapter first.
    if config.trainer.lora is None:
        config.inference.served_model_name = config.inference.served_model_name or config.inference.model
        config.inference.model = str(weights_step_dir(run_dir, step))
    return step


def checked_model_path(name: str, field: str) -> None:
    try:
        check_model_path(name, field)
    except ValueError as e:
        raise ConfigError(str(e)) from None


RL_OUTPUT_DIR = "trainer.output_dir (--output-dir)"
OUTPUT_DIR = "output_dir (--output-dir)"


def checked_output_dir(path: Path, field: str, may_clean: bool = False) -> Path:
    """``path`` if it can hold a run: not a file, not under /proc, /sys or /dev, not `/`; with
    ``may_clean`` (an RL run's, which `--clean` empties) not the home folder, the project root
    or a folder above them either."""
    problem = output_dir_problem(path, may_clean)
    if problem is not None:
        raise ConfigError(f"{field}: {problem}")
    return Path(path)


def make_dir(path: Path, field: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{field}: cannot create the folder {str(path)!r} ({e.strerror or e})") from None


def run_state(run_dir: Path) -> tuple[Path, ...]:
    """What a run leaves in its directory, and `--clean` deletes (configs/ is rewritten anyway)."""
    return (
        weights_dir(run_dir), checkpoints_dir(run_dir), rollouts_dir(run_dir), metrics_path(run_dir), logs_dir(run_dir),
        run_dir / "wandb",  # W&B run ids: a fresh run starts fresh W&B runs
    )


def check_run_dir(run_dir: Path, clean: bool, dry_run: bool) -> list[Path]:
    """Refuse to mix two runs in one directory unless asked to start over, and to start over in
    one that no prime-rl run marked as its own; returns what ``--clean`` is to delete."""
    leftovers = [p for p in run_state(run_dir) if p.exists()]
    if not leftovers or (dry_run and not clean):
        return []
    names = ", ".join(p.name for p in leftovers)
    if not clean:
        raise ConfigError(
            f"output_dir {str(run_dir)!r} holds a previous run ({names}); "
            "pass --resume to continue it, --clean to start over, or choose another --output-dir"
        )
    if not is_marked_run(run_dir):
        raise ConfigError(
            f"--clean: output_dir {str(run_dir)!r} was not made by a prime-rl run (no {RUN_MARKER} marker), so its "
            f"{names} stay; a run started before prime-rl wrote that marker has none either: delete it yourself, "
            "continue it with --resume (which marks it), or choose another --output-dir"
        )
    return leftovers


def start_run_dir(run_dir: Path, leftovers: list[Path], resume_step: int | None) -> None:
    """The last step before launch: delete what --clean starts over from, or rewind to the resumed
    checkpoint, then mark the directory as a run's. A resumed run keeps its marker; one made
    before the marker existed gets it now (its complete checkpoint shows a prime-rl run made it)."""
    for path in leftovers:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if resume_step is not None:
        for line in rewind(run_dir, resume_step):
            print(f"[prime-rl] resume: removed {line}", flush=True)
    if resume_step is None or not is_marked_run(run_dir):
        write_run_marker(run_dir, kind="rl")


def check_ports(config: RLConfig, placement: Placement, dry_run: bool, serve: bool = True) -> None:
    """Every port the run binds must be free (without ``serve``, the inference ports are the
    attached warm servers'); a dry run only warns (the port may be freed by the time the run
    starts, e.g. by the run that holds it now)."""
    problems = port_problems(rl_bindings(config, placement, serve=serve))
    if not problems:
        return
    if not dry_run:
        raise ConfigError("\n".join(problems))
    for line in problems:
        print(f"[prime-rl] warning: {line} (the run itself would stop here)", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- inference

INFERENCE_FLAGS = {
    "--no-tmux": "run headless: the server's log under SERVERS_DIR/<host>-<port>/logs/ (default when tmux is missing)",
    "--dry-run": "write the servers' resolved configs and exit",
}
RUN_DIR_FLAGS = ("--clean", "--resume")
"""A run's flags about its directory: accepted (the same command line as the run's) and
ignored, since a server has no run directory (an attached run loads its own weights)."""


def inference(argv: list[str]) -> int:
    """`prime-rl inference CONFIG`: the RL config's vLLM servers alone, resolved as a run
    resolves them, kept up (under the launcher) until Ctrl-C or SIGTERM; a state file per
    server tells runs of a compatible config to attach instead of starting their own."""
    if not argv or "--help" in argv or "-h" in argv:
        print_help("prime-rl inference CONFIG.toml [flags]   (the run's config and flags; runs of it attach to the servers)",
                   RLConfig, INFERENCE_FLAGS)
        return 0
    argv, _ = take_resume_step(argv)
    if "--slurm" in argv:
        raise ConfigError("--slurm: `prime-rl inference` serves on this machine; a --slurm job starts its own servers")
    files, flags = split_argv([a for a in argv if a not in INFERENCE_FLAGS and a not in RUN_DIR_FLAGS])
    if not files:
        raise ConfigError("expected a config file: prime-rl inference CONFIG.toml [flags]")
    config = load_config(RLConfig, files, flags)
    checked_model_path(config.inference.model, "inference.model")
    if config.trainer.lora is not None:
        raise ConfigError("trainer.lora: a LoRA run never attaches to a warm server (its adapter needs its own base "
                          "weights), so no run of this config would use it; run `prime-rl CONFIG` as is")
    placement = planned(config, count_gpus())
    if warm_ones := [f for f in warm.find_servers(placement.replicas) if f.live]:
        raise ConfigError(f"inference.port: a warm server (`prime-rl inference`, pid {warm_ones[0].state.pid}) serves "
                          f"{warm_ones[0].state.url} already; runs of this config attach to it")
    first = placement.replicas[0]
    server_dir = warm.server_dir(first.host, first.port)
    problems = port_problems(inference_bindings(placement))
    if problems:
        raise ConfigError("\n".join(problems))
    make_dir(server_dir, f"{warm.SERVERS_DIR_ENV} ({warm.servers_dir()})")
    config.inference.output_dir = server_dir
    specs = replica_specs(config, server_dir, placement.nodes[0], multi=len(placement.replicas) > 1)
    states = warm.server_states(config, placement.replicas, files, os.getpid(), logs_dir(server_dir))
    for line in describe(placement):
        if line.startswith("inference replica"):
            print(f"[prime-rl] {line}", flush=True)
    if "--dry-run" in argv:
        print(f"[prime-rl] resolved configs written to {server_dir / 'configs'}/")
        return 0
    watch = warm.ServerWatch(states, config.inference.api_key, on_ready=print_ready)
    watch.start()
    try:
        return run(server_dir, specs, "--no-tmux" not in argv and tmux_available(), session_name=f"prime-rl-inference-{first.port}")
    finally:
        watch.stop()  # after the servers stopped: no state file outlives its server


def print_ready(state: warm.ServerState, path: Path) -> None:
    print(f"[prime-rl] inference ready: {state.url} serving {state.model} (state: {path}); runs of this config attach "
          "to it; Ctrl-C stops it", flush=True)


# --------------------------------------------------------------------------- sft


def sft(argv: list[str]) -> int:
    if not argv or "--help" in argv or "-h" in argv:
        print_help("prime-rl sft CONFIG.toml [flags]", SFTConfig, {})
        return 0
    files, flags = split_argv(argv)
    config = load_config(SFTConfig, files, flags)
    checked_model_path(config.model.name, "model.name")
    if not config.data.path.is_file():
        raise ConfigError(f"data.path: SFT data file {str(config.data.path)!r} does not exist (expected JSONL of chats)")
    out = checked_output_dir(config.output_dir, OUTPUT_DIR)
    resolved = out / "configs" / "sft.json"
    make_dir(resolved.parent, OUTPUT_DIR)
    write_json_atomic(resolved, config.model_dump(mode="json"))
    cmd = [sys.executable, "-m", "trainer.sft", "--config", str(resolved)]
    try:
        return subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except KeyboardInterrupt:
        return 130


# --------------------------------------------------------------------------- export


def export(argv: list[str]) -> int:
    """`prime-rl export`: a run's `weights/step_N` as a folder of its own (the merged model or
    the LoRA adapter); the work runs in `trainer.export`, which imports torch."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="prime-rl export",
        description="Write a run's weights/step_N as a standalone folder: with LoRA the PEFT adapter, or with "
        "--merge the base model with the adapter merged in (an HF model folder); full fine-tuning weights are copied.",
    )
    parser.add_argument("run_dir", type=Path, help="the run's output_dir")
    parser.add_argument("--step", type=int, default=None, help="weights/step_N to export (default: the newest complete one)")
    parser.add_argument("--merge", action="store_true", help="merge the LoRA adapter into the base model")
    parser.add_argument("--output", type=Path, default=None, help="folder to create (default: RUN_DIR/exports/step_N[-merged])")
    parser.add_argument("--base", default=None, help="base model of the adapter, if it moved (default: the one adapter_config.json names)")
    args = parser.parse_args(argv)
    complete = complete_steps(weights_dir(args.run_dir))
    if not complete:
        raise ConfigError(f"{str(args.run_dir)!r}: no complete weights/step_N in {weights_dir(args.run_dir)} (is it a run's output_dir?)")
    step = complete[-1] if args.step is None else args.step
    if step not in complete:
        raise ConfigError(f"--step {step}: {weights_step_dir(args.run_dir, step)} is not complete; complete ones: {', '.join(map(str, complete))}")
    output = args.output or args.run_dir / "exports" / f"step_{step}{'-merged' if args.merge else ''}"
    if output.exists():
        raise ConfigError(f"--output: {str(output)!r} exists already; remove it or choose another folder")
    if args.base is not None:
        checked_model_path(args.base, "--base")
    cmd = [sys.executable, "-m", "trainer.export", str(weights_step_dir(args.run_dir, step)), str(output)]
    cmd += ["--merge"] * args.merge + (["--base", args.base] if args.base else [])
    return subprocess.call(cmd)


# --------------------------------------------------------------------------- gepa

GEPA_OPTIONS: dict[str, tuple[str, str]] = {
    "-m/--model": ("model", "rollout model: an endpoint name from --endpoints-path, or a local model folder or HF id, served by a vLLM server started and stopped for the run (default: gpt-4.1-mini)"),
    "-M/--reflection-model": ("reflection-model", "teacher that reads the results and proposes prompts: an endpoint name (default: the rollout model)"),
    "-B/--max-calls": ("gepa.max-calls", "evaluation budget in rollouts, validation included (default 500)"),
    "-n/--num-train": ("gepa.num-train", "training examples reflection minibatches come from (default 100)"),
    "-N/--num-val": ("gepa.num-val", "validation examples the Pareto frontier is kept over (default 50)"),
    "--minibatch-size": ("gepa.minibatch-size", "examples per reflection minibatch (default 3)"),
    "--perfect-score": ("gepa.perfect-score", "minibatches whose every rollout reaches this reward are skipped during reflection (default: none)"),
    "--state-columns": ("gepa.state-columns", "rollout state keys, comma-separated, copied into the reflection data beside query, completion, answer, reward and error"),
    "-a/--env-args": ("entry.args", "JSON object passed to the environment's load_environment()"),
    "--system-prompt-file": ("entry.system_prompt_file", "the seed prompt, from a file, instead of the environment's own (e.g. an earlier run's best_prompt.txt)"),
    "--python": ("entry.python", "the Python of a virtual environment holding the environment and its verifiers (a verifiers environment runs there, in a worker process)"),
    "-t/--max-tokens": ("sampling.max-tokens", "maximum completion tokens per turn (default: the server's)"),
    "-T/--temperature": ("sampling.temperature", "sampling temperature of the rollouts (default: the server's)"),
}
GEPA_USAGE = "prime-rl gepa ENV_ID|CONFIG.toml [options] [--dotted.flags ...]"


def gepa(argv: list[str]) -> int:
    """`prime-rl gepa`: resolve both models, then run the gepa process (and, for a local model,
    a vLLM server beside it) under the launcher, the gepa process on the terminal."""
    if not argv or "--help" in argv or "-h" in argv:
        print_options_help(GEPA_USAGE, "Optimizes an environment's system prompt with GEPA: a teacher model reads evaluation "
                           "results and proposes prompts; a Pareto frontier is kept over validation examples.",
                           GEPA_OPTIONS, GepaRunConfig)
        return 0
    config = load_run_config(GepaRunConfig, argv, GEPA_OPTIONS, "env", GEPA_USAGE)
    config.target = resolve_eval_target(config)
    config.reflection_target = resolve_reflection_target(config)
    run_dir = new_run_dir(config)
    return run(run_dir, served_process_specs(config, run_dir, "gepa", "orchestrator.gepa"), use_tmux=False,
               session_name="", exit_code_from="gepa")


def resolve_reflection_target(config: GepaRunConfig) -> EvalTarget:
    """The teacher: the rollout model itself (its endpoint or local server), or an endpoint."""
    if "base_url" in config.reflection_client.model_fields_set:
        raise ConfigError("reflection_client.base_url: comes from the endpoint; choose the teacher with -M/--reflection-model")
    if config.reflection_model is None or config.reflection_model == config.model:
        config.reflection_client.base_url = config.client.base_url
        config.reflection_client.api_key = config.client.api_key
        return config.target
    endpoint = known_endpoint(config.reflection_model, config, field="reflection_model")
    config.reflection_client.base_url = endpoint.url
    return EvalTarget(type="endpoint", model=endpoint.model, api_key_var=endpoint.key, endpoint_id=endpoint.endpoint_id)


# --------------------------------------------------------------------------- eval

# option -> (the setting it sets, its help); -a/--env-args fills the [[eval]] entry's `args`.
EVAL_OPTIONS: dict[str, tuple[str, str]] = {
    "-m/--model": ("model", "endpoint name from --endpoints-path, or a local model folder (a run's weights/step_N too) or HF id, served by a vLLM server started and stopped for the eval (default: gpt-4.1-mini)"),
    "-n/--num-examples": ("num-examples", "examples per environment, the first ones of its eval split (default 5; -1 = all)"),
    "-r/--rollouts-per-example": ("rollouts-per-example", "rollouts per example (default 3)"),
    "-a/--env-args": ("entry.args", "JSON object passed to the environment's load_environment(), e.g. '{\"min_len\": 5}'"),
    "--system-prompt-file": ("entry.system_prompt_file", "a file whose text replaces the environment's system prompt, e.g. the best_prompt.txt of `prime-rl gepa`"),
    "--python": ("entry.python", "the Python of a virtual environment holding the environment and its verifiers (a verifiers environment runs there, in a worker process)"),
    "-t/--max-tokens": ("sampling.max-tokens", "maximum completion tokens per turn (default: the server's)"),
    "-T/--temperature": ("sampling.temperature", "sampling temperature (default: the server's; 0 = greedy)"),
    "-s/--save-results": ("save-results", "write results.jsonl and summary.json to OUTPUT_DIR/<env>--<model>/<run>/"),
}
EVAL_USAGE = "prime-rl eval ENV_ID|CONFIG.toml [options] [--dotted.flags ...]"


def evaluate(argv: list[str]) -> int:
    """`prime-rl eval`: validate, resolve the model, then run the eval process (and, for a local
    model, a vLLM server beside it) under the launcher, the eval process on the terminal."""
    if not argv or "--help" in argv or "-h" in argv:
        print_eval_help()
        return 0
    config = load_eval_config(argv)
    config.target = resolve_eval_target(config)
    run_dir = new_run_dir(config)
    return run(run_dir, eval_process_specs(config, run_dir), use_tmux=False, session_name="", exit_code_from="eval")


def new_run_dir(config: EvalRunConfig | GepaRunConfig) -> Path:
    """OUTPUT_DIR/runs/<run_id>, created; a run id already used is refused."""
    output_dir = checked_output_dir(config.output_dir, OUTPUT_DIR)
    config.run_id = config.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = output_dir / "runs" / config.run_id
    if run_dir.exists():
        raise ConfigError(f"run_id: {str(run_dir)!r} exists already; choose another run_id or leave it unset")
    make_dir(run_dir, OUTPUT_DIR)
    config.inference.output_dir = run_dir
    return run_dir


def load_eval_config(argv: list[str]) -> EvalRunConfig:
    """Defaults < CONFIG.toml (or one [[eval]] entry of ENV_ID) < options and dotted flags."""
    return load_run_config(EvalRunConfig, argv, EVAL_OPTIONS, "eval", EVAL_USAGE)


def load_run_config(cls, argv: list[str], options: dict, entries: str, usage: str):
    """`prime-rl eval` and `prime-rl gepa`: CONFIG.toml, or ENV_ID as the one ``entries``
    entry, then the command's options and dotted flags."""
    first = argv[0]
    if first.startswith("-"):
        raise ConfigError(f"expected an environment id or a config file first, got {first!r}: {usage}")
    flags, entry = option_flags(argv[1:], options)
    if Path(first).suffix in (".toml", ".json"):
        data, source = read_config_file(Path(first)), first
    else:
        data, source = {entries: [{"id": first}]}, "command line"
    data = deep_merge(data, parse_flags(flags))
    if entry:
        merge_into_entry(data, entry, source, entries, entry_options(options, entry))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def option_flags(args: list[str], options: dict) -> tuple[list[str], dict[str, Any]]:
    """Options (`-n 4`, `--max-tokens 64`, `-s`) -> dotted flags; options of the environment
    entry (`entry.*`: `-a JSON`, `--system-prompt-file F`) -> that entry's fields. Other dotted
    flags (`--inference.port 8123`) pass through."""
    names = {name: setting for option, (setting, _) in options.items() for name in option.split("/")}
    flags: list[str] = []
    entry: dict[str, Any] = {}
    args = iter(args)
    for arg in args:
        name, eq, inline = arg.partition("=")
        if name not in names:
            flags.append(arg)
            continue
        setting = names[name]
        if setting == "save-results":  # a switch: never takes the next argument as its value
            flags.append(f"--save-results={inline or 'true'}")
            continue
        value = inline if eq else next(args, None)
        if value is None:
            raise ConfigError(f"{name}: expected a value")
        if setting == "entry.args":
            entry["args"] = parse_env_args(value)
        elif setting.startswith("entry."):
            entry[setting.removeprefix("entry.")] = value
        else:
            flags += [f"--{setting}", value]
    return flags, entry


def parse_env_args(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"-a/--env-args: not valid JSON ({e}): {value[:200]!r}") from None
    except RecursionError:  # json recurses once per level of nesting
        raise ConfigError("-a/--env-args: not valid JSON: objects or arrays nested too deeply") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"-a/--env-args: expected a JSON object of load_environment() arguments, got {value!r}")
    return parsed


def entry_options(options: dict, entry: dict[str, Any]) -> str:
    """The options that set ``entry``'s fields, for messages (`-a/--env-args`)."""
    return ", ".join(o for o, (setting, _) in options.items() if setting.startswith("entry.") and setting[len("entry."):] in entry)


def merge_into_entry(data: dict[str, Any], entry: dict[str, Any], source: str, entries_key: str, options: str) -> None:
    """The entry options (`-a`, `--system-prompt-file`) go to the only [[eval]] / [[env]] entry
    (with several, it would be ambiguous); `-a` merges into its args."""
    entries = data.get(entries_key)
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        count = len(entries) if isinstance(entries, list) else 0
        raise ConfigError(f"{options}: {source} has {count} [[{entries_key}]] entries; set them in each entry instead")
    target = entries[0]
    for field, value in entry.items():
        if field == "args":
            key = "env_args" if "env_args" in target else "args"
            target[key] = {**(target.get(key) or {}), **value}
        else:
            target[field] = value


def resolve_eval_target(config: EvalRunConfig | GepaRunConfig) -> EvalTarget:
    """An endpoint of the endpoints file, or a local model for a vLLM server of our own; fills
    `client.base_url` (and the `inference` section for a local model)."""
    for field in ("base_url", "api_key"):
        if field in config.client.model_fields_set:
            raise ConfigError(f"client.{field}: comes from the endpoint or the local vLLM server; choose the model with -m/--model")
    endpoint = find_endpoint(config)
    if endpoint is not None:
        config.client.base_url = endpoint.url
        return EvalTarget(type="endpoint", model=endpoint.model, api_key_var=endpoint.key, endpoint_id=endpoint.endpoint_id)
    inference = config.inference
    if "model" in inference.model_fields_set and inference.model != config.model:
        raise ConfigError(f"conflicting values: `model` = {config.model!r} but `inference.model` = {inference.model!r}; set `model` only")
    if "attach" in inference.model_fields_set:
        raise ConfigError("inference.attach: only an RL run attaches to a warm server (`prime-rl inference`)")
    inference.model = config.model
    adapter = lora_adapter(config.model)
    if adapter is not None:  # a LoRA run's weights/step_N: its base model, serving the adapter
        base, rank = adapter
        checked_model_path(base, f"model (the base model {Path(config.model) / 'adapter_config.json'} names)")
        inference.model = base
        inference.max_lora_rank = inference.max_lora_rank or vllm_lora_rank(rank)
        inference.lora_modules = {config.model: str(Path(config.model).resolve())}
    if "port" not in inference.model_fields_set:
        inference.port = free_port(inference.host)
    elif problems := port_problems([Binding(inference.host, inference.port, "inference.port")]):
        raise ConfigError(problems[0])
    config.client.base_url = f"http://{inference.host}:{inference.port}"
    config.client.api_key = inference.api_key
    for entry in config.eval if isinstance(config, EvalRunConfig) else config.env:
        if problem := tool_parser_problem(entry.id, declares_tools(entry.id), inference.tool_call_parser, PASS_PARSER):
            raise ConfigError(problem)
    # Served under its own path name (vLLM's default), which requests then use.
    return EvalTarget(type="local", model=inference.served_model_name or config.model)


def lora_adapter(model: str) -> tuple[str, int] | None:
    """(base model, rank) when ``model`` is a PEFT adapter folder, else None."""
    path = Path(model).expanduser() / "adapter_config.json"
    if not path.is_file():
        return None
    try:
        adapter = json.loads(path.read_text())
        return str(adapter["base_model_name_or_path"]), int(adapter["r"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model: {str(path)!r} is not a PEFT adapter config ({type(e).__name__}: {e})") from None


def find_endpoint(config: EvalRunConfig | GepaRunConfig) -> Endpoint | None:
    """`endpoint_id`, else `model` when it names an endpoint; None for a local folder or HF id."""
    if config.endpoint_id is not None:
        if "model" in config.model_fields_set:
            raise ConfigError(f"conflicting values: `model` = {config.model!r} and `endpoint_id` = {config.endpoint_id!r}; set one of them")
        return known_endpoint(config.endpoint_id, config, field="endpoint_id")
    name = config.model
    if Path(name).expanduser().exists():
        if lora_adapter(name) is None:  # an adapter folder is checked with its base model
            checked_model_path(name, "model")
        return None
    if config.endpoints_path.is_file() and name in (endpoints := load_endpoints(config.endpoints_path)):
        return endpoints[name]
    if "/" in name:  # a path (then it must exist) or an HF id `org/name`
        checked_model_path(name, "model")
        return None
    return known_endpoint(name, config, field="model")


def known_endpoint(name: str, config: EvalRunConfig | GepaRunConfig, field: str) -> Endpoint:
    path = config.endpoints_path
    endpoints = load_endpoints(path) if path.is_file() or field == "endpoint_id" else {}
    if name not in endpoints:
        known = f"known: {', '.join(sorted(endpoints))}" if endpoints else f"no endpoints file at {str(path)!r}"
        local = "; a local model folder or an HF id `org/name` works too" if field == "model" else ""
        raise ConfigError(f"{field}: unknown endpoint {name!r} in {path} ({known}){local}")
    return endpoints[name]


def free_port(host: str) -> int:
    """A port free now on `host` (the server binds it moments later)."""
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return s.getsockname()[1]


def eval_process_specs(config: EvalRunConfig, run_dir: Path) -> list[ProcessSpec]:
    return served_process_specs(config, run_dir, "eval", "orchestrator.eval")


def served_process_specs(config: EvalRunConfig | GepaRunConfig, run_dir: Path, name: str, module: str) -> list[ProcessSpec]:
    """The command's process on the terminal; for a local model, vLLM (logged) beside it."""
    python = sys.executable
    quiet = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    specs = []
    if config.target.type == "local":
        write_config(run_dir, "inference", config.inference.model_dump(mode="json"))
        specs.append(ProcessSpec("inference", [python, "-m", "inference.server", "--config", str(config_path(run_dir, "inference"))],
                                 env={}, required=False))
    path = write_config(run_dir, name, config.model_dump(mode="json"))
    specs.append(ProcessSpec(name, [python, "-m", module, "--config", str(path)], env=quiet, terminal=True))
    return specs


def print_eval_help() -> None:
    print_options_help(
        EVAL_USAGE,
        "Evaluates a model on the eval splits of environments: ENV_ID (e.g. reverse-text) or a config with [[eval]] "
        "entries (configs/eval/*.toml). Prints a table per environment; exit code 0, 2 for a config error, 1 for a "
        "runtime failure.",
        EVAL_OPTIONS, EvalRunConfig,
    )


def print_options_help(usage: str, description: str, options: dict, cls) -> None:
    print(f"usage: {usage}\n")
    print(textwrap.fill(description, width=100))
    print("\noptions:")
    for option, (_, doc) in options.items():
        print(f"  {option}\n      {doc}")
    print("\nEvery setting is a TOML key and a flag (kebab-case, dotted by section):\n")
    print("\n".join(help_text(cls)))


def print_help(usage: str, cls, extra: dict[str, str]) -> None:
    print(f"usage: {usage}\n\nEvery setting is a TOML key and a flag (kebab-case, dotted by section):\n")
    print("\n".join(help_text(cls)))
    for flag, doc in extra.items():
        print(f"  {flag}\n      {doc}")


if __name__ == "__main__":
    main()
