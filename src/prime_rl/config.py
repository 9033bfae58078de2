"""Typed configuration shared by the launcher and the three processes.

One TOML file holds shared fields (``model``, ``max_steps``, ``seq_len``, ...) plus
``[trainer]``, ``[orchestrator]`` and ``[inference]`` sections. Shared fields are copied
into every section that needs them (see ``SHARED_FIELDS``); a section that sets the
same field to another value is an error. The flat hosted-training form (``batch_size``,
``rollouts_per_example``, ``[sampling]``, ``[[env]]``, ``[wandb]`` at top level) is the
same mechanism. Every model forbids unknown keys and documents each field with a
docstring, which is also its ``--help`` text.

This module never imports torch or vLLM: the launcher validates configs before any
process starts.
"""

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


# --------------------------------------------------------------------------- environments

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


# --------------------------------------------------------------------------- shared pieces


class ModelConfig(StrictModel):
    name: str = "Qwen/Qwen3-0.6B"
    """HF model id or local path of the model to train (HF format, safetensors)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype on the trainer; float32 on CPU, bfloat16 on GPUs."""

    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    """Attention of the trainer's model; None = transformers' default (sdpa). `flash_attention_2`
    (CUDA) runs packed rows through its variable-length kernel, without padding or a mask; it
    needs `uv pip install flash-attn --no-build-isolation` after the CUDA sync (PyPI ships it
    as a source package that builds against the installed torch)."""


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

    worker_timeout_s: float = Field(120.0, gt=0)
    """A worker process that sends nothing for this long (it sends a heartbeat every 2 s) is taken to hang: the run stops with an error naming the environment."""

    @field_validator("args")
    @classmethod
    def _args_not_too_deep(cls, args: dict[str, Any]) -> dict[str, Any]:
        return check_args_nesting(args)

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


def check_args_nesting(args: dict[str, Any]) -> dict[str, Any]:
    """``load_environment`` arguments whose tables and lists nest no deeper than a config may
    (what walks them later, the written config included, would hit Python's recursion limit)."""
    problem = nesting_problem(args)
    if problem:
        raise ValueError(problem)
    return args


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


class PreflightConfig(StrictModel):
    """Before RL, a few rollouts of the starting model on a sample of examples, to catch a task that is too hard or too easy."""

    enabled: bool = True
    """Run the preflight check before the first step of a fresh run (a resumed run skips it)."""

    num_examples: int = Field(16, ge=1)
    """Examples sampled per environment."""

    rollouts_per_example: int = Field(10, ge=1)
    """Attempts per example (the rule of thumb: 0% after 10+ attempts means too hard)."""

    too_hard_frac: float = Field(0.5, ge=0, le=1)
    """Advise when more than this share of examples scored 0 on every attempt."""

    too_easy_frac: float = Field(0.5, ge=0, le=1)
    """Advise when more than this share of examples has a mean reward of 0.8 or more."""

    no_diversity_frac: float = Field(0.5, ge=0, le=1)
    """Advise when more than this share of groups got identical rewards (no learning signal)."""

    strict: bool = False
    """Stop the run (instead of only advising) when a threshold is crossed."""


class EvalConfig(StrictModel):
    """Evaluation on the environments' eval splits during RL."""

    interval: int = Field(0, ge=0)
    """Evaluate every this many steps (and after the last step); 0 = never."""

    num_examples: int = Field(16, ge=-1)
    """Examples per environment (the first ones of its eval split; -1 = all)."""

    rollouts_per_example: int = Field(1, ge=1)
    """Rollouts per example."""


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
    """Largest frame the trainer takes (ZeroMQ `MAXMSGSIZE`: a bigger one drops the connection before it is buffered) and the orchestrator sends (a bigger batch fails the step, naming this setting). None = filled by the launcher from the run's batch (`prime_rl.deployment`), 64 MiB in a process started without it."""

    curve_server_secret: str | None = Field(None, repr=False)
    """Orchestrator: the CURVE secret key (Z85) of its PUSH sockets. Generated per run by the launcher (`prime_rl.deployment`), with the three below; never set by hand. None with the others = no encryption nor authentication, allowed on loopback only."""

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


# --------------------------------------------------------------------------- trainer


class OptimConfig(StrictModel):
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""

    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""

    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clipping threshold."""

    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up steps."""


MAX_TEACHER_TOP_K = 1024
"""Most tokens a teacher returns a position (`trainer.loss.distill.top_k`): 1024 x 8 bytes a sampled token on the wire."""


class DistillConfig(StrictModel):
    """On-policy distillation (`[trainer.loss.distill]`, with a `[teacher]`): the teacher scores
    every token the student sampled, and each sampled token's advantage becomes
    `reward_weight * A - kl_weight * (log p_student - log p_teacher)`, A the group advantage
    of its rollout and log p_student the logprob it was sampled with (the per-token reverse
    KL as a penalty). The importance correction stays as it is."""

    reward_weight: float = Field(0.0, ge=0)
    """Weight of the group advantage: 0 = pure distillation (the reward is only logged), 1 with
    `kl_weight` > 0 = RL plus distillation."""

    kl_weight: float = Field(1.0, ge=0)
    """Weight of the per-token reverse KL to the teacher."""

    top_k: int = Field(0, ge=0, le=MAX_TEACHER_TOP_K)
    """0 = the KL term is the one-sample estimate above, in each sampled token's advantage. K > 0 = the teacher also returns its K most likely tokens at every sampled position, and the KL term is each position's reverse KL(student || teacher) over those K tokens plus one bucket for the rest of the vocabulary, computed from the student's whole distribution and added to the loss as `kl_weight` x its mean over the loss tokens (no sampling noise; exact when K covers the vocabulary; docs/distillation.md). A local teacher is served with vLLM `--max-logprobs` >= K; an endpoint must allow K."""

    @model_validator(mode="after")
    def _some_signal(self) -> DistillConfig:
        if self.reward_weight == 0 and self.kl_weight == 0:
            raise ValueError("reward_weight and kl_weight are both 0: nothing would be learned; set kl_weight > 0")
        return self


