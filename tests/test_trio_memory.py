"""The trio with what lives in the trainer's memory: `weight_transfer.mode = "memory"` (every
policy version but a checkpoint's and the last travels from the trainer's memory into the
running vLLM, through its native weight-transfer routes and this project's engine on gloo) and
a distillation teacher in the trainer's process (`teacher.placement = "trainer"`). The trainer
(or, slow-marked, vLLM) is SIGKILLed after a checkpoint, the launcher names it, and `--resume`
continues in a new transfer group with the teacher loaded again. One run carries both: each
is a trio run across a kill, and the suite has room for one such run, not two."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

from helpers import kill_mid_run, resume, served_prompt_logprobs, trio_toml
from orchestrator.progress import load_record
from prime_rl.rundir import complete_steps, log_path, metrics_path, read_jsonl, rollouts_dir, weights_dir
from prime_rl.transfer import announcement_path
from prime_rl.wire import decode_batch, sample_arrays, teacher_array, teacher_view

MAX_STEPS, INTERVAL = 8, 4


@pytest.mark.parametrize(("victim", "marker"), [
    ("trainer", "trainer.rl"),
    pytest.param("inference", "inference.vllm_cpu", marks=pytest.mark.slow),  # the other end of the group
])
def test_memory_mode_and_a_teacher_in_the_trainer_train_exactly_across_a_kill(tmp_path, tiny_model, other_tiny_model, victim, marker):
    run_dir, config = tmp_path / "run", tmp_path / "run.toml"
    # async_level 0: each step samples with the very weights the trainer trains next, so any
    # difference between what vLLM received and what the trainer holds shows as mismatch KL.
    # The teacher: other weights of the tiny model's architecture, scoring under a system
    # prompt of its own (context distillation), half reward and half KL over its top 5.
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=MAX_STEPS, async_level=0, extra=f"""
[weight_transfer]
mode = "memory"

[ckpt]
interval = {INTERVAL}

[teacher]
model = "{other_tiny_model}"
placement = "trainer"
system_prompt = "Reverse the text, character by character."

[trainer.loss.distill]
reward_weight = 0.5
top_k = 5

[orchestrator.traces]
groups = "all"
"""))
    stores_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "prime-rl-trainer-*")))
    out, code, stopped_s = kill_mid_run(run_dir, config, marker, after_checkpoint=INTERVAL)
    assert code != 0 and f"{victim} failed: it was killed by SIGKILL" in out, out
    assert stopped_s < 30, f"the launcher took {stopped_s:.1f} s to stop the others"

    resumed_from, _ = resume(run_dir, config, "--resume")
    assert resumed_from == INTERVAL

    rows = read_jsonl(metrics_path(run_dir))
    trainer = [r for r in rows if r["process"] == "trainer"]
    orchestrator = [r for r in rows if r["process"] == "orchestrator"]
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS)), "every step trained once across the kill"
    for row in trainer:  # vLLM sampled every step with exactly the trainer's weights
        assert row["loss/mismatch_kl"] < 1e-6 and row["staleness/max"] == 0, row
    # every version was loaded once, before and after the restart; checkpoint 4's is a reload
    # when the orchestrator sampled step 4 before the kill, else the resumed server starts on
    # its folder (the kill races the orchestrator: either way the mismatch KL above is ~0)
    reloaded = sorted(r["weights/reloaded_step"] for r in orchestrator if "weights/reloaded_step" in r)
    assert len(reloaded) == len(set(reloaded)) and sorted({*reloaded, INTERVAL}) == list(range(1, MAX_STEPS)), reloaded
    # the others were never written: only the checkpoint's and the last version are folders
    assert complete_steps(weights_dir(run_dir)) == [INTERVAL, MAX_STEPS]
    assert not announcement_path(run_dir).exists()
    assert "Creating weight transfer engine: PrimeRLWeightTransferEngine" in log_path(run_dir, "inference").read_text()
    # the trainer's private folder (the transfer store) is gone, the killed one's too
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "prime-rl-trainer-*"))) <= stores_before
    assert_the_trainers_teacher_scored_as_a_served_one(run_dir, trainer, other_tiny_model, tmp_path)


def assert_the_trainers_teacher_scored_as_a_served_one(run_dir, trainer_rows, teacher, tmp_path) -> None:
    """No teacher server ran and no teacher scores went on the wire, only the teacher's first
    prompt; the teacher's logprob of every token the trainer trained on (its traces, every
    rollout traced) equals what a vLLM server of the teacher returns for the same tokens
    under the teacher's prompt."""
    import numpy as np

    assert not log_path(run_dir, "teacher").exists()
    assert all(r["time/teacher"] > 0 and r["loss/reverse_kl_top_k"] >= 0 for r in trainer_rows)
    traced = {(r["id"], r["part"]): r for r in read_jsonl(run_dir / "traces" / "trainer.jsonl")}
    samples = [s for step in complete_steps(rollouts_dir(run_dir)) for frame in load_record(run_dir, step).frames
               for micro in decode_batch(frame).micro_batches for s in micro.samples]
    assert len(samples) >= 16 * (MAX_STEPS - INTERVAL)  # the steps a resume may still need are kept
    assert all(s.teacher_prompt_ids is not None for s in samples)
    answers = served_prompt_logprobs(teacher, tmp_path, [teacher_view(s)[0].tolist() for s in samples])
    ours, theirs = [], []
    for sample, answer in zip(samples, answers):
        assert teacher_array(sample) is None, "no teacher scores travel on the wire"
        row = traced[(sample.trace_id, sample.trace_part)]
        ours.append(np.array(row["teacher_logprobs"], dtype=np.float32))
        theirs.append(answer[np.flatnonzero(sample_arrays(sample)[1]) + teacher_view(sample)[1]][: len(ours[-1])])
        assert len(ours[-1]) == len(theirs[-1]) > 0
    ours, theirs = np.concatenate(ours), np.concatenate(theirs)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)  # float32 on both sides; the traces round to 1e-5
    print(f"{len(ours)} sampled tokens: the trainer's teacher against a served one, max |diff| {np.abs(ours - theirs).max():.2e}")
