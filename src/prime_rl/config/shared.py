"""Config pieces every side uses: the strict base model, environments and their checks, sampling, the model, W&B, the rollout transport, checkpoints, the inference client.

Never imports torch or vLLM (the launcher validates configs before any process starts)."""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prime_rl import registry
from prime_rl.settings import nesting_problem


class StrictModel(BaseModel):
    """Base for every config: unknown keys are errors, docstrings are the help text, and no
    float is `inf` or `nan` (TOML's `inf`, a flag's `--lr inf`): no setting spells "unbounded"
    as infinity (None does that), and a non-finite temperature or learning rate would only
    fail later, batch after batch."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=False, allow_inf_nan=False
    )


# The built-in ids come from one registry (`prime_rl/registry.toml`), which the orchestrator
# loads environments through as well.
KNOWN_ENVIRONMENTS = tuple(registry.builtins())


environment_name = registry.environment_name


environment_module = registry.environment_module


def check_environment_id(env_id: str, python: Path | None = None) -> None:
    """Built-in id (with or without `primeintellect/`), or an importable module (dashes ->
    underscores), in this project's Python or in the one the entry names; anything else
    fails clearly, before any process starts."""
    if python is not None:
        if registry.builtin(env_id) is not None:
            raise ValueError(f"environment {env_id!r} is built in: it runs in prime-rl's own Python; remove `python`")
        registry.check_worker_python(env_id, python)
        return
    if registry.builtin(env_id) is not None or registry.importable_here(registry.resolve(env_id)):
        return
    module = environment_module(env_id)
    raise ValueError(
        f"unknown environment id {env_id!r}; known: {', '.join(KNOWN_ENVIRONMENTS)}. A module of your own "
        f"works once it is importable as {module!r} and defines load_environment(): install it into this "
        "environment (`uv pip install -e ./my-env`) or put it on PYTHONPATH; a verifiers environment can also "
        "live in a virtual environment of its own: set `python = \"/path/to/venv/bin/python\"` in its entry"
    )


def check_model_path(name: str, field: str) -> None:
    """A local-looking model path must exist; `org/name` ids are left to the HF hub."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ValueError(f"{field}: {name!r} is a directory without config.json (expected an HF model folder)")
        return
    # `org/name` is a hub id unless its first part is a local folder (then it is a path).
    looks_like_hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not Path(name.split("/")[0]).is_dir()
    if not looks_like_hub_id or name.startswith((".", "~")):
        raise ValueError(f"{field}: model path {name!r} does not exist")


class ModelConfig(StrictModel):
    name: str = "Qwen/Qwen3-0.6B"
    """HF model id or local path of the model to train (HF format, safetensors)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the trainer: float32 on CPU, bfloat16 on GPUs. The weights and AdamW's state stay float32 either way (master weights: a bf16 weight could not take a 1e-6 step); with bfloat16 FSDP2 gathers the weights in bf16 for forward and backward and reduces gradients in float32. The weights written for inference (`weights/step_N`) are cast to this dtype."""

    attn_implementation: str | None = None
    """Attention of the trainer's model: `sdpa`, `eager`, `flash_attention_2`, `flash_attention_3` or a hub kernel (`kernels-community/flash-attn2`); None = flash_attention_2 on CUDA when `flash-attn` is installed and the dtype is bfloat16, else sdpa. Flash-attention runs packed rows through its variable-length kernel, without padding or a mask, and computes in 16 bits only (README "Installing" says how to install it)."""

    activation_checkpointing: bool | None = None
    """Keep only each decoder layer's input through the forward and recompute the layer in backward: activation memory per token falls from all of a layer's tensors to one hidden state per layer, for about a third more compute. None = on when the trainer runs on CUDA, off on CPU."""

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, name: str | None) -> str | None:
        if name is None or name in ATTENTION_IMPLEMENTATIONS or re.fullmatch(r"[\w.-]+/[\w.-]+(@[\w.-]+)?(:[\w.-]+)?", name):
            return name
        raise ValueError(
            f"unknown attention {name!r}: expected one of {', '.join(ATTENTION_IMPLEMENTATIONS)} or a hub kernel `org/name`"
        )

    @model_validator(mode="after")
    def _flash_needs_16_bits(self) -> ModelConfig:
        # transformers' rule for a flash-attention implementation: "flash" in its name
        if self.attn_implementation is not None and "flash" in self.attn_implementation and self.dtype == "float32":
            raise ValueError(
                f"attn_implementation {self.attn_implementation!r} computes in 16 bits only, but dtype is float32: "
                "set dtype = \"bfloat16\" (the weights stay float32 masters) or attn_implementation = \"sdpa\""
            )
        return self


ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
"""transformers' built-in attentions the trainer supports (besides hub kernels `org/name`)."""