class LossConfig(StrictModel):
    """Token-level policy-gradient loss corrected by the trainer/inference importance ratio."""

    importance: Literal["token_mask", "sequence_mask", "truncated", "none"] = "token_mask"
    """How the ratio pi_trainer / pi_inference corrects the off-policy gap: `token_mask` weighs
    each token by its ratio and drops tokens whose ratio leaves [mask_ratio_low, mask_ratio_high];
    `sequence_mask` drops whole samples whose geometric-mean ratio leaves that band; `truncated`
    weighs each token by min(ratio, truncate_max), no masking; `none` ignores it (plain REINFORCE)."""

    mask_ratio_low: float = Field(0.125, gt=0)
    """Tokens (samples, for `sequence_mask`) whose ratio falls below this are masked out."""

    mask_ratio_high: float = Field(8.0, gt=0)
    """Tokens (samples, for `sequence_mask`) whose ratio rises above this are masked out."""

    truncate_max: float = Field(2.0, gt=0)
    """Cap on the importance weight for `importance = "truncated"`."""

    log_ratio_clamp: float = Field(10.0, gt=0)
    """The log-ratio is clamped to [-c, c] before `exp` so the ratio stays finite."""

    denominator: Literal["informative", "all"] = "informative"
    """Tokens the step's loss is averaged over: `informative` counts the loss tokens of samples with a nonzero advantage only (a group whose rewards were all equal teaches nothing and must not shrink the step of the others), `all` counts every loss token. With distillation (`kl_weight` > 0) every sample is informative."""

    distill: DistillConfig | None = None
    """On-policy distillation toward `[teacher]` (`[trainer.loss.distill]`); None = RL only."""

    @model_validator(mode="after")
    def _band(self) -> LossConfig:
        if self.mask_ratio_low >= self.mask_ratio_high:
            raise ValueError("mask_ratio_low must be below mask_ratio_high")
        # A band edge beyond the clamp could never be crossed: a clamped ratio would pass.
        limit = math.exp(self.log_ratio_clamp)
        if self.mask_ratio_high >= limit or self.mask_ratio_low <= 1 / limit:
            raise ValueError(
                f"the mask band [{self.mask_ratio_low}, {self.mask_ratio_high}] must lie inside the log-ratio clamp "
                f"(exp(+-{self.log_ratio_clamp}) = [{1 / limit:.4g}, {limit:.4g}]): raise log_ratio_clamp or narrow the band"
            )
        return self


# vLLM's `--max-lora-rank` takes one of these (vllm/config/lora.py, `MaxLoRARanks`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(StrictModel):
    """Low-rank adapters (`peft`): only the adapters train; the base model stays frozen."""

    rank: int = Field(16, ge=1, le=VLLM_LORA_RANKS[-1])
    """Adapter rank r (vLLM serves ranks up to 512)."""

    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the adapter's update is scaled by alpha / rank."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training. Inference applies none, so anything
    above 0 makes the trainer score a different distribution than the one sampled."""

    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the linear layers that get adapters (Qwen3 and Llama names: attention and MLP projections)."""

    @model_validator(mode="after")
    def _modules(self) -> LoraConfig:
        if not self.target_modules:
            raise ValueError("target_modules: expected at least one module name (e.g. \"q_proj\")")
        return self


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's `--max-lora-rank` accepts that holds an adapter of ``rank``."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


class WeightsConfig(StrictModel):
    keep_last: int = Field(3, ge=1)
    """How many `weights/step_N/` directories to keep (older ones are deleted)."""


class CheckpointConfig(StrictModel):
    """Resumable checkpoints: the trainer's under `checkpoints/step_N/`, the orchestrator's progress under `rollouts/`."""

    interval: int = Field(10, ge=0)
    """Write a checkpoint every this many steps (and after the last step); 0 = never (no resume possible)."""

    keep_last: int = Field(2, ge=1)
    """How many complete checkpoints to keep; the newest complete one is never deleted."""

    resume_step: int | None = Field(None, ge=1)
    """Resume from `checkpoints/step_N/` (set by `prime-rl --resume`; None = a fresh run)."""


class TrainerConfig(StrictModel):
    model: ModelConfig = ModelConfig()
    """Model to train."""

    optim: OptimConfig = OptimConfig()
    """Optimizer settings."""

    loss: LossConfig = LossConfig()
    """Loss settings."""

    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (`[trainer.lora]`); None = full fine-tuning. `weights/step_N/` then holds the adapter (PEFT format), which inference loads at run time."""

    weights: WeightsConfig = WeightsConfig()
    """Weight handoff to inference."""

    transport: TransportConfig = TransportConfig()
    """Where micro-batches come from."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Resumable checkpoints."""

    max_steps: int = Field(20, ge=1)
    """Number of optimizer steps."""

    seq_len: int = Field(512, ge=8)
    """Maximum tokens (prompt + completion) per sample."""

    output_dir: Path = Path("outputs/run")
    """Run directory shared by the three processes."""

    seed: int = 0
    """Random seed."""

    num_threads: int = Field(2, ge=1)
    """torch intra-op threads. Two on a 2-core machine: the trainer then uses the core
    vLLM leaves idle once a step's sampling is done (docs/machine_facts.md)."""

    share_prefix: bool = True
    """Run the prompt a group's rollouts share once, not once per rollout (`trainer.packing`;
    same logprobs and gradients to float rounding). Off by itself for models whose attention
    takes no custom mask or that have sliding-window layers."""

    pack: bool = True
    """Pack several samples (and shared-prefix groups) into each model row, each attending only
    to itself, so the trainer computes (almost) no padding (`trainer.packing`; same logprobs and
    gradients to float rounding). Off: one row per sample or group, right-padded. Off by itself
    for models whose attention takes no custom mask or that have sliding-window layers, unless
    they run flash-attention's variable-length kernel."""

    max_nonfinite_steps: int = Field(3, ge=1)
    """A step with a non-finite loss or gradient is skipped; this many in a row stop the run."""

    wandb: WandbConfig | None = None
    """W&B logging; off when absent."""


# --------------------------------------------------------------------------- orchestrator


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


class AdvantageConfig(StrictModel):
    normalize_std: bool = False
    """Divide each group's centred rewards by the group's reward std (GRPO); off = Dr. GRPO style."""


class FilterConfig(StrictModel):
    """Online difficulty filtering: groups that teach nothing are dropped and replaced by newly sampled ones."""

    enabled: bool = False
    """Filter each step's groups (off: every sampled group is trained on)."""

    drop_equal_rewards: bool = True
    """Drop groups whose rollouts all got the same reward (zero advantage: no gradient)."""

    min_mean_reward: float | None = None
    """Drop groups whose mean reward is below this (too hard); None = no lower bound."""

    max_mean_reward: float | None = None
    """Drop groups whose mean reward is above this (too easy); None = no upper bound."""

    max_extra_examples: int = Field(32, ge=0)
    """Most examples sampled per step beyond the batch's to replace dropped groups; past it the batch is filled with dropped groups (counted in `filter/topped_up`)."""

    @model_validator(mode="after")
    def _band(self) -> FilterConfig:
        low, high = self.min_mean_reward, self.max_mean_reward
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_mean_reward ({low}) must not exceed max_mean_reward ({high})")
        return self


