"""Packing rollouts into per-rank TrainBatch messages: tokens, masks, truncation, splits."""

import numpy as np
import pytest
from prime_rl.wire import SCHEMA_VERSION, decode_batch, encode_batch, sample_arrays

from orchestrator.batch import ScoredRollout, pack_batches, to_sample
from prime_rl.envs import Rollout, Turn


def single(example_id=0, reward=1.0):
    return Rollout(example_id, [Turn([1, 2, 3], [4, 5], [-0.5, -1.0])], reward)


def two_turns():
    return Rollout(7, [Turn([1, 2], [3], [-0.1]), Turn([4], [5, 6], [-0.2, -0.3])], 0.5)


def test_single_turn_sample():
    ids, mask, logprobs = sample_arrays(to_sample(ScoredRollout(single(), 0.25, 3), seq_len=16))
    assert ids.tolist() == [1, 2, 3, 4, 5]
    assert mask.tolist() == [False, False, False, True, True]
    np.testing.assert_array_equal(logprobs, np.float32([0, 0, 0, -0.5, -1.0]))


def test_turns_concatenate_in_order():
    sample = to_sample(ScoredRollout(two_turns(), -0.5, 2), seq_len=16)
    ids, mask, logprobs = sample_arrays(sample)
    assert ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert mask.tolist() == [False, False, True, False, True, True]
    np.testing.assert_array_equal(logprobs, np.float32([0, 0, -0.1, 0, -0.2, -0.3]))
    assert (sample.advantage, sample.reward, sample.policy_version, sample.example_id) == (-0.5, 0.5, 2, 7)


def test_a_restarted_turn_starts_a_sample_of_its_own():
    """A v1 client that re-rendered the conversation: turn 2 carries its whole prompt
    (restart), so the rollout trains as [turn 0, turn 1] and [turn 2, turn 3], each exact."""
    from orchestrator.batch import to_samples

    turns = [Turn([1, 2], [3], [-0.1]), Turn([4], [5], [-0.2]), Turn([1, 2, 9, 4, 5, 6], [7], [-0.3], restart=True),
             Turn([8], [10], [-0.4])]
    first, second = to_samples(ScoredRollout(Rollout(3, turns, 1.0), 0.5, 1), seq_len=32)
    ids, mask, logprobs = sample_arrays(first)
    assert ids.tolist() == [1, 2, 3, 4, 5] and mask.tolist() == [False, False, True, False, True]
    ids, mask, logprobs = sample_arrays(second)
    assert ids.tolist() == [1, 2, 9, 4, 5, 6, 7, 8, 10]
    assert mask.tolist() == [False] * 6 + [True, False, True]
    np.testing.assert_array_equal(logprobs, np.float32([0] * 6 + [-0.3, 0, -0.4]))
    assert first.advantage == second.advantage == 0.5
    assert len(to_samples(ScoredRollout(two_turns(), 0.0, 0), seq_len=32)) == 1  # no restart: one sample


def test_truncation_cuts_all_buffers_alike():
    ids, mask, logprobs = sample_arrays(to_sample(ScoredRollout(two_turns(), 0.0, 0), seq_len=4))
    assert ids.tolist() == [1, 2, 3, 4]
    assert mask.tolist() == [False, False, True, False]
    np.testing.assert_array_equal(logprobs, np.float32([0, 0, -0.1, 0]))


def test_mismatched_logprobs_fail():
    bad = Rollout(3, [Turn([1, 2], [3, 4], [-0.1])], 0.0)
    with pytest.raises(ValueError, match="example 3.*2 completion ids but 1 logprobs"):
        to_sample(ScoredRollout(bad, 0.0, 0), seq_len=16)


def sized(example_id: int, tokens: int) -> Rollout:
    """A one-turn rollout of ``tokens`` tokens (the last one sampled)."""
    return Rollout(example_id, [Turn(list(range(1, tokens)), [9], [-0.1])], 1.0)


def rank_samples(batch) -> list:
    return [s for m in batch.micro_batches for s in m.samples]


