"""SFT: assistant-only masks on a hand-checked chat, and a tiny end-to-end run."""

import json
import random

from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.rundir import MARKER, read_jsonl
from trainer.sft import main, reached_loss, tokenize_chat

IM_START, IM_END, NL = 257, 258, 10  # tiny byte-level tokenizer: byte ids, then specials


def test_assistant_mask_hand_checked(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    chat = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ba"},
        {"role": "user", "content": "cd"},
        {"role": "assistant", "content": "dc"},
    ]
    ids, mask = tokenize_chat(tok, chat)

    def turn(role, content):  # <|im_start|>role\ncontent<|im_end|>\n
        return [IM_START, *role.encode(), NL, *content.encode(), IM_END, NL]

    assert ids == turn("user", "ab") + turn("assistant", "ba") + turn("user", "cd") + turn("assistant", "dc")
    # Only each assistant reply and its <|im_end|>; not the role header, not the newline after.
    assistant_turn_mask = [0] * (1 + len("assistant") + 1) + [1, 1, 1] + [0]
    user_turn_mask = [0] * len(turn("user", "ab"))
    assert mask == user_turn_mask + assistant_turn_mask + user_turn_mask + assistant_turn_mask
    assert [t for t, m in zip(ids, mask) if m] == [ord("b"), ord("a"), IM_END, ord("d"), ord("c"), IM_END]


def test_sft_run_writes_a_loadable_model_with_marker(tiny_model, tmp_path):
    rng = random.Random(0)
    with open(tmp_path / "chats.jsonl", "w") as f:
        for _ in range(16):
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))
            chat = [{"role": "user", "content": word}, {"role": "assistant", "content": word[::-1]}]
            f.write(json.dumps({"messages": chat}) + "\n")
    out = tmp_path / "sft"
    config = {
        "model": {"name": str(tiny_model)},
        "data": {"path": str(tmp_path / "chats.jsonl"), "batch_size": 8, "micro_batch_size": 4},
        "optim": {"lr": 3e-3},
        "max_steps": 12,
        "seq_len": 64,
        "output_dir": str(out),
        "num_threads": 1,
    }
    (tmp_path / "sft.json").write_text(json.dumps(config))

    assert main(["--config", str(tmp_path / "sft.json")]) == 0

    assert (out / MARKER).is_file() and (out / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    assert (out / "tokenizer_config.json").read_text() == (tiny_model / "tokenizer_config.json").read_text()
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13)) and all(r["process"] == "sft" for r in rows)
    assert {"loss/sft", "perf/tokens_per_s", "time/step"} <= rows[0].keys()
    assert rows[-1]["loss/sft"] < rows[0]["loss/sft"]


def test_the_loss_target_is_a_mean_over_the_window():
    losses = [3.0, 1.0, 0.8, 0.6]
    assert not reached_loss(losses, None, 1)  # no target: never
    assert not reached_loss(losses[:1], 2.0, 2)  # fewer steps than the window: never
    assert not reached_loss(losses[:2], 1.9, 2)  # (3.0 + 1.0) / 2 = 2.0
    assert reached_loss(losses[:2], 2.0, 2)
    assert reached_loss(losses, 0.8, 3) and not reached_loss(losses, 0.79, 3)  # (1.0 + 0.8 + 0.6) / 3


def test_sft_stops_at_its_loss_target_and_still_publishes(tiny_model, tmp_path, capsys):
    chats = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]} for w in ("abc", "defg")]
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    out = tmp_path / "sft"
    config = {"model": {"name": str(tiny_model)}, "data": {"path": str(tmp_path / "chats.jsonl"), "batch_size": 2, "micro_batch_size": 2},
              "max_steps": 50, "stop_loss": 100.0, "stop_window": 3, "seq_len": 64, "output_dir": str(out), "num_threads": 1}
    (tmp_path / "sft.json").write_text(json.dumps(config))
    assert main(["--config", str(tmp_path / "sft.json")]) == 0
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]  # the first window's mean is below 100
    assert (out / MARKER).is_file()
    assert "stopped at step 3: mean loss of the last 3 steps" in capsys.readouterr().out


def test_the_sft_model_carries_a_generation_config_transformers_would_refuse(tmp_path, sampling_defaults_model):
    """A source whose generation_config.json sets top_k without do_sample (transformers'
    save_pretrained refuses it): SFT still saves, with that file verbatim, and the output
    loads with the same logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.sft import save_model

    model = AutoModelForCausalLM.from_pretrained(sampling_defaults_model).eval()
    out = tmp_path / "out"
    save_model(model, AutoTokenizer.from_pretrained(sampling_defaults_model), str(sampling_defaults_model), out)
    source_text = (sampling_defaults_model / "generation_config.json").read_text()
    assert (out / "generation_config.json").read_text() == source_text
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits, model(ids).logits)
