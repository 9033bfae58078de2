"""LoRA in the trainer: only adapters train, weights/step_N holds a PEFT adapter that peft
loads to the trained model, checkpoints hold adapters only, export writes the adapter or
the merged model."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from trainer_helpers import LORA, fresh, train_step
from torch.distributed.checkpoint import FileSystemReader

from prime_rl.config import LoraConfig
from prime_rl.rundir import MARKER, checkpoint_step_dir
from trainer.ckpt import CheckpointError, load_checkpoint, save_checkpoint
from trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, add_lora
from trainer.weights import save_weights


def base(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def logits(model, ids=torch.tensor([[5, 80, 81, 82, 9, 100]])):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_only_the_adapters_train_and_version_0_is_the_base_model(tiny_model):
    model, optimizer, _ = fresh(tiny_model, LORA)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    # 2 layers x 3 target modules x (A, B)
    assert len(trainable) == 12 and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 12
    torch.testing.assert_close(logits(model), logits(base(tiny_model)), rtol=0, atol=0)  # lora_B starts at 0


def test_weights_hold_a_peft_adapter_that_peft_loads_to_the_trained_model(tiny_model, tmp_path):
    from peft import PeftModel

    model, optimizer, scheduler = fresh(tiny_model, LORA)
    frozen_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    for step in range(3):
        train_step(model, optimizer, scheduler, step)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[name]), name
    folder = save_weights(model, tmp_path, step=3, keep_last=2, source_model_dir=tiny_model)

    assert (folder / MARKER).is_file()
    assert sorted(p.name for p in folder.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, MARKER])
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == str(tiny_model)
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
        keys = sorted(f.keys())
    assert len(keys) == 12 and all(k.startswith("base_model.model.model.layers.") and ".default." not in k for k in keys), keys

    loaded = PeftModel.from_pretrained(base(tiny_model), folder)
    trained = logits(model)
    torch.testing.assert_close(logits(loaded), trained)
    assert (trained - logits(base(tiny_model))).abs().max() > 1e-3  # the adapter changed the model


def test_a_lora_checkpoint_holds_the_adapters_only(tiny_model, tmp_path):
    """Adapters and their AdamW state; the frozen base comes from the model folder on resume
    (test_trainer_ckpt's exact-resume test runs with LoRA too)."""
    model, optimizer, scheduler = fresh(tiny_model, LORA)
    train_step(model, optimizer, scheduler, 0)
    save_checkpoint(model, optimizer, scheduler, tmp_path, step=1, keep_last=1)
    folder = checkpoint_step_dir(tmp_path, 1)
    saved = FileSystemReader(folder / "model_optim").read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 12 and all("lora_" in k for k in model_keys), model_keys
    assert json.loads((folder / "trainer.json").read_text())["lora"] is True


def test_a_checkpoint_resumes_only_in_the_mode_that_wrote_it(tiny_model, tmp_path):
    save_checkpoint(*fresh(tiny_model, LORA), tmp_path / "lora", step=1, keep_last=1)
    save_checkpoint(*fresh(tiny_model, lora=None), tmp_path / "full", step=1, keep_last=1)
    with pytest.raises(CheckpointError, match=r"written by LoRA adapters .* configured for full fine-tuning"):
        load_checkpoint(*fresh(tiny_model, lora=None), tmp_path / "lora", step=1)
    with pytest.raises(CheckpointError, match=r"written by full fine-tuning .* configured for LoRA adapters"):
        load_checkpoint(*fresh(tiny_model, LORA), tmp_path / "full", step=1)


def test_unknown_target_modules_are_named(tiny_model):
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules: \['qkv'\] name no linear layer .*'q_proj'"):
        add_lora(base(tiny_model), LoraConfig(target_modules=["q_proj", "qkv"]))


def prime_rl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prime_rl.cli", *args], capture_output=True, text=True, timeout=300)


def test_export_writes_the_merged_model_or_the_adapter(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, optimizer, scheduler = fresh(tiny_model, LORA)
    run = tmp_path / "run"
    for step in range(1, 4):
        train_step(model, optimizer, scheduler, step)
        save_weights(model, run, step=step, keep_last=2, source_model_dir=tiny_model)

    done = prime_rl("export", str(run), "--merge")  # the newest weights: step 3
    assert done.returncode == 0, done.stderr
    merged_dir = run / "exports" / "step_3-merged"
    assert "merged model" in done.stdout and str(merged_dir) in done.stdout
    assert not (merged_dir / MARKER).exists() and not (merged_dir / ADAPTER_CONFIG).exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)  # no peft needed
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), logits(model), rtol=1e-5, atol=1e-5)
    assert AutoTokenizer.from_pretrained(merged_dir).encode("abc") == AutoTokenizer.from_pretrained(tiny_model).encode("abc")

    done = prime_rl("export", str(run), "--step", "2", "--output", str(tmp_path / "adapter"))
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert ADAPTER_CONFIG in files and ADAPTER_WEIGHTS in files and "tokenizer.json" in files and MARKER not in files

    missing = prime_rl("export", str(run), "--step", "1")  # pruned (keep_last 2)
    assert missing.returncode == 2 and "--step 1:" in missing.stderr and "complete ones: 2, 3" in missing.stderr
    again = prime_rl("export", str(run), "--merge")
    assert again.returncode == 2 and "exists already" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr


def test_export_of_full_fine_tuning_weights_copies_them(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model, optimizer, scheduler = fresh(tiny_model, lora=None)
    train_step(model, optimizer, scheduler, 0)
    save_weights(model, tmp_path / "run", step=1, keep_last=1, source_model_dir=tiny_model)
    done = prime_rl("export", str(tmp_path / "run"), "--merge", "--output", str(tmp_path / "out"))
    assert done.returncode == 0 and "need no merge" in done.stdout, done.stderr
    assert not (tmp_path / "out" / MARKER).exists() and (tmp_path / "out" / "tokenizer.json").is_file()
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out")), logits(model))
