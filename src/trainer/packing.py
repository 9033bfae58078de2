"""How a micro-batch's samples become model rows: right-padded, or with shared prefixes.

The rollouts of a group start with the same prompt and differ only after it. Laid out
one per row, the trainer runs that prompt through the model once per rollout; on the
quickstart (74-token prompts, 6-token completions, groups of 8) that is 90% of the
tokens it computes. A shared-prefix row holds the prompt once and then each rollout's
own tokens one after another:

    row:       p0 p1 p2 | a0 a1 | b0 b1 b2
    positions:  0  1  2 |  3  4 |  3  4  5
    segment:    0  0  0 |  1  1 |  2  2  2

A token attends to earlier tokens of its own segment and to the shared prefix (segment
0), never to another rollout's tokens, and its position id is what it would be in its own
sequence. So every logit equals the one a row of its own would give (to float rounding),
and gradients reaching the prefix add up over the rollouts, as they would over separate
rows. The prefix is the tokens before the first policy token, so nothing a loss is
computed on is shared.

A shared row's attention is dense over its whole length: sharing is chosen only where the
row's attention area (length squared) is at most that of the separate rows it replaces,
so it never costs more attention and always saves tokens. Long completions after a short
prompt therefore stay in separate rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Row:
    """One model row: ``prefix`` tokens shared by ``members`` (sample indices), each of
    whose own tokens follow in order. ``prefix == 0`` with one member is a plain row."""

    prefix: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Model inputs for a micro-batch and where each sample's tokens landed."""

    ids: np.ndarray
    """int64 [R, L] token ids, ``pad_id`` after each row's end."""

    positions: np.ndarray
    """int64 [R, L] position ids (each token's index within its own sample; 0 on padding)."""

    segments: np.ndarray
    """int64 [R, L]: 0 for the shared prefix, k >= 1 for the k-th member's own tokens, -1 for padding."""

    source: np.ndarray
    """int64 [B, T]: flat index into the R * L positions of the one holding token t of
    sample b (0 past a sample's end). The logits there score token t + 1."""

    @property
    def shared(self) -> bool:
        return bool((self.segments > 1).any())


def policy_start(mask: np.ndarray) -> int:
    """Index of a sample's first policy (loss) token; its length when it has none."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else len(mask)


def plan_rows(ids: list[np.ndarray], masks: list[np.ndarray], share: bool) -> list[Row]:
    """Rows for samples in order: runs of consecutive samples whose tokens before their
    first policy token are identical share them, in chunks whose attention area
    (row length squared) is at most that of their separate rows."""
    if not share:
        return [Row(0, (i,)) for i in range(len(ids))]
    rows: list[Row] = []
    i = 0
    while i < len(ids):
        p = policy_start(masks[i])
        members = [i]
        shared_len, separate_area = len(ids[i]), len(ids[i]) ** 2
        j = i + 1
        while 0 < p < len(ids[i]) and j < len(ids) and policy_start(masks[j]) == p and np.array_equal(ids[j][:p], ids[i][:p]):
            grown = shared_len + len(ids[j]) - p
            if grown**2 > separate_area + len(ids[j]) ** 2:
                break
            members.append(j)
            shared_len, separate_area = grown, separate_area + len(ids[j]) ** 2
            j += 1
        rows.append(Row(p if len(members) > 1 else 0, tuple(members)))
        i = j
    return rows


def lay_out(ids: list[np.ndarray], rows: list[Row], pad_id: int) -> Layout:
    """Fill rows with the samples' tokens, position ids, segment ids and source indices."""
    lengths = [r.prefix + sum(len(ids[m]) - r.prefix for m in r.members) for r in rows]
    L, T = max(lengths), max(len(x) for x in ids)
    out_ids = np.full((len(rows), L), pad_id, dtype=np.int64)
    positions = np.zeros((len(rows), L), dtype=np.int64)
    segments = np.full((len(rows), L), -1, dtype=np.int64)
    source = np.zeros((len(ids), T), dtype=np.int64)
    for r, row in enumerate(rows):
        p = row.prefix
        first = ids[row.members[0]]
        out_ids[r, :p], positions[r, :p], segments[r, :p] = first[:p], np.arange(p), 0
        at = p
        for k, m in enumerate(row.members, start=1):
            own = ids[m][p:]
            span = slice(at, at + len(own))
            out_ids[r, span], positions[r, span], segments[r, span] = own, np.arange(p, p + len(own)), k
            source[m, :p] = r * L + np.arange(p)
            source[m, p : len(ids[m])] = r * L + np.arange(at, at + len(own))
            at += len(own)
    return Layout(out_ids, positions, segments, source)


def attention_allowed(segments: np.ndarray) -> np.ndarray:
    """bool [R, 1, L, L]: query q may attend to key k. Causal, within the query's own
    segment or the shared prefix; a padding query attends only to itself (its output is
    never used, and a row of its own keeps the softmax finite)."""
    L = segments.shape[1]
    q_seg, k_seg = segments[:, :, None], segments[:, None, :]
    causal = np.tril(np.ones((L, L), dtype=bool))[None]
    allowed = causal & (q_seg >= 0) & (k_seg >= 0) & ((k_seg == 0) | (k_seg == q_seg))
    allowed |= (q_seg < 0) & np.eye(L, dtype=bool)[None]
    return allowed[:, None]
