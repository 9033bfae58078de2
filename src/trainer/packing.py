"""How a micro-batch's samples become model rows: packed back to back, with shared prefixes.

A row of the model holds several sequences one after another, each a *block*: a plain
sample, or a group's shared prompt followed by each rollout's own tokens (a shared-prefix
block). A token attends only to earlier tokens of its own block, and within a shared-prefix
block only to the prefix and its own rollout's tokens; position ids restart at 0 with every
sample, so each token's position is what it would be in a row of its own:

    row:        p0 p1 p2 | a0 a1 | b0 b1 b2 || c0 c1 c2 c3 || pad
    positions:   0  1  2 |  3  4 |  3  4  5 ||  0  1  2  3 ||  0
    block:       0  0  0 |  0  0 |  0  0  0 ||  1  1  1  1 || -1
    segment:     0  0  0 |  1  1 |  2  2  2 ||  1  1  1  1 || -1

(segment 0 is a block's shared prefix, k >= 1 its k-th member's own tokens; -1 padding.) So
every logit equals the one a row of its own would give (to float rounding), and gradients
reaching a shared prefix add up over its rollouts, as they would over separate rows.

Blocks (``plan_blocks``). The rollouts of a group start with the same prompt; a run of
consecutive samples with identical tokens before their first policy token shares them, in
chunks whose attention area (block length squared) is at most that of the separate samples
it replaces: sharing never costs more attention and always saves tokens. The prefix ends
before the first policy token, so nothing a loss is computed on is shared. On the quickstart
(74-token prompts, 6-token completions, groups of 8) that saves 90% of the tokens; long
completions after a short prompt stay separate samples.

Micro-batches (``plan_micro_batches``): a rank's samples are cut into micro-batches of at most
``trainer.micro_batch_tokens`` tokens, counted as the model computes them (a shared prefix
once), by the same first-fit decreasing packing of blocks as rows, so a group that shares its
prompt stays in one micro-batch where it fits.

Rows (``plan_rows``): blocks are packed first-fit decreasing (longest block first, into the
first row with room, each row then listing its blocks in order) up to a token budget
(``row_budget``).

- With a mask (sdpa, eager; on CPU and wherever flash-attention is missing) the budget is
  the micro-batch's longest block, and ``attention_allowed`` builds the dense [R, 1, L, L]
  boolean mask from the block and segment ids, on the device the model runs on. Rows are
  then never wider than the widest row of one block per row, so packing never adds tokens
  or attention area (a dense mask
  computes every masked pair too); it only fills padding with whole samples. A budget of
  ``seq_len`` removes little more padding at up to twice the attention area:
  ``benchmarks/packing.py`` measured it no faster than the longest block in any regime.
  Where no two samples fit in the longest (generation-heavy: samples of 130-200 tokens)
  the rows are those of the unpacked layout.
- With flash-attention's variable-length kernel (any flash-attention ``trainer.model.
  attn_implementation``; the default on CUDA where `flash-attn` is installed, README
  "Installing") there is no mask and no padding: every block of a micro-batch goes into one
  row, and the kernel attends within the boundaries ``varlen_boundaries`` gives it (``cu_seqlens``, passed to
  transformers as ``cu_seq_lens_q/k``). That layout takes no shared prefix: the kernel's
  sequences are contiguous, a rollout's attention to its prompt is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Block:
    """One sequence of a row: ``prefix`` tokens shared by ``members`` (sample indices), each
    of whose own tokens follow in order. ``prefix == 0`` with one member is a plain sample."""

    prefix: int
    members: tuple[int, ...]

    def length(self, lengths: list[int]) -> int:
        return self.prefix + sum(lengths[m] - self.prefix for m in self.members)


@dataclass(frozen=True)
class Layout:
    """Model inputs for a micro-batch and where each sample's tokens landed."""

    ids: np.ndarray
    """int64 [R, L] token ids, ``pad_id`` after each row's end."""

    positions: np.ndarray
    """int64 [R, L] position ids (each token's index within its own sample; 0 on padding)."""

    blocks: np.ndarray
    """int64 [R, L]: index of the token's block within its row, -1 for padding."""

    segments: np.ndarray
    """int64 [R, L]: 0 for a block's shared prefix, k >= 1 for its k-th member's own tokens, -1 for padding."""

    source: np.ndarray
    """int64 [B, T]: flat index into the R * L positions of the one holding token t of
    sample b (0 past a sample's end). The logits there score token t + 1."""

    @property
    def shared(self) -> bool:
        """Some block holds a shared prefix."""
        return bool((self.segments > 1).any())

    @property
    def packed(self) -> bool:
        """Some row holds more than one block."""
        return bool((self.blocks > 0).any())


