"""scripts/build_tiny_model.py: its flags reach the build, and a build is deterministic.

The suite builds its models in-process (``helpers.build_tiny``), so the command's flags are
checked here: the command with flags writes the same files as the keywords they name."""

import json

from helpers import build_tiny, load_script


def test_the_commands_flags_build_the_same_model_as_the_keywords(tmp_path, capsys):
    script = load_script("build_tiny_model")
    script.main([str(tmp_path / "cli"), "--arch", "llama", "--seed", "3", "--chat-template", "think-stripping",
                 "--hidden-size", "32", "--num-layers", "1", "--head-dim", "64"])
    assert "wrote tiny llama model" in capsys.readouterr().out
    build_tiny(tmp_path / "keywords", arch="llama", seed=3, chat_template="think-stripping", hidden_size=32, num_layers=1,
               head_dim=64)
    other_seed = build_tiny(tmp_path / "seed4", arch="llama", seed=4, chat_template="think-stripping", hidden_size=32,
                            num_layers=1, head_dim=64)
    cli, keywords = tmp_path / "cli", tmp_path / "keywords"
    for name in ("model.safetensors", "config.json", "tokenizer_config.json", "tokenizer.json"):
        assert (cli / name).read_bytes() == (keywords / name).read_bytes(), name
    assert (cli / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()
    config = json.loads((cli / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == ("llama", 32, 1, 64)
    assert json.loads((cli / "tokenizer_config.json").read_text())["chat_template"] == script.CHAT_TEMPLATES["think-stripping"]
