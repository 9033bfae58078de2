"""The configs of the orchestrator's one-shot commands: `prime-rl eval` (a model scored on environments) and
`prime-rl gepa` (a system prompt searched by GEPA).

Never imports torch or vLLM (the launcher validates configs before any process starts)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from prime_rl.config.shared import ClientConfig, EnvConfig, StrictModel, check_env_args, check_environment_id, check_prompt_file, environment_name
from prime_rl.config.inference import InferenceConfig


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
    def _args_checked(cls, args: dict[str, Any]) -> dict[str, Any]:
        return check_env_args(args)

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
        check_seq_len(self)
        return self


def check_seq_len(config: EvalRunConfig | GepaRunConfig) -> None:
    """`seq_len` fills `inference.seq_len` (``prime_rl.launch.resolve``): both set must agree."""
    if config.seq_len is not None and "seq_len" in config.inference.model_fields_set and config.inference.seq_len != config.seq_len:
        raise ValueError(
            f"conflicting values: `seq_len` = {config.seq_len} but `inference.seq_len` = {config.inference.seq_len}; set one of them"
        )


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
        check_seq_len(self)
        return self