class SamplingConfig(StrictModel):
    max_tokens: int = Field(128, ge=1)
    """Maximum number of completion tokens per turn."""

    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer divides its logits by the same value."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; only 1 (off): the trainer scores the full softmax."""

    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; only -1 or 0 (off): the trainer scores the full softmax."""

    min_p: float = Field(0.0, ge=0, le=1)
    """Min-p sampling; only 0 (off): the trainer scores the full softmax."""

    @model_validator(mode="after")
    def _full_distribution(self) -> SamplingConfig:
        # Every request pins these fields (and the penalties) to "off", and vLLM ignores the
        # model's generation_config.json: see docs/sampling.md.
        truncated = [f"{k} = {v}" for k, v, off in (("top_p", self.top_p, (1.0,)), ("top_k", self.top_k, (-1, 0)),
                                                     ("min_p", self.min_p, (0.0,))) if v not in off]
        if truncated:
            raise ValueError(
                f"{', '.join(truncated)}: truncated sampling is not supported in RL: the trainer scores the full "
                "softmax (logits / temperature), so samples from a truncated distribution would bias every "
                "importance ratio; leave top_p = 1, top_k = -1, min_p = 0 and tune the temperature instead"
            )
        return self


class EnvConfig(StrictModel):
    id: str = "reverse-text"
    """Environment id: built-in (`reverse-text`, `alphabet-sort`, `gsm8k`, `wordle`, `wiki-search`, `math-python`, with or without `primeintellect/`) or a module defining `load_environment` (`my-env` imports `my_env`): one written against `prime_rl.envs`, a classic verifiers environment, or a module exporting a verifiers v1 `Taskset`."""

    args: dict[str, Any] = {}
    """Keyword arguments passed to the environment's `load_environment`."""

    weight: float = Field(1.0, gt=0)
    """Share of each batch's examples drawn from this environment, relative to the other entries' weights."""

    name: str | None = None
    """Name in metrics (`reward/<name>/mean`); defaults to the id without its owner prefix."""

    system_prompt_file: Path | None = None
    """A file whose text replaces the environment's system prompt, e.g. the `best_prompt.txt` of `prime-rl gepa`; None = the environment's own."""

    python: Path | None = None
    """The Python of a virtual environment that holds this environment and its verifiers (0.3.x classic or 0.4.x v1), e.g. `/path/to/venv/bin/python`: the environment then runs there, in a worker process of the orchestrator. None = prime-rl's own Python."""

    max_concurrent: int = Field(64, ge=1)
    """Most groups of this environment played at once in its worker process (with `python`, or a verifiers environment)."""

    episode_timeout_s: float | None = Field(3600.0, gt=0)
    """Longest a group's episodes (which run together: every turn, tool call and model call of each) may take: a group still running then is cut off (its episodes cancelled, a worker's harness programs stopped), counted in `errors/<env>/episode_timeout`, said once, and another group starts in its place; None = no limit."""

    worker_timeout_s: float = Field(120.0, gt=0)
    """A worker process that sends nothing for this long (it sends a heartbeat every 2 s) is taken to hang: the run stops with an error naming the environment."""

    @field_validator("args")
    @classmethod
    def _args_checked(cls, args: dict[str, Any]) -> dict[str, Any]:
        return check_env_args(args)

    @model_validator(mode="after")
    def _known_environment(self) -> EnvConfig:
        check_environment_id(self.id, self.python)
        check_prompt_file(self.system_prompt_file)
        if self.name is not None and not re.fullmatch(r"[\w.-]+", self.name):
            raise ValueError(f"env name {self.name!r} may only hold letters, digits, `_`, `-` and `.`")
        return self

    @property
    def metric_name(self) -> str:
        return self.name or environment_name(self.id).split("/")[-1]


def check_env_args(args: dict[str, Any]) -> dict[str, Any]:
    """``load_environment`` arguments whose tables and lists nest no deeper than a config may
    (what walks them later, the written config included, would hit Python's recursion limit)
    and that hold no `nan` or `inf` (``nonfinite_arg``)."""
    problem = nesting_problem(args)
    if problem:
        raise ValueError(problem)
    found = nonfinite_arg(args)
    if found is not None:
        where, value = found
        raise ValueError(f"`{shorten(where)}`: expected a finite number, got {value}")
    return args


