"""The cores a process starts on, and taking back the run's once it is ready.

On a CPU machine of two cores, the three processes of a run each import torch at once, and
vLLM's API server, whose start-up (~8 CPU-s of imports) is the longest and the only one the
first step waits for, gets two thirds of a core. So the launcher starts the trainer and the
orchestrator on one core (``ProcessSpec.start_cores``, `deployment.cpu_vllm_first`), leaving
vLLM the other, and sets ``RUN_CORES_ENV`` to the run's cores; each process calls
``take_back_cores`` once it is ready and runs on all of them from then on (docs/benchmarks.md,
"vLLM's start-up first").
"""

from __future__ import annotations

import contextlib
import os

import psutil

RUN_CORES_ENV = "PRIME_RL_RUN_CORES"
"""The run's cores (`0,1`), set by the launcher on a process it starts on fewer of them."""

SHARE_WORKER_CORE = "PRIME_RL_VLLM_SHARE_WORKER_CORE"
"""Set to `1` on a CPU vLLM server (``prime_rl.vllm_command.vllm_env``, `inference.cpu_share_core`):
its worker, forked (``inference.vllm_cpu``) or spawned (``inference.vllm_cpu.share_core_when_spawned``,
a vLLM plugin), runs the engine core on its core where vLLM bound it to one. Here, not in
``prime_rl.vllm_command``, because every vLLM process imports the plugin's module: this one
imports psutil alone."""


def format_cores(cores: set[int] | frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def move_threads(proc: psutil.Process, cores: set[int] | frozenset[int]) -> None:
    """Every thread of ``proc`` onto ``cores``: affinity is per thread, and threads already
    started keep their own otherwise (those started later inherit their creator's). A thread
    that ended since the listing, or a core the kernel refuses it, is skipped; a process that
    is gone raises psutil's error."""
    for thread in proc.threads():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(thread.id, cores)


def take_back_cores(name: str) -> set[int] | None:
    """Once process ``name`` is ready: move every thread of it, and of the processes it
    started meanwhile (an orchestrator's environment workers), onto the run's cores
    (``RUN_CORES_ENV``), say so in one line, and clear the variable so that later children do
    not see it. Returns the cores it runs on now, or None where the launcher started the
    process on all of them (nothing to do). Threads and children that exit meanwhile are
    skipped; threads started later inherit the cores of their creator."""
    value = os.environ.pop(RUN_CORES_ENV, None)
    if not value:
        return None
    cores = {int(c) for c in value.split(",")}
    started_on = os.sched_getaffinity(0)
    me = psutil.Process()
    for proc in (me, *me.children(recursive=True)):
        with contextlib.suppress(psutil.Error):  # a child that exited meanwhile
            move_threads(proc, cores)
    now = os.sched_getaffinity(0)  # what the kernel granted (a cpuset may have narrowed since)
    print(f"[{name}] ready: on cores {format_cores(now)} from now (started on {format_cores(started_on)} "
          "while vLLM started: deployment.cpu_vllm_first)", flush=True)
    return now
