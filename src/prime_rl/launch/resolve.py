"""The resolve stage: the only writer of configs. A validated config in, what each process runs
with out.

Validation (``prime_rl.config``) only checks: a config that loads is consistent, and nothing
in it was rewritten. What is derived rather than written is decided here, by functions that
each return a new config (a copy; the one given is never changed) and that the commands call
in order; ``prime_rl.launch.deployment.process_specs`` then only serializes what they decided
(tests/test_layout.py refuses a config attribute written anywhere else):

- ``resolve``, an RL run (`prime-rl CONFIG.toml`, `prime-rl inference`, a SLURM node):
  trainer ranks from `[deployment]` (or the older `orchestrator.num_trainer_ranks`); the
  orchestrator's client (the replicas' URLs, inference's key), tool-call parser and
  checkpoint schedule (the trainer's); LoRA's served rank and adapter name; the
  distillation teacher (`orchestrator.teacher` from `[teacher]`, ``prime_rl.launch.teacher``);
  resolving twice changes nothing;
- then, as the launch learns more: ``resumed`` (a checkpoint to continue from), ``attached``
  (warm servers to sample from), ``with_server_key`` (the run's own servers' key),
  ``with_transport`` (CURVE keys and frame cap) and ``placed`` (the addresses of a placement);
  ``served`` for `prime-rl inference`'s own servers;
- ``resolve_eval`` / ``resolve_gepa``, `prime-rl eval` and `gepa`: the model to query, an
  endpoint of the endpoints file or a local model for a vLLM server of the command's own (a
  free port, a LoRA adapter's base model); ``in_run_dir`` names their run.

Imports neither torch nor vLLM: it runs before any process starts.
"""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path

import zmq

from prime_rl.config import (
    LORA_ADAPTER_NAME, EvalRunConfig, EvalTarget, GepaRunConfig, RLConfig, TransportConfig, check_model_path, vllm_lora_rank,
)
from prime_rl.endpoints import Endpoint, load_endpoints
from prime_rl.launch.deployment import Placement, PlacementError
from prime_rl.launch.ports import Binding, port_problems
from prime_rl.launch.teacher import teacher_client, teacher_system_prompt
from prime_rl.registry import PASS_PARSER, declares_tools, tool_parser_problem
from prime_rl.rundir import weights_step_dir
from prime_rl.settings import ConfigError
from prime_rl.wire import DEFAULT_MAX_FRAME_BYTES, max_frame_bytes

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
    # Memory mode's transfer group: the trainer and every replica's workers.
    for section in (config.trainer, orchestrator, inference):
        section.weight_transfer.workers = config.num_replicas * inference.tensor_parallel_size
    # `[teacher]` becomes the orchestrator's teacher client (kept when filled already: a SLURM
    # job's resolved config), or with placement = "trainer" the trainer's own teacher.
    if config.teacher is not None and config.teacher.placement == "trainer":
        config.trainer.teacher_model = config.teacher.model
        orchestrator.teacher_system_prompt = teacher_system_prompt(config.teacher)
    elif config.teacher is not None and orchestrator.teacher is None:
        orchestrator.teacher = teacher_client(config)
    return config


def resumed(config: RLConfig, run_dir: Path, step: int) -> RLConfig:
    """Every process pointed at checkpoint ``step`` (a copy). Inference starts on the
    checkpoint's weights, served under the name requests use; with LoRA it serves the base
    model, and the orchestrator loads the checkpoint's adapter first."""
    config = config.model_copy(deep=True)
    config.trainer.ckpt.resume_step = step
    config.orchestrator.ckpt.resume_step = step
    if config.trainer.lora is None:
        config.inference.served_model_name = config.inference.served_model_name or config.inference.model
        config.inference.model = str(weights_step_dir(run_dir, step))
    return config


