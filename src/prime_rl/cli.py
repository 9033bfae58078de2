"""The `prime-rl` command.

    prime-rl CONFIG.toml [--dotted.flags ...] [--no-tmux] [--dry-run] [--clean]   RL run (the trio)
    prime-rl CONFIG.toml --resume | --resume-step N [...]                        continue a run
    prime-rl sft CONFIG.toml [--dotted.flags ...]                                 supervised fine-tuning
    prime-rl [sft] --help                                                         every setting, with its doc

Configs are validated, and model paths checked, before any process starts; a bad
config exits with code 2 and one line per problem. The resolved config of each
process is written to RUN/configs/ and is what that process reads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from prime_rl.config import RLConfig, SFTConfig, check_model_path
from prime_rl.launcher import ProcessSpec, run, tmux_available
from prime_rl.resume import ResumeRefused, check_resumable, choose_resume_step, rewind
from prime_rl.rundir import (
    checkpoints_dir,
    config_path,
    logs_dir,
    metrics_path,
    rollouts_dir,
    weights_dir,
    weights_step_dir,
    write_json_atomic,
)
from prime_rl.settings import ConfigError, help_text, load_config, split_argv

LAUNCHER_FLAGS = {
    "--no-tmux": "run headless: one log file per process under RUN/logs/ (default when tmux is missing)",
    "--dry-run": "write each process's resolved config to RUN/configs/ and exit",
    "--clean": "delete a previous run's weights, logs and metrics in the run directory first",
    "--resume": "continue the run in output_dir from its newest complete checkpoint",
    "--resume-step N": "continue from checkpoint N (later weights, checkpoints and metrics rows are discarded)",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["sft"]:
            sys.exit(sft(argv[1:]))
        if argv[:1] == ["rl"]:
            argv = argv[1:]
        sys.exit(rl(argv))
    except ConfigError as e:
        print(f"prime-rl: {e}", file=sys.stderr)
        sys.exit(2)


# --------------------------------------------------------------------------- rl


def rl(argv: list[str]) -> int:
    if not argv or "--help" in argv or "-h" in argv:
        print_help("prime-rl CONFIG.toml [flags]", RLConfig, LAUNCHER_FLAGS)
        return 0
    argv, resume_step = take_resume_step(argv)
    launcher_flags = {flag for flag in LAUNCHER_FLAGS if flag in argv}
    files, flags = split_argv([a for a in argv if a not in LAUNCHER_FLAGS])
    if not files:
        raise ConfigError("expected a config file: prime-rl CONFIG.toml [flags]")
    config = load_config(RLConfig, files, flags)
    checked_model_path(config.trainer.model.name, "trainer.model.name")
    checked_model_path(config.inference.model, "inference.model")

    run_dir = Path(config.trainer.output_dir)
    resuming = "--resume" in launcher_flags or resume_step is not None
    if resuming:
        if "--clean" in launcher_flags:
            raise ConfigError("--clean and --resume contradict each other: start over or continue, not both")
        step = prepare_resume(config, run_dir, resume_step, dry_run="--dry-run" in launcher_flags)
        print(f"[prime-rl] resuming {run_dir} from checkpoint step {step}", flush=True)
    else:
        prepare_run_dir(run_dir, clean="--clean" in launcher_flags, dry_run="--dry-run" in launcher_flags)
    write_process_configs(config, run_dir)
    if "--dry-run" in launcher_flags:
        print(f"[prime-rl] resolved configs written to {run_dir / 'configs'}/")
        return 0

    use_tmux = "--no-tmux" not in launcher_flags and tmux_available()
    return run(run_dir, process_specs(config, run_dir), use_tmux, session_name=f"prime-rl-{run_dir.name}")


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


def prepare_resume(config: RLConfig, run_dir: Path, requested: int | None, dry_run: bool) -> int:
    """Pick and check the checkpoint, point every process at it, rewind the run directory."""
    try:
        step = choose_resume_step(run_dir, requested)
        check_resumable(run_dir, step, config.trainer.max_steps)
    except ResumeRefused as e:
        raise ConfigError(str(e)) from None
    config.trainer.ckpt.resume_step = step
    config.orchestrator.ckpt.resume_step = step
    # Inference starts on the checkpoint's weights, served under the name requests use.
    config.inference.served_model_name = config.inference.served_model_name or config.inference.model
    config.inference.model = str(weights_step_dir(run_dir, step))
    if not dry_run:
        for line in rewind(run_dir, step):
            print(f"[prime-rl] resume: removed {line}", flush=True)
    return step


def checked_model_path(name: str, field: str) -> None:
    try:
        check_model_path(name, field)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def prepare_run_dir(run_dir: Path, clean: bool, dry_run: bool) -> None:
    """Refuse to mix two runs in one directory unless asked to start over."""
    state = (
        weights_dir(run_dir), checkpoints_dir(run_dir), rollouts_dir(run_dir), metrics_path(run_dir), logs_dir(run_dir),
        run_dir / "wandb",  # W&B run ids: a fresh run starts fresh W&B runs
    )
    leftovers = [p for p in state if p.exists()]
    if leftovers and not dry_run:
        if not clean:
            raise ConfigError(
                f"output_dir {str(run_dir)!r} holds a previous run ({', '.join(p.name for p in leftovers)}); "
                "pass --resume to continue it, --clean to start over, or choose another --output-dir"
            )
        for path in leftovers:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def write_process_configs(config: RLConfig, run_dir: Path) -> None:
    for name in ("inference", "orchestrator", "trainer"):
        path = config_path(run_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, getattr(config, name).model_dump(mode="json"))


def process_specs(config: RLConfig, run_dir: Path) -> list[ProcessSpec]:
    python = sys.executable
    # One thread per process: the processes share the cores (MACHINE_FACTS), and
    # OMP_WAIT_POLICY=PASSIVE stops idle OpenMP threads from spinning.
    quiet = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    ranks = config.orchestrator.num_trainer_ranks
    trainer_cmd = [python, "-m", "trainer.rl", "--config", str(config_path(run_dir, "trainer"))]
    if ranks > 1:
        trainer_cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *trainer_cmd[1:]]
    return [
        ProcessSpec("inference", [python, "-m", "inference.server", "--config", str(config_path(run_dir, "inference"))],
                    env={}, required=False),
        ProcessSpec("orchestrator", [python, "-m", "orchestrator.main", "--config", str(config_path(run_dir, "orchestrator"))],
                    env={**quiet, "OMP_NUM_THREADS": "1"}),
        ProcessSpec("trainer", trainer_cmd, env={**quiet, "OMP_NUM_THREADS": str(config.trainer.num_threads)}),
    ]


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
    out = Path(config.output_dir)
    resolved = out / "configs" / "sft.json"
    resolved.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(resolved, config.model_dump(mode="json"))
    cmd = [sys.executable, "-m", "trainer.sft", "--config", str(resolved)]
    try:
        return subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except KeyboardInterrupt:
        return 130


def print_help(usage: str, cls, extra: dict[str, str]) -> None:
    print(f"usage: {usage}\n\nEvery setting is a TOML key and a flag (kebab-case, dotted by section):\n")
    print("\n".join(help_text(cls)))
    for flag, doc in extra.items():
        print(f"  {flag}\n      {doc}")


if __name__ == "__main__":
    main()
