"""The orchestrator's progress records and what a resume makes of them."""

import json
from collections import Counter

import pytest

from orchestrator.batch import ScoredRollout, pack_batches
from orchestrator.progress import (
    PROGRESS_FILE,
    Cursor,
    ResumeError,
    StepRecord,
    load_record,
    plan_resume,
    prune_records,
    repacked_frames,
    save_record,
)
from prime_rl.envs import Rollout, Turn
from prime_rl.rundir import MARKER, WriteFailed, checkpoint_step_dir, complete_steps, rollouts_dir, rollouts_step_dir
from prime_rl.wire import decode_batch, encode_batch

DATA = {"seed": 0, "dataset_sizes": [100], "examples_per_step": 2}


def record(step: int, versions: tuple[int, int], ranks: int = 1) -> StepRecord:
    """Step n's record: 2 examples per step, so the cursor is 2n before and 2n + 2 after."""
    return StepRecord(
        step=step,
        frames=[f"batch {step} rank {r}".encode() for r in range(ranks)],
        before=Cursor(2 * step),
        after=Cursor(2 * step + 2),
        picks=[(0, 2 * step), (0, 2 * step + 1)],
        min_version=versions[0],
        max_version=versions[1],
        data=DATA,
        metrics={"reward/mean": 0.5},
    )


def checkpoint(run, step):
    folder = checkpoint_step_dir(run, step)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text(f"{step}\n")


def test_record_round_trip_and_marker(tmp_path):
    saved = record(3, (2, 3), ranks=2)
    save_record(tmp_path, saved)
    assert load_record(tmp_path, 3) == saved
    (rollouts_step_dir(tmp_path, 3) / MARKER).unlink()
    assert load_record(tmp_path, 3) is None  # no marker: never read


def test_resume_resends_what_the_checkpointed_policy_sampled_and_resamples_the_rest(tmp_path):
    # async_level 1, crash after the trainer's step 5; checkpoint at 4. Batches 4 and 5 were
    # sampled by versions <= 4; batch 6 by version 5, which the restart throws away.
    for step, versions in [(3, (2, 3)), (4, (3, 4)), (5, (4, 4)), (6, (5, 5))]:
        save_record(tmp_path, record(step, versions))
    (rollouts_dir(tmp_path) / "step_7.tmp").mkdir()  # a record cut off mid-write
    plan = plan_resume(tmp_path, 4, DATA)
    assert [r.step for r in plan.replay] == [4, 5]
    assert [r.frames for r in plan.replay] == [[b"batch 4 rank 0"], [b"batch 5 rank 0"]]
    assert (plan.next_step, plan.cursor) == (6, Cursor(12))  # step 6 samples the same examples again
    assert complete_steps(rollouts_dir(tmp_path)) == [3, 4, 5]
    assert sorted(p.name for p in rollouts_dir(tmp_path).iterdir()) == ["step_3", "step_4", "step_5"]
    # Resuming again from the same checkpoint decides the same.
    again = plan_resume(tmp_path, 4, DATA)
    assert ([r.step for r in again.replay], again.next_step, again.cursor) == ([4, 5], 6, Cursor(12))


def test_resume_without_recorded_batches_continues_from_the_previous_cursor(tmp_path):
    save_record(tmp_path, record(3, (2, 3)))
    plan = plan_resume(tmp_path, 4, DATA)
    assert (plan.replay, plan.next_step, plan.cursor) == ([], 4, Cursor(8))


def test_the_examples_in_flight_round_trip_in_the_layout_older_records_have(tmp_path):
    """progress.json keeps its flat keys (cursor_/pending_ before and after), so records of
    runs made before ``Cursor`` still resume; one without pending lists reads as none."""
    saved = record(3, (2, 3))
    saved.before, saved.after = Cursor(6, [(0, 9)]), Cursor(8, [(0, 9), (0, 11)])
    save_record(tmp_path, saved)
    meta = json.loads((rollouts_step_dir(tmp_path, 3) / PROGRESS_FILE).read_text())
    assert (meta["cursor_before"], meta["pending_before"], meta["cursor_after"], meta["pending_after"]) == (
        6, [[0, 9]], 8, [[0, 9], [0, 11]])
    assert load_record(tmp_path, 3) == saved
    assert plan_resume(tmp_path, 4, DATA).cursor == Cursor(8, [(0, 9), (0, 11)])
    for key in ("pending_before", "pending_after"):
        del meta[key]
    (rollouts_step_dir(tmp_path, 3) / PROGRESS_FILE).write_text(json.dumps(meta))
    assert (load_record(tmp_path, 3).before, load_record(tmp_path, 3).after) == (Cursor(6), Cursor(8))