def attached(config: RLConfig, served_model_name: str, weights: Path, api_key: str | None) -> RLConfig:
    """The orchestrator pointed at warm servers (a copy; ``prime_rl.launch.warm``): requests name
    the served model, prompts use the run's tokenizer, ``weights`` (the run's starting weights)
    are loaded first, and the servers' key is used when the run names none."""
    config = config.model_copy(deep=True)
    orchestrator = config.orchestrator
    if orchestrator.client.api_key is None:
        orchestrator.client.api_key = api_key
    orchestrator.initial_weights = Path(weights)
    orchestrator.tokenizer = orchestrator.tokenizer or orchestrator.model
    orchestrator.model = served_model_name
    return config


def served(config: RLConfig, server_dir: Path, api_key: str | None) -> RLConfig:
    """`prime-rl inference`'s servers: their folder, and the key drawn when the config names none (a copy)."""
    config = config.model_copy(deep=True)
    config.inference.output_dir = server_dir
    config.inference.api_key = config.inference.api_key or api_key
    return config


def with_server_key(config: RLConfig) -> RLConfig:
    """``config`` with a key drawn for the vLLM servers the run starts itself, when it names
    none (a copy; as is when it has one). vLLM's admin routes (`/pause`, `/collective_rpc`
    loading another folder, `/server_info`) answer whoever reaches the port, on loopback any
    local user; with a key every route requires it (``inference.auth``) and the orchestrator
    sends it only to a server that proved it holds it (``prime_rl.keys``). Drawn per launch,
    like the transport keys; the configs holding it are written 0600 (``write_config``). Not
    for a run attached to warm servers: it brings their key (``prime_rl.launch.warm``)."""
    if config.inference.api_key is not None:
        return config
    config = config.model_copy(deep=True)
    key = secrets.token_urlsafe(32)
    config.inference.api_key = key
    if config.orchestrator.client.api_key is None:
        config.orchestrator.client.api_key = key
    teacher = config.orchestrator.teacher
    if teacher is not None and config.teacher is not None and config.teacher.local_server and teacher.client.api_key is None:
        teacher.client.api_key = key  # the local teacher's vLLM runs with the inference section's key
    return config


PER_TURN_SAMPLES = 8
"""Samples per rollout the frame cap allows for with `multi_turn = "per_turn"` (one per turn); 2 otherwise (a re-rendered conversation splits a rollout)."""


def has_transport_keys(config: RLConfig) -> bool:
    return config.orchestrator.transport.curve_server_secret is not None or config.trainer.transport.curve_client_secret is not None


def with_transport(config: RLConfig) -> RLConfig:
    """``config`` with the rollout transport resolved for both sides (a copy; as is when done):

    - CURVE keys drawn per run, one keypair per side: the orchestrator gets its server secret
      and the trainer's public key (the only client it admits), the trainer its own secret and
      the server's public key. Always, loopback included: any local user can connect to a
      port on 127.0.0.1 and take batches. The configs holding them are written 0600
      (``write_config``) and logged redacted (``prime_rl.keys``).
    - ``max_message_bytes``, unless set: every sample of a step at ``seq_len`` tokens (one rank
      may get them all; with the teacher's top-k tokens at each, when the loss asks for them),
      at least the wire's default.

    The top-level `[transport]` is cleared: it was copied into both sections at validation and
    would conflict with their keys when RUN/slurm/rl.json is read back."""
    orchestrator, trainer = config.orchestrator.transport, config.trainer.transport
    if not has_transport_keys(config):
        server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
        client_public, client_secret = (k.decode() for k in zmq.curve_keypair())
        orchestrator = orchestrator.model_copy(update={"curve_server_secret": server_secret, "curve_client_public": client_public})
        trainer = trainer.model_copy(update={"curve_client_secret": client_secret, "curve_server_public": server_public})
    elif not transport_keys_match(orchestrator, trainer):
        raise PlacementError("transport: the trainer's and the orchestrator's CURVE keys are not one pair; drop them all to get fresh ones")
    per_rollout = PER_TURN_SAMPLES if config.orchestrator.multi_turn == "per_turn" else 2
    distill = config.trainer.loss.distill
    top_k = distill.top_k if distill is not None else 0
    samples = config.orchestrator.batch_size * per_rollout
    cap = max(DEFAULT_MAX_FRAME_BYTES, max_frame_bytes(samples, config.orchestrator.seq_len, top_k))
    orchestrator, trainer = (t if t.max_message_bytes else t.model_copy(update={"max_message_bytes": cap}) for t in (orchestrator, trainer))
    if (orchestrator, trainer, None) == (config.orchestrator.transport, config.trainer.transport, config.transport):
        return config
    config = config.model_copy(deep=True)
    config.orchestrator.transport, config.trainer.transport, config.transport = orchestrator, trainer, None
    return config


