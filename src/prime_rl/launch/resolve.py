"""The resolve stage: a validated config in, what each process runs with out.

Validation (``prime_rl.config``) only checks: a config that loads is consistent, and nothing
in it was rewritten. What is derived rather than written is decided here, once: the commands
resolve the loaded config before their checks, and ``prime_rl.launch.deployment.process_specs``,
which adds the machine's facts (GPUs, replicas, ports, transport keys) and writes each
process's config file and command, resolves what it is given (resolving twice changes
nothing):

- ``resolve``, an RL run (`prime-rl CONFIG.toml`, `prime-rl inference`, a SLURM node):
  trainer ranks from `[deployment]` (or the older `orchestrator.num_trainer_ranks`); the
  orchestrator's client (the replicas' URLs, inference's key), tool-call parser and
  checkpoint schedule (the trainer's); LoRA's served rank and adapter name; the
  distillation teacher (`orchestrator.teacher` from `[teacher]`, ``prime_rl.launch.teacher``);
- ``resolve_eval_target`` / ``resolve_reflection_target``, `prime-rl eval` and `gepa`: the
  model to query, an endpoint of the endpoints file or a local model for a vLLM server of
  the command's own (a free port, a LoRA adapter's base model).

Imports neither torch nor vLLM: it runs before any process starts.
"""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path

from prime_rl.config import (
    LORA_ADAPTER_NAME, EvalRunConfig, EvalTarget, GepaRunConfig, RLConfig, check_model_path, vllm_lora_rank,
)
from prime_rl.endpoints import Endpoint, load_endpoints
from prime_rl.launch.ports import Binding, port_problems
from prime_rl.registry import PASS_PARSER, declares_tools, tool_parser_problem
from prime_rl.settings import ConfigError
from prime_rl.launch.teacher import resolve_teacher

# --------------------------------------------------------------------------- an RL run


def resolve(config: RLConfig) -> RLConfig:
    """``config`` with every derived setting filled in (a copy; resolving twice changes nothing)."""
    config = config.model_copy(deep=True)
    deployment, orchestrator, inference = config.deployment, config.orchestrator, config.inference
    if config.older_ranks_spelling:
        deployment.trainer_gpus = orchestrator.num_trainer_ranks
    orchestrator.num_trainer_ranks = config.num_trainer_ranks
    # The orchestrator's client: every replica (unless the config names the servers), the key.
    if "base_url" not in orchestrator.client.model_fields_set:
        urls = config.replica_urls()
        orchestrator.client.base_url = urls[0] if len(urls) == 1 else urls
    if orchestrator.client.api_key is None:
        orchestrator.client.api_key = inference.api_key
    if orchestrator.tool_call_parser is None:
        orchestrator.tool_call_parser = inference.tool_call_parser
    # `[trainer.lora]` alone turns on adapter serving in vLLM and adapter loading in the orchestrator.
    if config.trainer.lora is not None:
        inference.max_lora_rank = config.lora_rank_served
        orchestrator.lora_adapter = orchestrator.lora_adapter or LORA_ADAPTER_NAME
    # One checkpoint schedule for both processes: the orchestrator follows the trainer's.
    orchestrator.ckpt = config.trainer.ckpt.model_copy()
    return resolve_teacher(config)


# --------------------------------------------------------------------------- eval and gepa


