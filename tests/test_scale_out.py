"""The real trio scaled out on one machine: 2 trainer ranks (torchrun, FSDP2 on gloo) and 2
vLLM-CPU replicas behind one orchestrator, then a resume of that run on 1 rank and 1 replica."""

import json
import math
import os
import subprocess
import sys

from helpers import REPO, free_port, free_port_pair, new_tag, tagged_processes, trio_toml
from prime_rl.launcher import tail
from prime_rl.rundir import MARKER, checkpoint_step_dir, config_path, log_path, metrics_path, read_jsonl, weights_step_dir
from orchestrator.progress import load_record, repacked_frames
from test_trainer_rl import run_trainer_process

STEPS = 4
SCALE_OUT = """
[deployment]
inference_gpus = 2
trainer_gpus = 2

[orchestrator.client]
verify_reload = true

[ckpt]
interval = 1
keep_last = 4   # checkpoints 1-4 kept, so the orchestrator keeps its record of step 0
"""


def run_cli(config, *flags, tag: str, timeout: float = 900) -> str:
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    proc = subprocess.run([sys.executable, "-m", "prime_rl.cli", str(config), "--no-tmux", *flags], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    run_dir = config.parent / config.stem
    names = ("inference-0", "inference-1", "inference", "orchestrator", "trainer")
    logs = "".join(f"\n--- {p} ---\n{tail(log_path(run_dir, p), 30)}" for p in names if log_path(run_dir, p).exists())
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    return proc.stdout


def test_two_ranks_and_two_replicas_then_resume_on_one(tmp_path, tiny_model):
    run_dir = tmp_path / "scaled"
    config = tmp_path / "scaled.toml"
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=STEPS, extra=SCALE_OUT))
    tag = new_tag()
    out = run_cli(config, tag=tag)
    assert "inference replica 1: vLLM on CPU" in out and "trainer: torchrun, 2 rank(s)" in out, out
    rows = read_jsonl(metrics_path(run_dir))
    orchestrator = [r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r]
    trainer = [r for r in rows if r["process"] == "trainer" and "loss/policy" in r]
    assert [r["step"] for r in trainer] == list(range(STEPS))

    # Requests went to both replicas.
    last = orchestrator[-1]
    assert last["inference/requests/0"] > 0 and last["inference/requests/1"] > 0, last

    # Both replicas started alike, and after every reload both served the new weights: the
    # same logprobs for the same prompt, and not those of the weights before.
    probes = [(orchestrator[0]["startup/probe_logprob/0"], orchestrator[0]["startup/probe_logprob/1"])]
    probes += [(r["weights/probe_logprob/0"], r["weights/probe_logprob/1"]) for r in orchestrator if "weights/reloaded_step" in r]
    assert len(probes) >= 3, orchestrator  # the start and at least two reloads
    for a, b in probes:
        assert math.isclose(a, b, abs_tol=1e-3), probes
    assert len({round(a, 4) for a, _ in probes}) == len(probes), f"each reload changes what is served: {probes}"

    # One writer per step, and the weights of every step exist.
    assert [r["weights/writers"] for r in trainer] == [1] * STEPS
    assert all((weights_step_dir(run_dir, s) / MARKER).is_file() for s in range(1, STEPS + 1))

    # The first step on 2 ranks == the same batch on 1 rank: the loss is a global token
    # mean and gradients are summed over ranks, so neither depends on the rank count.
    record = load_record(run_dir, 0)
    assert len(record.frames) == 2
    one = json.loads(config_path(run_dir, "trainer").read_text())
    port = free_port()
    one.update(output_dir=str(tmp_path / "one"), max_steps=1, ckpt={"interval": 0}, transport={**one["transport"], "port": port})
    code, output = run_trainer_process(tmp_path, one, repacked_frames(record, 1, micro_batch_size=8))
    assert code == 0, output
    single = [r for r in read_jsonl(tmp_path / "one" / "metrics.jsonl") if r["process"] == "trainer"][0]
    for key in ("loss/policy", "optim/grad_norm", "perf/loss_tokens"):
        assert math.isclose(single[key], trainer[0][key], rel_tol=1e-4, abs_tol=1e-7), (key, single[key], trainer[0][key])

    # Resume the 2-rank, 2-replica run from its checkpoint at step 2 on 1 rank and 1 replica:
    # the recorded batches from step 2 on are re-packed for one rank and the run goes one step further.
    assert (checkpoint_step_dir(run_dir, 2) / MARKER).is_file()
    ports = f"--inference.port={free_port_pair()}"
    out = run_cli(config, "--resume-step", "2", "--max-steps", str(STEPS + 1), "--deployment.trainer-gpus", "1",
                  "--deployment.inference-gpus", "1", ports, tag=tag)
    assert "trainer: one process" in out, out
    assert "re-packed step 2's batch from 2 ranks to 1" in log_path(run_dir, "orchestrator").read_text()
    rows = read_jsonl(metrics_path(run_dir))
    resumed = [r for r in rows if r["process"] == "trainer" and "loss/policy" in r]
    assert [r["step"] for r in resumed] == list(range(STEPS + 1)), [r["step"] for r in resumed]
    assert all(math.isfinite(r["loss/policy"]) for r in resumed)
    assert (weights_step_dir(run_dir, STEPS + 1) / MARKER).is_file()
    assert tagged_processes(tag) == [], "no child process may survive the runs"
