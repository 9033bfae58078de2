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
- on GPUs, each replica over the GPUs its placement gave it (`--tensor-parallel-size`,
  `tensor_parallel_size`);
- with `api_key`: the key required on every route, admin routes and /health included
  (`inference.auth`), not only under /v1 as vLLM's `--api-key` does.
The command line and environment are rendered by the launcher's ``prime_rl.vllm_command``
(which `--dry-run` prints too); this module only execs them. It does not know about the
orchestrator or the trainer.
"""

from __future__ import annotations

import os
import sys

from prime_rl.config import InferenceConfig
from prime_rl.settings import ConfigError, process_config
from prime_rl.vllm_command import on_cpu, vllm_command, vllm_env


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = process_config(InferenceConfig, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"[inference] {e}", file=sys.stderr)
        sys.exit(2)
    cpu = on_cpu()
    cmd = vllm_command(cfg, cpu)
    print(f"[inference] exec: {' '.join(cmd)}", flush=True)
    os.execvpe(cmd[0], cmd, vllm_env(cfg, cpu, os.environ))


if __name__ == "__main__":
    main()
