"""Model rows (trainer.packing): blocks (shared prefixes), packed rows and the varlen row by
hand, then the model's logprobs, loss and gradients against one row per sample, for each
model family the trainer supports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prime_rl.config import LossConfig
from prime_rl.wire import MicroBatch, make_sample
from trainer.data import collate
from trainer.packing import (
    Block, attention_allowed, lay_out, plan_blocks, plan_rows, policy_start, row_budget, varlen_boundaries,
)

REPO = Path(__file__).resolve().parents[1]


def arr(*xs):
    return np.array(xs, dtype=np.int64)


def mask(*xs):
    return np.array(xs, dtype=bool)


def unpacked(ids, blocks, pad_id=0):
    """The layout of one block per row, in order."""
    return lay_out(ids, blocks, plan_rows([0] * len(blocks), None), pad_id)


def test_policy_start_is_the_first_loss_token_or_the_length():
    assert policy_start(mask(0, 0, 1, 0, 1)) == 2
    assert policy_start(mask(0, 0, 0)) == 3


def test_a_group_shares_its_prompt_and_the_layout_is_as_drawn():
    # prompt 7 8 9 10, then completions (1 2), (3 4 5); a third sample with another prompt.
    # One row of 4 + 2 + 3 = 9 tokens: area 81 <= 6^2 + 7^2 = 85, so the two share it.
    ids = [arr(7, 8, 9, 10, 1, 2), arr(7, 8, 9, 10, 3, 4, 5), arr(6, 9, 1)]
    masks = [mask(0, 0, 0, 0, 1, 1), mask(0, 0, 0, 0, 1, 1, 1), mask(0, 1, 1)]
    blocks = plan_blocks(ids, masks, share=True)
    assert blocks == [Block(4, (0, 1)), Block(0, (2,))]
    layout = unpacked(ids, blocks)
    assert layout.ids.tolist() == [[7, 8, 9, 10, 1, 2, 3, 4, 5], [6, 9, 1, 0, 0, 0, 0, 0, 0]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 4, 5, 4, 5, 6], [0, 1, 2, 0, 0, 0, 0, 0, 0]]
    assert layout.segments.tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2], [1, 1, 1, -1, -1, -1, -1, -1, -1]]
    assert layout.blocks.tolist() == [[0] * 9, [0, 0, 0, -1, -1, -1, -1, -1, -1]]
    # flat indices (row * 9 + column) of each sample's tokens; 0 past a sample's end
    assert layout.source.tolist() == [[0, 1, 2, 3, 4, 5, 0], [0, 1, 2, 3, 6, 7, 8], [9, 10, 11, 0, 0, 0, 0]]
    assert layout.shared and not layout.packed
    allowed = allowed_mask(layout)[0, 0].int().numpy()
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
    padded_row = allowed_mask(layout)[1, 0].int().numpy()
    assert padded_row[:3, :3].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert padded_row[3:, :].tolist() == np.eye(9, dtype=int)[3:].tolist()  # padding sees only itself


def test_sharing_stops_where_the_row_would_cost_more_attention_than_separate_rows():
    # prompt of 2, completions of 10: one row of 2 + 10 + 10 = 22 -> 484 > 12^2 + 12^2 = 288
    long = [arr(*([5, 6] + list(range(10, 20)))) for _ in range(2)]
    long_masks = [mask(*([0, 0] + [1] * 10)) for _ in range(2)]
    assert [b.members for b in plan_blocks(long, long_masks, share=True)] == [(0,), (1,)]
    # prompt of 10, completions of 2: 10 + 2 + 2 + 2 = 16 -> 256 <= 3 * 12^2 = 432
    short = [arr(*(list(range(20, 30)) + [1, 2])) for _ in range(3)]
    short_masks = [mask(*([0] * 10 + [1, 1])) for _ in range(3)]
    assert plan_blocks(short, short_masks, share=True) == [Block(10, (0, 1, 2))]


def test_no_sharing_when_off_or_prompts_differ_or_nothing_precedes_the_policy():
    ids = [arr(7, 8, 1), arr(7, 9, 1), arr(1, 2), arr(1, 3)]
    masks = [mask(0, 0, 1), mask(0, 0, 1), mask(1, 1), mask(1, 1)]
    assert all(len(b.members) == 1 for b in plan_blocks(ids, masks, share=True))
    assert [b.members for b in plan_blocks(ids[:1] * 2, masks[:1] * 2, share=False)] == [(0,), (1,)]
    layout = unpacked(ids, plan_blocks(ids, masks, share=False))
    assert not layout.shared and not layout.packed and layout.source[1].tolist() == [3, 4, 5]


def test_rows_are_filled_first_fit_decreasing():
    # longest first: 9 -> row 0 (room 1); 6 -> row 1 (4); 5 -> row 2 (5); 4 -> row 1 (0);
    # 3 -> row 2 (2); 2 -> row 2 (0). Each row lists its blocks in order.
    assert plan_rows([5, 9, 3, 4, 2, 6], budget=10) == [(1,), (3, 5), (0, 2, 4)]
    assert plan_rows([12, 3], budget=10) == [(0,), (1,)]  # too long for the budget: a row of its own
    assert plan_rows([5, 9, 3], budget=None) == [(0,), (1,), (2,)]  # no packing: one per row, in order
    assert row_budget([5, 9, 3], pack=True, varlen=False) == 9  # the longest block: no row grows
    assert row_budget([5, 9, 3], pack=True, varlen=True) == 17  # the varlen kernel: everything in one row
    assert row_budget([5, 9, 3], pack=False, varlen=True) is None


def test_a_packed_row_holds_a_shared_block_and_samples_each_attending_only_to_itself():
    # blocks: the shared group (4 + 2 + 3 = 9 tokens), sample 2 (3), sample 3 (5); budget 9:
    # the group fills row 0, then 5 opens row 1 and 3 joins it (5 + 3 = 8 <= 9, one pad).
    ids = [arr(7, 8, 9, 10, 1, 2), arr(7, 8, 9, 10, 3, 4, 5), arr(6, 9, 1), arr(11, 12, 13, 14, 15)]
    masks = [mask(0, 0, 0, 0, 1, 1), mask(0, 0, 0, 0, 1, 1, 1), mask(0, 1, 1), mask(0, 0, 1, 1, 1)]
    blocks = plan_blocks(ids, masks, share=True)
    sizes = [b.length([len(x) for x in ids]) for b in blocks]
    assert blocks == [Block(4, (0, 1)), Block(0, (2,)), Block(0, (3,))] and sizes == [9, 3, 5]
    rows = plan_rows(sizes, row_budget(sizes, pack=True, varlen=False))
    assert rows == [(0,), (1, 2)]
    layout = lay_out(ids, blocks, rows, pad_id=0)
    assert layout.ids.tolist() == [[7, 8, 9, 10, 1, 2, 3, 4, 5], [6, 9, 1, 11, 12, 13, 14, 15, 0]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 4, 5, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 0]]  # restart per sample
    assert layout.blocks.tolist() == [[0] * 9, [0, 0, 0, 1, 1, 1, 1, 1, -1]]
    assert layout.segments.tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1, -1]]
    assert layout.source.tolist() == [
        [0, 1, 2, 3, 4, 5, 0], [0, 1, 2, 3, 6, 7, 8], [9, 10, 11, 0, 0, 0, 0], [12, 13, 14, 15, 16, 0, 0]]
    assert layout.shared and layout.packed
    allowed = allowed_mask(layout)[1, 0].int().numpy()
    assert allowed.tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0, 0],  # sample 3 starts: never sees sample 2
        [0, 0, 0, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1],  # padding sees only itself
    ]


def test_the_varlen_row_is_every_sample_back_to_back_with_its_boundaries():
    ids = [arr(1, 2, 3), arr(4, 5, 6, 7, 8), arr(9, 10)]
    blocks = plan_blocks(ids, [mask(0, 1, 1), mask(0, 1, 1, 1, 1), mask(0, 1)], share=False)
    sizes = [3, 5, 2]
    layout = lay_out(ids, blocks, plan_rows(sizes, row_budget(sizes, pack=True, varlen=True)), pad_id=0)
    assert layout.ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]  # no padding
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert varlen_boundaries(layout).tolist() == [0, 3, 8, 10]
    assert varlen_boundaries(layout).dtype == np.int32
    with pytest.raises(ValueError, match="one row"):
        varlen_boundaries(unpacked(ids, blocks))  # three padded rows


def test_collate_for_the_varlen_kernel_passes_boundaries_and_no_mask():
    import trainer.model as tm

    samples = [make_sample(list(range(3, 3 + n)), [0] + [1] * (n - 1), [-1.0] * n, advantage=1.0, reward=0.0,
                           policy_version=0, example_id=0) for n in (4, 2, 3)]
    mt = collate(MicroBatch(samples=samples), 64, 0, torch.device("cpu"), share_prefix=True, pack=True, varlen=True)
    assert mt.model_mask is None and mt.model_ids.shape == (1, 9) and mt.num_model_tokens == 9
    assert mt.cu_seqlens.tolist() == [0, 4, 6, 9] and mt.cu_seqlens.dtype == torch.int32 and mt.max_seqlen == 4
    assert mt.model_positions.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert tm.varlen_kwargs(mt.cu_seqlens, mt.max_seqlen) == {
        "cu_seq_lens_q": mt.cu_seqlens, "cu_seq_lens_k": mt.cu_seqlens, "max_length_q": 4, "max_length_k": 4}

    seen = {}

    class Recorder(torch.nn.Module):  # what the HF model would be called with
        def forward(self, **kwargs):
            seen.update(kwargs)
            return type("Out", (), {"logits": torch.zeros(1, 9, 5)})()

    tm.forward_logits(Recorder(), mt.model_ids, mt.model_mask, mt.model_positions, mt.cu_seqlens, mt.max_seqlen)
    assert "attention_mask" not in seen and seen["position_ids"] is mt.model_positions
    assert seen["cu_seq_lens_q"] is mt.cu_seqlens and seen["max_length_k"] == 4


def allowed_mask(layout):
    """``attention_allowed`` of a layout's block and segment ids (built on the device, here CPU)."""
    return attention_allowed(torch.from_numpy(layout.blocks), torch.from_numpy(layout.segments))


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


