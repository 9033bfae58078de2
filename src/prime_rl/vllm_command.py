"""How a vLLM server is started: its command line and environment, rendered from its
`[inference]` section.

The launcher decides how vLLM starts, as ``prime_rl.launch.deployment`` renders torchrun's command
for the trainer: `inference.server` execs exactly what ``vllm_command`` and ``vllm_env``
return, and `prime-rl CONFIG --dry-run` prints the same (``shell_line``), so what a run
would start is visible before it starts. What RL needs from each flag is in
`inference.server`'s docstring.

Pure functions of the config and of which vLLM is installed; imports neither torch nor vLLM
(the launcher runs this before any process starts), nor `inference` (processes share only
this package): the middleware is named here by its import path, and the key reaches it in
the environment variable ``prime_rl.keys.API_KEY_ENV``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import sys
from collections.abc import Mapping

from prime_rl.config import InferenceConfig
from prime_rl.cores import SHARE_WORKER_CORE
from prime_rl.keys import API_KEY_ENV, redact
from prime_rl.transfer import ENGINES, group_backend

CPU_FORK_SERVER = "inference.vllm_cpu"
"""The module that runs vLLM's server with its engine processes forked (`inference.cpu_fork`)."""

PRECOMPILE_HEADERS = "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"
"""Inductor's switch for precompiled C++ headers (``server_env`` turns it off)."""

COMPILE_DISABLE = "TORCH_COMPILE_DISABLE"
"""torch's switch that makes torch.compile a no-op (``vllm_env`` sets it for eager CPU servers)."""

AUTH_MIDDLEWARE = "inference.auth.RequireApiKey"
"""vLLM `--middleware` that requires the key on every route (vLLM's `--api-key` guards /v1 only)."""

TMP_DIR_ENV = "TMPDIR"
"""The temporary directory of a vLLM server, where it binds its ZeroMQ IPC sockets
(`VLLM_RPC_BASE_PATH` defaults to it) and writes its `vllm_dist_<uuid>` init file, and removes
neither, even on a clean exit (2,786 sockets and 506 init files had piled up in /tmp here): the
launcher gives every server a private one, made at its start and removed once it stopped
(``prime_rl.launch.launcher.ProcessSpec.tmp_dir_env``). torch's compile cache, which defaults
to a folder there too, stays where it was (``server_env``)."""


def server_env() -> dict[str, str]:
    """What a vLLM server's environment keeps of the machine's temporary directory: torch
    inductor's compile cache, reused across runs (a private TMPDIR would start it empty).

    Inductor's precompiled C++ headers go to a folder of the temporary directory whatever
    `TORCHINDUCTOR_CACHE_DIR` says, and a cached kernel whose key names them compiles its
    header again when that folder is new: with a private TMPDIR, every run. On CPU that is
    the first request with logprobs, which compiles vLLM's sampled-token rank: 6.6 s of every
    quickstart's start-up with the header, 1.8 s without (11.7 s once, on an empty cache;
    docs/benchmarks.md, "The quickstart over seeds"). So headers are not precompiled, unless
    the user's environment says otherwise."""
    import getpass
    import tempfile

    default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return {"TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", default),
            PRECOMPILE_HEADERS: os.environ.get(PRECOMPILE_HEADERS, "0")}


