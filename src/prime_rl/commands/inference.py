"""`prime-rl inference CONFIG.toml`: the RL config's vLLM servers alone, kept warm for runs of
that config to attach to (``prime_rl.launch.warm``). A warm server always requires a key, on every
route: without `inference.api_key` it draws one (readable by this user only, for the runs it
attaches), and beyond loopback it refuses to start without one."""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

from prime_rl.launch import warm
from prime_rl.commands.common import make_dir, planned, print_help, take_resume_step
from prime_rl.config import RLConfig
from prime_rl.launch.deployment import count_gpus, describe, inference_bindings, replica_specs
from prime_rl.launch.launcher import run, tmux_available
from prime_rl.launch.ports import port_problems
from prime_rl.launch.resolve import checked_model_path, resolve, served
from prime_rl.rundir import logs_dir
from prime_rl.settings import ConfigError, load_config, split_argv

INFERENCE_FLAGS = {
    "--no-tmux": "run headless: the server's log under SERVERS_DIR/<host>-<port>/logs/ (default when tmux is missing)",
    "--dry-run": "write the servers' resolved configs and exit",
}

RUN_DIR_FLAGS = ("--clean", "--resume", "--quiet")
"""A run's flags about its directory and its status: accepted (the same command line as the
run's) and ignored, since a server has no run directory (an attached run loads its own
weights) and no steps."""


def main(argv: list[str]) -> int:
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
    config = resolve(load_config(RLConfig, files, flags))
    checked_model_path(config.inference.model, "inference.model")
    if (host := warm.beyond_loopback(config.inference)) is not None:
        raise ConfigError(f"inference.host: a warm server on {host!r} (beyond loopback) needs inference.api_key: anyone who "
                          "reaches it could pause it or load other weights into it; set a key (runs bring the same one), or bind 127.0.0.1")
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
    key, key_file = draw_key(config, server_dir, dry_run="--dry-run" in argv)
    config = served(config, server_dir, key)
    specs = replica_specs(config, server_dir, placement.nodes[0], multi=len(placement.replicas) > 1)
    states = warm.server_states(config, placement.replicas, files, os.getpid(), logs_dir(server_dir), key_file)
    for line in describe(dataclasses.replace(placement, teacher=None), config):  # it serves the replicas alone
        if line.startswith(("inference replica", "  $ ")):  # each replica and its vLLM command line
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


def draw_key(config: RLConfig, server_dir: Path, dry_run: bool) -> tuple[str | None, Path | None]:
    """Without `inference.api_key`, a fresh key for the servers (their resolved configs are then
    0600, deployment.write_config), in ``server_dir/api_key`` for the runs that attach (none in a
    dry run, which shows the servers as they would start). Returns the key and that file; (None,
    None): the key was given."""
    if config.inference.api_key:
        return None, None
    if dry_run:
        return secrets.token_urlsafe(32), None
    key, key_file = warm.draw_key(server_dir)
    print(f"[prime-rl] no inference.api_key: the servers require a drawn one, in {key_file} (readable by you only); "
          "runs of this config on this machine attach with it", flush=True)
    return key, key_file


def print_ready(state: warm.ServerState, path: Path) -> None:
    print(f"[prime-rl] inference ready: {state.url} serving {state.model} (state: {path}); runs of this config attach "
          "to it; Ctrl-C stops it", flush=True)
