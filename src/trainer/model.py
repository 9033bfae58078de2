"""Process setup and model loading: threads, torch.distributed, HF causal LM, FSDP2.

Weights are always loaded in float32: they are the master copy AdamW updates (an update of
1e-6 to a bf16 weight of 0.02, whose bf16 step is ~1e-4, rounds to nothing). The compute
dtype is ``trainer.model.dtype``:

- float32 in one process (the CPU default): a plain module, no process group;
- anything else, or several ranks under torchrun (gloo on CPU / nccl on CUDA): every decoder
  layer and then the root sharded with FSDP2 ``fully_shard`` under a mixed-precision policy
  (gathered in the compute dtype, gradients reduced in float32). One process gets a process
  group of its own for it. Parameter names are unchanged, so a gathered state dict has HF names.

The output layer is ``trainer.head.TokenHead``: the trainer asks the model for the scores of
the sampled tokens at the loss positions, never for [R, L, V] logits.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from prime_rl.config import LoraConfig, ModelConfig
from trainer.head import HeadQuery, install_token_head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_world(num_threads: int) -> World:
    """Set torch threads; join the process group when launched by torchrun with > 1 rank."""
    torch.set_num_threads(num_threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def teardown_world(world: World) -> None:
    if dist.is_initialized():  # several ranks, or one rank's own group (``join_one_rank_group``)
        dist.destroy_process_group()


def load_model(cfg: ModelConfig, world: World, lora: LoraConfig | None = None) -> nn.Module:
    """``cfg.name``'s HF causal LM, in float32 (the master copy the optimizer updates), made
    ready to train by ``prepare_model``."""
    from transformers import AutoModelForCausalLM  # heavy import, only where it is needed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per load is noise in a process log
    attn = attention_implementation(cfg, world.device)
    model = AutoModelForCausalLM.from_pretrained(cfg.name, dtype=torch.float32, attn_implementation=attn)
    return prepare_model(model, cfg, world, lora)


def prepare_model(model: nn.Module, cfg: ModelConfig, world: World, lora: LoraConfig | None = None) -> nn.Module:
    """A float32 HF causal LM made ready to train on the rank's device: the ``TokenHead`` output
    layer (``trainer.head``), activation checkpointing per decoder layer when on, LoRA adapters
    when ``lora`` is given, and FSDP2 with the compute dtype ``cfg.dtype`` as its
    mixed-precision policy whenever that is not float32 or there are several ranks."""
    model.config.use_cache = False  # training never decodes; the KV cache only costs memory
    install_token_head(model)
    if activation_checkpointing(cfg, world.device):
        # Per decoder layer, non-reentrant: each layer's input is kept, its inside recomputed in
        # backward. Inside FSDP2 units, which skip their hooks during the recompute.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        from trainer.lora import add_lora

        model = add_lora(model, lora)
    model.to(world.device)
    if world.distributed or cfg.dtype != "float32":
        join_one_rank_group(world)
        shard_model(model, DTYPES[cfg.dtype])
    model.train()
    return model


def attention_implementation(cfg: ModelConfig, device: torch.device) -> str:
    """``cfg.attn_implementation``, else flash-attention 2 where it runs (CUDA, installed, a 16-bit
    compute dtype: packed rows then need no mask), else SDPA."""
    if cfg.attn_implementation is not None:
        return cfg.attn_implementation
    if device.type == "cuda" and cfg.dtype != "float32" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def activation_checkpointing(cfg: ModelConfig, device: torch.device) -> bool:
    """``cfg.activation_checkpointing``, else on for CUDA (where activations bound the micro-batch)
    and off on CPU (the tiny models there fit; recomputing costs a third more time)."""
    if cfg.activation_checkpointing is not None:
        return cfg.activation_checkpointing
    return device.type == "cuda"


def join_one_rank_group(world: World) -> None:
    """FSDP2 needs a process group; a single process gets one of its own (an in-memory store)."""
    if world.distributed or dist.is_initialized():
        return
    backend = "nccl" if world.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=world.device if backend == "nccl" else None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: `model.model.layers` for Llama/Qwen-style HF models."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return max(lists, key=len)


def shard_model(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """FSDP2: one unit per decoder layer (all-gathered just in time), then the root. The
    parameters stay float32 shards; with a 16-bit compute dtype each unit is gathered in it for
    forward and backward, and gradients are reduced in float32 onto the float32 shards, which
    AdamW updates (mixed precision with master weights)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def forward_logits(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0,
    query: HeadQuery | None = None,
):
    """[R, L] ids -> logits [R, L, V], or with ``query`` the scores ``trainer.head`` computes at
    its positions (what training asks for: no [R, L, V] tensor).

    ``attention_mask`` is [R, L] (1 on real tokens of right-padded rows), [R, 1, L, L] bool
    (query by key, for packed and shared-prefix rows; SDPA takes it as it is, eager attention
    as an additive bias), or None with ``cu_seqlens`` [S + 1] int32: one unpadded row of S
    sequences back to back for flash-attention's variable-length kernel (``trainer.packing``),
    which builds no mask. Position ids default to 0..len-1 over real tokens, so a sample's
    logits do not depend on how it is padded; pad positions' logits are never used.
    """
    head = {} if query is None else {"query": query}  # a model without ``TokenHead`` takes no query
    if cu_seqlens is not None:
        return logits_of(model(input_ids=input_ids, position_ids=position_ids, **head, **varlen_kwargs(cu_seqlens, max_seqlen)))
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if attention_mask.dim() == 4 and getattr(model.config, "_attn_implementation", None) != "sdpa":
        dtype = torch.float32  # the additive bias eager attention adds to its float32-or-wider scores
        attention_mask = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill(
            ~attention_mask, torch.finfo(dtype).min
        )
    return logits_of(model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **head))


def logits_of(out):
    """What a forward returned: ``TokenHead``'s logits or scores as they are, an HF output's logits."""
    return out if isinstance(out, torch.Tensor) or type(out) is dict else out.logits  # an HF output is a dict too


def varlen_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """What transformers' flash-attention path takes for packed rows (``FlashAttentionKwargs``;
    ``_flash_attention_forward`` then calls ``flash_attn_varlen_func`` on them). Queries and
    keys are the same tokens, so their boundaries are the same; the longest sequence is an
    int, so the kernel call needs no device-to-host sync."""
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_seqlen, "max_length_k": max_seqlen}


def uses_varlen(model: nn.Module) -> bool:
    """Whether the model's attention runs packed rows through the variable-length kernel: any
    flash-attention, the pip package's or a hub kernel's (`kernels-community/flash-attn2`), by
    transformers' own rule (``utils.generic.is_flash_attention_requested``: "flash" in the name)."""
    return "flash" in (getattr(model.config, "_attn_implementation", None) or "")


def shared_prefix_support(model: nn.Module) -> str | None:
    """Why this model cannot run shared-prefix rows (``trainer.packing``), or None if it can:
    they need an attention that takes an arbitrary mask and no sliding-window layers."""
    config = model.config
    attn = getattr(config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        return f"attention implementation {attn!r} takes no custom mask (sdpa or eager do)"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "the model has sliding-window layers"
    return None


def packing_support(model: nn.Module) -> str | None:
    """Why this model cannot run packed rows, or None if it can: the variable-length kernel
    takes them as they are (sliding windows included); otherwise they need a custom mask,
    as shared prefixes do."""
    return None if uses_varlen(model) else shared_prefix_support(model)
