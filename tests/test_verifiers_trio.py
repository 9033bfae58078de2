"""The real trio (vLLM, orchestrator, trainer) on a classic verifiers environment in its own venv.

vf-multi (a verifiers 0.3.1 MultiTurnEnv, three model turns) in the cached test venv, 4
steps on the tiny model, trained as a LoRA adapter (one run carries the verifiers worker's and
LoRA's checks). The worker is SIGKILLed once checkpoint 2 exists: the run stops within seconds,
saying which environment; `--resume` then starts vLLM on the base model with checkpoint 2's
adapter and trains the remaining steps, loading each new adapter without a restart.
Checked: rewards of every step, mismatch KL, what vLLM served against peft with the adapter of
the step, no worker (or any process) left.
"""

from __future__ import annotations

import re

import pytest
from prime_rl.launch.launcher import tail
from prime_rl.rundir import MARKER, log_path, metrics_path, read_jsonl, weights_step_dir

from helpers import assert_traced, finish, kill_mid_run, start_launcher, tagged_processes, trio_toml
from verifiers_venvs import CLASSIC, V1
from verifiers_venvs import verifiers_venv

MAX_STEPS = 4
LORA = "\n[trainer.lora]\nrank = 8\nalpha = 16\n\n[ckpt]\ninterval = 2\nkeep_last = 5\n"


def test_lora_on_a_classic_multi_turn_env_trains_in_the_trio_and_resumes_after_its_worker_is_killed(tmp_path, tiny_model):
    """`[trainer.lora]` end to end, on-policy (async_level 0), on a classic verifiers
    environment: the trainer writes PEFT adapters, vLLM (base model, LoRA enabled) loads each
    one at run time and requests name it, so what was sampled is what peft computes with that
    adapter. The worker's death stops the run naming the environment; the resume starts vLLM
    on the base model and loads the checkpoint's adapter before sampling. The environment's
    `letters_reward` differs between any two replies, so every group has advantages and the
    adapter moves from the first step (with vf-multi's own rewards most groups tie, and an
    adapter still at zero serves the base model: a clean-clone run failed so, its step-2 gap
    to the base 9e-8)."""
    python = verifiers_venv("0.3.1", CLASSIC)
    run_dir = tmp_path / "run"
    config = tmp_path / "rl.toml"
    env = f'id = "vf-multi"\npython = "{python}"\nargs = {{ num_examples = 64, letters_reward = true }}'
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=MAX_STEPS, env=env, seq_len=256, max_tokens=8,
                                async_level=0, lr=2e-2, extra=LORA))

    # first run: kill the worker once checkpoint 2 is complete
    out, code, stopped_s = kill_mid_run(run_dir, config, "vfworker_main.py", after_checkpoint=2)
    assert code == 1 and stopped_s < 30, out
    assert "orchestrator failed" in out and "environment 'vf-multi': its worker process was killed by signal 9" in out, out

    # the same command with --resume trains the rest
    proc, tag = start_launcher(config, "--resume")
    finish(proc, run_dir)
    assert tagged_processes(tag) == [], "the worker (and everything else) is gone after the run"
    restarted = tail(log_path(run_dir, "inference"), 10_000).rsplit("[inference] exec:", 1)[1]
    assert f"--model {tiny_model} " in restarted  # the base model, not weights/step_2
    loads = re.findall(r"Loaded new LoRA adapter: name '([^']+)', path '([^']+)'", restarted)
    assert loads[0] == ("policy-lora", str(weights_step_dir(run_dir, 2))), loads

    rows = read_jsonl(metrics_path(run_dir))
    orchestrator = [r for r in rows if r["process"] == "orchestrator"]
    assert [r["step"] for r in orchestrator] == list(range(MAX_STEPS))
    assert all("reward/vf-multi/mean" in r and "metrics/vf-multi/nonempty_fraction" in r for r in orchestrator)
    assert all(r["seq/turns_mean"] == 3.0 for r in orchestrator)
    assert [r["policy/version"] for r in orchestrator] == list(range(MAX_STEPS))
    assert orchestrator[-1].get("weights/reloaded_step") == MAX_STEPS - 1, orchestrator[-1]
    trainer = [r for r in rows if r["process"] == "trainer" and "loss/mismatch_kl" in r]
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS))
    assert all(r["loss/mismatch_kl"] < 1e-3 for r in trainer), [r["loss/mismatch_kl"] for r in trainer]
    assert sorted(p.name for p in weights_step_dir(run_dir, MAX_STEPS).iterdir()) == [
        MARKER, "adapter_config.json", "adapter_model.safetensors"]
    # the worker's rollouts are traced like the built-ins', across the kill and the resume
    for row in assert_traced(run_dir, MAX_STEPS, rollouts_per_example=4):
        assert [m["role"] for m in row["completion"]].count("assistant") == 3 and len(row["turns"]) == 3
    # step 2: the checkpoint's adapter, loaded at the resumed vLLM's start; step 3: one loaded at run time

    for step in (2, 3):
        to_adapter, to_base = served_logprob_gaps(run_dir, tiny_model, step)
        print(f"step {step}: served vs peft with its adapter, max gap {to_adapter:.2e}; vs the base model, mean gap {to_base:.3f}")
        assert to_adapter < 1e-3 and to_base > 1e-2, (step, to_adapter, to_base)
    print(f"stopped {stopped_s:.1f} s after the kill; mismatch KL at step 0: {trainer[0]['loss/mismatch_kl']:.2e}; "
          f"rewards: {[round(r['reward/mean'], 3) for r in orchestrator]}")


def served_logprob_gaps(run_dir, base_model, step: int) -> tuple[float, float]:
    """The batch sampled for ``step`` (its progress record): the largest gap between the
    logprobs vLLM returned and those of peft on base + ``weights/step_<version>``, and the
    mean gap to the base model alone."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from orchestrator.progress import load_record
    from prime_rl.wire import MicroBatch, decode_batch
    from trainer.data import collate

    batch = decode_batch(load_record(run_dir, step).frames[0])
    samples = [s for micro in batch.micro_batches for s in micro.samples]
    (version,) = {s.policy_version for s in samples}
    assert version == step  # on-policy
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32),
                                        weights_step_dir(run_dir, version)).eval()
    to_adapter, to_base = [], []
    for sample in samples:
        mt = collate(MicroBatch(samples=[sample]), 256, 0, torch.device("cpu"))
        mask, served = mt.loss_mask[0, 1:], mt.inference_logprobs[0, 1:]
        for model, gaps in ((adapted, to_adapter), (base, to_base)):
            with torch.no_grad():
                logits = model(input_ids=mt.input_ids).logits[0, :-1] / batch.temperature
            lp = torch.log_softmax(logits, -1).gather(-1, mt.input_ids[0, 1:, None])[:, 0]
            gaps.append((lp - served)[mask].abs())
    return float(torch.cat(to_adapter).max()), float(torch.cat(to_base).mean())


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
