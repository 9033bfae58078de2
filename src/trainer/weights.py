"""Weight handoff to inference: ``RUN/weights/step_N/`` as an HF folder, marker last.

The folder holds ``model.safetensors`` (HF parameter names, tied tensors stored once),
``config.json``, ``generation_config.json`` and the source model's tokenizer files, so it
loads with ``AutoModelForCausalLM.from_pretrained`` and with vLLM's ``reload_weights``
(which reads every ``*.safetensors`` in the folder). With LoRA (``trainer.lora``) it holds
the adapter alone, in PEFT's format, which inference loads beside the base model it serves.
It is filled under ``step_N.tmp``, renamed, and only then gets its marker
(``prime_rl.rundir``): readers act on the marker.
This module does not know who reads the folder or when.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from prime_rl.tokenizer import TOKENIZER_FILES
from prime_rl.rundir import checkpoints_dir, complete_steps, prune_step_dirs, weights_dir, write_step_dir
from trainer.lora import is_lora, write_adapter_folder

GENERATION_CONFIG = "generation_config.json"



def full_state_dict(model: nn.Module, dtype: torch.dtype | None = None, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict with HF names, each floating tensor cast to ``dtype`` (None: as
    stored) before it is gathered: a bf16 server gets half the bytes gathered, moved and
    written, and never the float32 masters. Under FSDP2 (one rank or several) a collective
    every rank must call, one tensor at a time so no rank holds more than one unsharded
    tensor; only rank 0 gets tensors (the others an empty dict). ``trainable_only`` leaves out
    frozen parameters (a LoRA model's base weights)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {}
    for name, tensor in model.state_dict().items():
        if trainable_only and name not in trainable:
            continue
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if hasattr(tensor, "full_tensor"):  # an FSDP2 shard (DTensor)
            tensor = tensor.full_tensor()
        if rank == 0:
            out[name] = tensor.cpu()
    return out


def dedupe_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Store each tensor once, contiguous, on CPU: drop tied targets (HF re-ties them on load).

    A tied target (e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight``) is dropped when
    its source is present, which is how HF and vLLM expect tied checkpoints; any other names
    sharing one storage keep only the first (safetensors refuses shared tensors).
    """
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # {target: source}
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        if name in tied and tied[name] in state:
            continue
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t.to("cpu").contiguous()
    return out


def write_hf_folder(
    model: nn.Module, state: dict[str, torch.Tensor], folder: Path, source_model_dir: str | Path | None
) -> None:
    """model.safetensors + config.json + generation_config.json (+ tokenizer files) into folder."""
    folder = Path(folder)
    tensors = dedupe_tied(model, state)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    floating = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    if floating is not None:  # the dtype the weights were written in, not the trainer's float32 masters
        config.dtype = floating
    config.save_pretrained(folder)
    source = Path(source_model_dir) if source_model_dir is not None else None
    if source is not None and (source / GENERATION_CONFIG).is_file():
        # verbatim: transformers refuses to re-save a config it deems inconsistent (top_k
        # without do_sample, as some models ship), which would fail the first weight save
        shutil.copy2(source / GENERATION_CONFIG, folder / GENERATION_CONFIG)
    elif getattr(model, "generation_config", None) is not None:
        model.generation_config.to_json_file(folder / GENERATION_CONFIG)  # no validation either
    if source is not None:  # a hub id has no local folder: weights + config suffice
        copy_tokenizer_files(source, folder)


def copy_tokenizer_files(source: Path, dest: Path) -> bool:
    """Copy the tokenizer files of a local model folder verbatim; False if source is no folder.

    Verbatim rather than re-saved: a re-save rewrites tokenizer_config.json for the running
    transformers version, which another version (the inference side's) may not read.
    """
    if not source.is_dir():
        return False
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    return True


def save_weights(
    model: nn.Module, run_dir: Path, step: int, keep_last: int, source_model_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Publish policy version ``step`` as ``RUN/weights/step_N`` (marker last), prune old ones,
    its tensors in ``dtype`` (the serving dtype; None: as stored).

    Every rank must call this (gathering is collective); rank 0 writes and returns the
    folder, other ranks return None.
    """
    lora = is_lora(model)
    state = full_state_dict(model, dtype, trainable_only=lora)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    parent = weights_dir(run_dir)
    write_folder = write_adapter_folder if lora else write_hf_folder
    final = write_step_dir(parent, step, "weights", lambda tmp: write_folder(model, state, tmp, source_model_dir))
    prune_weights(run_dir, keep_last)
    return final


def prune_weights(run_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` `weights/step_N` and those of every complete checkpoint (a
    resumed run starts inference on its checkpoint's weights), delete the rest. Due after every
    save of either: a checkpoint's pruning frees the weights only it kept (rank 0 only)."""
    prune_step_dirs(weights_dir(run_dir), keep_last, protect=set(complete_steps(checkpoints_dir(run_dir))))
