"""Shared-prefix rows (trainer.packing): the layout by hand, then the model's logprobs and
gradients against one row per sample, for each model family the trainer supports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from prime_rl.config import LossConfig
from prime_rl.wire import MicroBatch, make_sample
from trainer.data import collate
from trainer.packing import attention_allowed, lay_out, plan_rows, policy_start

REPO = Path(__file__).resolve().parents[1]


def arr(*xs):
    return np.array(xs, dtype=np.int64)


def mask(*xs):
    return np.array(xs, dtype=bool)


def test_policy_start_is_the_first_loss_token_or_the_length():
    assert policy_start(mask(0, 0, 1, 0, 1)) == 2
    assert policy_start(mask(0, 0, 0)) == 3


def test_a_group_shares_its_prompt_and_the_layout_is_as_drawn():
    # prompt 7 8 9 10, then completions (1 2), (3 4 5); a third sample with another prompt.
    # One row of 4 + 2 + 3 = 9 tokens: area 81 <= 6^2 + 7^2 = 85, so the two share it.
    ids = [arr(7, 8, 9, 10, 1, 2), arr(7, 8, 9, 10, 3, 4, 5), arr(6, 9, 1)]
    masks = [mask(0, 0, 0, 0, 1, 1), mask(0, 0, 0, 0, 1, 1, 1), mask(0, 1, 1)]
    rows = plan_rows(ids, masks, share=True)
    assert [(r.prefix, r.members) for r in rows] == [(4, (0, 1)), (0, (2,))]
    layout = lay_out(ids, rows, pad_id=0)
    assert layout.ids.tolist() == [[7, 8, 9, 10, 1, 2, 3, 4, 5], [6, 9, 1, 0, 0, 0, 0, 0, 0]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 4, 5, 4, 5, 6], [0, 1, 2, 0, 0, 0, 0, 0, 0]]
    assert layout.segments.tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2], [1, 1, 1, -1, -1, -1, -1, -1, -1]]
    # flat indices (row * 9 + column) of each sample's tokens; 0 past a sample's end
    assert layout.source.tolist() == [[0, 1, 2, 3, 4, 5, 0], [0, 1, 2, 3, 6, 7, 8], [9, 10, 11, 0, 0, 0, 0]]
    assert layout.shared
    allowed = attention_allowed(layout.segments)[0, 0].astype(int)
    assert allowed.tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],  # first completion: prompt + itself
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0, 0],  # second completion: prompt + itself, never the first
        [1, 1, 1, 1, 0, 0, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 1, 1, 1],
    ]
    padded_row = attention_allowed(layout.segments)[1, 0].astype(int)
    assert padded_row[:3, :3].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert padded_row[3:, :].tolist() == np.eye(9, dtype=int)[3:].tolist()  # padding sees only itself


def test_sharing_stops_where_the_row_would_cost_more_attention_than_separate_rows():
    # prompt of 2, completions of 10: one row of 2 + 10 + 10 = 22 -> 484 > 12^2 + 12^2 = 288
    long = [arr(*([5, 6] + list(range(10, 20)))) for _ in range(2)]
    long_masks = [mask(*([0, 0] + [1] * 10)) for _ in range(2)]
    assert [r.members for r in plan_rows(long, long_masks, share=True)] == [(0,), (1,)]
    # prompt of 10, completions of 2: 10 + 2 + 2 + 2 = 16 -> 256 <= 3 * 12^2 = 432
    short = [arr(*(list(range(20, 30)) + [1, 2])) for _ in range(3)]
    short_masks = [mask(*([0] * 10 + [1, 1])) for _ in range(3)]
    assert [(r.prefix, r.members) for r in plan_rows(short, short_masks, share=True)] == [(10, (0, 1, 2))]


def test_no_sharing_when_off_or_prompts_differ_or_nothing_precedes_the_policy():
    ids = [arr(7, 8, 1), arr(7, 9, 1), arr(1, 2), arr(1, 3)]
    masks = [mask(0, 0, 1), mask(0, 0, 1), mask(1, 1), mask(1, 1)]
    assert all(len(r.members) == 1 for r in plan_rows(ids, masks, share=True))
    assert [r.members for r in plan_rows(ids[:1] * 2, masks[:1] * 2, share=False)] == [(0,), (1,)]
    layout = lay_out(ids, plan_rows(ids, masks, share=False), pad_id=0)
    assert not layout.shared and layout.source[1].tolist() == [3, 4, 5]


# --------------------------------------------------------------------------- against the model


def group_samples(rng: np.random.Generator) -> list:
    """Two groups of 4 rollouts (shared prompts of 16 and 14 tokens, completions of 2-7
    tokens), then two multi-turn samples (a 20-token prompt, 3 policy tokens, a 4-token
    environment reply, 2 policy tokens). Each group fits the attention-area rule in one row."""
    samples = []
    for prompt_len in (16, 14):
        prompt = rng.integers(3, 250, prompt_len).tolist()
        for _ in range(4):
            n = int(rng.integers(2, 8))
            ids = prompt + rng.integers(3, 250, n).tolist()
            samples.append(make_sample(ids, [0] * prompt_len + [1] * n, rng.normal(-2, 0.5, len(ids)).tolist(),
                                       advantage=float(rng.normal()), reward=0.0, policy_version=0, example_id=0))
    prompt = rng.integers(3, 250, 20).tolist()
    for _ in range(2):
        turn1, reply, turn2 = (rng.integers(3, 250, k).tolist() for k in (3, 4, 2))
        ids = prompt + turn1 + reply + turn2
        samples.append(make_sample(ids, [0] * 20 + [1] * 3 + [0] * 4 + [1] * 2, rng.normal(-2, 0.5, len(ids)).tolist(),
                                   advantage=float(rng.normal()), reward=0.0, policy_version=0, example_id=1))
    return samples


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    for arch in ("qwen3", "llama", "qwen3_moe"):
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), str(root / arch), "--arch", arch],
                       check=True, capture_output=True)
    return {arch: root / arch for arch in ("qwen3", "llama", "qwen3_moe")}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_shared_rows_give_the_same_logprobs_and_gradients_as_one_row_per_sample(family_models, arch):
    from transformers import AutoModelForCausalLM

    from trainer.loss import policy_loss, scored_logprobs
    from trainer.model import forward_logits, shared_prefix_support

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(family_models[arch], dtype=torch.float32)
    assert shared_prefix_support(model) is None
    micro = MicroBatch(samples=group_samples(np.random.default_rng(0)))

    def logprobs_and_grads(share: bool):
        model.zero_grad()
        mt = collate(micro, 64, 0, torch.device("cpu"), share_prefix=share)
        logits = forward_logits(model, mt.model_ids, mt.model_mask, mt.model_positions)
        loss_mask = mt.loss_mask[:, 1:]
        lp, _ = scored_logprobs(logits, mt.source, mt.input_ids, loss_mask, 0.7)
        loss, _ = policy_loss(lp, mt.inference_logprobs[:, 1:], mt.advantages, loss_mask, LossConfig(), 30)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return mt, lp.detach(), grads

    separate, lp_separate, g_separate = logprobs_and_grads(False)
    shared, lp_shared, g_shared = logprobs_and_grads(True)
    assert separate.model_ids.shape[0] == 10 and shared.model_ids.shape[0] == 3  # 2 groups + the multi-turn pair
    assert shared.num_model_tokens < separate.num_model_tokens == separate.num_real_tokens
    torch.testing.assert_close(lp_shared, lp_separate, atol=1e-5, rtol=0)
    assert (lp_separate != 0).sum() == separate.loss_mask[:, 1:].sum()  # every loss token was scored
    assert g_shared.keys() == g_separate.keys() and len(g_shared) > 0
    for name, g in g_separate.items():
        torch.testing.assert_close(g_shared[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_models_that_take_no_custom_mask_are_named():
    from types import SimpleNamespace

    from trainer.model import shared_prefix_support

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert shared_prefix_support(model(_attn_implementation="sdpa", layer_types=["full_attention"])) is None
    assert "flash_attention_2" in shared_prefix_support(model(_attn_implementation="flash_attention_2"))
    assert "sliding-window" in shared_prefix_support(
        model(_attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"]))