def transport_keys_match(orchestrator: TransportConfig, trainer: TransportConfig) -> bool:
    """Whether each side holds the other's public key (a side without keys matches nothing)."""
    if orchestrator.curve_server_secret is None or trainer.curve_client_secret is None:
        return False
    server_public = zmq.curve_public(orchestrator.curve_server_secret.encode()).decode()
    client_public = zmq.curve_public(trainer.curve_client_secret.encode()).decode()
    return trainer.curve_server_public == server_public and orchestrator.curve_client_public == client_public


def placed(config: RLConfig, placement: Placement) -> RLConfig:
    """The run on ``placement`` (a copy), what ``process_specs`` then writes: the transport
    resolved (``with_transport``), the orchestrator's client on the replicas' URLs, and both
    ends of the transport on the orchestrator's address (bound on the placement's bind host,
    else the config's). A multi-node job's keys must be in its resolved config already: each
    node places its own processes, and keys drawn there would differ from node to node."""
    if len(placement.nodes) > 1 and not has_transport_keys(config):
        raise PlacementError("a multi-node job needs the transport keys in its resolved config (RUN/slurm/rl.json, written by `prime-rl --slurm`)")
    config = with_transport(config).model_copy(deep=True)
    orchestrator = config.orchestrator
    urls = [r.url for r in placement.replicas]
    orchestrator.client.base_url = urls[0] if len(urls) == 1 else urls
    orchestrator.transport.host = placement.orchestrator_host
    orchestrator.transport.bind_host = placement.bind_host or orchestrator.transport.bind_host
    config.trainer.transport.host = placement.orchestrator_host
    return config


# --------------------------------------------------------------------------- eval and gepa


def resolve_eval(config: EvalRunConfig) -> EvalRunConfig:
    """`prime-rl eval`'s config with its model target resolved (a copy)."""
    config = config.model_copy(deep=True)
    config.target = resolve_eval_target(config)
    return config


def resolve_gepa(config: GepaRunConfig) -> GepaRunConfig:
    """`prime-rl gepa`'s config with the rollout model and the reflection model resolved (a copy)."""
    config = config.model_copy(deep=True)
    config.target = resolve_eval_target(config)
    config.reflection_target = resolve_reflection_target(config)
    return config


def in_run_dir(config: EvalRunConfig | GepaRunConfig, run_dir: Path) -> EvalRunConfig | GepaRunConfig:
    """The command's run (``commands.common.new_run_dir``): its id is the folder's name, and a
    local vLLM server logs there (a copy)."""
    config = config.model_copy(deep=True)
    config.run_id = run_dir.name
    config.inference.output_dir = run_dir
    return config


def resolve_eval_target(config: EvalRunConfig | GepaRunConfig) -> EvalTarget:
    """An endpoint of the endpoints file, or a local model for a vLLM server of our own; fills
    `client.base_url` (and the `inference` section for a local model) of ``config``, the copy
    ``resolve_eval``/``resolve_gepa`` made."""
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
    if inference.api_key is None:  # our own server: every route needs a key (with_server_key)
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
