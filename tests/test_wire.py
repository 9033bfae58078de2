"""Wire format: round trip and rejection of malformed, wrong-version or inconsistent frames."""

import re

import msgspec
import numpy as np
import pytest
from prime_rl.traces import MAX_ID_CHARS

from prime_rl.wire import (
    SCHEMA_VERSION,
    MicroBatch,
    Sample,
    TrainBatch,
    WireError,
    decode_batch,
    encode_batch,
    make_sample,
    max_frame_bytes,
    sample_arrays,
    teacher_array,
    teacher_top_arrays,
)


def batch(step=3, version=SCHEMA_VERSION, samples=None) -> TrainBatch:
    samples = samples or [
        make_sample([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -1.25], advantage=0.5, reward=1.0, policy_version=2, example_id=7)
    ]
    return TrainBatch(schema_version=version, step=step, rank=0, temperature=0.7, micro_batches=[MicroBatch(samples)])


def test_round_trip_preserves_every_field():
    original = batch()
    decoded = decode_batch(encode_batch(original), expected_step=3, expected_rank=0)
    assert decoded == original
    ids, mask, logprobs = sample_arrays(decoded.micro_batches[0].samples[0])
    assert ids.tolist() == [1, 2, 3, 4]
    assert mask.tolist() == [False, False, True, True]
    assert logprobs.tolist() == [0.0, 0.0, -0.5, -1.25]  # exactly representable in float32


def test_buffers_are_packed_little_endian_int32_and_float32():
    sample = make_sample([258], [1], [-1.0], advantage=0, reward=0, policy_version=0, example_id=0)
    assert sample.input_ids == b"\x02\x01\x00\x00"
    assert sample.inference_logprobs == np.float32(-1.0).tobytes()


def test_garbage_is_rejected():
    with pytest.raises(WireError, match="not a msgpack train batch"):
        decode_batch(b"\xc1 not msgpack")


def test_wrong_schema_version_is_rejected():
    with pytest.raises(WireError, match="wrong schema version 99"):
        decode_batch(encode_batch(batch(version=99)))


def test_wrong_step_is_rejected():
    with pytest.raises(WireError, match="batch for step 3 arrived while expecting step 4"):
        decode_batch(encode_batch(batch(step=3)), expected_step=4)


def test_missing_field_is_rejected():
    frame = msgspec.msgpack.encode({"schema_version": SCHEMA_VERSION, "step": 1})
    with pytest.raises(WireError, match="malformed train batch"):
        decode_batch(frame)


def test_inconsistent_lengths_are_rejected():
    bad = Sample(
        input_ids=np.arange(4, dtype="<i4").tobytes(),
        loss_mask=bytes([0, 1, 1]),
        inference_logprobs=np.zeros(4, dtype="<f4").tobytes(),
        advantage=0.0,
        reward=0.0,
        policy_version=0,
        example_id=0,
    )
    with pytest.raises(WireError, match="inconsistent lengths: 4 tokens, 3 mask entries"):
        decode_batch(encode_batch(batch(samples=[bad])))


def test_make_sample_checks_lengths():
    with pytest.raises(WireError):
        make_sample([1, 2], [1], [0.0, 0.0], advantage=0, reward=0, policy_version=0, example_id=0)


@pytest.mark.parametrize("field", ["advantage", "logprob"])
def test_non_finite_values_are_rejected(field):
    logprobs = [0.0, float("nan")] if field == "logprob" else [0.0, -1.0]
    advantage = float("inf") if field == "advantage" else 0.0
    sample = make_sample([1, 2], [0, 1], logprobs, advantage=advantage, reward=0, policy_version=0, example_id=0)
    with pytest.raises(WireError, match="must be finite"):
        decode_batch(encode_batch(batch(samples=[sample])))


# --------------------------------------------------------------------------- what would crash the trainer later


def frame_with(micro_batches) -> bytes:
    return encode_batch(TrainBatch(SCHEMA_VERSION, 3, 0, 0.7, micro_batches))


