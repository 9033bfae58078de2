"""Process setup and model loading: threads, torch.distributed, HF causal LM, FSDP2.

One process (no WORLD_SIZE or WORLD_SIZE=1): no process group at all, plain module.
Under torchrun (WORLD_SIZE > 1): gloo on CPU / nccl on CUDA, every decoder layer and
then the root sharded with FSDP2 ``fully_shard`` (parameter names are unchanged, so a
gathered state dict has HF names).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from prime_rl.config import LoraConfig, ModelConfig

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
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def load_model(cfg: ModelConfig, world: World, lora: LoraConfig | None = None) -> nn.Module:
    """HF causal LM in the configured dtype, on the rank's device, with LoRA adapters when
    ``lora`` is given (``trainer.lora``), FSDP2-sharded if distributed."""
    from transformers import AutoModelForCausalLM  # heavy import, only where it is needed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar per load is noise in a process log
    attn = {} if cfg.attn_implementation is None else {"attn_implementation": cfg.attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(cfg.name, dtype=DTYPES[cfg.dtype], **attn)
    model.config.use_cache = False  # training never decodes; the KV cache only costs memory
    if lora is not None:
        from trainer.lora import add_lora

        model = add_lora(model, lora)
    model.to(world.device)
    if world.distributed:
        shard_model(model)
    model.train()
    return model


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


def shard_model(model: nn.Module) -> None:
    """FSDP2: one unit per decoder layer (all-gathered just in time), then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)


def forward_logits(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0,
) -> torch.Tensor:
    """[R, L] ids -> logits [R, L, V].

    ``attention_mask`` is [R, L] (1 on real tokens of right-padded rows), [R, 1, L, L] bool
    (query by key, for packed and shared-prefix rows; passed to the attention as an additive
    bias), or None with ``cu_seqlens`` [S + 1] int32: one unpadded row of S sequences back
    to back for flash-attention's variable-length kernel (``trainer.packing``), which builds
    no mask. Position ids default to 0..len-1 over real tokens, so a sample's logits do not
    depend on how it is padded; pad positions' logits are never used.
    """
    if cu_seqlens is not None:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **varlen_kwargs(cu_seqlens, max_seqlen))
        return out.logits
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if attention_mask.dim() == 4:
        dtype = model.get_input_embeddings().weight.dtype
        attention_mask = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill(
            ~attention_mask, torch.finfo(dtype).min
        )
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.logits


def varlen_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """What transformers' flash-attention path takes for packed rows (``FlashAttentionKwargs``;
    ``_flash_attention_forward`` then calls ``flash_attn_varlen_func`` on them). Queries and
    keys are the same tokens, so their boundaries are the same; the longest sequence is an
    int, so the kernel call needs no device-to-host sync."""
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_seqlen, "max_length_k": max_seqlen}


VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
"""Attention implementations with a variable-length kernel: packed rows need no mask."""


def uses_varlen(model: nn.Module) -> bool:
    """Whether the model's attention runs packed rows through the variable-length kernel."""
    return getattr(model.config, "_attn_implementation", None) in VARLEN_ATTENTION


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
