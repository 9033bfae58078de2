"""scripts/summarize_run.py: the quickstart's last step reads metrics.jsonl correctly."""

import subprocess
import sys

from helpers import REPO
from prime_rl.rundir import append_jsonl, metrics_path


def test_summary_reports_first_and_last_window(tmp_path):
    for step, reward in enumerate([0.1, 0.2, 0.3, 0.7, 0.8, 0.9]):
        append_jsonl(metrics_path(tmp_path), {"process": "orchestrator", "step": step, "time": step, "reward/mean": reward})
        append_jsonl(metrics_path(tmp_path), {"process": "trainer", "step": step, "time": step, "loss/mismatch_kl": 1e-8 * (step + 1)})
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "summarize_run.py"), str(tmp_path), "--window", "3"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "first 3 steps: 0.200" in out
    assert "last 3 steps:  0.800   (change +0.600)" in out
    assert "at the first step (step 0): 1.00e-08" in out


def test_summary_of_an_empty_run_fails_clearly(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_run.py"), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "no orchestrator/trainer rows" in proc.stderr
