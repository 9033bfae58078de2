"""save_weights: HF folder loadable by transformers, tied tensors once, marker protocol, pruning."""

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from prime_rl.rundir import MARKER, complete_steps, latest_weights_step, weights_dir
from trainer.weights import save_weights


def tiny_tied_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config).eval()


def test_saved_step_loads_in_transformers_with_tied_weights_stored_once(tmp_path):
    model = tiny_tied_model()
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text("{}")
    folder = save_weights(model, tmp_path / "run", step=1, keep_last=2, source_model_dir=source)

    assert folder == weights_dir(tmp_path / "run") / "step_1" and (folder / MARKER).read_text() == "1\n"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (folder / name).is_file(), name
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys

    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_prune_keeps_last_and_unmarked_dirs_are_not_complete(tmp_path):
    model = tiny_tied_model()
    run = tmp_path / "run"
    for step in range(1, 5):
        save_weights(model, run, step=step, keep_last=2, source_model_dir=None)
    assert complete_steps(weights_dir(run)) == [3, 4]
    assert not (weights_dir(run) / "step_1").exists() and not (weights_dir(run) / "step_2").exists()

    # A folder that has all the files but no marker (a writer that died mid-way) is not a step.
    half = weights_dir(run) / "step_9"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"")
    (weights_dir(run) / "step_10.tmp").mkdir()
    assert complete_steps(weights_dir(run)) == [3, 4] and latest_weights_step(run) == 4


def test_a_generation_config_transformers_would_refuse_to_save_is_carried_verbatim(tmp_path):
    """Some models ship sampling defaults without `do_sample` (top_k 3 here); transformers'
    save_pretrained refuses such a config, which must not fail the trainer's weight save."""
    import json

    model = tiny_tied_model()
    source = tmp_path / "source"
    source.mkdir()
    text = json.dumps({"top_k": 3, "top_p": 0.5, "temperature": 0.6, "eos_token_id": 1})
    (source / "generation_config.json").write_text(text)
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(source)  # as from_pretrained(source) sets it
    folder = save_weights(model, tmp_path / "run", step=1, keep_last=2, source_model_dir=source)
    assert (folder / "generation_config.json").read_text() == text
    assert save_weights(model, tmp_path / "run2", step=1, keep_last=2) is not None  # no source folder
    assert (weights_dir(tmp_path / "run2") / "step_1" / "generation_config.json").is_file()
