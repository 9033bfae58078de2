"""The distillation teacher in the trainer's own process (`[teacher] placement = "trainer"`,
``trainer.teacher_model``).

A served teacher scores the student's tokens in a vLLM server of its own: every sample goes
over HTTP as a prompt, is prefilled there, and its logprobs (and top-k) come back through
the orchestrator and the wire. Here the teacher's weights sit beside the student's, frozen,
in the compute dtype (one copy a rank, not sharded), and each micro-batch is scored by one
forward of the teacher over the very rows the student trains on (packed, shared prefixes,
the same attention), before the student's own forward. What it fills is what a served
teacher's scores fill (``MicroTensors.teacher_logprobs`` and, with ``top_k``, its top-k at
every loss token), with the same numerics: raw logits (temperature 1), normalised in
float32. From there the loss and the metrics are the same code for both placements.

Context distillation: samples that carry the teacher's own first prompt
(``Sample.teacher_prompt_ids``) are scored as the teacher sees them, that prompt in place of
the student's, on rows of their own laid out as the student's are; each sampled token's
scores are then read at its position shifted by the prompts' difference in length.

``load_teacher`` refuses in one line a teacher whose tokenizer encodes a probe text other
than the student's, or whose vocabulary differs in size (its ids index the student's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from prime_rl.chat import probe_text
from prime_rl.config import ModelConfig
from prime_rl.wire import MicroBatch, make_sample, sample_arrays, teacher_view
from trainer.data import MicroTensors
from trainer.head import install_token_head
from trainer.model import DTYPES, World, attention_implementation, forward_logits


class TeacherError(ValueError):
    """The teacher cannot score this run's samples (one line saying why)."""


def load_teacher(path: str, cfg: ModelConfig, world: World, student: nn.Module) -> nn.Module:
    """``path``'s causal LM, frozen in the compute dtype on the rank's device, with the
    trainer's scoring head; checked against the student (``cfg.name``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    what = f"trainer.teacher_model {path!r}"
    try:
        ours, theirs = AutoTokenizer.from_pretrained(cfg.name), AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TeacherError(f"{what}: cannot load its tokenizer or the student's ({str(e).splitlines()[0]})") from None
    text = probe_text(ours)
    if ours.encode(text, add_special_tokens=False) != theirs.encode(text, add_special_tokens=False):
        raise TeacherError(f"{what}: its tokenizer differs from the student's (a probe text encodes differently): "
                           "the teacher scores the student's exact token ids, so it needs the same tokenizer")
    attn = attention_implementation(cfg, world.device)  # the student's: the same rows, masks and kernels
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype], attn_implementation=attn)
    rows, student_rows = teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0]
    if rows != student_rows:
        raise TeacherError(f"{what}: its vocabulary has {rows} rows, the student's {student_rows} "
                           "(the teacher's top-k ids index the student's logits)")
    teacher.config.use_cache = False
    install_token_head(teacher)
    return teacher.requires_grad_(False).eval().to(world.device)


@torch.no_grad()
def score(teacher: nn.Module, mt: MicroTensors, top_k: int, micro: MicroBatch | None = None,
          lay_out: Callable[[MicroBatch, int], MicroTensors] | None = None) -> MicroTensors:
    """``mt`` with the teacher's logprob of every loss token ([B, T], 0 elsewhere) and, with
    ``top_k``, its K most likely tokens at each ([N, K], in ``head_query``'s order). ``micro``
    is ``mt``'s samples; when some carry a teacher prompt, their teacher's view is laid out by
    ``lay_out(micro, seq_len)`` (``collate`` as the student's rows are) and scored there."""
    if micro is None or all(s.teacher_prompt_ids is None for s in micro.samples):
        return dataclasses.replace(mt, **teacher_scores(teacher, mt, top_k))
    views, moved = [], []  # each sample's view, and its sampled tokens' positions in mt and in the view
    for sample in micro.samples:
        ids, offset = teacher_view(sample, mt.input_ids.shape[1])
        where = np.flatnonzero(sample_arrays(sample)[1][: mt.input_ids.shape[1]])
        shifted = np.zeros(len(ids), dtype=np.uint8)
        shifted[where + offset] = 1
        views.append(make_sample(ids, shifted, np.zeros(len(ids), dtype=np.float32), advantage=0.0, reward=0.0,
                                 policy_version=0, example_id=sample.example_id))
        moved.append((torch.from_numpy(where), torch.from_numpy(where + offset)))
    seen = lay_out(MicroBatch(views), max(len(v.input_ids) // 4 for v in views))  # int32 ids
    scores = teacher_scores(teacher, seen, top_k)
    logprobs = torch.zeros_like(mt.inference_logprobs)
    for b, (here, there) in enumerate(moved):  # the same tokens, in the same order, moved
        logprobs[b, here.to(logprobs.device)] = scores["teacher_logprobs"][b, there.to(logprobs.device)]
    return dataclasses.replace(mt, **{**scores, "teacher_logprobs": logprobs})


def teacher_scores(teacher: nn.Module, mt: MicroTensors, top_k: int) -> dict[str, torch.Tensor | None]:
    """The teacher's scores of ``mt``'s loss tokens on ``mt``'s own rows, as ``MicroTensors`` fields."""
    query = dataclasses.replace(mt.head_query(1.0), top_ids=None, top_logprobs=None, top_k=top_k, entropy=False)
    scores = forward_logits(teacher, mt.model_ids, mt.model_mask, mt.model_positions, mt.cu_seqlens, mt.max_seqlen,
                            query=query)
    logprobs = torch.zeros_like(mt.inference_logprobs)
    logprobs[:, 1:][mt.loss_mask[:, 1:]] = scores["logprobs"]
    return {"teacher_logprobs": logprobs, "teacher_top_ids": scores["top_ids"] if top_k else None,
            "teacher_top_logprobs": scores["top_logprobs"] if top_k else None}