def shorten(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters for a one-line message (a key can be any length)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def nonfinite_arg(args: dict[str, Any]) -> tuple[str, float] | None:
    """The first `nan`, `inf` or `-inf` at any depth of ``args`` as (path, value), e.g.
    (`reward.weights[1]`, inf), or None. TOML (`nan`, `inf`, `1e999`) and JSON (`NaN`,
    `Infinity`) both parse them, but the resolved config is JSON, which has none: they would
    reach the environment as None. Walks iteratively, in the order the keys were given."""
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in reversed(args.items())]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where, value
        if isinstance(value, dict):
            stack.extend((f"{where}.{k}", v) for k, v in reversed(value.items()))
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))
"""Kernel views, not prompts: `/proc/self/environ` reads as a file and holds the process's secrets."""


def check_prompt_file(path: Path | None) -> None:
    """A system prompt file must be a plain text file anyone could read: its text becomes every
    example's system prompt (and goes into logs, rollouts and checkpoints of the run)."""
    if path is None:
        return
    shown = f"system_prompt_file: {str(path)!r}"
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{shown} does not exist (expected a text file holding the system prompt)")
    if path.is_dir():
        raise ValueError(f"{shown} is a directory, expected a text file holding the system prompt")
    resolved = path.resolve()
    kernel = next((root for root in PSEUDO_FILESYSTEMS if resolved.is_relative_to(root)), None)
    if kernel is not None:
        raise ValueError(f"{shown} lies under {kernel}, a view of the system, not a prompt (expected a text file)")
    if not resolved.is_file():
        raise ValueError(f"{shown} is not a regular file (expected a text file holding the system prompt)")
    mode = resolved.stat().st_mode
    if os.geteuid() == 0 and not mode & stat.S_IROTH:
        # root reads anything: a root-only file (/etc/shadow, a key) would be leaked into prompts
        raise ValueError(
            f"{shown} is readable only with root's privileges; make it world-readable (chmod a+r) "
            "if it is meant as a prompt"
        )
    if not os.access(resolved, os.R_OK):
        raise ValueError(f"{shown} is not readable by this user")


def check_env_names(envs: list[EnvConfig]) -> None:
    names = [e.metric_name for e in envs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"several [[env]] entries are named {duplicates[0]!r}; give each a distinct `name`")


class WandbConfig(StrictModel):
    project: str = "prime-rl"
    """W&B project."""

    name: str | None = None
    """W&B run name; defaults to the run directory's name."""

    entity: str | None = None
    """W&B entity (team or user)."""

    mode: Literal["online", "offline", "disabled"] = "online"
    """W&B mode; `offline` writes locally and needs no network."""


class TransportConfig(StrictModel):
    """Rollout transport from orchestrator to trainer (ZeroMQ PUSH/PULL, msgpack frames),
    encrypted and authenticated with ZeroMQ CURVE when the launcher's per-run keys are set."""

    # Its own validation errors never echo a key (nested in a section, `format_validation_error` shows no dict input).
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)

    type: Literal["zmq"] = "zmq"
    """Transport kind; only ZeroMQ for now."""

    host: str = "127.0.0.1"
    """The orchestrator's address: trainer rank r connects to `host:port + r`."""

    bind_host: str | None = None
    """Address the orchestrator binds, if not `host` (e.g. `0.0.0.0`; set by multi-node SLURM jobs from `slurm.bind_host`)."""

    port: int = Field(5555, ge=1024, le=65535)
    """Base port; one port per trainer rank."""

    timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one send or receive before the process fails with a message."""

    first_batch_timeout_s: float = Field(1800.0, gt=0)
    """Longest wait for the first batch: it covers inference start-up (see `orchestrator.client.startup_timeout_s`)."""

    max_message_bytes: int | None = Field(None, ge=2**16)
    """Largest frame the trainer takes (ZeroMQ `MAXMSGSIZE`: a bigger one drops the connection before it is buffered) and the orchestrator sends (a bigger batch fails the step, naming this setting). None = filled by the launcher from the run's batch (`prime_rl.launch.deployment`), 64 MiB in a process started without it."""

    curve_server_secret: str | None = Field(None, repr=False)
    """Orchestrator: the CURVE secret key (Z85) of its PUSH sockets. Generated per run by the launcher (`prime_rl.launch.deployment`), with the three below; never set by hand. None with the others = no encryption nor authentication, allowed on loopback only."""

    curve_client_public: str | None = None
    """Orchestrator: the trainer's CURVE public key (Z85), the only client its sockets admit."""

    curve_client_secret: str | None = Field(None, repr=False)
    """Trainer: its CURVE secret key (Z85)."""

    curve_server_public: str | None = None
    """Trainer: the orchestrator's CURVE public key (Z85), which it checks the server against."""

    @model_validator(mode="after")
    def _curve_keys(self) -> TransportConfig:
        keys = {name: getattr(self, name) for name in CURVE_KEY_FIELDS}
        bad = [name for name, key in keys.items() if key is not None and not _Z85_KEY.fullmatch(key)]
        if bad:
            raise ValueError(f"{', '.join(bad)}: a CURVE key is 40 characters of Z85")
        server, client = keys["curve_server_secret"], keys["curve_client_secret"]
        if (server is None) != (keys["curve_client_public"] is None) or (client is None) != (keys["curve_server_public"] is None):
            raise ValueError(
                "CURVE keys come in pairs: curve_server_secret with curve_client_public (orchestrator), "
                "curve_client_secret with curve_server_public (trainer)"
            )
        return self

    def leaves_loopback(self) -> bool:
        """Whether the orchestrator's bind address or the address the trainer connects to is not loopback."""
        return not all(_is_loopback(h) for h in (self.host, self.bind_host) if h is not None)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


