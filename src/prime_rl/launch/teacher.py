"""The distillation teacher of an RL run (`[teacher]`), resolved for the launcher.

A local teacher (`teacher.model`) is a vLLM server of its own, started and stopped with the
run in its own pane, on `inference.host`:`teacher.port` (its GPUs after the trainer's,
``prime_rl.launch.deployment``). An endpoint (`teacher.endpoint`) is a server that already runs,
named in the endpoints file. Either way the orchestrator gets `orchestrator.teacher`: where
to send scoring requests, the model name, the variable holding the key, and the system
prompt of context distillation (read here from `system_prompt_file`, so a missing file
stops the launch, not the run).

Imports neither torch nor vLLM: it runs before any process starts.
"""

from __future__ import annotations

from pathlib import Path

from prime_rl.config import (
    ClientConfig, InferenceConfig, RLConfig, TeacherClientConfig, TeacherConfig, WeightTransferConfig, check_prompt_file,
)
from prime_rl.settings import ConfigError


def teacher_client(config: RLConfig) -> TeacherClientConfig:
    """The orchestrator's teacher client from `[teacher]` (``resolve`` sets it as `orchestrator.teacher`)."""
    teacher = config.teacher
    assert teacher is not None
    distill = config.trainer.loss.distill
    return TeacherClientConfig(
        **served_teacher(config, teacher),
        system_prompt=teacher_system_prompt(teacher),
        top_k=distill.top_k if distill is not None else 0,
    )


def served_teacher(config: RLConfig, teacher: TeacherConfig) -> dict:
    """model, client and api_key_env of the server that scores: the local one or the endpoint."""
    client = dict(timeout_s=teacher.timeout_s, max_concurrency=teacher.max_concurrency,
                  startup_timeout_s=config.orchestrator.client.startup_timeout_s)
    if teacher.model is not None:
        url = f"http://{config.inference.host}:{teacher.port}"
        return {"model": teacher.model, "client": ClientConfig(base_url=url, api_key=config.inference.api_key, **client)}
    from prime_rl.endpoints import load_endpoints

    endpoints = load_endpoints(teacher.endpoints_path)
    if teacher.endpoint not in endpoints:
        known = ", ".join(sorted(endpoints)) or "none"
        raise ConfigError(f"teacher.endpoint: no endpoint {teacher.endpoint!r} in {teacher.endpoints_path} (known: {known})")
    endpoint = endpoints[teacher.endpoint]
    base = endpoint.url.rstrip("/").removesuffix("/v1")
    return {"model": endpoint.model, "client": ClientConfig(base_url=base, **client), "api_key_env": endpoint.key}


def teacher_system_prompt(teacher: TeacherConfig) -> str | None:
    if teacher.system_prompt_file is None:
        return teacher.system_prompt
    path = Path(teacher.system_prompt_file).expanduser()
    if not path.is_file():
        raise ConfigError(f"teacher.system_prompt_file: {str(path)!r} not found (expected a text file holding the teacher's system prompt)")
    try:
        check_prompt_file(path)  # the hardening every system prompt file gets: no /proc, no root-only file
    except ValueError as e:
        raise ConfigError(f"teacher.{e}") from None
    text = path.read_text().strip()
    if not text:
        raise ConfigError(f"teacher.system_prompt_file: {str(path)!r} is empty")
    return text


def teacher_inference(config: RLConfig) -> InferenceConfig:
    """The local teacher's vLLM server: the run's inference settings (dtype, host, key, CPU
    binding) with the teacher's model, port, context and batch, and room for the top-k
    logprobs the loss asks for; no LoRA, no tool parser, no weight transfer (its weights never change)."""
    teacher = config.teacher
    assert teacher is not None and teacher.local_server
    seq_len = teacher.seq_len
    if seq_len is None:
        room = teacher.prompt_room if (teacher.system_prompt or teacher.system_prompt_file) else 0
        seq_len = config.inference.seq_len + 1 + room
    distill = config.trainer.loss.distill
    top_k = distill.top_k if distill is not None else 0
    return config.inference.model_copy(update={
        "model": teacher.model, "served_model_name": None, "port": teacher.port, "seq_len": seq_len,
        "max_logprobs": max(config.inference.max_logprobs, top_k),
        "max_num_seqs": teacher.max_num_seqs, "kv_cache_gb": teacher.kv_cache_gb, "max_lora_rank": None,
        "lora_modules": {}, "tool_call_parser": None, "attach": None, "weight_transfer": WeightTransferConfig(),
    })