def one_sample(ids=(1, 2, 3), logprobs=(0.0, -0.5, -1.0)):
    return make_sample(list(ids), [0, 1, 1], list(logprobs), advantage=0.5, reward=1.0, policy_version=0, example_id=0)


def test_a_batch_without_micro_batches_is_rejected():
    with pytest.raises(WireError, match="at least one micro-batch"):
        decode_batch(frame_with([]))


def test_an_empty_micro_batch_is_rejected():
    """collate cannot pad zero samples (max() of nothing)."""
    with pytest.raises(WireError, match=r"micro_batches\[1\] holds no samples"):
        decode_batch(frame_with([MicroBatch([one_sample()]), MicroBatch([])]))


@pytest.mark.parametrize("bad_id", [-1, 264, 2**31 - 1])
def test_token_ids_outside_the_embedding_are_rejected(bad_id):
    """An id the embedding has no row for is an index error on CPU and a device assert on GPU."""
    frame = frame_with([MicroBatch([one_sample(), one_sample(ids=(1, bad_id, 3))])])
    with pytest.raises(WireError, match=rf"micro_batches\[0\].samples\[1\]: token id {bad_id} out of range"):
        decode_batch(frame, vocab_size=264)
    assert decode_batch(frame_with([MicroBatch([one_sample(ids=(0, 263, 5))])]), vocab_size=264)


def test_negative_ids_are_rejected_without_a_vocab_size():
    with pytest.raises(WireError, match="token id -5 out of range"):
        decode_batch(frame_with([MicroBatch([one_sample(ids=(1, -5, 3))])]))


def test_positive_logprobs_are_rejected_beyond_rounding():
    with pytest.raises(WireError, match=r"samples\[0\]: inference logprob 0.5 is positive"):
        decode_batch(frame_with([MicroBatch([one_sample(logprobs=(0.0, 0.5, -1.0))])]))
    # float32 log-softmax may round a near-certain token's logprob just above 0
    decode_batch(frame_with([MicroBatch([one_sample(logprobs=(0.0, 3e-7, -1.0))])]))


def test_deep_nesting_under_an_unknown_key_is_a_wire_error():
    """msgspec recurses while skipping an unknown key's value: a 1M-deep array is a
    RecursionError unless decode_batch turns it into a rejected frame."""
    frame = b"\x82" + msgspec.msgpack.encode("schema_version") + b"\x01" + msgspec.msgpack.encode("junk")
    frame += b"\x91" * 1_000_000 + b"\xc0"
    with pytest.raises(WireError, match="nested too deep"):
        decode_batch(frame)


def test_max_frame_bytes_bounds_a_full_frame():
    """Every sample traced, each with the longest trace id the wire accepts."""
    seq_len, n = 64, 10
    samples = [make_sample(np.arange(seq_len), np.ones(seq_len), -np.ones(seq_len), advantage=-1.5, reward=0.25,
                           policy_version=2**40, example_id=2**40, trace_id="x" * MAX_ID_CHARS, trace_part=2**40)
               for _ in range(n)]
    frame = encode_batch(TrainBatch(SCHEMA_VERSION, 2**40, 0, 0.7, [MicroBatch(samples[:4]), MicroBatch(samples[4:])]))
    assert len(frame) <= max_frame_bytes(n, seq_len) < 2 * len(frame)


# --------------------------------------------------------------------------- distillation: the teacher's logprobs


def teacher_sample(teacher=(0.0, -0.25, -2.0)):
    return make_sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -1.0], advantage=0.5, reward=1.0, policy_version=0,
                       example_id=0, teacher_logprobs=list(teacher))


def test_teacher_logprobs_round_trip():
    original = teacher_sample()
    decoded = decode_batch(frame_with([MicroBatch([original])])).micro_batches[0].samples[0]
    assert decoded == original
    assert teacher_array(decoded).tolist() == [0.0, -0.25, -2.0]
    assert teacher_array(one_sample()) is None  # RL samples carry none


