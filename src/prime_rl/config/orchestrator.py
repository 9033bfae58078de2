"""The orchestrator's section (`[orchestrator]`): batching, advantages, filtering, preflight, evaluation during RL, the distillation teacher's client.

Never imports torch or vLLM (the launcher validates configs before any process starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from prime_rl.config.shared import (
    CheckpointConfig, ClientConfig, EnvConfig, MAX_TEACHER_TOP_K, SamplingConfig, StrictModel, TransportConfig, WandbConfig,
    WeightTransferConfig, check_env_names,
)


class PreflightConfig(StrictModel):
    """Before RL trains, a check of the first step's groups (sampled by the starting model), to catch a task that is too hard or too easy."""

    enabled: bool = True
    """Check the first step's groups of a fresh run (a resumed run skips it)."""

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data):
        removed = sorted({"num_examples", "rollouts_per_example"} & set(data)) if isinstance(data, dict) else []
        if removed:
            raise ValueError(
                f"{removed[0]} is gone: the preflight now checks the first step's groups "
                "(batch_size / rollouts_per_example examples x rollouts_per_example attempts); remove the key"
            )
        return data

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


class TracesConfig(StrictModel):
    """Rollouts written where a person can read them: `RUN/traces/` (`prime_rl.traces`), W&B's table, the dashboard."""

    groups: int | Literal["all"] = 2
    """Whole groups traced each step (chosen at random, seeded), and of each environment's evaluation; `all` = every rollout; 0 = none."""

    @field_validator("groups", mode="before")
    @classmethod
    def _groups(cls, value):
        """One error line, not one per member of the union; a flag's "3" reads as 3 (as pydantic reads an int field's)."""
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError('expected a whole number of groups >= 0, or "all"')

    wandb_interval: int = Field(10, ge=0)
    """With W&B on, the traced rollouts of every this many steps as a table (`traces/rollouts`); 0 = never."""


class LoadConfig(StrictModel):
    """How many episodes run at once: bounded by the run's memory and by what inference keeps up with (`orchestrator.load`)."""

    memory_budget_gb: float | None = Field(None, gt=0)
    """The most memory all of the run's processes together may hold (inference, trainer, orchestrator, environment workers and their episodes' programs, as resident memory): a group of episodes starts only while its estimated memory fits. None = 90% of what the machine (or its cgroup's limit) could give the run when the orchestrator started: the memory available then plus what the run already held."""

    inference_signals: bool = True
    """Also bound the episodes in flight by vLLM's own signals (its `/metrics`): cut by a quarter when it preempts requests or its KV cache is 95% full, grown by a group a second while under 80%."""

    poll_s: float = Field(1.0, gt=0, le=60)
    """Seconds between measurements of the run's memory and vLLM's signals."""


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

    traces: TracesConfig = TracesConfig()
    """A sample of every step's rollouts in `RUN/traces/`, for people to read."""

    load: LoadConfig = LoadConfig()
    """Episodes in flight, bounded by memory and by vLLM's signals."""

    transport: TransportConfig = TransportConfig()
    """Where micro-batches go."""

    weight_transfer: WeightTransferConfig = WeightTransferConfig()
    """How each new policy reaches the vLLM servers (memory mode: this process asks them to receive it)."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Resumable progress (data cursor, batches sampled but not yet trained on)."""

    batch_size: int = Field(64, ge=1)
    """Rollouts per step (examples per step x rollouts_per_example)."""

    rollouts_per_example: int = Field(8, ge=1)
    """Samples per prompt; advantages are computed within each group."""

    micro_batch_size: int = Field(32, ge=1)
    """Samples per chunk of a rank's message to the trainer (the wire's layout only: the trainer forms its own micro-batches by tokens, `trainer.micro_batch_tokens`)."""

    num_trainer_ranks: int = Field(1, ge=1)
    """Trainer ranks; each gets its own share of every step's samples, balanced by token count (filled from `[deployment]` in an RL run)."""

    max_steps: int = Field(20, ge=1)
    """Number of steps to produce batches for."""

    async_level: int = Field(1, ge=0)
    """Batch for step n is sampled with policy version >= n - async_level (versions count optimizer steps; 0 = on-policy)."""

    batching: Literal["continuous", "step"] = "continuous"
    """`continuous`: groups of rollouts stay in flight across step boundaries, each step's batch is cut from the groups that completed first, and new weights are loaded while requests are in flight (vLLM's `/pause?mode=keep`); `step`: the same pool with one step in flight: every step samples its own groups, all at once, and weights are reloaded between steps."""

    initial_weights: Path | None = None
    """Weights to load into inference before sampling (a server that is already up, started for another run: `prime-rl inference`): the run's model, or `weights/step_N` on a resume. None = inference starts with the run's own weights."""

    max_inflight_groups: int | None = Field(None, ge=1)
    """Most groups in flight at once with `continuous` batching; None = (async_level + 1) x the groups of one step, all that the async bound can use."""

    max_off_policy_steps: int | None = Field(None, ge=0)
    """With `continuous` batching, the oldest policy version step n may train on: n - max_off_policy_steps (at least `async_level`). Above `async_level`, groups start in every free slot while the step being cut may train them (its version >= that step - `async_level`), so more start than a step needs: the step takes the first to complete, and the stragglers land in later steps within this bound (as the reference trainer's `max_off_policy_steps`). None = `async_level`: each step starts its own groups and waits for every one that would otherwise go stale. The step barrier (`batching = "step"`) trains each group in its own step: no effect there."""

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

    teacher_system_prompt: str | None = None
    """Context distillation with the teacher in the trainer (`[teacher] placement = "trainer"` with a system prompt; filled by the launcher): every sample also carries its first prompt as the teacher sees it, under this system message. A served teacher's (`teacher.system_prompt`) is rendered for its requests instead."""

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
        if self.max_off_policy_steps is not None and self.max_off_policy_steps < self.async_level:
            raise ValueError(f"max_off_policy_steps ({self.max_off_policy_steps}) must be at least async_level ({self.async_level})")
        if self.teacher is not None and self.teacher_system_prompt is not None:
            raise ValueError("teacher_system_prompt is for a teacher in the trainer; a served teacher's is teacher.system_prompt")
        return self
