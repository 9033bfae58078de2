"""scripts/gpu_check.py on CPU: the replay of a recorded run, and the report it writes.

The recorded run is made by hand (no trio): the trainer config the launcher would write and
two steps of batches as the orchestrator records them (``rollouts/step_N/rank_0.msgpack`` +
marker), whose inference logprobs come from the same tiny model, so the importance ratio is
1 and the first step's loss is known in advance.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from trainer_helpers import batch_frame, make_samples  # reverse-text samples scored by the tiny model

from prime_rl.rundir import MARKER, config_path, rollouts_step_dir

SCRIPT = REPO / "scripts" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recorded_run(tiny_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("recorded")
    config = {"model": {"name": str(tiny_model)}, "output_dir": str(run), "seq_len": 64, "num_threads": 1}
    config_path(run, "trainer").parent.mkdir(parents=True)
    config_path(run, "trainer").write_text(json.dumps(config))
    samples = make_samples(tiny_model, policy_version=0)
    for step in (0, 1):
        folder = rollouts_step_dir(run, step)
        folder.mkdir(parents=True)
        (folder / "rank_0.msgpack").write_bytes(batch_frame(step, samples))
        (folder / MARKER).write_text(f"{step}\n")
    return run


def test_cpu_replay_reports_throughput_and_skips_cuda_checks(recorded_run, tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--run-dir", str(recorded_run), "--out", str(out), "--steps", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0

    report = json.loads(out.read_text())
    replay = report["checks"]["replay"]
    assert replay["status"] == "ok", replay
    assert (replay["device"], replay["dtype"], replay["world_size"]) == ("cpu", "float32", 1)
    assert replay["tokens_per_s"] > 0 and replay["tokens_per_s_per_gpu"] == replay["tokens_per_s"]
    assert replay["peak_memory_mb"] > 0 and replay["params"] > 0
    assert [s["warmup"] for s in replay["steps"]] == [True, False]
    assert [s["samples"] for s in replay["steps"]] == [4, 4]
    # Ratio 1 on the initial weights: loss = -sum(A_b * n_b) / N over completions of 4, 6, 4
    # and 8 tokens with advantages 1, -1, 0.5, -0.5: -(4 - 6 + 2 - 4) / 22.
    assert replay["warmup_loss"] == pytest.approx(4 / 22, abs=1e-5)
    assert "replay" in done.stdout and "result: ok" in done.stdout
    if not torch.cuda.is_available():
        assert replay["mfu"] is None  # no peak FLOP/s for a CPU without --peak-flops
        for name in ("fsdp", "vllm_import", "vllm_cli"):
            assert report["checks"][name]["status"] == "skipped"
            assert report["checks"][name]["reason"].startswith("no CUDA device")


def test_fsdp_loss_comparison_and_summary_exit_code(tmp_path, capsys):
    gpu_check = load_script()
    losses = {"warmup_loss": 0.1, "first_timed_loss": -0.0100}
    single = {"status": "ok", "world_size": 1, "device": "cuda", "dtype": "bfloat16", **losses}
    sharded = {"status": "ok", "reason": "", "world_size": 8, "device": "cuda", "dtype": "bfloat16",
               "warmup_loss": 0.1001, "first_timed_loss": -0.0101}
    assert gpu_check.compare_losses(sharded, single, rtol=2e-2, atol=1e-4)["status"] == "ok"
    off = gpu_check.compare_losses({**sharded, "first_timed_loss": -0.02}, single, rtol=2e-2, atol=1e-4)
    assert off["status"] == "failed" and off["reason"].startswith("first timed step") and "8 ranks" in off["reason"]
    off = gpu_check.compare_losses({**sharded, "warmup_loss": 0.2}, single, rtol=2e-2, atol=1e-4)
    assert off["status"] == "failed" and off["reason"].startswith("warm-up step")
    assert gpu_check.compare_losses(sharded, None, rtol=2e-2, atol=1e-4)["status"] == "failed"

    # the shell script's record of a crashed torchrun, then the summary it prints
    out = tmp_path / "report.json"
    checks = {"replay": {"status": "skipped", "reason": "no run"}, "fsdp": {"status": "skipped", "reason": "x"}}
    out.write_text(json.dumps({"run_dir": None, "checks": checks}))
    assert gpu_check.main(["--out", str(out), "--summary"]) == 0
    gpu_check.main(["--out", str(out), "--record-failure", "fsdp", "torchrun exited with code 1"])
    gpu_check.main(["--out", str(out), "--record-failure", "fsdp", "a later, vaguer reason"])
    assert json.loads(out.read_text())["checks"]["fsdp"] == {"status": "failed", "reason": "torchrun exited with code 1"}
    assert gpu_check.main(["--out", str(out), "--summary"]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert gpu_check.main(["--out", str(tmp_path / "missing.json"), "--summary"]) == 1