class TeacherClientConfig(StrictModel):
    """The orchestrator's teacher (filled from `[teacher]` in an RL run): a vLLM server scoring
    the student's tokens (prompt logprobs over the student's exact token ids)."""

    model: str
    """Model name sent in requests."""

    client: ClientConfig = ClientConfig()
    """The teacher server's URL, timeouts and retries."""

    api_key_env: str | None = None
    """Environment variable holding the teacher's API key (an endpoint's `key`); None = no key."""

    system_prompt: str | None = None
    """Context distillation: the teacher scores each completion under the conversation with
    this system message (replacing the conversation's own, or put first); None = the
    student's exact prompt."""

    top_k: int = Field(0, ge=0, le=MAX_TEACHER_TOP_K)
    """The teacher's K most likely tokens at every sampled position also go to the trainer (`trainer.loss.distill.top_k`); 0 = only the sampled token's logprob."""


class OrchestratorConfig(StrictModel):
    model: str = "Qwen/Qwen3-0.6B"
    """Model name as served by inference (its path or id)."""

    env: list[EnvConfig] = [EnvConfig()]
    """Environments to sample from."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings."""

    client: ClientConfig = ClientConfig()
    """Inference client."""

    advantage: AdvantageConfig = AdvantageConfig()
    """How rewards become advantages within each group."""

    filter: FilterConfig = FilterConfig()
    """Online difficulty filtering of each step's groups."""

    tokenizer: str | None = None
    """Tokenizer (HF id or local path) that renders prompts; None = `model`."""

    tool_call_parser: str | None = None
    """vLLM's tool-call parser the inference server runs (filled from `inference.tool_call_parser`); tool environments need one."""

    lora_adapter: str | None = None
    """Name under which each new `weights/step_N/` adapter is loaded into inference and which requests then name (set when `[trainer.lora]` is); None = full weights are reloaded."""

    multi_turn: Literal["sequence", "per_turn"] = "sequence"
    """How a multi-turn rollout is trained: `sequence` = one sample with every turn's exact tokens (needs a chat template that renders each turn as an extension of the previous ones); `per_turn` = one sample per turn, its prompt the template's rendering of the conversation so far (for templates that rewrite earlier turns, e.g. Qwen3's <think> stripping)."""

    preflight: PreflightConfig = PreflightConfig()
    """Difficulty check before RL."""

    eval: EvalConfig = EvalConfig()
    """Evaluation during RL."""

    transport: TransportConfig = TransportConfig()
    """Where micro-batches go."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Resumable progress (data cursor, batches sampled but not yet trained on)."""

    batch_size: int = Field(64, ge=1)
    """Rollouts per step (examples per step x rollouts_per_example)."""

    rollouts_per_example: int = Field(8, ge=1)
    """Samples per prompt; advantages are computed within each group."""

    micro_batch_size: int = Field(32, ge=1)
    """Samples per micro-batch sent to the trainer."""

    num_trainer_ranks: int = Field(1, ge=1)
    """Trainer ranks; each gets its own share of every step's samples, balanced by token count (filled from `[deployment]` in an RL run)."""

    max_steps: int = Field(20, ge=1)
    """Number of steps to produce batches for."""

    async_level: int = Field(1, ge=0)
    """Batch for step n is sampled with policy version >= n - async_level (versions count optimizer steps; 0 = on-policy)."""

    batching: Literal["continuous", "step"] = "continuous"
    """`continuous`: groups of rollouts stay in flight across step boundaries, each step's batch is cut from the groups that completed first, and new weights are loaded while requests are in flight (vLLM's `/pause?mode=keep`); `step`: every step samples its own groups, all at once, and weights are reloaded between steps."""

    initial_weights: Path | None = None
    """Weights to load into inference before sampling (a server that is already up, started for another run: `prime-rl inference`): the run's model, or `weights/step_N` on a resume. None = inference starts with the run's own weights."""

    max_inflight_groups: int | None = Field(None, ge=1)
    """Most groups in flight at once with `continuous` batching; None = (async_level + 1) x the groups of one step, all that the async bound can use."""

    seq_len: int = Field(512, ge=8)
    """Maximum tokens (prompt + completion) per sample."""

    output_dir: Path = Path("outputs/run")
    """Run directory shared by the three processes."""

    weights_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for the trainer's next weights before failing."""

    seed: int = 0
    """Random seed (data order)."""

    teacher: TeacherClientConfig | None = None
    """The teacher that scores every sampled token for distillation (filled from `[teacher]`); None = none."""

    wandb: WandbConfig | None = None
    """W&B logging; off when absent."""

    @model_validator(mode="after")
    def _batch_divisible(self) -> OrchestratorConfig:
        check_env_names(self.env)
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by rollouts_per_example ({self.rollouts_per_example})"
            )
        if self.batch_size < self.num_trainer_ranks:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be at least num_trainer_ranks ({self.num_trainer_ranks}): every rank needs a sample"
            )
        return self


# --------------------------------------------------------------------------- inference