def resolve_eval_target(config: EvalRunConfig | GepaRunConfig) -> EvalTarget:
    """An endpoint of the endpoints file, or a local model for a vLLM server of our own; fills
    `client.base_url` (and the `inference` section for a local model)."""
    for field in ("base_url", "api_key"):
        if field in config.client.model_fields_set:
            raise ConfigError(f"client.{field}: comes from the endpoint or the local vLLM server; choose the model with -m/--model")
    endpoint = find_endpoint(config)
    if endpoint is not None:
        config.client.base_url = endpoint.url
        return EvalTarget(type="endpoint", model=endpoint.model, api_key_var=endpoint.key, endpoint_id=endpoint.endpoint_id)
    inference = config.inference
    if "model" in inference.model_fields_set and inference.model != config.model:
        raise ConfigError(f"conflicting values: `model` = {config.model!r} but `inference.model` = {inference.model!r}; set `model` only")
    if "attach" in inference.model_fields_set:
        raise ConfigError("inference.attach: only an RL run attaches to a warm server (`prime-rl inference`)")
    inference.model = config.model
    if config.seq_len is not None:
        inference.seq_len = config.seq_len
    adapter = lora_adapter(config.model)
    if adapter is not None:  # a LoRA run's weights/step_N: its base model, serving the adapter
        base, rank = adapter
        checked_model_path(base, f"model (the base model {Path(config.model) / 'adapter_config.json'} names)")
        inference.model = base
        inference.max_lora_rank = inference.max_lora_rank or vllm_lora_rank(rank)
        inference.lora_modules = {config.model: str(Path(config.model).resolve())}
    if "port" not in inference.model_fields_set:
        inference.port = free_port(inference.host)
    elif problems := port_problems([Binding(inference.host, inference.port, "inference.port")]):
        raise ConfigError(problems[0])
    config.client.base_url = f"http://{inference.host}:{inference.port}"
    if inference.api_key is None:  # our own server: every route needs a key (prime_rl.launch.deployment.with_server_key)
        inference.api_key = secrets.token_urlsafe(32)
    config.client.api_key = inference.api_key
    for entry in config.eval if isinstance(config, EvalRunConfig) else config.env:
        if problem := tool_parser_problem(entry.id, declares_tools(entry.id), inference.tool_call_parser, PASS_PARSER):
            raise ConfigError(problem)
    # Served under its own path name (vLLM's default), which requests then use.
    return EvalTarget(type="local", model=inference.served_model_name or config.model)


def resolve_reflection_target(config: GepaRunConfig) -> EvalTarget:
    """GEPA's teacher: the rollout model itself (its endpoint or local server), or an endpoint."""
    if "base_url" in config.reflection_client.model_fields_set:
        raise ConfigError("reflection_client.base_url: comes from the endpoint; choose the teacher with -M/--reflection-model")
    if config.reflection_model is None or config.reflection_model == config.model:
        config.reflection_client.base_url = config.client.base_url
        config.reflection_client.api_key = config.client.api_key
        return config.target
    endpoint = known_endpoint(config.reflection_model, config, field="reflection_model")
    config.reflection_client.base_url = endpoint.url
    return EvalTarget(type="endpoint", model=endpoint.model, api_key_var=endpoint.key, endpoint_id=endpoint.endpoint_id)


def lora_adapter(model: str) -> tuple[str, int] | None:
    """(base model, rank) when ``model`` is a PEFT adapter folder, else None."""
    path = Path(model).expanduser() / "adapter_config.json"
    if not path.is_file():
        return None
    try:
        adapter = json.loads(path.read_text())
        return str(adapter["base_model_name_or_path"]), int(adapter["r"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model: {str(path)!r} is not a PEFT adapter config ({type(e).__name__}: {e})") from None


def find_endpoint(config: EvalRunConfig | GepaRunConfig) -> Endpoint | None:
    """`endpoint_id`, else `model` when it names an endpoint; None for a local folder or HF id."""
    if config.endpoint_id is not None:
        if "model" in config.model_fields_set:
            raise ConfigError(f"conflicting values: `model` = {config.model!r} and `endpoint_id` = {config.endpoint_id!r}; set one of them")
        return known_endpoint(config.endpoint_id, config, field="endpoint_id")
    name = config.model
    if Path(name).expanduser().exists():
        if lora_adapter(name) is None:  # an adapter folder is checked with its base model
            checked_model_path(name, "model")
        return None
    if config.endpoints_path.is_file() and name in (endpoints := load_endpoints(config.endpoints_path)):
        return endpoints[name]
    if "/" in name:  # a path (then it must exist) or an HF id `org/name`
        checked_model_path(name, "model")
        return None
    return known_endpoint(name, config, field="model")


def known_endpoint(name: str, config: EvalRunConfig | GepaRunConfig, field: str) -> Endpoint:
    path = config.endpoints_path
    endpoints = load_endpoints(path) if path.is_file() or field == "endpoint_id" else {}
    if name not in endpoints:
        known = f"known: {', '.join(sorted(endpoints))}" if endpoints else f"no endpoints file at {str(path)!r}"
        local = "; a local model folder or an HF id `org/name` works too" if field == "model" else ""
        raise ConfigError(f"{field}: unknown endpoint {name!r} in {path} ({known}){local}")
    return endpoints[name]


def checked_model_path(name: str, field: str) -> None:
    try:
        check_model_path(name, field)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def free_port(host: str) -> int:
    """A port free now on `host` (the server binds it moments later)."""
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return s.getsockname()[1]
