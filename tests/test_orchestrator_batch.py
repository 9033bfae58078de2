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


def test_truncation_cuts_all_buffers_alike():
    ids, mask, logprobs = sample_arrays(to_sample(ScoredRollout(two_turns(), 0.0, 0), seq_len=4))
    assert ids.tolist() == [1, 2, 3, 4]
    assert mask.tolist() == [False, False, True, False]
    np.testing.assert_array_equal(logprobs, np.float32([0, 0, -0.1, 0]))


def test_mismatched_logprobs_fail():
    bad = Rollout(3, [Turn([1, 2], [3, 4], [-0.1])], 0.0)
    with pytest.raises(ValueError, match="example 3.*2 completion ids but 1 logprobs"):
        to_sample(ScoredRollout(bad, 0.0, 0), seq_len=16)


def test_rank_split_and_micro_batches():
    items = [ScoredRollout(single(example_id=i), advantage=float(i), policy_version=1) for i in range(8)]
    batches = pack_batches(items, step=5, num_ranks=2, micro_batch_size=3, temperature=0.7, seq_len=16)
    assert [b.rank for b in batches] == [0, 1]
    for rank, batch in enumerate(batches):
        assert (batch.schema_version, batch.step, batch.temperature) == (SCHEMA_VERSION, 5, 0.7)
        assert [len(m.samples) for m in batch.micro_batches] == [3, 1]  # 4 per rank; the last micro-batch is short
        ids = [s.example_id for m in batch.micro_batches for s in m.samples]
        assert ids == list(range(rank * 4, rank * 4 + 4))  # contiguous slices, order kept
        decoded = decode_batch(encode_batch(batch), expected_step=5, expected_rank=rank)
        assert decoded == batch


def test_uneven_rank_split_gives_near_equal_contiguous_slices():
    items = [ScoredRollout(single(example_id=i), 0.0, 0) for i in range(6)]
    batches = pack_batches(items, step=1, num_ranks=4, micro_batch_size=2, temperature=1.0, seq_len=16)
    ids = [[s.example_id for m in b.micro_batches for s in m.samples] for b in batches]
    assert ids == [[0, 1], [2], [3], [4, 5]]  # every rank gets work; the trainer keeps ranks in lockstep
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


def test_a_rollout_without_tokens_cannot_be_trained_on():
    with pytest.raises(ValueError, match="example 2: a rollout without tokens"):
        pack_batches([ScoredRollout(Rollout(2, [], 1.0), 0.0, 0)], step=0, num_ranks=1, micro_batch_size=1,
                     temperature=1.0, seq_len=16)
