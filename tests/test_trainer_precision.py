"""Mixed precision, activation checkpointing and the output layer, on CPU.

- bf16 compute keeps float32 master weights: at lr 1e-6 a few AdamW steps move (nearly)
  every weight, where bf16 weights barely move (the control reproduces the old trainer);
- a resume restores the float32 weights and AdamW state exactly, and goes on identically;
- weights for inference are written in the compute dtype, cast before they are gathered;
- activation checkpointing gives the same loss and gradients (its memory is measured in
  tests/test_memory_estimate.py);
- ``TokenHead`` gives the logprobs, entropy, top-k KL and gradients of full logits, chunk by chunk;
- micro-batches are cut by tokens, groups kept whole where they fit;
- the attention a run gets, and the settings that are refused.
"""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import free_port
from safetensors import safe_open
from torch.distributed.fsdp import FSDPModule

from prime_rl.config import ModelConfig, OptimConfig, TrainerConfig
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch
from trainer.ckpt import load_checkpoint, save_checkpoint
from trainer.head import HeadQuery, score_tokens
from trainer.loss import entropy_from_logits, selective_log_softmax, top_k_reverse_kl
from trainer.model import World, load_model, prepare_model
from trainer.optim import build_optimizer
from trainer.packing import plan_micro_batches
from trainer.rl import train_step
from trainer.weights import full_state_dict, save_weights
from trainer_helpers import LORA, batch_frame, make_samples, run_trainer_process, trainer_config

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def one_rank_group():
    """bfloat16 compute shards the model with FSDP2 over a process group of this process's own
    (``trainer.model.join_one_rank_group``); later tests must not inherit it."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def batch(samples, step: int = 0) -> TrainBatch:
    return TrainBatch(SCHEMA_VERSION, step=step, rank=0, temperature=0.8, micro_batches=[MicroBatch(samples)])


def trainer(tiny_model, dtype: str, lr: float, lora=None) -> tuple:
    cfg = TrainerConfig(model=ModelConfig(name=str(tiny_model), dtype=dtype), seq_len=64, optim=OptimConfig(lr=lr), lora=lora)
    torch.manual_seed(0)
    model = load_model(cfg.model, WORLD, cfg.lora)
    return (model, *build_optimizer(model, cfg.optim)), cfg


def snapshot(model) -> dict[str, torch.Tensor]:
    """The gathered weights, copied (on CPU a gathered tensor may be the live one)."""
    return {name: t.clone() for name, t in full_state_dict(model).items()}


def moved(before: dict, after: dict, names) -> float:
    """Share of the elements of ``names`` that changed."""
    changed = sum(int((after[n].float() != before[n].float()).sum()) for n in names)
    return changed / sum(before[n].numel() for n in names)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_bf16_compute_keeps_float32_masters_that_move_at_lr_1e_6(tiny_model, one_rank_group, lora):
    samples = make_samples(tiny_model, policy_version=0)
    state, cfg = trainer(tiny_model, "bfloat16", 1e-6, lora)
    model = state[0]
    assert isinstance(model, FSDPModule) and {p.dtype for p in model.parameters()} == {torch.float32}
    ids = torch.tensor([[1, 2, 3]])
    assert model(input_ids=ids).dtype == torch.bfloat16  # the compute (logits without a query) is bf16
    trained = [n for n, p in model.named_parameters() if p.requires_grad and "embed_tokens" not in n]
    before = snapshot(model)
    for step in range(3):
        train_step(*state, batch(samples, step), cfg, WORLD)
    after = full_state_dict(model)
    # the embedding's rows of tokens no sample holds get no gradient; every other weight moves
    print("moved with masters", moved(before, after, trained))
    assert moved(before, after, trained) > 0.98, moved(before, after, trained)

    if lora is not None:  # adapters start at 0, where bf16 is fine enough: the control below is for full weights
        return
    # The control, what the trainer did before: bf16 weights updated in place. A step of ~1e-6
    # is below half a bf16 step of a weight of ~0.02 (~1e-4): almost nothing moves.
    control, _ = trainer(tiny_model, "float32", 1e-6, lora)
    model = control[0].to(torch.bfloat16)
    control = (model, *build_optimizer(model, cfg.optim))
    before = snapshot(model)
    for step in range(3):
        train_step(*control, batch(samples, step), cfg.model_copy(update={"model": ModelConfig(name=str(tiny_model))}), WORLD)
    print("moved in bf16 weights", moved(before, full_state_dict(model), trained))
    assert moved(before, full_state_dict(model), trained) < 0.2


def test_a_bf16_resume_restores_the_float32_state_exactly(tiny_model, tmp_path, one_rank_group):
    samples = make_samples(tiny_model, policy_version=0)
    straight, cfg = trainer(tiny_model, "bfloat16", 1e-3)
    for step in range(4):
        train_step(*straight, batch(samples, step), cfg, WORLD)

    interrupted, _ = trainer(tiny_model, "bfloat16", 1e-3)
    for step in range(2):
        train_step(*interrupted, batch(samples, step), cfg, WORLD)
    save_checkpoint(*interrupted, tmp_path, step=2, keep_last=2)
    saved = snapshot(interrupted[0])
    moments = [{k: v.full_tensor().clone() for k, v in s.items() if torch.is_tensor(v) and v.dim()}
               for s in interrupted[1].state.values()]
    train_step(*interrupted, batch(samples, 99), cfg, WORLD)  # lost with the process

    resumed, _ = trainer(tiny_model, "bfloat16", 1e-3)
    assert load_checkpoint(*resumed, tmp_path, step=2) == 2
    restored = full_state_dict(resumed[0])
    assert {v.dtype for v in restored.values()} == {torch.float32}
    for name, tensor in saved.items():
        assert torch.equal(restored[name], tensor), name
    restored_moments = [{k: v.full_tensor() for k, v in s.items() if torch.is_tensor(v) and v.dim()}
                        for s in resumed[1].state.values()]
    for a, b in zip(moments, restored_moments, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for step in range(2, 4):
        train_step(*resumed, batch(samples, step), cfg, WORLD)
    end_straight, end_resumed = full_state_dict(straight[0]), full_state_dict(resumed[0])
    for name, tensor in end_straight.items():
        assert torch.equal(end_resumed[name], tensor), name


def test_weights_for_inference_are_the_masters_cast_to_the_compute_dtype(tiny_model, tmp_path, one_rank_group):
    from transformers import AutoModelForCausalLM

    (model, *_), cfg = trainer(tiny_model, "bfloat16", 1e-3)
    folder = save_weights(model, tmp_path, 1, keep_last=1, source_model_dir=tiny_model, dtype=torch.bfloat16)
    masters = full_state_dict(model)
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), masters[name].to(torch.bfloat16)), name
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16


def test_a_bf16_trainer_process_learns_and_publishes_bf16_weights(tiny_model, tmp_path):
    from trainer_helpers import completion_logprobs

    run = tmp_path / "run"
    config = trainer_config(tiny_model, run, free_port())
    config["model"] = {**config["model"], "dtype": "bfloat16"}
    samples = make_samples(tiny_model, policy_version=0)
    returncode, out = run_trainer_process(tmp_path, config, [batch_frame(0, samples), batch_frame(1, samples)])
    assert returncode == 0, out
    with safe_open(run / "weights" / "step_2" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    before = completion_logprobs(tiny_model, samples)
    after = completion_logprobs(run / "weights" / "step_2", samples)
    assert after[0] > before[0] and after[1] < before[1], (before, after)  # the advantages' way


# --------------------------------------------------------------------------- activation checkpointing


def test_activation_checkpointing_gives_the_same_loss_and_gradients(tiny_model):
    from transformers import AutoModelForCausalLM

    samples = make_samples(tiny_model, policy_version=0)
    cfg = TrainerConfig(model=ModelConfig(name=str(tiny_model)), seq_len=64, optim=OptimConfig(lr=1e-3))
    results = []
    for checkpointing in (False, True):
        model_cfg = ModelConfig(name=str(tiny_model), activation_checkpointing=checkpointing)
        model = prepare_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), model_cfg, WORLD)
        assert model.model.gradient_checkpointing == checkpointing
        grads = {}
        optimizer, scheduler = build_optimizer(model, cfg.optim)
        for name, p in model.named_parameters():  # the gradients, read before the step zeroes them
            p.register_hook(lambda g, name=name: grads.__setitem__(name, g.clone()))
        stats = train_step(model, optimizer, scheduler, batch(samples), cfg, WORLD)
        results.append((stats, grads))
    (plain, g_plain), (checkpointed, g_checkpointed) = results
    assert checkpointed["loss_sum"] == pytest.approx(plain["loss_sum"], abs=1e-7)
    assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    assert g_plain.keys() == g_checkpointed.keys() and len(g_plain) > 10
    for name, g in g_plain.items():
        torch.testing.assert_close(g_checkpointed[name], g, atol=1e-7, rtol=1e-5, msg=name)


# --------------------------------------------------------------------------- the output layer


def test_the_head_scores_like_full_logits_chunk_by_chunk(monkeypatch):
    import trainer.head as head

    torch.manual_seed(0)
    n, hidden_size, vocab, k = 23, 16, 40, 3
    hidden = torch.randn(n, hidden_size, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    top_ids = torch.stack([torch.randperm(vocab)[:k] for _ in range(n)])
    top_lp = torch.log_softmax(torch.randn(n, vocab), -1).gather(-1, top_ids)
    query = HeadQuery(positions=torch.arange(n), targets=targets, temperature=0.7, top_ids=top_ids, top_logprobs=top_lp)
    weights = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)

    def backward(scores):
        loss = (scores["logprobs"] * weights[0]).sum() + (scores["top_k_kl"] * weights[1]).sum()
        return torch.autograd.grad(loss, (hidden, weight))

    logits = (hidden @ weight.t()).float() / 0.7  # the reference: every logit at once
    reference = {"logprobs": selective_log_softmax(logits, targets), "entropy": entropy_from_logits(logits),
                 "top_k_kl": top_k_reverse_kl(logits, top_ids, top_lp)}
    expected_grads = backward(reference)
    monkeypatch.setattr(head, "HEAD_CHUNK_ELEMENTS", 5 * vocab)  # chunks of 5 positions: 5, 5, 5, 5, 3
    scores = score_tokens(hidden, weight, query)
    for key, value in reference.items():
        assert scores[key].dtype == torch.float32
        torch.testing.assert_close(scores[key], value, msg=key)
    for got, want in zip(backward(scores), expected_grads):
        torch.testing.assert_close(got, want)
    empty = score_tokens(hidden[:0], weight, HeadQuery(torch.arange(0), targets[:0], 1.0))
    assert empty["logprobs"].shape == (0,) and "top_k_kl" not in empty


def test_a_trainer_model_scores_queries_as_its_hf_logits(tiny_model):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = prepare_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), ModelConfig(), WORLD)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        logits = reference(input_ids=ids).logits  # [2, 9, V]
        positions = torch.tensor([0, 4, 9 + 3, 9 + 7])
        scores = model(input_ids=ids, query=HeadQuery(positions, torch.tensor([5, 6, 7, 8]), temperature=0.5))
    expected = torch.log_softmax(logits.flatten(0, 1)[positions] / 0.5, -1)[torch.arange(4), torch.tensor([5, 6, 7, 8])]
    torch.testing.assert_close(scores["logprobs"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(input_ids=ids), logits, atol=1e-5, rtol=1e-5)  # no query: the logits
    assert model.state_dict().keys() == reference.state_dict().keys()  # lm_head.weight keeps its name


# --------------------------------------------------------------------------- micro-batches by tokens


def sample_arrays_of(lengths: list[int], prompt: int, groups: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """ids and loss masks of samples of ``lengths``; samples of one group share a ``prompt``-token prompt."""
    ids, masks = [], []
    for length, group in zip(lengths, groups):
        ids.append(np.concatenate([np.full(prompt, 100 + group), np.arange(length - prompt) + 3]))
        masks.append(np.concatenate([np.zeros(prompt, bool), np.ones(length - prompt, bool)]))
    return ids, masks


def test_micro_batches_are_cut_by_tokens_keeping_groups_whole():
    # three groups of 4 rollouts (prompt 20 + completions of 10: 60 tokens each when shared) and
    # one long sample of 150
    lengths, groups = [30] * 12 + [150], [0] * 4 + [1] * 4 + [2] * 4 + [3]
    ids, masks = sample_arrays_of(lengths, 20, groups)
    plan = plan_micro_batches(ids, masks, budget=128, share=True)
    assert sorted(i for m in plan for i in m) == list(range(13))  # every sample once
    assert [12] in plan  # above the budget: a micro-batch of its own
    for m in plan:  # a group's samples never split; at most two groups (120 tokens) a micro-batch
        assert {groups[i] for i in m} and all(groups.count(groups[i]) == sum(groups[j] == groups[i] for j in m) for i in m)
    assert sorted(len(m) for m in plan) == [1, 4, 8]
    # without sharing each rollout costs its 30 tokens: 4 a micro-batch
    plan = plan_micro_batches(ids, masks, budget=128, share=False)
    assert sorted(len(m) for m in plan) == [1, 4, 4, 4]


def test_a_step_trains_in_token_budget_micro_batches(tiny_model):
    samples = make_samples(tiny_model, policy_version=0)  # 4 samples of 13-17 tokens
    totals = {}
    for budget in (8192, 20):
        (model, optimizer, scheduler), cfg = trainer(tiny_model, "float32", 1e-3)
        cfg = cfg.model_copy(update={"micro_batch_tokens": budget})
        totals[budget] = train_step(model, optimizer, scheduler, batch(samples), cfg, WORLD)
    assert (totals[8192]["micro_batches"], totals[20]["micro_batches"]) == (1, 4)
    assert totals[20]["loss_sum"] == pytest.approx(totals[8192]["loss_sum"], abs=1e-6)  # the same step's mean
    assert totals[20]["grad_norm"] == pytest.approx(totals[8192]["grad_norm"], rel=1e-5)


# --------------------------------------------------------------------------- attention


def test_the_attention_a_run_gets(monkeypatch):
    import importlib.util

    from trainer.model import activation_checkpointing, attention_implementation, uses_varlen

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else None)
    assert attention_implementation(ModelConfig(dtype="bfloat16"), cuda) == "flash_attention_2"
    assert attention_implementation(ModelConfig(dtype="bfloat16"), cpu) == "sdpa"
    assert attention_implementation(ModelConfig(dtype="bfloat16", attn_implementation="sdpa"), cuda) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert attention_implementation(ModelConfig(dtype="bfloat16"), cuda) == "sdpa"  # not installed
    assert (activation_checkpointing(ModelConfig(), cuda), activation_checkpointing(ModelConfig(), cpu)) == (True, False)
    assert activation_checkpointing(ModelConfig(activation_checkpointing=False), cuda) is False

    class Config:
        _attn_implementation = "kernels-community/flash-attn2"  # a hub kernel runs packed rows unmasked too

    assert uses_varlen(type("M", (), {"config": Config()})())
    Config._attn_implementation = "sdpa"
    assert not uses_varlen(type("M", (), {"config": Config()})())


def test_flash_attention_in_float32_and_unknown_attentions_are_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"computes in 16 bits only, but dtype is float32: set dtype = \"bfloat16\""):
        ModelConfig(attn_implementation="flash_attention_2")
    with pytest.raises(ValidationError, match="16 bits only"):
        ModelConfig(attn_implementation="kernels-community/flash-attn2")
    with pytest.raises(ValidationError, match=r"unknown attention 'flsh': expected one of sdpa, eager"):
        ModelConfig(attn_implementation="flsh")
    assert ModelConfig(attn_implementation="kernels-community/flash-attn2", dtype="bfloat16").dtype == "bfloat16"