def on_cpu() -> bool:
    """CPU machines install the `vllm-cpu` distribution (see pyproject's dependency groups)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def vllm_command(cfg: InferenceConfig, cpu: bool) -> list[str]:
    """vLLM's OpenAI server for ``cfg``, `extra_args` last (so they win where vLLM reads the last value)."""
    # `vllm serve` fails with vllm-cpu (it looks for the distribution `vllm`): start the module,
    # on CPU through ours that forks its engine processes (inference.vllm_cpu).
    cmd = [sys.executable, "-m", CPU_FORK_SERVER if cpu and cfg.cpu_fork else "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", cfg.model, "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    cmd += ["--dtype", cfg.dtype, "--max-model-len", str(cfg.seq_len), "--max-num-seqs", str(cfg.max_num_seqs)]
    cmd += ["--max-logprobs", str(cfg.max_logprobs)]
    cmd += ["--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log"]
    # vLLM's own defaults (the full softmax), not the model folder's generation_config.json:
    # requests pin these fields too (orchestrator.client.FULL_DISTRIBUTION); docs/sampling.md
    cmd += ["--generation-config", "vllm"]
    if cfg.seed is not None:
        cmd += ["--seed", str(cfg.seed)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.api_key:
        # Not vLLM's --api-key, which guards /v1 only: a middleware that guards every route,
        # admin ones included, with the key from the environment (vllm_env), off the command line
        cmd += ["--middleware", AUTH_MIDDLEWARE]
    if cfg.max_lora_rank is not None:
        # one adapter at a time: each step's replaces the last one in place (the orchestrator)
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", "1"]
    if cfg.lora_modules:
        cmd += ["--lora-modules", *(f"{name}={path}" for name, path in cfg.lora_modules.items())]
    if cfg.tool_call_parser:
        # vLLM's parser reads the calls; /v1/chat/completions/derender (a scale-out route)
        # runs it on the token ids the orchestrator sampled through /v1/completions
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser, "--enable-scale-out"]
    if cfg.weight_transfer.mode == "memory":
        # an engine registered by this project's vLLM plugin (inference.weight_transfer, its
        # entry point in pyproject.toml): gloo on CPU, NCCL on GPUs
        engine = ENGINES[group_backend(cuda=not cpu)]
        cmd += ["--weight-transfer-config", json.dumps({"backend": engine})]
    if not cpu:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        # Always, 1 included: the placement gave this replica exactly that many GPUs
        # (CUDA_VISIBLE_DEVICES), and the dry run shows the split. Not on CPU, where a replica
        # holds no devices and is one vLLM-CPU process, as the CPU runs are tested.
        cmd += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    return cmd + list(cfg.extra_args)


def vllm_env(cfg: InferenceConfig, cpu: bool, inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``inherited`` (the inference process's own) with what vLLM
    needs for ``cfg`` set over it; without ``inherited``, only what this module sets."""
    env = {"VLLM_CONFIGURE_LOGGING": "1", **(inherited or {})}  # the user's own logging setting wins
    env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes the admin routes used for weight reload
    if cfg.api_key:
        env[API_KEY_ENV] = cfg.api_key  # read by the RequireApiKey middleware
    if cfg.max_lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gb)
        if cfg.enforce_eager:
            # An eager server's only compiled code is two sampler helpers (the sampled token's
            # rank for logprobs, the random sample), compiled by inductor at the first request:
            # ~2 s from a warm cache, ~10 s from an empty one, on step 0's critical path, to speed up
            # a [batch, vocab] comparison. Eager, the first request takes 0.4-0.5 s instead of
            # 2.4-2.7 s (docs/vllm_probe.md, "torch.compile in an eager server"). The user's value wins.
            env.setdefault(COMPILE_DISABLE, "1")
        if cfg.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind
        if cfg.cpu_share_core:
            env[SHARE_WORKER_CORE] = "1"
    return env


def shell_line(cfg: InferenceConfig, cpu: bool, env: Mapping[str, str] | None = None) -> str:
    """The server as one shell line for display, `VAR=value ... python -m vllm...`: ``env``
    (the launcher's, e.g. CUDA_VISIBLE_DEVICES) and what ``vllm_env`` sets, with every secret
    (the API key) shown as `<redacted>`."""
    shown = redact({**(env or {}), **vllm_env(cfg, cpu)})
    assignments = [f"{name}={shlex.quote(value)}" for name, value in shown.items()]
    return " ".join([*assignments, shlex.join(vllm_command(cfg, cpu))])