class InferenceConfig(StrictModel):
    model: str = "Qwen/Qwen3-0.6B"
    """HF model id or local path to serve."""

    served_model_name: str | None = None
    """Name requests use for the model (vLLM `--served-model-name`); None = `model`. A resumed run serves `weights/step_N` under the original name."""

    host: str = "127.0.0.1"
    """Address the server binds."""

    port: int = Field(8000, ge=1024, le=65535)
    """Port the server binds."""

    api_key: str | None = None
    """Require this bearer key on every request."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights dtype in vLLM; keep it equal to the trainer's."""

    seq_len: int = Field(512, ge=8)
    """vLLM `--max-model-len`."""

    max_num_seqs: int = Field(256, ge=1)
    """Most sequences batched at once. 256 holds a whole quickstart step (32 prompts x 8),
    which on CPU takes ~0.7 s instead of 1.0-1.5 s in waves of 64 (docs/machine_facts.md)."""

    max_logprobs: int = Field(20, ge=0)
    """Most logprobs a request may ask for a position (vLLM `--max-logprobs`); a distillation teacher gets `trainer.loss.distill.top_k` when that is larger."""

    enforce_eager: bool = True
    """Skip graph capture (faster start; the right choice on CPU)."""

    kv_cache_gb: int = Field(1, ge=1)
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of GPU memory vLLM may use (GPU machines)."""

    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per vLLM replica (`--tensor-parallel-size`); `deployment.inference_gpus` / this = replicas."""

    cpu_threads_bind: str | None = None
    """VLLM_CPU_OMP_THREADS_BIND (e.g. `0` or `0-1`); None leaves vLLM's default."""

    max_lora_rank: int | None = Field(None, ge=1)
    """Serve LoRA adapters up to this rank, loaded at run time (vLLM `--enable-lora --max-lora-rank`); filled from `[trainer.lora]`. None = no adapters."""

    lora_modules: dict[str, str] = {}
    """LoRA adapters served from the start, name -> PEFT adapter folder (vLLM `--lora-modules`); needs `max_lora_rank`. `prime-rl eval -m RUN/weights/step_N` of a LoRA run fills it."""

    tool_call_parser: str | None = None
    """vLLM's tool-call parser for the model family (`--tool-call-parser`, with `--enable-auto-tool-choice`): `hermes` for Qwen3, Qwen2.5 and the tiny test model. Tool environments need it; None = no tool calls."""

    extra_args: list[str] = []
    """Extra command-line flags passed to the vLLM server as written."""

    output_dir: Path = Path("outputs/run")
    """Run directory (the server's log lives there)."""

    attach: bool | None = None
    """An RL run only: use the warm servers `prime-rl inference CONFIG` keeps up on this run's ports instead of starting vLLM (the run loads its own weights into them). None = attach when a live warm server holds the ports, else start our own; true = attach or refuse; false = always start our own (a warm server on the ports is refused, as any program holding them)."""

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> InferenceConfig:
        if self.lora_modules and self.max_lora_rank is None:
            raise ValueError("lora_modules: set max_lora_rank too (the largest adapter rank to serve)")
        return self


# --------------------------------------------------------------------------- placement


class DeploymentConfig(StrictModel):
    """How one node's GPUs are split between inference and the trainer (`[deployment]`). The
    launcher gives each process its GPUs through CUDA_VISIBLE_DEVICES: inference the first
    `inference_gpus`, the trainer the next `trainer_gpus`. On a machine without GPUs the same
    numbers select CPU processes: vLLM-CPU replicas and gloo trainer ranks."""

    inference_gpus: int = Field(1, ge=1)
    """GPUs for inference: one vLLM server (replica) per `inference.tensor_parallel_size` of them, on ports `inference.port`, +1, ...; the orchestrator spreads requests over all of them."""

    trainer_gpus: int = Field(1, ge=1)
    """GPUs for the trainer: `torchrun --nproc-per-node`, one FSDP2 rank each (1 = a plain process)."""

    teacher_gpus: int = Field(1, ge=1)
    """GPUs for a local `[teacher]`'s vLLM server (tensor parallel over them), after the trainer's; unused without one."""


class SlurmConfig(StrictModel):
    """`prime-rl CONFIG.toml --slurm`: the sbatch job that runs this config (`[slurm]`)."""

    nodes: int = Field(1, ge=1)
    """Nodes of the job. One: the whole trio on it, GPUs split by `[deployment]`. Several: the first `inference_nodes` run vLLM replicas on all their GPUs, the rest run the trainer (multi-node torchrun on all their GPUs) and, on the first of them, the orchestrator."""

    inference_nodes: int = Field(0, ge=0)
    """With nodes > 1: how many (the first ones) run inference; at least 1, fewer than `nodes`."""

    gpus_per_node: int = Field(8, ge=0)
    """GPUs to request per node (`--gpus-per-node`); 0 = CPU nodes (one replica or trainer rank per node)."""

    partition: str | None = None
    """`--partition`; None = the cluster's default."""

    account: str | None = None
    """`--account`; None = the user's default."""

    time: str = "24:00:00"
    """`--time` limit of the job."""

    job_name: str | None = None
    """`--job-name`; None = `prime-rl-<output_dir's name>`."""

    cpus_per_node: int | None = Field(None, ge=1)
    """`--cpus-per-task` of each node's one task; None = the cluster's default."""

    bind_host: str | None = None
    """Address vLLM and the orchestrator's ZeroMQ sockets bind on their node in a multi-node job; None = the node's own address as SLURM knows it (`NodeAddr`). Single-node jobs stay on 127.0.0.1. (torchrun's rendezvous and the trainer's gloo/NCCL sockets follow torch's own settings, e.g. `GLOO_SOCKET_IFNAME`/`NCCL_SOCKET_IFNAME` in `setup`.)"""

    rdzv_port: int = Field(29500, ge=1024, le=65535)
    """Port of torchrun's c10d rendezvous on the first trainer node."""

    setup: list[str] = []
    """Shell lines run on every node before the job starts (`module load ...`, `source .venv/bin/activate`)."""

    sbatch_args: list[str] = []
    """Extra `#SBATCH` options as written, e.g. `--exclusive` or `--mem=0`."""

    @model_validator(mode="after")
    def _split(self) -> SlurmConfig:
        if self.nodes > 1 and not 1 <= self.inference_nodes < self.nodes:
            raise ValueError(
                f"inference_nodes: with nodes = {self.nodes}, expected 1 to {self.nodes - 1} inference nodes "
                f"(the rest train), got {self.inference_nodes}"
            )
        if self.nodes == 1 and self.inference_nodes:
            raise ValueError("inference_nodes: a single-node job runs inference beside the trainer; set nodes > 1 or leave it 0")
        return self

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


