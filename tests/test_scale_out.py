"""The real trio scaled out on one machine: 2 trainer ranks (torchrun, FSDP2 on gloo) and 2
vLLM-CPU replicas behind one orchestrator, every route of each guarded by the API key, then
a resume of that run on 1 rank and 1 replica."""

import json
import math
import os
import subprocess
import sys
import time

import httpx
import pytest

from helpers import REPO, free_port, free_port_pair, new_tag, tagged_processes, trio_toml
from prime_rl.launch.launcher import tail
from prime_rl.rundir import MARKER, checkpoint_step_dir, config_path, log_path, metrics_path, read_jsonl, weights_step_dir
from orchestrator.progress import load_record, repacked_frames
from trainer_helpers import run_trainer_process

STEPS = 4
SCALE_OUT = """api_key = "scale-out-key"
[deployment]
inference_gpus = 2
trainer_gpus = 2

[orchestrator.client]
verify_reload = true

[ckpt]
interval = 1
keep_last = 4   # checkpoints 1-4 kept, so the orchestrator keeps its record of step 0
"""


def run_cli(config, *flags, tag: str, while_running=None, timeout: float = 900) -> str:
    """Run `prime-rl CONFIG` to the end (``while_running(run_dir)`` meanwhile); its output."""
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    proc = subprocess.Popen([sys.executable, "-m", "prime_rl.cli", str(config), "--no-tmux", *flags], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = config.parent / config.stem
    try:
        if while_running is not None:
            while_running(run_dir)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)
    names = ("inference-0", "inference-1", "inference", "orchestrator", "trainer")
    logs = "".join(f"\n--- {p} ---\n{tail(log_path(run_dir, p), 30)}" for p in names if log_path(run_dir, p).exists())
    assert proc.returncode == 0, out + logs
    return out


def admin_routes_refuse_strangers(run_dir) -> None:
    """While the run goes on: each replica answers the key on /health and refuses the admin
    routes without it (vLLM's own --api-key would leave them open; inference.auth)."""
    deadline = time.monotonic() + 300
    for i in range(2):
        path = config_path(run_dir, f"inference-{i}")
        while not path.is_file():
            assert time.monotonic() < deadline, f"no {path}"
            time.sleep(0.5)
        cfg = json.loads(path.read_text())
        url, key = f"http://{cfg['host']}:{cfg['port']}", cfg["api_key"]
        while True:
            try:
                if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"replica {i} never became healthy"
            time.sleep(1)
        for route in ("/collective_rpc", "/pause"):
            response = httpx.post(url + route, json={"method": "reload_weights", "kwargs": {"weights_path": "/tmp"}})
            assert response.status_code == 401, (route, response.text)
        assert httpx.get(f"{url}/health").status_code == 401


def test_two_ranks_and_two_replicas_then_resume_on_one(tmp_path, tiny_model):
    run_dir = tmp_path / "scaled"
    config = tmp_path / "scaled.toml"
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=STEPS, extra=SCALE_OUT))
    tag = new_tag()
    out = run_cli(config, tag=tag, while_running=admin_routes_refuse_strangers)
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
    # the start and at least one reload: with continuous batching a step's row holds the
    # newest reload since the previous step (weights load in the background), and step 2
    # needs version 1, so a reload is logged by then
    assert len(probes) >= 2, orchestrator
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
    one.update(output_dir=str(tmp_path / "one"), max_steps=1, ckpt={"interval": 0}, transport=plain_transport(one["transport"], port))
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


def plain_transport(resolved: dict, port: int) -> dict:
    """The run's trainer transport on another port, without its CURVE keys: the frames are
    replayed by a plain PUSH socket (run_trainer_process)."""
    return {key: value for key, value in resolved.items() if not key.startswith("curve_")} | {"port": port}



MEMORY_SCALE_OUT = """[deployment]
inference_gpus = 2
trainer_gpus = 2

[orchestrator.client]
verify_reload = true

[weight_transfer]
mode = "memory"

[ckpt]
interval = 0
"""


@pytest.mark.slow
def test_two_ranks_update_two_replicas_in_memory(tmp_path, tiny_model):
    """Memory mode across 2 FSDP2 ranks and 2 vLLM replicas: one group of the trainer's rank 0
    and both workers; after every update both replicas serve the trainer's weights (the same
    probe logprob, another one each update, mismatch KL below 1e-6 at `async_level = 0`), and
    only the last version is written as a folder."""
    run_dir, config = tmp_path / "memory", tmp_path / "memory.toml"
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=STEPS, async_level=0, extra=MEMORY_SCALE_OUT))
    tag = new_tag()
    out = run_cli(config, tag=tag)
    assert "inference replica 1: vLLM on CPU" in out and "trainer: torchrun, 2 rank(s)" in out, out
    rows = read_jsonl(metrics_path(run_dir))
    trainer = [r for r in rows if r["process"] == "trainer" and "loss/policy" in r]
    orchestrator = [r for r in rows if r["process"] == "orchestrator" and "reward/mean" in r]
    assert [r["step"] for r in trainer] == list(range(STEPS)) and [r["weights/writers"] for r in trainer] == [1] * STEPS
    assert all(r["loss/mismatch_kl"] < 1e-6 for r in trainer), [r["loss/mismatch_kl"] for r in trainer]
    reloads = [r for r in orchestrator if "weights/reloaded_step" in r]
    assert [r["weights/reloaded_step"] for r in reloads] == list(range(1, STEPS))
    probes = [(r["weights/probe_logprob/0"], r["weights/probe_logprob/1"]) for r in reloads]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in probes), probes
    assert len({round(a, 4) for a, _ in probes}) == len(probes), f"each update changes what is served: {probes}"
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == [f"step_{STEPS}"]
    assert tagged_processes(tag) == []
