"""The trainer's configs: its section of an RL run (`[trainer]`: optimizer, loss and distillation, LoRA, weights) and
`prime-rl sft CONFIG.toml`, the supervised warm-up it runs alone.

Never imports torch or vLLM (the launcher validates configs before any process starts)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from prime_rl.config.shared import CheckpointConfig, MAX_TEACHER_TOP_K, ModelConfig, StrictModel, TransportConfig, WandbConfig, WeightTransferConfig


HEAD_CHUNK_ELEMENTS = 2**26
"""Logits ``trainer.head`` computes at once: [C, V] with C = this // V positions (float32: 256 MB).
A constant of the contracts, not a setting, so the head and the launcher's memory estimate
(``prime_rl.launch.memory``), which imports no torch, share one number."""


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

    decay: Literal["none", "linear", "cosine"] = "none"
    """After the warm-up, the lr falls from `lr` toward `lr * min_lr_ratio` over the rest of the run's `max_steps`: along a line (`linear`) or half a cosine (`cosine`); `none` keeps it at `lr`. Like the warm-up it counts applied updates (a step skipped for a zero or non-finite gradient does not advance it)."""

    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where `decay` ends, as a fraction of `lr`."""


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


class TrainerConfig(StrictModel):
    model: ModelConfig = ModelConfig()
    """Model to train."""

    optim: OptimConfig = OptimConfig()
    """Optimizer settings."""

    loss: LossConfig = LossConfig()
    """Loss settings."""

    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (`[trainer.lora]`); None = full fine-tuning. `weights/step_N/` then holds the adapter (PEFT format), which inference loads at run time."""

    teacher_model: str | None = None
    """The distillation teacher in the trainer's own process (`[teacher] placement = "trainer"`, filled by the launcher): an HF model folder with the student's tokenizer, loaded frozen in the compute dtype beside the student, which scores each micro-batch's sampled tokens (and its top-k, with `loss.distill.top_k`) in a forward of its own over the same packed rows. None = a served teacher's scores come with the batch, or no teacher."""

    weights: WeightsConfig = WeightsConfig()
    """Weight handoff to inference."""

    transport: TransportConfig = TransportConfig()
    """Where micro-batches come from."""

    weight_transfer: WeightTransferConfig = WeightTransferConfig()
    """How each new policy reaches the vLLM servers (memory mode: this process sends it)."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Resumable checkpoints."""

    max_steps: int = Field(20, ge=1)
    """Number of optimizer steps."""

    seq_len: int = Field(512, ge=8)
    """Maximum tokens (prompt + completion) per sample."""

    micro_batch_tokens: int = Field(8192, ge=8)
    """Tokens the model computes in one forward and backward (one micro-batch): the trainer packs its share of a step's samples (whole prompt-sharing groups where they fit) into micro-batches of at most this many tokens, padding included; a sample longer than this gets one of its own. Activation memory grows with it (`--dry-run` prints the estimate)."""

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

    @model_validator(mode="after")
    def _teacher_trains(self) -> TrainerConfig:
        if self.teacher_model is not None and self.loss.distill is None:
            raise ValueError("teacher_model is set but loss.distill is not: the teacher's scores would not be trained on")
        return self


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
    """Optimizer steps (with `stop_loss`: the most it may take)."""

    stop_loss: float | None = Field(None, gt=0)
    """Stop once the mean `loss/sft` of the last `stop_window` steps is at or below this;
    None = always `max_steps`. Where the loss falls steeply, a step count lands on another
    point of the fall on every machine and seed, a loss the same point (docs/benchmarks.md).
    With `stop_plateau` too, both must hold (this one keeps a flat stretch before the fall
    from counting as the plateau)."""

    stop_plateau: float | None = Field(None, gt=0)
    """Stop once the mean `loss/sft` of the last `stop_window` steps is less than this below
    the mean of the `stop_window` steps before them: the loss has stopped falling. None = no
    plateau test."""

    stop_window: int = Field(20, ge=1)
    """Steps `stop_loss` and `stop_plateau` average over."""

    label_smoothing: float = Field(0.0, ge=0, lt=1)
    """Share of each target's probability spread uniformly over the vocabulary in the loss
    (torch's ``CrossEntropyLoss(label_smoothing=...)``); 0 = plain NLL. The loss's floor is
    then above 0 and a model trained to it still samples a wrong token now and then."""

    input_noise: float = Field(0.0, ge=0, lt=1)
    """Share of the assistant's tokens replaced in the model's input (never in its targets) by a
    token drawn uniformly from the vocabulary: the model learns to go on correctly after a
    wrong token, as it will meet its own sampled mistakes in RL, rather than derail after
    one in a way that differs from seed to seed. 0 = the chats as they are."""

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
