"""Wire format: round trip and rejection of malformed, wrong-version or inconsistent frames."""

import msgspec
import numpy as np
import pytest

from prime_rl.wire import (
    SCHEMA_VERSION,
    MicroBatch,
    Sample,
    TrainBatch,
    WireError,
    decode_batch,
    encode_batch,
    make_sample,
    sample_arrays,
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