def test_resume_without_progress_or_with_other_data_settings_is_refused(tmp_path):
    with pytest.raises(ResumeError, match=r"no orchestrator progress for step 4 .*expected step_3 or step_4"):
        plan_resume(tmp_path, 4, DATA)
    save_record(tmp_path, record(3, (2, 3)))
    with pytest.raises(ResumeError, match=r"\(examples_per_step was 2, now 4\); resume with the original settings"):
        plan_resume(tmp_path, 4, {**DATA, "examples_per_step": 4})


def packed_record(step: int, ranks: int) -> StepRecord:
    """Step n's record with real frames: 3 groups of 2 rollouts of different lengths."""
    items = [
        ScoredRollout(Rollout(ex, [Turn(list(range(1, n)), [9], [-0.1])], float(i)), float(i), step, "env")
        for ex, lengths in enumerate([(7, 5), (3, 4), (6, 2)])
        for i, n in enumerate(lengths)
    ]
    batches = pack_batches(items, step=step, num_ranks=ranks, micro_batch_size=2, temperature=0.7, seq_len=16)
    return StepRecord(**{**vars(record(step, (step, step))), "frames": [encode_batch(b) for b in batches]})


def frame_samples(frames: list[bytes], step: int) -> list:
    batches = [decode_batch(frame, expected_step=step, expected_rank=rank) for rank, frame in enumerate(frames)]
    assert all(b.temperature == 0.7 for b in batches)
    return [s for b in batches for m in b.micro_batches for s in m.samples]


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_record_for_2_ranks_resumes_on_another_rank_count(tmp_path, ranks):
    save_record(tmp_path, packed_record(4, ranks=2))
    (replayed,) = plan_resume(tmp_path, 4, DATA).replay  # the rank count is no reason to refuse
    frames = repacked_frames(replayed, ranks, micro_batch_size=2)
    assert len(frames) == ranks
    before, after = frame_samples(replayed.frames, 4), frame_samples(frames, 4)
    assert Counter(after) == Counter(before)  # the same samples, none lost or doubled
    # Re-packing is the packing a fresh step on `ranks` ranks would have made.
    assert frames == packed_record(4, ranks).frames


def test_a_damaged_record_cannot_be_repacked(tmp_path):
    damaged = StepRecord(**{**vars(packed_record(4, ranks=2)), "frames": [b"\xc1 not msgpack", b""]})
    with pytest.raises(ResumeError, match=r"cannot re-pack step 4's recorded batch for 1 trainer ranks: not a msgpack"):
        repacked_frames(damaged, 1, micro_batch_size=2)


def test_records_older_than_every_checkpoint_are_pruned(tmp_path):
    for step in range(8):
        save_record(tmp_path, record(step, (step, step)))
    prune_records(tmp_path)  # no checkpoint yet: everything may be needed
    assert complete_steps(rollouts_dir(tmp_path)) == list(range(8))
    checkpoint(tmp_path, 4)
    checkpoint(tmp_path, 6)
    prune_records(tmp_path)  # resuming from 4 needs step 3's cursor at most
    assert complete_steps(rollouts_dir(tmp_path)) == [3, 4, 5, 6, 7]


def test_a_failed_record_write_names_the_path(tmp_path):
    rollouts_dir(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    rollouts_dir(tmp_path).write_text("a file where the rollouts folder belongs")
    with pytest.raises(WriteFailed, match=rf"^cannot write rollouts {rollouts_step_dir(tmp_path, 0)}: "):
        save_record(tmp_path, record(0, (0, 0)))
