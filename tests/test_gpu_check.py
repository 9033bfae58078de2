"""scripts/gpu_check.sh on CPU: the same trainer path as on a GPU (random model built by the
trainer's code, bf16 compute over float32 masters, activation checkpointing, token-budget
micro-batches, a weight save for vLLM) at a tiny size; the CUDA-only checks are skipped, and
the table and exit codes are those a GPU run gives."""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, load_script

SCRIPT = REPO / "scripts" / "gpu_check.py"


def test_the_check_runs_the_trainers_path_and_reports_it(tmp_path):
    out = tmp_path / "gpu_check.json"
    flags = ["--device", "cpu", "--size", "tiny", "--micro-batch-tokens", "512", "--micro-batches", "2", "--steps", "2",
             "--out", str(out), "--save-dir", str(tmp_path / "save")]
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *flags], capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"})
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0
    checks = json.loads(out.read_text())["checks"]
    assert {name: c["status"] for name, c in checks.items()} == {
        "environment": "ok", "build": "ok", "head_parity": "ok", "steps": "ok", "weights_move": "ok",
        "memory_estimate": "skipped", "no_checkpointing": "skipped", "weights_save": "ok", "vllm_import": "skipped",
    }
    steps = checks["steps"]
    assert steps["tokens_per_step"] == 1024 and steps["micro_batches"] >= 2 and steps["mfu"] is None
    assert len(steps["losses"]) == 3 and steps["seconds_per_step"] > 0
    assert checks["weights_move"]["share"] > 0.9 and checks["weights_move"]["lr"] == 1e-6  # masters move at 1e-6
    assert checks["head_parity"]["max_abs_diff"] < 1e-3
    assert checks["weights_save"]["bytes"] > 0
    table = done.stdout.split("== gpu_check (tiny on cpu)")[1]
    assert "weights_move      ok" in table and "result: ok" in table

    # the same steps on two FSDP2 ranks (gloo; NCCL on GPUs): bf16 gathers, float32 reductions,
    # the same global batch split over the ranks: the first loss equals the one-process one
    sharded = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(SCRIPT), *flags[:-4], "--fsdp-of", str(out), "--out", str(tmp_path / "sharded.json")],
                             capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})  # torchrun leaves its log folder there
    print(sharded.stdout[-2000:], sharded.stderr[-2000:])
    assert sharded.returncode == 0
    fsdp = json.loads(out.read_text())["checks"]["fsdp"]
    assert fsdp["status"] == "ok" and fsdp["world_size"] == 2
    assert fsdp["loss"] == pytest.approx(checks["steps"]["first_loss"], rel=1e-3)


def test_a_failed_check_fails_the_run_and_the_fsdp_loss_is_compared(tmp_path, capsys):
    gpu_check = load_script("gpu_check")
    out = tmp_path / "report.json"
    out.write_text(json.dumps({"size": "4b", "device": "cuda:0", "checks": {"environment": {"status": "ok", "reason": "",
                   "torch": "2.11", "cuda": "13.0", "transformers": "5.17", "gpu": "H200", "gpu_bytes": 150e9, "bf16": True}}}))
    assert gpu_check.main(["--out", str(out), "--summary"]) == 0
    assert gpu_check.main(["--out", str(out), "--record-failure", "build", "exited with code 137"]) == 1
    assert gpu_check.main(["--out", str(out), "--summary"]) == 1
    assert "build             failed   exited with code 137" in capsys.readouterr().out
    assert gpu_check.main(["--out", str(tmp_path / "missing.json"), "--summary"]) == 1

    def report(loss):
        return {"world_size": 8, "checks": {"steps": {"status": "ok", "first_loss": loss, "tokens_per_s": 1.0}}}

    assert gpu_check.fsdp_check(report(0.1001), report(0.1))["status"] == "ok"
    off = gpu_check.fsdp_check(report(0.2), report(0.1))
    assert off["status"] == "failed" and "on 8 ranks" in off["reason"]
    assert gpu_check.fsdp_check(report(0.1), None)["status"] == "failed"