def policy_start(mask: np.ndarray) -> int:
    """Index of a sample's first policy (loss) token; its length when it has none."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else len(mask)


def plan_blocks(ids: list[np.ndarray], masks: list[np.ndarray], share: bool) -> list[Block]:
    """Blocks for samples in order: runs of consecutive samples whose tokens before their
    first policy token are identical share them (with ``share``), in chunks whose attention
    area (block length squared) is at most that of their separate samples."""
    if not share:
        return [Block(0, (i,)) for i in range(len(ids))]
    blocks: list[Block] = []
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
        blocks.append(Block(p if len(members) > 1 else 0, tuple(members)))
        i = j
    return blocks


def plan_rows(sizes: list[int], budget: int | None) -> list[tuple[int, ...]]:
    """Block indices of each row. ``budget`` None: one block per row, in order. Otherwise
    first-fit decreasing: blocks from the longest (ties in order) each go into the first
    row whose total stays within ``budget``, else open a new row (a block longer than the
    budget gets a row of its own); each row lists its blocks in order."""
    if budget is None:
        return [(i,) for i in range(len(sizes))]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = next((r for r in range(len(rows)) if sizes[i] <= room[r]), None)
        if r is None:
            rows.append([i])
            room.append(budget - sizes[i])
        else:
            rows[r].append(i)
            room[r] -= sizes[i]
    return [tuple(sorted(row)) for row in rows]


def plan_micro_batches(ids: list[np.ndarray], masks: list[np.ndarray], budget: int, share: bool) -> list[list[int]]:
    """Sample indices of each micro-batch: blocks (``plan_blocks``) packed first-fit decreasing
    into micro-batches of at most ``budget`` tokens (a block above it alone), each micro-batch
    listing its samples in order."""
    if not ids:
        return []
    blocks = plan_blocks(ids, masks, share)
    lengths = [len(x) for x in ids]
    bins = plan_rows([b.length(lengths) for b in blocks], budget)
    return [[m for b in group for m in blocks[b].members] for group in bins]


def row_budget(sizes: list[int], pack: bool, varlen: bool) -> int | None:
    """The token budget of a row (see the module docstring): None (no packing), the longest
    block (a mask's attention area never grows), or every token (the varlen kernel)."""
    if not pack:
        return None
    return sum(sizes) if varlen else max(sizes)


def lay_out(ids: list[np.ndarray], blocks: list[Block], rows: list[tuple[int, ...]], pad_id: int) -> Layout:
    """Fill rows with the blocks' tokens, position ids, block and segment ids and source indices."""
    lengths = [len(x) for x in ids]
    L = max(sum(blocks[b].length(lengths) for b in row) for row in rows)
    out_ids = np.full((len(rows), L), pad_id, dtype=np.int64)
    positions = np.zeros((len(rows), L), dtype=np.int64)
    block_ids = np.full((len(rows), L), -1, dtype=np.int64)
    segments = np.full((len(rows), L), -1, dtype=np.int64)
    source = np.zeros((len(ids), max(lengths)), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for j, b in enumerate(row):
            block = blocks[b]
            block_ids[r, at : at + block.length(lengths)] = j
            at = fill_block(ids, block, r, at, L, out_ids, positions, segments, source)
    return Layout(out_ids, positions, block_ids, segments, source)


def fill_block(ids, block: Block, r: int, at: int, L: int, out_ids, positions, segments, source) -> int:
    """Write ``block`` into row ``r`` from column ``at``; returns the column after it."""
    p = block.prefix
    first = ids[block.members[0]]
    span = slice(at, at + p)
    out_ids[r, span], positions[r, span], segments[r, span] = first[:p], np.arange(p), 0
    prefix_at, at = at, at + p
    for k, m in enumerate(block.members, start=1):
        own = ids[m][p:]
        span = slice(at, at + len(own))
        out_ids[r, span], positions[r, span], segments[r, span] = own, np.arange(p, p + len(own)), k
        source[m, :p] = r * L + prefix_at + np.arange(p)
        source[m, p : len(ids[m])] = r * L + np.arange(at, at + len(own))
        at += len(own)
    return at


def attention_allowed(blocks: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """bool [R, 1, L, L] from the int64 [R, L] block and segment ids, built where they lie (on the
    GPU in a GPU run: only [R, L] ids cross from the host, never an [L, L] mask): query q may
    attend to key k causally, within the query's own block, and there within its own segment or
    the block's shared prefix; a padding query attends only to itself (its output is never
    used, and a row of its own keeps the softmax finite)."""
    L = segments.shape[1]
    q_seg, k_seg = segments[:, :, None], segments[:, None, :]
    same_block = blocks[:, :, None] == blocks[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()[None]
    allowed = causal & same_block & (q_seg >= 0) & (k_seg >= 0) & ((k_seg == 0) | (k_seg == q_seg))
    allowed |= (q_seg < 0) & torch.eye(L, dtype=torch.bool, device=segments.device)[None]
    return allowed[:, None]


def varlen_boundaries(layout: Layout) -> np.ndarray:
    """int32 [S + 1]: where each of the S blocks of a one-row, unpadded, unshared layout
    starts, then its length: the ``cu_seqlens`` of flash-attention's variable-length kernel."""
    if layout.ids.shape[0] != 1 or (layout.blocks < 0).any() or layout.shared:
        raise ValueError("the varlen kernel takes one row of whole samples: no padding, no shared prefix")
    row = layout.blocks[0]
    starts = np.flatnonzero(np.diff(row, prepend=-1))
    return np.append(starts, len(row)).astype(np.int32)