class TeacherConfig(StrictModel):
    """The teacher of on-policy distillation (`[teacher]`, with `[trainer.loss.distill]`): it
    scores every token the student samples (prompt logprobs over the student's exact token
    ids, never re-tokenized), so it must use the student's tokenizer."""

    model: str | None = None
    """An HF model folder (or hub id), or a run's `weights/step_N` (full weights): served by a vLLM process of its own, which the launcher starts and stops with the run in its own pane."""

    endpoint: str | None = None
    """Instead of `model`: the name of an endpoint in `endpoints_path` whose server returns prompt logprobs over token ids (a vLLM server: its URL ending in `/v1`)."""

    endpoints_path: Path = Path("configs/endpoints.toml")
    """The endpoints file `endpoint` is looked up in."""

    system_prompt: str | None = None
    """Context distillation: the teacher scores the student's completions under the conversation with this system message (replacing the conversation's own, or put first), the student trains under its own prompt. None = the student's exact prompt."""

    system_prompt_file: Path | None = None
    """The same, read from a file (e.g. the `best_prompt.txt` of `prime-rl gepa`)."""

    port: int = Field(8100, ge=1024, le=65535)
    """Port of a local teacher's server (on `inference.host`)."""

    seq_len: int | None = Field(None, ge=8)
    """A local teacher's context (vLLM `--max-model-len`); None = the run's `seq_len` + 1, plus `prompt_room` with a system prompt."""

    prompt_room: int = Field(1024, ge=0)
    """With a system prompt and `seq_len` unset: tokens the teacher's prompt may add to the student's."""

    max_num_seqs: int = Field(256, ge=1)
    """A local teacher's most sequences batched at once."""

    kv_cache_gb: int = Field(1, ge=1)
    """A local teacher's KV cache on CPU (GiB)."""

    timeout_s: float = Field(300.0, gt=0)
    """Timeout of one scoring request."""

    max_concurrency: int = Field(64, ge=1)
    """Most scoring requests in flight at once."""

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        if (self.model is None) == (self.endpoint is None):
            raise ValueError("teacher: set exactly one of `model` (served locally) and `endpoint` (a running server)")
        if self.system_prompt is not None and self.system_prompt_file is not None:
            raise ValueError("teacher: set `system_prompt` or `system_prompt_file`, not both")
        return self


class WatchdogConfig(StrictModel):
    """The launcher's watchdog (`[watchdog]`): it reads every process's heartbeat
    (`RUN/logs/<process>.heartbeat.json`) and speaks up when none of them makes progress."""

    report_s: float = Field(120.0, ge=0)
    """Seconds without progress in any process before the launcher prints what each one waits for (again at most this often); 0 = never report."""

    timeout_s: float = Field(1800.0, ge=0)
    """Seconds without progress in any process before the launcher stops the run (exit 1); 0 = never, only report."""

    @model_validator(mode="after")
    def _report_before_timeout(self) -> WatchdogConfig:
        if self.report_s and self.timeout_s and self.report_s > self.timeout_s:
            raise ValueError(f"report_s ({self.report_s:g}) must not exceed timeout_s ({self.timeout_s:g})")
        return self


# --------------------------------------------------------------------------- root (RL)


# shared field -> the section fields it fills ("section.path.to.field").
SHARED_FIELDS: dict[str, tuple[str, ...]] = {
    "model": ("trainer.model.name", "orchestrator.model", "inference.model"),
    "max_steps": ("trainer.max_steps", "orchestrator.max_steps"),
    "seq_len": ("trainer.seq_len", "orchestrator.seq_len", "inference.seq_len"),
    "output_dir": ("trainer.output_dir", "orchestrator.output_dir", "inference.output_dir"),
    "async_level": ("orchestrator.async_level",),
    "seed": ("trainer.seed", "orchestrator.seed"),
    "batch_size": ("orchestrator.batch_size",),
    "rollouts_per_example": ("orchestrator.rollouts_per_example",),
    "sampling": ("orchestrator.sampling",),
    "env": ("orchestrator.env",),
    "wandb": ("trainer.wandb", "orchestrator.wandb"),
    "transport": ("trainer.transport", "orchestrator.transport"),
    "ckpt": ("trainer.ckpt", "orchestrator.ckpt"),
    "preflight": ("orchestrator.preflight",),
    "eval": ("orchestrator.eval",),
}


