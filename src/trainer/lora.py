"""LoRA through `peft`: adapters on the configured linear layers, the base model frozen.

The adapter a weight folder holds is PEFT's own format (``adapter_config.json`` +
``adapter_model.safetensors``, parameter names without the adapter's name), which
``PeftModel.from_pretrained`` and vLLM's ``/v1/load_lora_adapter`` both read. A freshly
added adapter is the identity (peft zeroes ``lora_B``), so policy version 0 is the base
model itself and inference serves the base until the first adapter arrives.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from prime_rl.config import LoraConfig
from prime_rl.extras import import_extra

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def add_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap ``model`` in a ``PeftModel`` with one trainable adapter; every other weight frozen."""
    peft = import_extra("peft", "LoRA ([trainer.lora])")
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    missing = [m for m in cfg.target_modules if m not in names]
    if missing:
        raise ValueError(
            f"trainer.lora.target_modules: {missing} name no linear layer of {type(model).__name__} "
            f"(its linear layers: {sorted(names)})"
        )
    peft_cfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, peft_cfg)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a (gathered) state dict, under PEFT's saved names, on CPU."""
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(model, state_dict=state)
    return {name: t.detach().to("cpu").contiguous() for name, t in adapter.items()}


def write_adapter_folder(model: nn.Module, state: dict[str, torch.Tensor], folder: Path, base_model: str | None) -> None:
    """adapter_model.safetensors + adapter_config.json (naming ``base_model``) into folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    save_file(adapter_state_dict(model, state), str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = model.peft_config["default"]
    if base_model is not None:
        cfg.base_model_name_or_path = str(base_model)
    cfg.save_pretrained(folder)


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()
