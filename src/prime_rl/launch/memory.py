"""Memory estimates of a run's processes, before any of them starts: a trainer rank and a vLLM replica.

Pure arithmetic on the model's shape (its ``config.json``) and the run's settings; imports
neither torch nor vLLM. ``prime-rl CONFIG.toml --dry-run`` prints both estimates, and a run
whose processes cannot fit the GPUs they are given is refused before it starts
(``prime_rl.commands.rl``).

**A trainer rank** (``trainer_memory``; what the code it estimates keeps, ``trainer.model``,
``trainer.head``, ``trainer.rl``). With P parameters over T FSDP2 ranks:

- state that lives through the run: the float32 master weights (4P/T), AdamW's two float32
  moments (8P/T);
- a step's peak on top of it, the larger of the backward's and the optimizer's:
  - backward: the float32 gradients (4P/T, counted whole: they fill in while activations are
    freed), the activations autograd keeps for a micro-batch of ``micro_batch_tokens`` tokens
    (``layer_activation_bytes`` per token and decoder layer; with activation checkpointing one
    hidden state per layer and token, plus one layer's activations recomputed), the head's
    chunk of logits (``head_bytes``), and under FSDP2 the gathered compute-dtype copies of the
    layers in flight (two: the current one and the prefetched next) and of the root's
    parameters (embedding, final norm, output layer: the root stays gathered through a step);
  - optimizer: the gradients and one parameter-sized float32 temporary of AdamW's
    multi-tensor update (CUDA; the CPU loop's are per parameter).

Activations per token and layer count what Qwen3/Llama decoder layers save for backward
(measured with autograd's saved-tensor hooks on transformers 5.19): each RMSNorm keeps a
float32 copy of its input, its normalised input and its output in the compute dtype; the
q/k norms the same on the projections; attention keeps q, k, v, its output and a float32
log-sum-exp per head; the output projection its input; the MLP its gate, activation, up and
product. An SDPA run with packed rows adds its [L, L] boolean mask per row. Checked against
the peak resident memory of real CPU training steps (``benchmarks/memory.py``; its table is
``benchmarks/results/memory.json``, within 25% at every point, ``tests/test_memory_estimate.py``).

**A vLLM replica** (``vllm_memory``): the weights in the serving dtype over its tensor-parallel
GPUs, an allowance for vLLM's own activations and CUDA graphs, and what
``gpu_memory_utilization`` leaves for the KV cache: how many tokens, and whole sequences of
``seq_len``, it holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prime_rl.config.trainer import HEAD_CHUNK_ELEMENTS

if TYPE_CHECKING:  # the arithmetic above a run's estimate needs no config
    from prime_rl.config import RLConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that its memory depends on."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    experts: int = 0
    """Routed experts per MoE layer (0: a dense MLP of ``intermediate``)."""

    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    """A MoE layer's always-on shared expert(s), in all (0: none)."""

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From an HF ``config.json`` (a multimodal model's ``text_config``); KeyError names a missing field."""
        c = config.get("text_config") or config
        heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
        shared = c.get("shared_expert_intermediate_size") or 0
        if not shared and c.get("n_shared_experts"):
            shared = c["n_shared_experts"] * c.get("moe_intermediate_size", 0)
        return cls(
            vocab=c["vocab_size"], hidden=hidden, layers=c["num_hidden_layers"], heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or hidden // heads,
            intermediate=c.get("intermediate_size") or 0,
            tied=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
            experts=experts, experts_per_token=c.get("num_experts_per_tok") or 0,
            expert_intermediate=c.get("moe_intermediate_size") or 0, shared_intermediate=shared,
        )

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        attention = self.hidden * (self.q + 2 * self.kv) + self.q * self.hidden + 2 * self.head_dim
        if self.experts:
            mlp = self.experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts
            mlp += 3 * self.hidden * self.shared_intermediate
        else:
            mlp = 3 * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Embedding, final norm and (untied) output layer: what no decoder layer holds."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def active_mlp_width(self) -> int:
        """Intermediate width a token's MLP computes: a dense MLP's, or its experts' and the shared one's."""
        if self.experts:
            return self.experts_per_token * self.expert_intermediate + self.shared_intermediate
        return self.intermediate


# --------------------------------------------------------------------------- where a shape comes from


KNOWN_SHAPES = {
    # config.json of models the shipped configs name, for a dry run on a machine that has not
    # downloaded them (huggingface.co/<id>/blob/main/config.json)
    "Qwen/Qwen3-4B-Instruct-2507": {"vocab_size": 151936, "hidden_size": 2560, "num_hidden_layers": 36,
                                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                    "intermediate_size": 9728, "tie_word_embeddings": True},
    "Qwen/Qwen3-4B": {"vocab_size": 151936, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "tie_word_embeddings": True},
    "Qwen/Qwen3-0.6B": {"vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "tie_word_embeddings": True},
}


def model_shape(name: str) -> tuple[ModelShape | None, str]:
    """(shape, where it came from) for a local folder, a hub id in the local HF cache, or a
    model of ``KNOWN_SHAPES``; (None, why not) otherwise. Never downloads."""
    sources = [Path(name).expanduser() / "config.json", *hub_cache_configs(name)]
    for path in sources:
        if path.is_file():
            try:
                return ModelShape.from_config(json.loads(path.read_text())), str(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                return None, f"{path} is not a decoder config this estimate reads ({type(e).__name__}: {e})"
    if name in KNOWN_SHAPES:
        return ModelShape.from_config(KNOWN_SHAPES[name]), f"{name}'s published config.json"
    return None, f"no config.json for {name!r} here (a local folder, or the HF cache once downloaded)"


def hub_cache_configs(name: str) -> list[Path]:
    """``config.json`` of every snapshot of hub id ``name`` in the local HF cache."""
    if name.count("/") != 1 or Path(name).exists():
        return []
    home = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    return sorted((home / f"models--{name.replace('/', '--')}" / "snapshots").glob("*/config.json"))


# --------------------------------------------------------------------------- a trainer rank


@dataclass(frozen=True)
class TrainerSetting:
    ranks: int
    """FSDP2 ranks the parameters, gradients and optimizer state are sharded over."""

    compute_dtype: str
    """`trainer.model.dtype`: float32 (a plain module on one rank) or bfloat16 (FSDP2 mixed precision)."""

    micro_batch_tokens: int
    checkpointing: bool
    attention: str = "flash"
    """`flash` (no mask), `sdpa` (a boolean [L, L] mask per packed row) or `eager` (an additive
    float32 mask and float32 scores per head)."""

    row_tokens: int | None = None
    """Longest model row (packed rows of SDPA or eager); None = ``micro_batch_tokens``."""

    loss_fraction: float = 1.0
    """Share of the tokens the loss scores (the head computes only those)."""

    device: str = "cuda"
    trainable_params: int | None = None
    """LoRA: the adapters' parameters (only they have gradients and optimizer state); None = all."""


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes of one rank."""

    weights: int
    """The float32 master weights (this rank's shard)."""

    optimizer: int
    """AdamW's moments."""

    gradients: int
    """All of the float32 gradients (this rank's shard)."""

    activations: int
    """What a micro-batch keeps through its forward for backward."""

    step_bytes: int
    """A step's peak on top of ``weights + optimizer``: gradients, activations and what is in flight."""

    teacher: int = 0
    """A distillation teacher's weights in the compute dtype, whole on every rank (`[teacher]
    placement = "trainer"`; its forward's transients come and go before the student's, whose
    peak is larger)."""

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.step_bytes + self.teacher


def layer_activation_bytes(shape: ModelShape, compute: int) -> int:
    """Bytes a decoder layer keeps for backward per token (module docstring)."""
    h, q, kv = shape.hidden, shape.q, shape.kv
    norm = (4 + 2 * compute) * h + 4  # float32 copy of the input, normalised and output in the compute dtype, rsqrt
    qk_norms = (4 + compute) * (q + kv) + 4 * (shape.heads + shape.kv_heads)
    attention = compute * (2 * q + 2 * kv) + 4 * shape.heads  # q, k, v, output; log-sum-exp
    o_input = compute * q
    mlp = 4 * compute * shape.active_mlp_width
    if shape.experts:  # the router's logits and weights, float32
        mlp += 8 * shape.experts
    return 2 * norm + qk_norms + attention + o_input + mlp


def mask_bytes_per_token(shape: ModelShape, s: TrainerSetting) -> int:
    """Attention masks and scores per token that depend on the row length L."""
    row = s.row_tokens or s.micro_batch_tokens
    if s.attention == "flash":
        return 0
    if s.attention == "sdpa":
        return row  # one boolean [L, L] mask per row: L bytes per token
    return 4 * row + shape.layers * 2 * 4 * shape.heads * row  # additive mask; scores and softmax per head


def head_bytes(shape: ModelShape, s: TrainerSetting, compute: int) -> int:
    """The output layer at work: one chunk of [C, V] logits in the compute dtype and its
    float32 copies (tempered, exponentials, the gradient in backward), ~16 bytes an element
    beside the compute dtype's (measured: 12 MiB for a [384, 2048] float32 chunk)."""
    loss_tokens = max(1, int(s.micro_batch_tokens * s.loss_fraction))
    chunk = min(loss_tokens, max(1, HEAD_CHUNK_ELEMENTS // shape.vocab))
    return chunk * shape.vocab * (compute + 16)


def trainer_memory(shape: ModelShape, s: TrainerSetting) -> TrainerMemory:
    """A trainer rank's memory (module docstring): bytes by kind, and a step's peak.

    Backward walks the layers from the last to the first: gradients fill in as activations
    are freed, so the peak is at one end of that walk (both change linearly with the layer),
    at the output layer before it, or in the optimizer step after it; the estimate is the
    largest of these."""
    compute = DTYPE_BYTES[s.compute_dtype]
    sharded = s.ranks > 1 or s.compute_dtype != "float32"
    params = shape.params
    share = 1.0 if s.trainable_params is None else s.trainable_params / params  # LoRA: adapters only
    trainable = int(params * share)
    weights, optimizer, gradients = 4 * params // s.ranks, 8 * trainable // s.ranks, 4 * trainable // s.ranks
    # the output layer's gradient exists from the start of backward, the embedding's (untied) only at its end
    layer_grads, head_grads = 4 * shape.layer_params * share / s.ranks, 4 * shape.vocab * shape.hidden * share / s.ranks
    tokens = s.micro_batch_tokens
    per_layer = tokens * layer_activation_bytes(shape, compute)  # one layer's activations for the micro-batch
    kept = tokens * shape.hidden * compute if s.checkpointing else per_layer  # what each layer keeps through forward
    head_input = tokens * ((4 + 2 * compute) * shape.hidden + mask_bytes_per_token(shape, s))  # final norm, masks
    layer_work = (per_layer if s.checkpointing else 0) + per_layer // 2  # its recompute, its gradients in flight
    gathered = root_gathered = 0
    if sharded:  # FSDP2: two layers gathered in the compute dtype (one prefetched), the root throughout
        gathered = 2 * compute * shape.layer_params + (compute + 4) * shape.layer_params * share
        root_gathered = compute * shape.root_params
    phases = {
        "output layer": head_grads + shape.layers * kept + head_input + head_bytes(shape, s, compute),
        "last layer": head_grads + shape.layers * kept + layer_work + gathered,
        "first layer": head_grads + (shape.layers - 1) * layer_grads + kept + layer_work + gathered,
        "optimizer": gradients + (4 * trainable // s.ranks if s.device == "cuda" else 8 * max_param(shape) * share),
    }
    peak = int(max(phases.values())) + root_gathered
    activations = shape.layers * kept + head_input
    return TrainerMemory(weights, optimizer, gradients, activations, peak)


def max_param(shape: ModelShape) -> int:
    """Elements of the largest parameter tensor (the optimizer's per-tensor temporaries on CPU)."""
    mlp = shape.expert_intermediate if shape.experts else shape.intermediate
    return max(shape.vocab * shape.hidden, mlp * shape.hidden, shape.q * shape.hidden)


# --------------------------------------------------------------------------- a vLLM replica


VLLM_OVERHEAD_BYTES = 2 * GIB
"""vLLM's own activations, CUDA context and graphs beside the weights and KV cache (its
profiling run measures them at start; ~1-3 GB for dense models of a few billion parameters)."""


@dataclass(frozen=True)
class ReplicaMemory:
    weights: int
    """Per GPU of the replica."""

    kv_cache: int
    """What ``gpu_memory_utilization`` leaves per GPU for the KV cache (negative: nothing)."""

    kv_bytes_per_token: int
    """Per GPU."""

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_cache) // max(1, self.kv_bytes_per_token)


def vllm_memory(shape: ModelShape, *, dtype: str, tensor_parallel: int, gpu_bytes: int, utilization: float) -> ReplicaMemory:
    """One vLLM replica's weights and KV cache per GPU, for GPUs of ``gpu_bytes``."""
    b = DTYPE_BYTES.get(dtype, 2)  # "auto": the checkpoint's dtype, bf16 for the models this is used with
    weights = shape.params * b // tensor_parallel
    kv_per_token = 2 * shape.layers * shape.kv * b // max(1, min(tensor_parallel, shape.kv_heads))
    kv_cache = int(gpu_bytes * utilization) - weights - VLLM_OVERHEAD_BYTES
    return ReplicaMemory(weights, kv_cache, kv_per_token)


def gib(n: int) -> str:
    """Bytes for people: GiB, or MiB below one."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"


# --------------------------------------------------------------------------- a run's estimate


REFERENCE_GPUS = {"80 GB (A100/H100)": 81559 * 2**20, "141 GB (H200)": 143771 * 2**20}
"""What `nvidia-smi` reports as their memory: an estimate made where no GPU is visible is held against these."""

CUDA_RESERVE_BYTES = GIB
"""Beside what a process's tensors hold: the CUDA context and the allocator's fragmentation."""


def lora_params(shape: ModelShape, rank: int, targets: list[str]) -> int:
    """Parameters of LoRA adapters of ``rank`` on the named projections of every layer."""
    h, q, kv, width = shape.hidden, shape.q, shape.kv, shape.active_mlp_width
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
             "gate_proj": (h, width), "up_proj": (h, width), "down_proj": (width, h)}
    return shape.layers * sum(rank * sum(sizes.get(t, (h, h))) for t in targets)


def trainer_setting(config: RLConfig, device: str, shape: ModelShape) -> TrainerSetting:
    """The trainer side of a resolved RL config as the estimate reads it."""
    trainer, model = config.trainer, config.trainer.model
    attention = model.attn_implementation or "sdpa"  # flash is chosen at start where installed; sdpa costs more
    kind = "flash" if "flash" in attention else ("eager" if attention == "eager" else "sdpa")
    checkpointing = model.activation_checkpointing if model.activation_checkpointing is not None else device == "cuda"
    tokens = max(trainer.micro_batch_tokens, trainer.seq_len)  # a sample above the budget is a micro-batch of its own
    lora = trainer.lora
    return TrainerSetting(
        ranks=config.num_trainer_ranks, compute_dtype=model.dtype, micro_batch_tokens=tokens, checkpointing=checkpointing,
        attention=kind, row_tokens=min(tokens, trainer.seq_len), device=device,
        trainable_params=None if lora is None else lora_params(shape, lora.rank, lora.target_modules),
    )


@dataclass(frozen=True)
class RunEstimate:
    lines: list[str]
    """What `--dry-run` prints."""

    problems: list[str]
    """One line per process that cannot fit its GPU (empty: it fits, or no GPU to hold it against)."""


def estimate_run(config: RLConfig, device: str, gpu_bytes: int | None) -> RunEstimate:
    """A trainer rank's and each vLLM replica's memory for a resolved RL config placed on
    ``device``, held against GPUs of ``gpu_bytes`` (this machine's), or, for a GPU placement
    shown on a machine without GPUs (None), against ``REFERENCE_GPUS``."""
    name = config.trainer.model.name
    shape, source = model_shape(name)
    if shape is None:
        return RunEstimate([f"memory estimate skipped: {source}"], [])
    s = trainer_setting(config, device, shape)
    t = trainer_memory(shape, s)
    teacher = ""
    if config.trainer.teacher_model is not None:
        teacher_shape, teacher_source = model_shape(config.trainer.teacher_model)
        if teacher_shape is None:
            return RunEstimate([f"memory estimate skipped: the teacher's {teacher_source}"], [])
        t = dataclasses.replace(t, teacher=teacher_shape.params * DTYPE_BYTES[s.compute_dtype])
        teacher = f" + the teacher {gib(t.teacher)} ({count(teacher_shape.params)}, {s.compute_dtype})"
    how = (f"{s.compute_dtype} compute, float32 masters, {'activation checkpointing' if s.checkpointing else 'no activation checkpointing'}, "
           f"micro-batches of {s.micro_batch_tokens:,} tokens" + (", LoRA" if s.trainable_params is not None else ""))
    lines = [
        f"memory estimate for {name} ({count(shape.params)} parameters; shape from {source}):",
        f"  trainer rank (1 of {s.ranks}; {how}): {gib(t.total)} = weights {gib(t.weights)} + AdamW {gib(t.optimizer)} "
        f"+ a step's peak {gib(t.step_bytes)} (gradients {gib(t.gradients)}, activations kept {gib(t.activations)}, "
        f"{t.activations / s.micro_batch_tokens / 1024:,.0f} KiB a token){teacher}",
    ]
    if device != "cuda":
        return RunEstimate(lines, [])
    inference = config.inference
    gpus = {"this machine's GPUs": gpu_bytes} if gpu_bytes else REFERENCE_GPUS
    problems = []
    for label, capacity in gpus.items():
        r = vllm_memory(shape, dtype=inference.dtype, tensor_parallel=inference.tensor_parallel_size, gpu_bytes=capacity,
                        utilization=inference.gpu_memory_utilization)
        trainer_fits = t.total + CUDA_RESERVE_BYTES <= capacity
        vllm_fits = r.kv_tokens >= inference.seq_len
        lines.append(
            f"  on {label} ({gib(capacity)}): trainer rank {'fits' if trainer_fits else 'does NOT fit'}; vLLM replica "
            f"({inference.tensor_parallel_size} GPU(s), {inference.dtype}) weights {gib(r.weights)} per GPU, KV cache at "
            f"gpu_memory_utilization {inference.gpu_memory_utilization:g} {gib(max(0, r.kv_cache))} = {r.kv_tokens:,} tokens "
            f"({r.kv_tokens // inference.seq_len} sequences of {inference.seq_len:,})"
        )
        if gpu_bytes and not trainer_fits:
            remedies = [] if s.checkpointing else ["turn on trainer.model.activation_checkpointing"]
            remedies += ["lower trainer.micro_batch_tokens", "add deployment.trainer_gpus", "train LoRA adapters ([trainer.lora])"]
            problems.append(
                f"memory: a trainer rank needs ~{gib(t.total + CUDA_RESERVE_BYTES)} but a GPU has {gib(capacity)}: "
                + ", ".join(remedies[:-1]) + f" or {remedies[-1]}"
            )
        if gpu_bytes and not vllm_fits:
            problems.append(
                f"memory: a vLLM replica has room for {r.kv_tokens:,} KV-cache tokens at inference.gpu_memory_utilization "
                f"{inference.gpu_memory_utilization:g}, fewer than one sequence of seq_len {inference.seq_len:,}: raise "
                "inference.gpu_memory_utilization or inference.tensor_parallel_size, or lower seq_len"
            )
    return RunEstimate(lines, problems)
