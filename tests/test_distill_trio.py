"""The real trio with a local distillation teacher (its own vLLM process): context
distillation mixed with RL on the tiny model, the teacher's top-k tokens at every sampled
position, a kill of the trainer mid-run, and a resume."""

import numpy as np

from helpers import finish, free_port, kill_mid_run, start_launcher, tagged_processes, trio_toml
from orchestrator.progress import load_record
from prime_rl.rundir import complete_steps, metrics_path, read_jsonl, rollouts_dir
from prime_rl.wire import decode_batch, sample_arrays, teacher_array, teacher_top_arrays

MAX_STEPS = 4


def test_a_teacher_process_scores_every_sampled_token_and_the_run_resumes(tmp_path, tiny_model, other_tiny_model):
    """Student: the tiny model; teacher: other weights of its architecture, scoring under a
    system prompt of its own (context distillation), half reward and half reverse KL over the
    teacher's top 5 tokens. Every recorded sample carries the teacher's logprob at each sampled
    token (0 elsewhere) and its 5 most likely tokens there, most likely first; both processes
    log the reverse KL; the trainer is SIGKILLed after checkpoint 2 and `--resume` trains the
    remaining steps once each; no process (the teacher's vLLM included) is left."""
    run_dir, config = tmp_path / "run", tmp_path / "run.toml"
    teacher = f"""
[teacher]
model = "{other_tiny_model}"
port = {free_port()}
system_prompt = "Reverse the text, character by character."

[trainer.loss.distill]
reward_weight = 0.5
kl_weight = 1.0
top_k = 5

[ckpt]
interval = 2
keep_last = 10
"""
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=MAX_STEPS, extra=teacher))

    out, code, _ = kill_mid_run(run_dir, config, "-m trainer.rl", after_checkpoint=2)
    assert code == 1 and "trainer failed: it was killed by SIGKILL" in out, out
    assert "teacher: vLLM on CPU" in out
    proc, tag = start_launcher(config, "--resume")
    finish(proc, run_dir)
    assert tagged_processes(tag) == [], "the teacher's server stops with the run"

    rows = read_jsonl(metrics_path(run_dir))
    trainer = [r for r in rows if r["process"] == "trainer"]
    orchestrator = [r for r in rows if r["process"] == "orchestrator"]
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS)), "every step trained once across the kill"
    assert all(r["loss/reverse_kl"] == r["loss/reverse_kl"] for r in trainer)  # logged and finite
    assert all(r["loss/reverse_kl_top_k"] >= 0 for r in trainer)
    assert all(r["distill/reverse_kl"] == r["distill/reverse_kl"] and r["distill/teacher_s"] > 0 for r in orchestrator)

    samples, steps = 0, complete_steps(rollouts_dir(run_dir))  # the records a resume may still need
    assert len(steps) >= MAX_STEPS - 2, steps
    for step in steps:
        for frame in load_record(run_dir, step).frames:
            for micro in decode_batch(frame).micro_batches:
                for sample in micro.samples:
                    ids, mask, student = sample_arrays(sample)
                    teacher_lp = teacher_array(sample)
                    assert teacher_lp is not None, f"step {step}: a sample without teacher logprobs"
                    assert (teacher_lp[mask] < 0).all() and (teacher_lp[~mask] == 0).all()
                    assert not np.allclose(teacher_lp[mask], student[mask], atol=1e-3), "the teacher is another model"
                    top_ids, top_lp = teacher_top_arrays(sample)
                    assert top_ids.shape == top_lp.shape == (mask.sum(), 5), f"step {step}: not 5 tokens a sampled token"
                    assert (np.diff(top_lp, axis=1) <= 0).all() and (top_lp <= 0).all(), "most likely first"
                    sampled = ids[mask]
                    assert (teacher_lp[mask] <= top_lp[:, 0] + 1e-5).all(), "no token beats the teacher's first"
                    listed = top_ids == sampled[:, None]
                    np.testing.assert_allclose(top_lp[listed], np.repeat(teacher_lp[mask], listed.sum(1)), atol=1e-4)
                    samples += 1
    assert samples == 16 * len(steps)  # batch_size rollouts of one sample each