@pytest.mark.parametrize(
    "teacher, error",
    [
        (np.zeros(2, dtype="<f4").tobytes(), "2 teacher logprobs for 3 tokens"),
        (np.array([0.0, float("nan"), -1.0], dtype="<f4").tobytes(), "teacher logprobs must be finite and not positive"),
        (np.array([0.0, 0.5, -1.0], dtype="<f4").tobytes(), "teacher logprobs must be finite and not positive"),
    ],
    ids=["length", "nan", "positive"],
)
def test_bad_teacher_logprobs_are_rejected_naming_the_sample(teacher, error):
    bad = msgspec.structs.replace(teacher_sample(), teacher_logprobs=teacher)
    with pytest.raises(WireError, match=rf"micro_batches\[0\].samples\[1\]: {error}"):
        decode_batch(frame_with([MicroBatch([teacher_sample(), bad])]))


def test_a_batch_with_teacher_logprobs_on_some_samples_only_is_rejected():
    common = dict(advantage=0.0, reward=0.0, policy_version=0, example_id=0)
    a = make_sample([1, 2, 3], [0, 1, 1], [0, -0.5, -0.5], teacher_logprobs=[0, -0.1, -0.2], **common)
    b = make_sample([1, 2, 3], [0, 1, 1], [0, -0.5, -0.5], **common)
    frame = encode_batch(TrainBatch(SCHEMA_VERSION, 0, 0, 1.0, [MicroBatch([a, b])]))
    with pytest.raises(WireError, match="^1 of 2 samples carry teacher logprobs: all or none must$"):
        decode_batch(frame)


# --------------------------------------------------------------------------- distillation: the teacher's top-k tokens


def top_k_sample(k=2, rows=2):
    """3 tokens, the last 2 sampled; the teacher's top-k at each: ids [[5, 6], [7, 8]]-like."""
    ids = np.arange(5, 5 + rows * k).reshape(rows, k)
    logprobs = -np.arange(1, 1 + rows * k, dtype=np.float32).reshape(rows, k) / 4
    return make_sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -1.0], advantage=0.5, reward=1.0, policy_version=0,
                       example_id=0, teacher_logprobs=[0.0, -0.25, -2.0], teacher_top=(ids, logprobs))


def test_teacher_top_k_round_trips_one_row_per_sampled_token():
    original = top_k_sample()
    decoded = decode_batch(frame_with([MicroBatch([original])]), vocab_size=16).micro_batches[0].samples[0]
    assert decoded == original and decoded.teacher_top_k == 2
    ids, logprobs = teacher_top_arrays(decoded)
    assert ids.tolist() == [[5, 6], [7, 8]] and logprobs.tolist() == [[-0.25, -0.5], [-0.75, -1.0]]
    assert teacher_top_arrays(teacher_sample()) is None  # asked for no top-k
    with pytest.raises(WireError, match=r"teacher top-k arrays \(3, 2\) / \(3, 2\) do not match 2 sampled tokens"):
        top_k_sample(rows=3)


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(teacher_top_k=3), "teacher top-k buffers of 4 ids and 4 logprobs for 2 sampled tokens x k 3"),
        (dict(teacher_top_logprobs=None), "teacher top-k needs teacher_top_k >= 1 and both buffers, got k 2"),
        (dict(teacher_top_k=0), "teacher top-k needs teacher_top_k >= 1 and both buffers, got k 0"),
        (dict(teacher_logprobs=None), "teacher top-k tokens without the teacher's logprobs"),
        (dict(teacher_top_logprobs=np.array([-1, 0.5, -1, -1], dtype="<f4").tobytes()),
         "teacher top-k logprobs must be finite and not positive"),
        (dict(teacher_top_logprobs=np.array([-1, np.nan, -1, -1], dtype="<f4").tobytes()),
         "teacher top-k logprobs must be finite and not positive"),
    ],
    ids=["k", "one-buffer", "no-k", "no-teacher-logprobs", "positive", "nan"],
)
def test_bad_teacher_top_k_is_rejected_naming_the_sample(change, error):
    bad = msgspec.structs.replace(top_k_sample(), **change)
    with pytest.raises(WireError, match=rf"micro_batches\[0\].samples\[1\]: {re.escape(error)}"):
        decode_batch(frame_with([MicroBatch([top_k_sample(), bad])]))