def single_samples(rng: np.random.Generator) -> list:
    """Six samples with prompts of their own (3-10 tokens, 2-12 policy tokens): short enough
    to fill the rows of the groups in ``group_samples`` or share rows with each other."""
    samples = []
    for _ in range(6):
        p, n = int(rng.integers(3, 11)), int(rng.integers(2, 13))
        ids = rng.integers(3, 250, p + n).tolist()
        samples.append(make_sample(ids, [0] * p + [1] * n, rng.normal(-2, 0.5, p + n).tolist(),
                                   advantage=float(rng.normal()), reward=0.0, policy_version=0, example_id=2))
    return samples


VARLEN_CALLS: list[int] = []
"""Sequences per call of ``varlen_reference``: proof that the model called it."""


def varlen_reference(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
    """flash-attention's varlen contract on CPU: causal attention within each [start, end) of
    ``cu_seq_lens_q``, nothing across them (query [1, H, N, D] -> out [1, N, H, D])."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert attention_mask is None and cu_seq_lens_q is not None and query.shape[0] == 1
    VARLEN_CALLS.append(len(cu_seq_lens_q) - 1)
    kwargs = {k: v for k, v in kwargs.items() if k in ("dropout", "scaling")}
    bounds = cu_seq_lens_q.tolist()
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kwargs)[0]
            for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=1), None


LAYOUTS = {  # collate's (share_prefix, pack, varlen)
    "shared": (True, False, False),
    "packed": (False, True, False),
    "packed+shared": (True, True, False),
    "varlen": (True, True, True),  # share_prefix is ignored for the varlen kernel
}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_every_layout_gives_the_logprobs_loss_and_gradients_of_one_row_per_sample(family_models, arch):
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    from trainer.head import install_token_head
    from trainer.loss import policy_loss
    from trainer.model import forward_logits, packing_support, shared_prefix_support

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(family_models[arch], dtype=torch.float32)
    install_token_head(model)
    assert shared_prefix_support(model) is None and packing_support(model) is None
    rng = np.random.default_rng(0)
    micro = MicroBatch(samples=group_samples(rng) + single_samples(rng))
    AttentionInterface.register("varlen_reference", varlen_reference)
    AttentionMaskInterface.register("varlen_reference", flash_attention_mask)  # no mask: None, as for flash

    def run(share: bool, pack: bool, varlen: bool):
        model.set_attn_implementation("varlen_reference" if varlen else "sdpa")
        model.zero_grad()
        mt = collate(micro, 64, 0, torch.device("cpu"), share_prefix=share, pack=pack, varlen=varlen)
        scores = forward_logits(model, mt.model_ids, mt.model_mask, mt.model_positions, mt.cu_seqlens, mt.max_seqlen,
                                query=mt.head_query(0.7))
        loss_mask = mt.loss_mask[:, 1:]
        lp = torch.zeros(loss_mask.shape).masked_scatter(loss_mask, scores["logprobs"])
        loss, _ = policy_loss(lp, mt.inference_logprobs[:, 1:], mt.advantages, loss_mask, LossConfig(), 30)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return mt, lp.detach(), loss.detach(), grads

    separate, lp_separate, loss_separate, g_separate = run(False, False, False)
    assert separate.model_ids.shape[0] == 16 and separate.num_model_tokens == separate.num_real_tokens
    assert (lp_separate != 0).sum() == separate.loss_mask[:, 1:].sum()  # every loss token was scored
    assert len(g_separate) > 0
    rows = {}
    for name, flags in LAYOUTS.items():
        VARLEN_CALLS.clear()
        mt, lp, loss, grads = run(*flags)
        assert VARLEN_CALLS == ([16] * model.config.num_hidden_layers if flags[2] else []), name
        rows[name] = (mt.model_ids.shape[0], mt.model_ids.numel(), mt.num_model_tokens)
        torch.testing.assert_close(lp, lp_separate, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(loss, loss_separate, atol=1e-6, rtol=1e-5, msg=name)
        assert grads.keys() == g_separate.keys(), name
        for param, g in g_separate.items():
            torch.testing.assert_close(grads[param], g, atol=1e-6, rtol=1e-4, msg=f"{name}: {param}")
    # (rows, tokens computed with padding, real tokens computed)
    assert rows["shared"][0] == 3 + 6  # 2 groups + the multi-turn pair share; the singles do not
    assert rows["shared"][2] == rows["packed+shared"][2] < separate.num_model_tokens  # prompts once
    assert rows["packed"][2] == rows["varlen"][2] == separate.num_model_tokens
    assert rows["packed"][0] < 16 and rows["packed+shared"][0] < rows["shared"][0]  # samples share rows
    assert rows["packed+shared"][1] < rows["shared"][1] and rows["packed"][1] < separate.model_ids.numel()
    assert rows["varlen"][:2] == (1, separate.num_model_tokens)  # no padding at all


def test_models_that_take_no_custom_mask_are_named():
    from types import SimpleNamespace

    from trainer.model import shared_prefix_support

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert shared_prefix_support(model(_attn_implementation="sdpa", layer_types=["full_attention"])) is None
    assert "flash_attention_2" in shared_prefix_support(model(_attn_implementation="flash_attention_2"))
    assert "sliding-window" in shared_prefix_support(
        model(_attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"]))
