"""The trainer's output layer: scores of chosen tokens at chosen positions, never [R, L, V] logits.

A causal LM ends in a linear layer to the vocabulary. Run over every position of a packed
micro-batch, its logits are [R, L, V]: at 8192 tokens and Qwen3's 151,936 ids that is 2.5 GB
in bf16, kept through backward, plus the float32 copies the loss makes. The trainer needs
far less: at each of the N loss positions, the logprob of the token that was sampled there
(with its gradient), the entropy (a metric, no gradient) and, for top-k distillation, the
reverse KL to the teacher (with its gradient).

``install_token_head`` replaces the model's output layer by a ``TokenHead`` holding the same
weight (tied embeddings stay tied, state-dict names stay ``lm_head.weight``) and gives the
model a forward that takes a ``HeadQuery``: the hidden states at the query's positions go
through the head in chunks of ``HEAD_CHUNK_ELEMENTS // V`` tokens, each chunk under
activation checkpointing, so the largest tensor alive is one chunk's [C, V] logits in
float32 (256 MB), in the forward and again when backward recomputes it. The head runs inside
the model's own forward, so FSDP2 gathers and reduces its weight as it does any other.

Numerics follow vLLM's sampler: the matrix product runs in the compute dtype (bf16 under
mixed precision), the logits are cast to float32, divided by the sampling temperature and
normalised in float32. Without a query the model returns full logits, as the layer it
replaced did (reference paths in tests, the lock-step pass of an idle rank).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from prime_rl.config.trainer import HEAD_CHUNK_ELEMENTS  # the estimate counts the head's chunks of this many logits
from trainer.loss import entropy_from_logits, selective_log_softmax, top_k_reverse_kl


@dataclass(frozen=True)
class HeadQuery:
    """What to score: not a pytree, so FSDP2 does not cast its tensors to the compute dtype."""

    positions: torch.Tensor
    """[N] int64: flat index into the R * L positions of the model rows."""

    targets: torch.Tensor
    """[N] int64: the token whose logprob each position gives (the next token of its sample)."""

    temperature: float
    """The sampling temperature: logits are divided by it, as vLLM's were."""

    top_ids: torch.Tensor | None = None
    """[N, K] int64: the teacher's K most likely tokens at each position (top-k distillation)."""

    top_logprobs: torch.Tensor | None = None
    """[N, K] float32: the teacher's logprobs of ``top_ids``."""

    top_k: int = 0
    """Also return this model's own K most likely tokens at each position (the in-trainer
    teacher's top-k, ``trainer.teacher``; no gradient)."""

    entropy: bool = True
    """Return each position's entropy (a metric of the policy; a teacher's is not needed)."""

    mean_logprob: bool = False
    """Also return each position's mean logprob over the whole vocabulary, with its gradient
    (the uniform part of a label-smoothed cross-entropy, SFT's ``label_smoothing``)."""


