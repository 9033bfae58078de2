"""SFT: assistant-only masks on a hand-checked chat, and a tiny end-to-end run."""

import json
import math
import random

from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.rundir import MARKER, read_jsonl
from trainer.sft import main, should_stop, tokenize_chat

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
    assert not should_stop(losses, None, None, 1)  # no target: never
    assert not should_stop(losses[:1], 2.0, None, 2)  # fewer steps than the window: never
    assert not should_stop(losses[:2], 1.9, None, 2)  # (3.0 + 1.0) / 2 = 2.0
    assert should_stop(losses[:2], 2.0, None, 2)
    assert should_stop(losses, 0.8, None, 3) and not should_stop(losses, 0.79, None, 3)  # (1.0 + 0.8 + 0.6) / 3


def test_the_plateau_is_the_fall_between_two_windows():
    losses = [3.0, 2.0, 1.0, 0.9, 0.85, 0.84]
    assert not should_stop(losses[:3], None, 1.0, 2)  # two windows not yet full
    # windows (1.0 + 0.9) / 2 = 0.95 -> (0.85 + 0.84) / 2 = 0.845: a fall of 0.105
    assert should_stop(losses, None, 0.11, 2) and not should_stop(losses, None, 0.1, 2)
    # (3.0 + 2.0) / 2 = 2.5 -> 0.95 is no plateau; a flat stretch high up is one, unless the loss gate says no
    assert not should_stop(losses[:4], None, 1.0, 2)
    flat = [3.0, 3.0, 3.0, 3.0]
    assert should_stop(flat, None, 0.01, 2) and not should_stop(flat, 2.0, 0.01, 2)
    assert should_stop(losses, 0.9, 0.11, 2) and not should_stop(losses, 0.8, 0.11, 2)


def test_input_noise_replaces_only_assistant_inputs():
    """``corrupt`` swaps target tokens (mask) for uniform draws at about the given share, never a
    prompt token, the same draws for the same generator seed; the targets are the data's."""
    import torch

    from trainer.sft import corrupt, next_token_query

    ids = torch.arange(4000).remainder(50).view(4, 1000)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 500:] = True
    out = corrupt(ids, mask, 0.3, 264, torch.Generator().manual_seed(0))
    changed = out != ids
    assert not changed[~mask].any()
    assert 0.27 < changed[mask].float().mean() < 0.3  # a draw equal to the token changes nothing (1 in 264)
    assert out.max() < 264 and out.min() >= 0
    assert torch.equal(out, corrupt(ids, mask, 0.3, 264, torch.Generator().manual_seed(0)))
    assert torch.equal(corrupt(ids, mask, 0.0, 264, None), ids)
    assert torch.equal(next_token_query(ids, mask).targets, ids[:, 500:].flatten())


def test_label_smoothing_is_torchs():
    """The head's mean logprob over the vocabulary makes the smoothed loss torch's
    ``cross_entropy(label_smoothing=...)``, value and gradient."""
    import torch
    import torch.nn.functional as F

    from trainer.head import HeadQuery, score_tokens
    from trainer.sft import smoothed_nll

    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8)
    targets = torch.tensor([0, 3, 10, 3, 7])
    for eps in (0.0, 0.3):
        query = HeadQuery(positions=torch.arange(5), targets=targets, temperature=1.0, mean_logprob=eps > 0)
        ours = smoothed_nll(score_tokens(hidden, weight, query), eps)
        (g_ours,) = torch.autograd.grad(ours.sum(), hidden)
        ref = F.cross_entropy(hidden @ weight.t(), targets, label_smoothing=eps, reduction="none")
        (g_ref,) = torch.autograd.grad(ref.sum(), hidden)
        torch.testing.assert_close(ours, ref)
        torch.testing.assert_close(g_ours, g_ref)


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
    assert "stopped at step 3: the mean loss of 3 steps is <= 100 (last 3: " in capsys.readouterr().out
    # label-smoothed (inputs noised) to a plateau: stops once two windows' means are within 100 of each other,
    # and logs the plain NLL beside the smoothed loss (a floor of at least 0.5 * ln 2 above it)
    config.update(stop_loss=None, stop_plateau=100.0, label_smoothing=0.5, input_noise=0.5, output_dir=str(tmp_path / "smoothed"))
    (tmp_path / "sft.json").write_text(json.dumps(config))
    assert main(["--config", str(tmp_path / "sft.json")]) == 0
    rows = read_jsonl(tmp_path / "smoothed" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["loss/sft"] > r["loss/nll"] / 2 + 0.5 * math.log(2) for r in rows), rows
    assert "stopped at step 6: it fell less than 100 below the 3 steps before (last 3: " in capsys.readouterr().out


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
