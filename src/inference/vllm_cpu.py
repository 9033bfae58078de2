"""`python -m inference.vllm_cpu ARGS`: vLLM's OpenAI server (ARGS as for `python -m
vllm.entrypoints.openai.api_server`) on a CPU machine, its engine and worker processes forked
from the API server instead of spawned.

vLLM starts two processes behind its API server: the engine core, and the worker that holds
the model. Its CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn when it checks the config,
so each of them starts a new interpreter that imports torch and vLLM again, one after the
other: most of a start here. Forked, they begin with the API server's imports already done.
Fork is vLLM's own default on GPUs (wherever CUDA is not initialized yet). On CPU, vLLM
binds each worker's OpenMP threads to its cores through the environment it starts the worker
with (OMP_NUM_THREADS and the affinity variables), which a new interpreter's OpenMP runtime
reads when it loads; a forked worker's runtime was loaded long before, in the API server, so
the worker applies that binding itself before it sets up its device
(``bind_threads_as_spawned``). Where that binding is one core (a 2-core machine: vLLM keeps
the other for its API server and engine core), the engine core joins the worker on it
(``share_worker_core``). Unbound, it ran two threads on both cores beside the trainer:
30% slower steps in the quickstart. Measured (docs/vllm_probe.md, "Fork"): healthy 9.8 s
after the command instead of 24.3 s, the same tokens and logprobs.

It also inspects the model's class in its own process, not a new interpreter
(``inspect_models_in_process``): ~10 s sooner on a machine's first run.

The launcher renders this command (``prime_rl.vllm_command``) when `inference.cpu_fork` is
on (the default); `cpu_fork = false` starts vLLM's module unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys

from prime_rl.cores import SHARE_WORKER_CORE

VLLM_SERVER = "vllm.entrypoints.openai.api_server"

ENGINE_TITLE = "VLLM::EngineCore"
"""How vLLM titles its engine core process (`setproctitle`)."""


def fork_engine_processes() -> None:
    """vLLM's CPU platform check, then VLLM_WORKER_MULTIPROC_METHOD=fork over its `spawn`.
    Fails at the start, naming what is missing, if the pinned vLLM changed the method."""
    from vllm.platforms.cpu import CpuPlatform

    check = getattr(CpuPlatform.check_and_update_config, "__func__", None)
    if check is None:
        raise SystemExit("[inference] vLLM's CpuPlatform.check_and_update_config is no longer a classmethod: "
                         "set inference.cpu_fork = false")

    def check_then_fork(cls, vllm_config) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_then_fork)


def omp_binding(environ: dict[str, str]) -> tuple[int | None, set[int] | None]:
    """The thread count and cores vLLM set for a worker's OpenMP runtime (``environ`` as the
    worker was started with): OMP_NUM_THREADS, and the cores of GOMP_CPU_AFFINITY (`0 1`),
    OMP_PLACES (`{0,1}`) or KMP_AFFINITY (`...,proclist=[0,1]`); None where unset."""
    threads = int(environ["OMP_NUM_THREADS"]) if environ.get("OMP_NUM_THREADS", "").isdigit() else None
    if environ.get("GOMP_CPU_AFFINITY"):
        cores = environ["GOMP_CPU_AFFINITY"].split()
    elif environ.get("OMP_PLACES", "").startswith("{"):
        cores = environ["OMP_PLACES"].strip("{}").split(",")
    elif "proclist=[" in environ.get("KMP_AFFINITY", ""):
        cores = environ["KMP_AFFINITY"].split("proclist=[", 1)[1].split("]", 1)[0].split(",")
    else:
        cores = []
    return threads, ({int(c) for c in cores} if cores and all(c.strip().isdigit() for c in cores) else None)


def bind_threads_as_spawned() -> None:
    """In a forked worker: the binding its OpenMP runtime would have read from the environment
    at a spawned start. The process keeps to the cores (the OpenMP threads it starts inherit
    them) and torch uses that many threads. The objects inherited from the API server leave
    the garbage collector's generations (as vLLM's engine core does with its own after its
    start): they are never freed here, and scanning them would cost every collection."""
    import gc

    import torch

    gc.freeze()
    threads, cores = omp_binding(dict(os.environ))
    if cores is not None:
        os.sched_setaffinity(0, cores)
        share_one_core(cores)
    if threads is not None:
        torch.set_num_threads(threads)


def share_worker_core(cores: set[int]) -> None:
    """The engine core, the worker's parent, on the worker's one core, every thread of it
    (threads it starts later inherit that).

    The engine core and the worker hand each step over shared-memory queues whose readers spin
    (`sched_yield`) for 1 s after each read. Each on a core of its own, the engine core's spin
    takes the core the trainer needs (vLLM reserves it for the engine and the API server), and
    rounds switch between fast and ~2x slower ones; on one core a spinning reader yields to the
    process it waits for. vLLM alone, quickstart rounds: 0.55-0.59 s against 1.06-1.70 s free
    (the API server there too: 0.69-0.85 s, and 1.3-1.4 s on long replies, where it
    detokenizes beside the worker; so it stays where vLLM puts it). docs/vllm_probe.md, "The
    engine and the worker spin-wait". Nothing is moved unless the parent is vLLM's engine core."""
    import psutil

    from prime_rl.cores import move_threads

    engine = psutil.Process().parent()
    if engine is None or not engine.name().startswith(ENGINE_TITLE):
        return
    for _ in range(2):  # once more for threads a thread started while the first pass ran
        move_threads(engine, cores)