class RLConfig(StrictModel):
    """`prime-rl CONFIG.toml`: the whole RL run (shared fields + one section per process)."""

    model: str | None = None
    """Model to start from (HF id or local path); fills every section."""

    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps of the run."""

    seq_len: int | None = Field(None, ge=8)
    """Maximum tokens (prompt + completion) per sample."""

    output_dir: Path | None = None
    """Run directory shared by the three processes."""

    async_level: int | None = Field(None, ge=0)
    """Most policy versions a batch may lag behind its step."""

    seed: int | None = None
    """Random seed."""

    batch_size: int | None = Field(None, ge=1)
    """Rollouts per step (flat hosted-training form)."""

    rollouts_per_example: int | None = Field(None, ge=1)
    """Samples per prompt (flat hosted-training form)."""

    sampling: SamplingConfig | None = None
    """Sampling settings (flat hosted-training form)."""

    env: list[EnvConfig] | None = None
    """Environments (flat hosted-training form: `[[env]]`)."""

    wandb: WandbConfig | None = None
    """W&B logging for trainer and orchestrator; off when absent."""

    transport: TransportConfig | None = None
    """Rollout transport settings for trainer and orchestrator."""

    ckpt: CheckpointConfig | None = None
    """Checkpoint settings for trainer and orchestrator."""

    preflight: PreflightConfig | None = None
    """Difficulty check before RL (orchestrator)."""

    eval: EvalConfig | None = None
    """Evaluation during RL (orchestrator)."""

    trainer: TrainerConfig = TrainerConfig()
    """Trainer process."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """Orchestrator process."""

    inference: InferenceConfig = InferenceConfig()
    """Inference process."""

    deployment: DeploymentConfig = DeploymentConfig()
    """GPUs for inference and for the trainer on one node."""

    slurm: SlurmConfig | None = None
    """The SLURM job for `prime-rl CONFIG.toml --slurm`; None = no SLURM settings."""

    watchdog: WatchdogConfig = WatchdogConfig()
    """Launcher's stall watchdog over the processes' heartbeats."""

    teacher: TeacherConfig | None = None
    """The teacher of on-policy distillation (`[teacher]`, with `[trainer.loss.distill]`); None = none."""

    @model_validator(mode="before")
    @classmethod
    def _propagate_shared(cls, data: Any) -> Any:
        if isinstance(data, dict):
            propagate_shared(data)
        return data

    @property
    def num_replicas(self) -> int:
        """vLLM servers of the run: per node `[deployment]`'s split, or whole inference nodes."""
        tp = self.inference.tensor_parallel_size
        if self.slurm is not None and self.slurm.multi_node:
            return self.slurm.inference_nodes * max(1, self.slurm.gpus_per_node // tp)
        return self.deployment.inference_gpus // tp

    @property
    def num_trainer_ranks(self) -> int:
        if self.slurm is not None and self.slurm.multi_node:
            return (self.slurm.nodes - self.slurm.inference_nodes) * max(1, self.slurm.gpus_per_node)
        return self.deployment.trainer_gpus

    def replica_urls(self, hosts: list[str] | None = None) -> list[str]:
        """One URL per replica: ports `inference.port`, +1, ... on each host (default: inference.host)."""
        hosts = hosts or [self.inference.host]
        per_host = self.num_replicas // len(hosts)
        return [f"http://{host}:{self.inference.port + i}" for host in hosts for i in range(per_host)]

    def _placement(self) -> None:
        """Trainer ranks and replicas come from `[deployment]` (or `[slurm]`'s nodes);
        `orchestrator.num_trainer_ranks`, the older spelling, still works on one node."""
        deployment, orchestrator, tp = self.deployment, self.orchestrator, self.inference.tensor_parallel_size
        if deployment.inference_gpus % tp:
            raise ValueError(
                f"deployment.inference_gpus ({deployment.inference_gpus}) must be a multiple of "
                f"inference.tensor_parallel_size ({tp}): each replica takes {tp} GPUs"
            )
        needed = deployment.inference_gpus + deployment.trainer_gpus
        if self.slurm is not None and not self.slurm.multi_node and 0 < self.slurm.gpus_per_node < needed:
            raise ValueError(
                f"slurm.gpus_per_node ({self.slurm.gpus_per_node}) is less than the {needed} GPUs [deployment] "
                f"splits on one node (inference_gpus {deployment.inference_gpus} + trainer_gpus {deployment.trainer_gpus})"
            )
        if self.slurm is not None and self.slurm.multi_node and 0 < self.slurm.gpus_per_node < tp:
            raise ValueError(f"inference.tensor_parallel_size ({tp}) exceeds slurm.gpus_per_node ({self.slurm.gpus_per_node})")
        if "num_trainer_ranks" in orchestrator.model_fields_set and not (self.slurm and self.slurm.multi_node):
            if "trainer_gpus" in deployment.model_fields_set and deployment.trainer_gpus != orchestrator.num_trainer_ranks:
                raise ValueError(
                    f"conflicting values: `deployment.trainer_gpus` = {deployment.trainer_gpus} but "
                    f"`orchestrator.num_trainer_ranks` = {orchestrator.num_trainer_ranks}; set deployment.trainer_gpus only"
                )
            deployment.trainer_gpus = orchestrator.num_trainer_ranks
        orchestrator.num_trainer_ranks = self.num_trainer_ranks
        if orchestrator.batch_size < orchestrator.num_trainer_ranks:
            raise ValueError(
                f"batch_size ({orchestrator.batch_size}) must be at least the trainer's ranks "
                f"({orchestrator.num_trainer_ranks}): every rank needs a sample"
            )

    @model_validator(mode="after")
    def _consistent(self) -> RLConfig:
        self._placement()
        client = self.orchestrator.client
        if "base_url" not in client.model_fields_set:
            urls = self.replica_urls()
            client.base_url = urls[0] if len(urls) == 1 else urls
            client.model_fields_set.discard("base_url")
        if client.api_key is None and self.inference.api_key is not None:
            client.api_key = self.inference.api_key
        if self.orchestrator.tool_call_parser is None and self.inference.tool_call_parser is not None:
            self.orchestrator.tool_call_parser = self.inference.tool_call_parser
            self.orchestrator.model_fields_set.discard("tool_call_parser")
        for env in self.orchestrator.env:
            if problem := registry.tool_parser_problem(env.id, registry.declares_tools(env.id), self.inference.tool_call_parser):
                raise ValueError(problem)
        self._lora()
        self._teacher()
        # One checkpoint schedule for both processes: the orchestrator follows the trainer's.
        if "ckpt" not in self.orchestrator.model_fields_set:
            self.orchestrator.ckpt = self.trainer.ckpt.model_copy()
            self.orchestrator.model_fields_set.discard("ckpt")
        elif self.orchestrator.ckpt != self.trainer.ckpt:
            raise ValueError(
                "conflicting values: `orchestrator.ckpt` differs from `trainer.ckpt`; set `[ckpt]` once for both"
            )
        return self

    def _lora(self) -> None:
        """`[trainer.lora]` turns on adapter serving in inference and adapter loading in the
        orchestrator; either one set without the trainer training adapters is a mistake."""
        lora, inference, orchestrator = self.trainer.lora, self.inference, self.orchestrator
        if lora is None:
            if orchestrator.lora_adapter is not None:
                raise ValueError("orchestrator.lora_adapter is set but `[trainer.lora]` is not: the trainer would write full weights")
            return
        if inference.max_lora_rank is None:
            inference.max_lora_rank = vllm_lora_rank(lora.rank)
            inference.model_fields_set.discard("max_lora_rank")
        elif inference.max_lora_rank < lora.rank:
            raise ValueError(f"inference.max_lora_rank ({inference.max_lora_rank}) is below trainer.lora.rank ({lora.rank})")
        if inference.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"inference.max_lora_rank: vLLM accepts one of {list(VLLM_LORA_RANKS)}, got {inference.max_lora_rank}")
        if orchestrator.lora_adapter is None:
            orchestrator.lora_adapter = LORA_ADAPTER_NAME
            orchestrator.model_fields_set.discard("lora_adapter")
        served = inference.served_model_name or inference.model
        if orchestrator.lora_adapter in (served, orchestrator.model):
            raise ValueError(f"orchestrator.lora_adapter {orchestrator.lora_adapter!r} must differ from the served model's name")


    def _teacher(self) -> None:
        """A teacher and the distillation loss come together: one without the other would
        score tokens for nothing, or train toward logprobs nobody sends."""
        distill = self.trainer.loss.distill
        if self.teacher is None and distill is not None:
            raise ValueError("trainer.loss.distill is set but there is no `[teacher]` (model = a folder, or endpoint = a name)")
        if self.teacher is not None and distill is None:
            raise ValueError("`[teacher]` is set but `[trainer.loss.distill]` is not: the teacher's logprobs would not be trained on")
        if self.teacher is not None and self.teacher.model is not None and self.slurm is not None and self.slurm.multi_node:
            raise ValueError("teacher.model: a local teacher runs on one node; in a multi-node job serve it yourself and set teacher.endpoint")


LORA_ADAPTER_NAME = "policy-lora"
"""The name each step's adapter is loaded under (in place) unless `orchestrator.lora_adapter` says otherwise."""


