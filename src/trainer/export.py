"""Export a run's weights as a folder that stands on its own (`prime-rl export`).

    python -m trainer.export WEIGHTS_DIR OUTPUT_DIR [--merge] [--base MODEL]

- full fine-tuning: ``weights/step_N`` already is an HF model folder; it is copied.
- LoRA, ``--merge``: the base model with the adapter merged into its weights
  (``peft``'s ``merge_and_unload``), written as an HF folder (safetensors, config,
  generation config and the base's tokenizer files) that needs neither peft nor the base.
- LoRA without ``--merge``: the PEFT adapter (``adapter_config.json`` +
  ``adapter_model.safetensors``) plus the base's tokenizer files.

The base model is the one the adapter's ``adapter_config.json`` names (the run's model),
or ``--base``. The folder is filled under ``OUTPUT_DIR.tmp`` and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from prime_rl.extras import import_extra
from prime_rl.rundir import MARKER
from trainer.lora import ADAPTER_CONFIG, is_adapter_folder
from trainer.weights import copy_tokenizer_files, write_hf_folder


def adapter_base(weights: Path, override: str | None) -> str:
    """The base model an adapter folder was trained on (``--base`` wins)."""
    if override is not None:
        return override
    base = json.loads((weights / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{weights / ADAPTER_CONFIG} names no base model: pass --base MODEL")
    return base


def merged_model(weights: Path, base: str):
    """The base model with the adapter of ``weights`` merged in (a plain transformers model)."""
    from transformers import AutoModelForCausalLM

    peft = import_extra("peft", "merging a LoRA adapter")
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")  # the base checkpoint's dtype
    return peft.PeftModel.from_pretrained(model, weights).merge_and_unload()


def export(weights: Path, output: Path, merge: bool, base: str | None = None) -> str:
    """Write the export into ``output`` (which must not exist); returns what was written."""
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if not is_adapter_folder(weights):
            shutil.copytree(weights, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MARKER))
            kind = "full model (copied; full fine-tuning weights need no merge)"
        elif merge:
            base_model = adapter_base(weights, base)
            model = merged_model(weights, base_model)
            write_hf_folder(model, model.state_dict(), tmp, base_model if Path(base_model).is_dir() else None)
            kind = f"merged model (base {base_model} + adapter)"
        else:
            base_model = adapter_base(weights, base)
            shutil.copytree(weights, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MARKER))
            copy_tokenizer_files(Path(base_model), tmp)
            kind = f"LoRA adapter (PEFT format, base {base_model})"
        tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("weights", type=Path, help="a run's weights/step_N folder")
    parser.add_argument("output", type=Path, help="folder to create")
    parser.add_argument("--merge", action="store_true", help="merge a LoRA adapter into its base model")
    parser.add_argument("--base", default=None, help="base model of a LoRA adapter (default: the one its config names)")
    args = parser.parse_args(argv)
    try:
        kind = export(args.weights, args.output, args.merge, args.base)
    except (OSError, ValueError) as e:
        print(f"[export] failed: {e}", file=sys.stderr)
        return 1
    print(f"[export] {kind} -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