def test_teacher_top_k_ids_outside_the_embedding_are_rejected():
    with pytest.raises(WireError, match=r"samples\[0\]: token id 8 out of range \(the model's embedding has 8 rows\)"):
        decode_batch(frame_with([MicroBatch([top_k_sample()])]), vocab_size=8)


# --------------------------------------------------------------------------- context distillation in the trainer


def context_sample(prompt=(9, 9, 9, 1), cut=2):
    """4 tokens, the first 2 the student's prompt, the teacher's own prompt in their place."""
    return make_sample([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -1.0], advantage=0.5, reward=1.0, policy_version=0,
                       example_id=0, teacher_prompt=(list(prompt), cut))


def test_a_teacher_prompt_round_trips_and_gives_the_teachers_view():
    from prime_rl.wire import teacher_view

    original = context_sample()
    decoded = decode_batch(frame_with([MicroBatch([original])]), vocab_size=16).micro_batches[0].samples[0]
    assert decoded == original
    ids, offset = teacher_view(decoded)
    assert ids.tolist() == [9, 9, 9, 1, 3, 4] and offset == 2  # token 2 of the sample is token 4 of the view
    assert teacher_view(decoded, seq_len=3)[0].tolist() == [9, 9, 9, 1, 3]
    assert teacher_view(one_sample())[1] == 0  # a sample without one: its own ids


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(teacher_prompt_cut=3), "teacher_prompt_cut 3 must lie inside the sample's first prompt"),
        (dict(teacher_prompt_cut=0), "teacher_prompt_cut 0 must lie inside the sample's first prompt"),
        (dict(teacher_prompt_ids=b""), "teacher_prompt_ids must be a non-empty int32 buffer"),
        (dict(teacher_prompt_ids=None), "teacher_prompt_cut 2 without teacher_prompt_ids"),
        (dict(teacher_logprobs=np.zeros(4, dtype="<f4").tobytes()), "carries both a served teacher's logprobs and a teacher prompt"),
    ],
    ids=["cut-into-the-completion", "cut-0", "empty", "cut-alone", "both-teachers"],
)
def test_a_bad_teacher_prompt_is_rejected_naming_the_sample(change, error):
    bad = msgspec.structs.replace(context_sample(), **change)
    with pytest.raises(WireError, match=rf"micro_batches\[0\].samples\[1\]: {re.escape(error)}"):
        decode_batch(frame_with([MicroBatch([context_sample(), bad])]))


def test_teacher_prompt_ids_outside_the_embedding_are_rejected():
    with pytest.raises(WireError, match=r"samples\[0\]: token id 9 out of range \(the model's embedding has 8 rows\)"):
        decode_batch(frame_with([MicroBatch([context_sample()])]), vocab_size=8)


def test_one_top_k_a_batch():
    frame = frame_with([MicroBatch([top_k_sample(k=2), top_k_sample(k=1)])])
    with pytest.raises(WireError, match=r"different k \(\[1, 2\]\)"):
        decode_batch(frame)


def test_max_frame_bytes_bounds_a_full_frame_with_the_teachers_top_k():
    seq_len, n, k = 32, 6, 20
    ids, logprobs = np.zeros((seq_len, k), np.int32), -np.ones((seq_len, k), np.float32)
    samples = [make_sample(np.arange(seq_len), np.ones(seq_len), -np.ones(seq_len), advantage=-1.5, reward=0.25,
                           policy_version=2, example_id=2, teacher_logprobs=-np.ones(seq_len), teacher_top=(ids, logprobs))
               for _ in range(n)]
    frame = encode_batch(TrainBatch(SCHEMA_VERSION, 2, 0, 0.7, [MicroBatch(samples)]))
    assert max_frame_bytes(n, seq_len) < len(frame) <= max_frame_bytes(n, seq_len, k) < 2 * len(frame)