def propagate_shared(data: dict[str, Any]) -> None:
    """Copy each shared field set at the top level into its section fields (in place).

    A section that sets the same field explicitly to a different value is a conflict.
    """
    for shared, targets in SHARED_FIELDS.items():
        if shared not in data or data[shared] is None:
            continue
        value = data[shared]
        for target in targets:
            *parents, leaf = target.split(".")
            node = data
            for part in parents:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                if not isinstance(child, dict):  # wrong type: let pydantic report it
                    break
                node = child
            else:
                if leaf in node and _normalized(node[leaf]) != _normalized(value):
                    raise ValueError(
                        f"conflicting values: `{shared}` = {value!r} but `{target}` = {node[leaf]!r}; set one of them"
                    )
                node[leaf] = value


def _normalized(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, dict | list):
        return value
    return str(value)  # CLI flags arrive as strings: `--max-steps 3` equals `max_steps = 3`


# --------------------------------------------------------------------------- SFT


class SFTDataConfig(StrictModel):
    path: Path = Path("data/sft.jsonl")
    """JSONL file, one `{"messages": [...]}` chat per line; loss on assistant tokens only."""

    batch_size: int = Field(32, ge=1)
    """Chats per optimizer step."""

    micro_batch_size: int = Field(32, ge=1)
    """Chats per forward/backward pass."""


class SFTConfig(StrictModel):
    """`prime-rl sft CONFIG.toml`: supervised fine-tuning, used as the warm-up before RL."""

    model: ModelConfig = ModelConfig()
    """Model to fine-tune."""

    data: SFTDataConfig = SFTDataConfig()
    """Training data."""

    optim: OptimConfig = OptimConfig(lr=1e-3)
    """Optimizer settings."""

    max_steps: int = Field(200, ge=1)
    """Optimizer steps."""

    seq_len: int = Field(512, ge=8)
    """Chats longer than this are truncated."""

    output_dir: Path = Path("outputs/sft")
    """Where the fine-tuned model (HF format) is written; RL starts from it."""

    seed: int = 0
    """Random seed."""

    num_threads: int = Field(2, ge=1)
    """torch intra-op threads."""

    wandb: WandbConfig | None = None
    """W&B logging; off when absent."""

    @model_validator(mode="after")
    def _micro_divides(self) -> SFTConfig:
        if self.data.batch_size % self.data.micro_batch_size:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must be divisible by data.micro_batch_size ({self.data.micro_batch_size})"
            )
        return self


# --------------------------------------------------------------------------- eval command


class EvalEnvConfig(StrictModel):
    """One environment of `prime-rl eval` (an `[[eval]]` entry)."""

    id: str
    """Environment id, as in `[[env]]` (`env_id` works too, as in `prime eval` configs)."""

    args: dict[str, Any] = {}
    """Keyword arguments passed to the environment's `load_environment` (`env_args` works too)."""

    name: str | None = None
    """Name in the table and in the results folder; defaults to the id without its owner prefix."""

    num_examples: int | None = Field(None, ge=-1)
    """Examples of this environment (the first ones of its eval split; -1 = all); None = the top-level `num_examples`."""

    rollouts_per_example: int | None = Field(None, ge=1)
    """Rollouts per example; None = the top-level `rollouts_per_example`."""

    system_prompt_file: Path | None = None
    """A file whose text replaces the environment's system prompt (`--system-prompt-file`), e.g. the `best_prompt.txt` of `prime-rl gepa`."""

    python: Path | None = None
    """The Python of a virtual environment holding this environment and its verifiers, as in `[[env]]`; None = prime-rl's own."""

    @model_validator(mode="before")
    @classmethod
    def _documented_names(cls, data: Any) -> Any:
        """`env_id` / `env_args` (the names `prime eval` configs use) -> `id` / `args`."""
        if isinstance(data, dict):
            for alias, field in (("env_id", "id"), ("env_args", "args")):
                if alias in data:
                    if field in data:
                        raise ValueError(f"[[eval]] entry sets both `{field}` and `{alias}`; keep one")
                    data = {**{k: v for k, v in data.items() if k != alias}, field: data[alias]}
        return data

    @field_validator("args")
    @classmethod
    def _args_not_too_deep(cls, args: dict[str, Any]) -> dict[str, Any]:
        return check_args_nesting(args)

    @model_validator(mode="after")
    def _known_environment(self) -> EvalEnvConfig:
        check_environment_id(self.id, self.python)
        check_prompt_file(self.system_prompt_file)
        if self.name is not None and not re.fullmatch(r"[\w.-]+", self.name):
            raise ValueError(f"eval name {self.name!r} may only hold letters, digits, `_`, `-` and `.`")
        if self.num_examples == 0:
            raise ValueError("num_examples must be -1 (all) or at least 1")
        return self

    @property
    def metric_name(self) -> str:
        return self.name or environment_name(self.id).split("/")[-1]

    def env_config(self) -> EnvConfig:
        """The `[[env]]` form the environment loader takes."""
        return EnvConfig(id=self.id, args=self.args, name=self.name, system_prompt_file=self.system_prompt_file, python=self.python)


class EvalSamplingConfig(StrictModel):
    max_tokens: int | None = Field(None, ge=1)
    """Maximum completion tokens per turn; None = the server's default (a local model: what is left of `seq_len`)."""

    temperature: float | None = Field(None, ge=0)
    """Sampling temperature (0 = greedy); None = the server's default (1.0 for vLLM)."""


class EvalTarget(StrictModel):
    """What `model` / `endpoint_id` resolved to; `prime-rl eval` writes it for the eval process."""

    type: Literal["endpoint", "local"]
    """`endpoint`: a text-only OpenAI-compatible API of the endpoints file; `local`: the vLLM server `prime-rl eval` starts, sampled with exact tokens as in RL."""

    model: str
    """Model name sent in requests."""

    api_key_var: str | None = None
    """Environment variable the eval process reads the endpoint's API key from (the key is never written to a file); unset = no key."""

    endpoint_id: str | None = None
    """Name of the endpoint in the endpoints file (None for a local model)."""


