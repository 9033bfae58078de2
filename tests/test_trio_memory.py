"""The trio with `weight_transfer.mode = "memory"`: every policy version but a checkpoint's and
the last travels from the trainer's memory into the running vLLM (its native weight-transfer
routes, this project's engine on gloo), the trainer (or, slow-marked, vLLM) is SIGKILLed after
a checkpoint, the launcher names it, and `--resume` continues in a new transfer group."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

from helpers import kill_mid_run, resume, trio_toml
from prime_rl.rundir import complete_steps, log_path, metrics_path, read_jsonl, weights_dir
from prime_rl.transfer import announcement_path

MAX_STEPS, INTERVAL = 8, 4


@pytest.mark.parametrize(("victim", "marker"), [
    ("trainer", "trainer.rl"),
    pytest.param("inference", "inference.vllm_cpu", marks=pytest.mark.slow),  # the other end of the group
])
def test_memory_mode_trains_on_exact_weights_and_resumes_after_a_process_is_killed(tmp_path, tiny_model, victim, marker):
    run_dir, config = tmp_path / "run", tmp_path / "run.toml"
    # async_level 0: each step samples with the very weights the trainer trains next, so any
    # difference between what vLLM received and what the trainer holds shows as mismatch KL
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=MAX_STEPS, async_level=0, extra=f"""
[weight_transfer]
mode = "memory"

[ckpt]
interval = {INTERVAL}
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
    # every version was loaded, before and after the restart (checkpoint 4's from its folder)
    reloaded = sorted(r["weights/reloaded_step"] for r in orchestrator if "weights/reloaded_step" in r)
    assert reloaded == list(range(1, MAX_STEPS)), reloaded
    # the others were never written: only the checkpoint's and the last version are folders
    assert complete_steps(weights_dir(run_dir)) == [INTERVAL, MAX_STEPS]
    assert not announcement_path(run_dir).exists()
    assert "Creating weight transfer engine: PrimeRLWeightTransferEngine" in log_path(run_dir, "inference").read_text()
    # the trainer's private folder (the transfer store) is gone, the killed one's too
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "prime-rl-trainer-*"))) <= stores_before