def share_core_when_spawned() -> None:
    """vLLM's general-plugin hook (every vLLM process calls it at its start; registered in
    pyproject.toml): in a worker vLLM spawned (`inference.cpu_fork = false`), the engine core
    joins it where vLLM bound it to one core, as a forked worker has it join
    (``bind_threads_as_spawned``; `inference.cpu_share_core`). Left where vLLM puts it, the
    spawned engine core spun on the other core of two, and while the server served few
    sequences every other process waited up to 13 s at a time for a core
    (docs/vllm_probe.md, "The engine and the worker spin-wait"). A no-op in any other
    process: in the API server and the engine core the parent is not the engine core, and a
    forked worker did this already."""
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
        return
    _, cores = omp_binding(dict(os.environ))
    if cores is not None:
        share_one_core(cores)


def share_one_core(cores: set[int]) -> None:
    """``share_worker_core`` where the worker is bound to one core and the server was told to
    (``SHARE_WORKER_CORE``, `inference.cpu_share_core`)."""
    if len(cores) == 1 and os.environ.get(SHARE_WORKER_CORE) == "1":
        share_worker_core(cores)


def bind_forked_workers() -> None:
    """vLLM's CPU worker binds its threads (``bind_threads_as_spawned``) before it sets up its
    device, where vLLM stops torch.set_num_threads from working."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    init_device = CPUWorker.init_device

    def bind_then_init_device(self) -> None:
        bind_threads_as_spawned()
        init_device(self)

    CPUWorker.init_device = bind_then_init_device


def inspect_models_in_process() -> None:
    """vLLM inspects a model's class (what the architecture supports) in a new interpreter,
    so that its API server does not initialize CUDA, then caches what it found under
    VLLM_CACHE_ROOT (`modelinfos/`). That interpreter imports torch and vLLM again: a
    machine's first server waited ~10 s for it here, using no CPU itself meanwhile. On CPU
    there is no CUDA to keep uninitialized, so the API server inspects the class itself
    (importing the model's module, which the forked worker then has); vLLM caches the result
    as before."""
    from vllm.model_executor.models import registry

    if callable(getattr(registry, "_run_in_subprocess", None)):  # tests/test_deployment.py holds vLLM to it
        registry._run_in_subprocess = lambda fn: fn()


def main() -> None:
    fork_engine_processes()
    bind_forked_workers()
    inspect_models_in_process()
    sys.argv = [VLLM_SERVER, *sys.argv[1:]]
    runpy.run_module(VLLM_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
