"""The distillation teacher in the trainer's process (`[teacher] placement = "trainer"`,
``trainer.teacher``): its scores of packed rows against the model run on each sample alone,
one training step with it against the same step with its scores carried in the batch (what
a served teacher sends), and the teachers it refuses. The trio with it: tests/test_trio.py."""

import json
import shutil

import numpy as np
import pytest
import torch

from prime_rl.config import DistillConfig, LossConfig, ModelConfig, TrainerConfig
from prime_rl.wire import SCHEMA_VERSION, MicroBatch, TrainBatch, make_sample
from trainer.data import collate
from trainer.model import World, load_model
from trainer.teacher import TeacherError, load_teacher, score

CPU = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
K = 5


def samples() -> list:
    """Four samples of one prompt (a shared prefix the trainer lays out once) and one other,
    each with its completion on the loss mask; advantages of both signs and 0."""
    prompt = [5, 17, 42, 8, 99, 3]
    completions = [[61, 62, 63, 64], [61, 70], [80, 81, 82, 83, 84, 85], [61, 62, 90]]
    out = []
    for i, completion in enumerate(completions):
        ids = prompt + completion
        mask = [0] * len(prompt) + [1] * len(completion)
        out.append(make_sample(ids, mask, [0.0] * len(prompt) + [-1.5] * len(completion), advantage=[0.5, -0.5, 0.0, 1.0][i],
                               reward=0.0, policy_version=0, example_id=0))
    other = [7, 7, 30, 31, 32, 33, 34]
    out.append(make_sample(other, [0, 0, 1, 1, 1, 1, 1], [0.0, 0.0] + [-2.0] * 5, advantage=-1.0, reward=0.0,
                           policy_version=0, example_id=1))
    return out


def with_teacher_prompts(sample_list) -> list:
    """The same samples, the first three with a teacher prompt of their own (context
    distillation): longer than the student's prompt, shorter, and as long."""
    from prime_rl.wire import sample_arrays

    prompts = {0: [5, 200, 201, 202, 17, 42, 8, 99, 3], 1: [5, 3], 2: [9, 9, 9, 9, 9, 9]}
    out = []
    for i, s in enumerate(sample_list):
        ids, mask, logprobs = sample_arrays(s)
        prompt = (prompts[i], 6) if i in prompts else None
        out.append(make_sample(ids, mask, logprobs, advantage=s.advantage, reward=0.0, policy_version=0,
                               example_id=s.example_id, teacher_prompt=prompt))
    return out