class EvalRunConfig(StrictModel):
    """`prime-rl eval ENV_ID|CONFIG.toml`: a model's scores on the eval splits of environments."""

    model: str = "gpt-4.1-mini"
    """An endpoint name of `endpoints_path`, or a local model folder (a run's `weights/step_N` too) or HF id, which `prime-rl eval` serves with a vLLM server it starts and stops."""

    endpoint_id: str | None = None
    """Endpoint name of `endpoints_path` to evaluate, instead of `model`."""

    endpoints_path: Path = Path("configs/endpoints.toml")
    """Endpoint registry: `[[endpoint]]` tables with `endpoint_id`, `model`, `url` and `key`."""

    num_examples: int = Field(5, ge=-1)
    """Examples per environment (the first ones of its eval split; -1 = all)."""

    rollouts_per_example: int = Field(3, ge=1)
    """Rollouts per example (pass@k is reported for k up to this)."""

    save_results: bool = False
    """Write `results.jsonl` (one row per rollout) and `summary.json` to OUTPUT_DIR/<env>--<model>/<run>/."""

    output_dir: Path = Path("outputs/evals")
    """Results folder; each run's resolved configs and logs go to OUTPUT_DIR/runs/<run>/."""

    seq_len: int | None = Field(None, ge=8)
    """Context of a local model (prompt + completion tokens, vLLM `--max-model-len`); fills `inference.seq_len`. Endpoints keep their own."""

    sampling: EvalSamplingConfig = EvalSamplingConfig()
    """Sampling settings."""

    eval: list[EvalEnvConfig] = []
    """Environments to evaluate (`[[eval]]` entries; `prime-rl eval ENV_ID` makes one)."""

    client: ClientConfig = ClientConfig()
    """Requests: timeout, concurrency, retries, start-up wait (`base_url` and `api_key` come from the endpoint or the local server)."""

    inference: InferenceConfig = InferenceConfig()
    """The vLLM server for a local model or HF id (unused for an endpoint); `model` fills `inference.model`."""

    run_id: str | None = None
    """Name of the run's folders (set by `prime-rl eval`: a timestamp and a short id)."""

    target: EvalTarget | None = None
    """What `model` resolved to (set by `prime-rl eval` for the eval process)."""

    @model_validator(mode="after")
    def _consistent(self) -> EvalRunConfig:
        if not self.eval:
            raise ValueError("no environment to evaluate: give an environment id (prime-rl eval ENV_ID) or [[eval]] entries")
        names = [entry.metric_name for entry in self.eval]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"several [[eval]] entries are named {duplicates[0]!r}; give each a distinct `name`")
        if self.num_examples == 0:
            raise ValueError("num_examples must be -1 (all) or at least 1")
        if self.seq_len is not None:
            if "seq_len" in self.inference.model_fields_set and self.inference.seq_len != self.seq_len:
                raise ValueError(
                    f"conflicting values: `seq_len` = {self.seq_len} but `inference.seq_len` = {self.inference.seq_len}; set one of them"
                )
            self.inference.seq_len = self.seq_len
        return self


# --------------------------------------------------------------------------- GEPA


class GepaConfig(StrictModel):
    """The search of `prime-rl gepa` (`[gepa]`): budget, data split, reflection minibatches."""

    max_calls: int = Field(500, ge=1)
    """Evaluation budget: rollouts the search may run, validation included (`--max-calls/-B`)."""

    num_train: int = Field(100, ge=1)
    """Training examples reflection minibatches come from: the first ones of the training split (`--num-train/-n`)."""

    num_val: int = Field(50, ge=1)
    """Validation examples the Pareto frontier is kept over: the first ones of the eval split (`--num-val/-N`)."""

    minibatch_size: int = Field(3, ge=1)
    """Examples per reflection minibatch (`--minibatch-size`)."""

    perfect_score: float | None = None
    """Minibatches whose every rollout reaches this reward are skipped during reflection (`--perfect-score`); None = none are skipped."""

    state_columns: list[str] = []
    """Rollout state keys copied into the reflection data beside the query, completion, expected answer, reward and error (`--state-columns`)."""

    seed: int = 0
    """Seed of the search (minibatch order, candidate selection)."""

    @field_validator("state_columns", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """`--state-columns turn,responses` on the command line."""
        return [c.strip() for c in value.split(",") if c.strip()] if isinstance(value, str) else value


class GepaRunConfig(StrictModel):
    """`prime-rl gepa ENV_ID|CONFIG.toml`: optimize an environment's system prompt with GEPA."""

    model: str = "gpt-4.1-mini"
    """Model that runs the rollouts: an endpoint name of `endpoints_path`, or a local model served by a vLLM server `prime-rl gepa` starts and stops (`--model/-m`)."""

    endpoint_id: str | None = None
    """Endpoint name of `endpoints_path` that runs the rollouts, instead of `model`."""

    reflection_model: str | None = None
    """The teacher that reads the results and proposes prompts: an endpoint name, or None = `model` (`--reflection-model/-M`)."""

    endpoints_path: Path = Path("configs/endpoints.toml")
    """Endpoint registry: `[[endpoint]]` tables with `endpoint_id`, `model`, `url` and `key`."""

    output_dir: Path = Path("outputs/gepa")
    """Results go to OUTPUT_DIR/<env>/<run>/."""

    seq_len: int | None = Field(None, ge=8)
    """Context of a local model (vLLM `--max-model-len`); fills `inference.seq_len`."""

    sampling: EvalSamplingConfig = EvalSamplingConfig()
    """Sampling settings of the rollouts."""

    env: list[EnvConfig] = []
    """The environment whose system prompt is optimized (`[[env]]`, exactly one)."""

    gepa: GepaConfig = GepaConfig()
    """The search."""

    client: ClientConfig = ClientConfig()
    """Requests of the rollouts (`base_url` and `api_key` come from the endpoint or the local server)."""

    reflection_client: ClientConfig = ClientConfig()
    """Requests of the teacher (`base_url` and `api_key` come from its endpoint)."""

    inference: InferenceConfig = InferenceConfig()
    """The vLLM server for a local model (unused for an endpoint)."""

    run_id: str | None = None
    """Name of the run's folder (set by `prime-rl gepa`: a timestamp and a short id)."""

    target: EvalTarget | None = None
    """What `model` resolved to (set by `prime-rl gepa` for the gepa process)."""

    reflection_target: EvalTarget | None = None
    """What `reflection_model` resolved to (set by `prime-rl gepa`)."""

    @model_validator(mode="after")
    def _consistent(self) -> GepaRunConfig:
        if len(self.env) != 1:
            raise ValueError(f"expected exactly one environment ([[env]] or ENV_ID), got {len(self.env)}")
        if self.gepa.max_calls < self.gepa.num_val:
            raise ValueError(
                f"gepa.max_calls ({self.gepa.max_calls}) is smaller than one evaluation of the validation set "
                f"(gepa.num_val = {self.gepa.num_val} rollouts): raise -B or lower -N"
            )
        return self
