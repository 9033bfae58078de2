"""The real trio (vLLM, orchestrator, trainer) on a classic verifiers environment in its own venv.

vf-multi (a verifiers 0.3.1 MultiTurnEnv, three model turns) in the cached test venv, 4
steps on the tiny model. The worker is SIGKILLed once checkpoint 2 exists: the run stops
within seconds, saying which environment; `--resume` then trains the remaining steps.
Checked: rewards of every step, mismatch KL at step 0, no worker (or any process) left.
"""

from __future__ import annotations

import pytest
from prime_rl.rundir import metrics_path, read_jsonl

from helpers import finish, kill_mid_run, start_launcher, tagged_processes, trio_toml
from verifiers_venvs import CLASSIC, V1
from verifiers_venvs import verifiers_venv

MAX_STEPS = 4


def test_classic_multi_turn_env_trains_in_the_trio_and_resumes_after_its_worker_is_killed(tmp_path, tiny_model):
    python = verifiers_venv("0.3.1", CLASSIC)
    run_dir = tmp_path / "run"
    config = tmp_path / "rl.toml"
    env = f'id = "vf-multi"\npython = "{python}"\nargs = {{ num_examples = 64 }}'
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=MAX_STEPS, env=env, seq_len=256, max_tokens=8)
                      + "\n[ckpt]\ninterval = 2\nkeep_last = 5\n")

    # first run: kill the worker once checkpoint 2 is complete
    out, code, stopped_s = kill_mid_run(run_dir, config, "vfworker_main.py", after_checkpoint=2)
    assert code == 1 and stopped_s < 30, out
    assert "orchestrator failed" in out and "environment 'vf-multi': its worker process was killed by signal 9" in out, out

    # the same command with --resume trains the rest
    proc, tag = start_launcher(config, "--resume")
    finish(proc, run_dir)
    assert tagged_processes(tag) == [], "the worker (and everything else) is gone after the run"

    rows = read_jsonl(metrics_path(run_dir))
    orchestrator = [r for r in rows if r["process"] == "orchestrator"]
    assert [r["step"] for r in orchestrator] == list(range(MAX_STEPS))
    assert all("reward/vf-multi/mean" in r and "metrics/vf-multi/nonempty_fraction" in r for r in orchestrator)
    assert all(r["seq/turns_mean"] == 3.0 for r in orchestrator)
    trainer = [r for r in rows if r["process"] == "trainer" and "loss/mismatch_kl" in r]
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS))
    assert trainer[0]["loss/mismatch_kl"] < 1e-3, trainer[0]
    print(f"stopped {stopped_s:.1f} s after the kill; mismatch KL at step 0: {trainer[0]['loss/mismatch_kl']:.2e}; "
          f"rewards: {[round(r['reward/mean'], 3) for r in orchestrator]}")


@pytest.mark.slow
def test_v1_multi_turn_taskset_trains_in_the_trio(tmp_path, tiny_model):
    """v1-again (verifiers 0.4.0, three model turns, v1's null harness on the subprocess
    runtime) in the real trio, 4 steps of 8 episodes. Slow: v1's harness starts a program per
    turn (~1.3 s each here), so a step takes tens of seconds on two cores."""
    python = verifiers_venv("0.4.0", V1)
    run_dir = tmp_path / "run"
    config = tmp_path / "rl.toml"
    env = f'id = "v1-again"\npython = "{python}"'
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=MAX_STEPS, env=env, seq_len=256, max_tokens=8,
                                batch_size=8, rollouts_per_example=4, preflight="enabled = false"))
    proc, tag = start_launcher(config)
    finish(proc, run_dir, timeout=1500)
    assert tagged_processes(tag) == [], "the worker (and everything else) is gone after the run"
    rows = read_jsonl(metrics_path(run_dir))
    orchestrator = [r for r in rows if r["process"] == "orchestrator"]
    assert [r["step"] for r in orchestrator] == list(range(MAX_STEPS))
    assert all("reward/v1-again/mean" in r and r["seq/turns_mean"] == 3.0 for r in orchestrator)
    trainer = [r for r in rows if r["process"] == "trainer" and "loss/mismatch_kl" in r]
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS))
    assert trainer[0]["loss/mismatch_kl"] < 1e-3, trainer[0]
    print(f"mismatch KL at step 0: {trainer[0]['loss/mismatch_kl']:.2e}; "
          f"rewards: {[round(r['reward/mean'], 3) for r in orchestrator]}; "
          f"s/step: {[round(r['time/step'], 1) for r in orchestrator]}")