def reference(model_dir, sample_list) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The teacher run on each sample alone with plain transformers, as it sees it (its own
    prompt first, with context distillation): (logprob of every loss token [n], its top-K ids
    [n, K] and logprobs [n, K]), temperature 1, float32."""
    from transformers import AutoModelForCausalLM

    from prime_rl.wire import sample_arrays, teacher_view

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for s in sample_list:
        _, mask, _ = sample_arrays(s)
        ids, offset = teacher_view(s)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.from_numpy(np.asarray([ids]))).logits[0].float(), -1)  # [T, V]
        at = np.nonzero(mask)[0] + offset - 1  # the position before each loss token scores it
        chosen = logprobs[at, torch.tensor(ids)[at + 1]]
        top = logprobs[at].topk(K, -1)
        out.append((chosen.numpy(), top.indices.numpy(), top.values.numpy()))
    return out


@pytest.mark.parametrize("context", [False, True], ids=["own prompt", "teacher's prompt"])
@pytest.mark.parametrize("layout", ["packed, shared prefixes", "a row a sample"])
def test_the_trainers_teacher_scores_packed_rows_as_the_model_scores_each_sample_alone(tiny_model, other_tiny_model, layout, context):
    """On the student's rows, or (context distillation) on rows of the teacher's view, laid
    out alike; either way each sampled token's scores are the model's on that sample alone."""
    student = load_model(ModelConfig(name=str(tiny_model)), CPU)
    teacher = load_teacher(str(other_tiny_model), ModelConfig(name=str(tiny_model)), CPU, student)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    packed = layout.startswith("packed")
    batch = with_teacher_prompts(samples()) if context else samples()
    lay_out = lambda m, seq_len: collate(m, seq_len, 0, CPU.device, share_prefix=packed, pack=packed)  # noqa: E731
    mt = lay_out(MicroBatch(batch), 64)
    assert (mt.num_model_tokens < int(mt.attention_mask.sum())) == packed  # the prompt laid out once
    scored = score(teacher, mt, K, MicroBatch(batch), lay_out)
    mask = mt.loss_mask[:, 1:]
    want = reference(other_tiny_model, batch)
    got = scored.teacher_logprobs[:, 1:]
    assert (scored.teacher_logprobs[:, 1:][~mask] == 0).all() and (scored.teacher_logprobs[:, 0] == 0).all()
    rows = 0
    for b, (chosen, top_ids, top_lp) in enumerate(want):
        np.testing.assert_allclose(got[b][mask[b]].numpy(), chosen, atol=2e-5)
        n = len(chosen)
        assert scored.teacher_top_ids[rows : rows + n].tolist() == top_ids.tolist()
        np.testing.assert_allclose(scored.teacher_top_logprobs[rows : rows + n].numpy(), top_lp, atol=2e-5)
        rows += n
    assert rows == scored.teacher_top_ids.shape[0] == int(mask.sum())
    assert score(teacher, mt, 0, MicroBatch(batch), lay_out).teacher_top_ids is None  # without top_k: the sampled tokens' alone


def one_step(tiny_model, batch, distill: DistillConfig, teacher_dir=None) -> dict[str, float]:
    from trainer.optim import build_optimizer
    from trainer.rl import train_step

    cfg = TrainerConfig(model=ModelConfig(name=str(tiny_model)), seq_len=64, loss=LossConfig(importance="none", distill=distill),
                        teacher_model=None if teacher_dir is None else str(teacher_dir))
    torch.manual_seed(0)
    model = load_model(cfg.model, CPU)
    teacher = None if teacher_dir is None else load_teacher(str(teacher_dir), cfg.model, CPU, model)
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    step = TrainBatch(SCHEMA_VERSION, step=3, rank=0, temperature=1.0, micro_batches=[MicroBatch(batch[:2]), MicroBatch(batch[2:])])
    stats = train_step(model, optimizer, scheduler, step, cfg, CPU, teacher=teacher)
    stats["weights"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return stats


@pytest.mark.parametrize("context", [False, True], ids=["own prompt", "teacher's prompt"])
@pytest.mark.parametrize("top_k", [0, K])
def test_a_step_with_the_trainers_teacher_is_the_step_a_served_teachers_scores_give(tiny_model, other_tiny_model, top_k, context):
    """The same samples, scored once by the teacher in the trainer and once carrying (what a
    served teacher sends) the same model's logprobs and top-k from plain transformers: one loss,
    one set of sums, the same update."""
    from prime_rl.wire import sample_arrays

    distill = DistillConfig(reward_weight=0.5, top_k=top_k)
    batch = with_teacher_prompts(samples()) if context else samples()
    served = []
    for s, (chosen, top_ids, top_lp) in zip(batch, reference(other_tiny_model, batch)):
        ids, mask, logprobs = sample_arrays(s)
        teacher_lp = np.zeros(len(ids), dtype=np.float32)
        teacher_lp[np.asarray(mask, bool)] = chosen
        served.append(make_sample(ids, mask, logprobs, advantage=s.advantage, reward=0.0, policy_version=0, example_id=s.example_id,
                                  teacher_logprobs=teacher_lp, teacher_top=(top_ids, top_lp) if top_k else None))
    inside = one_step(tiny_model, batch, distill, teacher_dir=other_tiny_model)
    outside = one_step(tiny_model, served, distill)
    for key in ("loss_sum", "loss_tokens", "distill_kl_sum", "top_k_kl_sum", "grad_norm"):
        assert inside[key] == pytest.approx(outside[key], rel=1e-4, abs=1e-6), key
    assert inside["distill_kl_sum"] != 0 and (inside["top_k_kl_sum"] > 0) == bool(top_k)
    torch.testing.assert_close(inside["weights"], outside["weights"], rtol=0, atol=1e-6)
    assert inside["teacher_s"] > 0 and outside["teacher_s"] == 0
    with pytest.raises(ValueError, match=r"the batch of step 3 carries a served teacher's logprobs and trainer.teacher_model is set"):
        one_step(tiny_model, served, distill, teacher_dir=other_tiny_model)


def test_a_teacher_that_cannot_score_the_students_ids_is_refused_in_one_line(tiny_model, other_tiny_model, tmp_path):
    student_cfg = ModelConfig(name=str(tiny_model))
    student = load_model(student_cfg, CPU)
    # another tokenizer: two byte tokens' ids swapped
    swapped = tmp_path / "swapped"
    shutil.copytree(other_tiny_model, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "a", "e"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TeacherError, match=r"^trainer.teacher_model '.*swapped': its tokenizer differs from the student's") as e:
        load_teacher(str(swapped), student_cfg, CPU, student)
    assert "\n" not in str(e.value)
    # another vocabulary size: one output row more
    from transformers import AutoModelForCausalLM

    wider = tmp_path / "wider"
    model = AutoModelForCausalLM.from_pretrained(other_tiny_model)
    model.resize_token_embeddings(model.get_input_embeddings().num_embeddings + 1)
    model.save_pretrained(wider)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (other_tiny_model / name).exists():
            shutil.copy(other_tiny_model / name, wider / name)
    with pytest.raises(TeacherError, match=r"its vocabulary has \d+ rows, the student's \d+ \(the teacher's top-k ids index"):
        load_teacher(str(wider), student_cfg, CPU, student)
