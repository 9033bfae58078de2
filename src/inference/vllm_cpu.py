"""`python -m inference.vllm_cpu ARGS`: vLLM's OpenAI server (ARGS as for `python -m
vllm.entrypoints.openai.api_server`) on a CPU machine, its engine and worker processes forked
from the API server instead of spawned.

vLLM starts two processes behind its API server: the engine core, and the worker that holds
the model. Its CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn when it checks the config,
so each of them starts a new interpreter that imports torch and vLLM again, one after the
other: most of a start here. Forked, they begin with the API server's imports already done.
Fork is vLLM's own default on GPUs (wherever CUDA is not initialized yet). Its hazard on a
CPU would be an OpenMP runtime already running in the parent (its threads do not survive a
fork); measured (docs/vllm_probe.md, "Fork"): healthy 9.8 s after the command instead of
24.3 s, the same tokens and logprobs, the forked worker decoding as fast as a spawned one.

The launcher renders this command (``prime_rl.vllm_command``) when `inference.cpu_fork` is
on (the default); `cpu_fork = false` starts vLLM's module unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys

VLLM_SERVER = "vllm.entrypoints.openai.api_server"


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


def main() -> None:
    fork_engine_processes()
    sys.argv = [VLLM_SERVER, *sys.argv[1:]]
    runpy.run_module(VLLM_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