def test_rank_split_and_micro_batches():
    items = [ScoredRollout(single(example_id=i // 2), advantage=float(i), policy_version=1) for i in range(8)]
    batches = pack_batches(items, step=5, num_ranks=2, micro_batch_size=3, temperature=0.7, seq_len=16)
    assert [b.rank for b in batches] == [0, 1]
    for rank, batch in enumerate(batches):
        assert (batch.schema_version, batch.step, batch.temperature) == (SCHEMA_VERSION, 5, 0.7)
        assert [len(m.samples) for m in batch.micro_batches] == [3, 1]  # 4 per rank; the last micro-batch is short
        decoded = decode_batch(encode_batch(batch), expected_step=5, expected_rank=rank)
        assert decoded == batch
    # 4 groups of 2 equal samples: LPT deals them out in turn; each rank keeps the original order
    assert [[s.advantage for s in rank_samples(b)] for b in batches] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_ranks_get_whole_groups_balanced_by_tokens():
    # Groups of 2 (tokens): ex0 10, ex1 16, ex2 6, ex3 8. Largest first, to the lighter rank:
    # ex1 -> r0 (16), ex0 -> r1 (10), ex3 -> r1 (18), ex2 -> r0 (22). Contiguous halves
    # would have been 26 vs 14.
    lengths = {0: 5, 1: 8, 2: 3, 3: 4}
    items = [ScoredRollout(sized(ex, lengths[ex]), 0.0, 0) for ex in range(4) for _ in range(2)]
    batches = pack_batches(items, step=0, num_ranks=2, micro_batch_size=3, temperature=1.0, seq_len=16)
    assert [[s.example_id for s in rank_samples(b)] for b in batches] == [[1, 1, 2, 2], [0, 0, 3, 3]]
    assert [[len(m.samples) for m in b.micro_batches] for b in batches] == [[3, 1], [3, 1]]


def test_tokens_are_counted_after_truncation():
    # Lengths 20, 5, 4, 3 cut at seq_len 6 weigh 6, 5, 4, 3: 6 -> r0, 5 -> r1, 4 -> r1 (9),
    # 3 -> r0 (9). Untruncated, 20 would outweigh the rest and r1 would get 5, 4 and 3.
    items = [ScoredRollout(sized(ex, n), 0.0, 0) for ex, n in enumerate([20, 5, 4, 3])]
    batches = pack_batches(items, step=0, num_ranks=2, micro_batch_size=4, temperature=1.0, seq_len=6)
    assert [[s.example_id for s in rank_samples(b)] for b in batches] == [[0, 3], [1, 2]]


def test_fewer_groups_than_ranks_split_groups_into_samples():
    # 2 groups on 3 ranks; single samples of 6, 3, 4, 4 tokens: 6 -> r0, 4 (ex1) -> r1,
    # 4 (ex1) -> r2, 3 (ex0) -> r1 (the lower of the two ranks at 4), kept in original order.
    items = [ScoredRollout(sized(ex, n), 0.0, 0) for ex, n in [(0, 6), (0, 3), (1, 4), (1, 4)]]
    batches = pack_batches(items, step=0, num_ranks=3, micro_batch_size=4, temperature=1.0, seq_len=16)
    per_rank = [[(s.example_id, len(sample_arrays(s)[0])) for s in rank_samples(b)] for b in batches]
    assert per_rank == [[(0, 6)], [(0, 3), (1, 4)], [(1, 4)]]


def test_every_rank_gets_work_or_packing_fails():
    items = [ScoredRollout(single(example_id=i), 0.0, 0) for i in range(6)]
    batches = pack_batches(items, step=1, num_ranks=4, micro_batch_size=2, temperature=1.0, seq_len=16)
    ids = [[s.example_id for s in rank_samples(b)] for b in batches]
    assert ids == [[0, 4], [1, 5], [2], [3]]  # unequal counts: the trainer keeps ranks in lockstep
    with pytest.raises(ValueError, match="1 samples cannot feed 2 trainer ranks"):
        pack_batches(items[:1], step=1, num_ranks=2, micro_batch_size=2, temperature=1.0, seq_len=16)


def test_per_turn_samples_carry_the_rollout_advantage():
    """Chat templates that rewrite earlier turns: each turn's prompt is the whole rendered
    conversation, and each turn is a sample of its own."""
    rollout = Rollout(4, [Turn([1, 2], [3], [-0.1]), Turn([1, 2, 3, 9], [5, 6], [-0.2, -0.3])], 0.5)
    (batch,) = pack_batches([ScoredRollout(rollout, 0.25, 1)], step=0, num_ranks=1, micro_batch_size=8,
                            temperature=1.0, seq_len=16, per_turn=True)
    first, second = batch.micro_batches[0].samples
    assert sample_arrays(first)[0].tolist() == [1, 2, 3] and sample_arrays(first)[1].tolist() == [False, False, True]
    ids, mask, logprobs = sample_arrays(second)
    assert ids.tolist() == [1, 2, 3, 9, 5, 6] and mask.tolist() == [False] * 4 + [True] * 2
    np.testing.assert_array_equal(logprobs, np.float32([0, 0, 0, 0, -0.2, -0.3]))
    assert first.advantage == second.advantage == 0.25


def test_a_rollout_without_tokens_is_left_out_of_the_batch_and_alone_cannot_feed_a_rank():
    """An episode that failed before the model replied (a v1 harness under load) has a reward
    but nothing to train: its group's other rollouts are trained, it is not."""
    kept = Rollout(3, [Turn([1, 2], [3], [-0.1])], 0.5)
    (batch,) = pack_batches([ScoredRollout(Rollout(2, [], 0.0), -0.25, 0), ScoredRollout(kept, 0.25, 0)], step=0,
                            num_ranks=1, micro_batch_size=4, temperature=1.0, seq_len=16)
    assert [s.example_id for m in batch.micro_batches for s in m.samples] == [3]
    with pytest.raises(ValueError, match="0 samples cannot feed 1 trainer ranks"):
        pack_batches([ScoredRollout(Rollout(2, [], 1.0), 0.0, 0)], step=0, num_ranks=1, micro_batch_size=1,
                     temperature=1.0, seq_len=16)