CURVE_KEY_FIELDS = ("curve_server_secret", "curve_client_public", "curve_client_secret", "curve_server_public")


_Z85_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


MAX_TEACHER_TOP_K = 1024
"""Most tokens a teacher returns a position (`trainer.loss.distill.top_k`): 1024 x 8 bytes a sampled token on the wire."""


class WeightTransferConfig(StrictModel):
    """How each new policy reaches the vLLM servers (`[weight_transfer]`, docs/scaling.md)."""

    mode: Literal["directory", "memory"] = "directory"
    """`directory`: the trainer writes every version as `weights/step_N/` and each server reads it
    (vLLM's `reload_weights`). `memory`: versions travel from the trainer's memory into the
    running servers over a transfer group (`prime_rl.transfer`; vLLM's native weight-transfer
    API), and only checkpoints' and the last step's weights are written as folders. LoRA
    adapters always travel as folders."""

    timeout_s: float = Field(120.0, gt=0)
    """Memory mode: the longest wait for a peer of the transfer group: to form it, to start a
    version's transfer once every worker asked for it, and in each broadcast."""

    workers: int = Field(1, ge=1)
    """Memory mode: the vLLM workers of every replica together (filled from `[deployment]`)."""


class CheckpointConfig(StrictModel):
    """Resumable checkpoints: the trainer's under `checkpoints/step_N/`, the orchestrator's progress under `rollouts/`."""

    interval: int = Field(10, ge=0)
    """Write a checkpoint every this many steps (and after the last step); 0 = never (no resume possible)."""

    keep_last: int = Field(2, ge=1)
    """How many complete checkpoints to keep; the newest complete one is never deleted."""

    resume_step: int | None = Field(None, ge=1)
    """Resume from `checkpoints/step_N/` (set by `prime-rl --resume`; None = a fresh run)."""


class ClientConfig(StrictModel):
    base_url: str | list[str] = "http://127.0.0.1:8000"
    """Inference server URL (without `/v1`), or one URL per vLLM replica: requests go to the
    replica with the fewest in flight, and every replica reloads each new policy. Filled from
    `[inference]` and `[deployment]` in an RL run."""

    api_key: str | None = None
    """Bearer key for the inference server, if it requires one."""

    timeout_s: float = Field(300.0, gt=0)
    """Timeout of one HTTP request."""

    max_concurrency: int = Field(64, ge=1)
    """Most requests in flight at once."""

    max_retries: int = Field(3, ge=0)
    """Retries of a request that failed transiently (dropped or refused connection, timeout, HTTP 5xx)."""

    retry_backoff_s: float = Field(0.5, ge=0)
    """First retry delay; doubles with each retry."""

    startup_timeout_s: float = Field(900.0, gt=0)
    """Longest wait for the inference server to become healthy (vLLM takes 30-75 s on CPU, minutes for large models)."""

    inflight_kv: Literal["recompute", "keep"] = "recompute"
    """What a sequence in flight when new weights are loaded (`orchestrator.batching =
    "continuous"`) does with the keys and values vLLM computed for it with the old weights:
    `recompute` them on the new weights when it resumes (vLLM's pause preempts it; its prompt
    and tokens so far are prefilled again), or `keep` them (it continues at once; its context
    stays encoded by the old policy, the importance ratio corrects each token as sampled)."""

    verify_reload: bool = False
    """After each reload, score one fixed prompt on every replica and fail the run if their
    logprobs differ (a replica left on old weights); the values are logged as
    `weights/probe_logprob/<replica>`. One short request per replica per reload."""

    @property
    def urls(self) -> list[str]:
        """Every inference server (replica) URL, without a trailing slash."""
        urls = [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)
        return [url.rstrip("/") for url in urls]

    @model_validator(mode="after")
    def _some_url(self) -> ClientConfig:
        if isinstance(self.base_url, list) and not self.base_url:
            raise ValueError("base_url: expected a URL or a non-empty list of URLs (one per replica)")
        return self
