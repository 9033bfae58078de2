"""The trainer's side of the rollout traces (`prime_rl.traces` has the format): for every
sample the orchestrator traced (``Sample.trace_id``), what the trainer saw at each token it
trained on: its own logprob, the entropy of its distribution, whether the importance
band dropped the token and, when distilling, the teacher's logprob. Each rank writes the rows of its own samples, a step's in one write."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prime_rl.config import LossConfig
from prime_rl.rundir import append_lines
from prime_rl.traces import trainer_traces_path
from trainer.loss import importance_weights


@torch.no_grad()
def sample_traces(traces: list[tuple[str, int] | None], trainer_lp: torch.Tensor, inference_lp: torch.Tensor,
                  loss_mask: torch.Tensor, entropy: torch.Tensor, loss_cfg: LossConfig,
                  teacher_lp: torch.Tensor | None = None) -> list[dict]:
    """Rows of the traced samples of one micro-batch. ``trainer_lp``, ``inference_lp``,
    ``loss_mask`` and ``teacher_lp`` (distilling; None otherwise) are [B, T-1] (position t
    scores token t+1), ``entropy`` [N] at the N loss tokens in row-major order; ``traces``
    holds each sample's (id, part) or None."""
    if not any(traces):
        return []
    mask = loss_mask.bool()
    log_ratio = (trainer_lp.detach().float() - inference_lp).clamp(-loss_cfg.log_ratio_clamp, loss_cfg.log_ratio_clamp)
    _, in_band = importance_weights(log_ratio, mask, loss_cfg)
    per_token = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, entropy.float())
    rows = []
    for b, trace in enumerate(traces):
        if trace is None:
            continue
        m = mask[b]
        rows.append({
            "id": trace[0], "part": trace[1],
            "logprobs": [round(v, 5) for v in trainer_lp[b][m].float().tolist()],
            "entropy": [round(v, 4) for v in per_token[b][m].tolist()],
            "masked": (~in_band[b][m]).int().tolist(),
            **({} if teacher_lp is None else {"teacher_logprobs": [round(v, 5) for v in teacher_lp[b][m].float().tolist()]}),
        })
    return rows


def write_traces(run_dir: Path, step: int, rank: int, rows: list[dict]) -> None:
    """Append a step's rows of this rank to `RUN/traces/trainer.jsonl`."""
    if not rows:
        return
    path = trainer_traces_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    append_lines(path, [json.dumps({**row, "step": step, "rank": rank}, separators=(",", ":")) for row in rows])