class TokenHead(nn.Module):
    """The output layer with the weight of the linear layer it replaces ([V, H], no bias)."""

    def __init__(self, weight: nn.Parameter, softcap: float | None = None):
        super().__init__()
        self.weight = weight
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor, query: HeadQuery | None = None):
        """hidden [R, L, H] -> logits [R, L, V] without a query, else the query's scores:
        ``{"logprobs": [N] float32 (with gradient), "entropy": [N] float32 (none),
        "top_k_kl": [N] float32 (with gradient; only with ``query.top_ids``),
        "mean_logprobs": [N] float32 (with gradient; only with ``query.mean_logprob``),
        "top_ids": [N, K] int64 and "top_logprobs": [N, K] float32 (only with ``query.top_k``)}``."""
        if query is None:
            return self.capped(F.linear(hidden, self.weight))
        return score_tokens(hidden.flatten(0, -2)[query.positions], self.weight, query, self.capped)

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma-style final soft-capping (``final_logit_softcapping``), as the model applies it."""
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


def score_tokens(hidden: torch.Tensor, weight: torch.Tensor, query: HeadQuery, cap=lambda x: x) -> dict[str, torch.Tensor]:
    """hidden [N, H] at the query's positions -> its scores (``TokenHead.forward``), chunk by chunk."""
    n, vocab = hidden.shape[0], weight.shape[0]
    chunk = max(1, HEAD_CHUNK_ELEMENTS // vocab)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for start in range(0, max(n, 1), chunk):  # one (empty) chunk when N = 0: outputs keep their shapes
        rows = slice(start, start + chunk)
        top = (query.top_ids[rows], query.top_logprobs[rows]) if query.top_ids is not None else (None, None)
        args = (hidden[rows], weight, query.targets[rows], query.temperature, cap, *top, query.top_k, query.entropy,
                query.mean_logprob)
        parts.append(checkpoint(score_chunk, *args, use_reentrant=False) if recompute else score_chunk(*args))
    out = {"logprobs": torch.cat([p[0] for p in parts]), "entropy": torch.cat([p[1] for p in parts])}
    if query.top_ids is not None:
        out["top_k_kl"] = torch.cat([p[2] for p in parts])
    if query.top_k:
        out["top_ids"], out["top_logprobs"] = torch.cat([p[3] for p in parts]), torch.cat([p[4] for p in parts])
    if query.mean_logprob:
        out["mean_logprobs"] = torch.cat([p[5] for p in parts])
    return out


def score_chunk(hidden, weight, targets, temperature, cap, top_ids=None, top_logprobs=None, own_k: int = 0,
                with_entropy: bool = True, with_mean: bool = False):
    """(logprobs [C], entropy [C], top-k KL [C], own top-k ids [C, K] and logprobs [C, K],
    mean logprob over the vocabulary [C]) of one chunk of positions; what was not asked for
    is an empty tensor. The own top-k is the
    K most likely tokens, most likely first, as vLLM returns a prompt's top logprobs."""
    logits = cap(hidden @ weight.t()).float() / temperature  # [C, V]
    empty = logits.new_zeros(0)
    if own_k:  # a teacher's scores, without gradient: one normalisation serves both
        with torch.no_grad():
            logprobs = torch.log_softmax(logits, dim=-1)
            top = logprobs.topk(min(own_k, logits.shape[-1]), dim=-1)
            chosen = logprobs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
        return chosen, entropy_from_logits(logits) if with_entropy else empty, empty, top.indices, top.values, empty
    logprobs = selective_log_softmax(logits, targets)
    entropy = entropy_from_logits(logits) if with_entropy else empty  # no gradient
    kl = top_k_reverse_kl(logits, top_ids, top_logprobs) if top_ids is not None else empty
    # log-normaliser = chosen logit - its logprob: no second logsumexp over the vocabulary
    mean = logits.mean(-1) - logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) + logprobs if with_mean else empty
    return logprobs, entropy, kl, empty.long(), empty, mean


def install_token_head(model: nn.Module) -> None:
    """Replace a causal LM's output layer by a ``TokenHead`` (same weight object) and give the
    model a forward that takes ``query=`` (``scored_forward``). Refuses output layers whose
    logits the head would not reproduce."""
    old = model.get_output_embeddings()
    if not isinstance(old, nn.Linear) or old.bias is not None:
        raise ValueError(f"{type(model).__name__}: expected a linear output layer without bias, got {type(old).__name__}")
    config = model.config
    scale = getattr(config, "logit_scale", None)
    if scale not in (None, 1, 1.0):
        raise ValueError(f"{type(model).__name__} scales its logits (logit_scale = {scale}); the trainer's head does not")
    softcap = getattr(config, "final_logit_softcapping", None) or None  # Gemma's; 0 and None mean none
    model.set_output_embeddings(TokenHead(old.weight, softcap))
    model.forward = types.MethodType(scored_forward, model)


def scored_forward(self, input_ids=None, attention_mask=None, position_ids=None, query: HeadQuery | None = None, **kwargs):
    """The causal LM's forward with ``TokenHead``: the backbone, then the head (logits without
    a query). Arguments a wrapper passes as None (peft: labels, return_dict, ...) are dropped."""
    kwargs.pop("use_cache", None)  # never: training decodes nothing
    for unused in ("labels", "return_dict", "output_attentions", "output_hidden_states", "inputs_embeds"):
        if kwargs.pop(unused, None) is not None:
            raise ValueError(f"the trainer's forward takes no {unused}")
    backbone = getattr(self, self.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                      **kwargs).last_hidden_state
    return self.get_output_embeddings()(hidden, query)
