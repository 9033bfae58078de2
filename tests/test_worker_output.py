"""An environment in a worker process that prints megabytes: its output is cut off at the
cap, said once, and the worker's own lines still reach its log."""

import subprocess
import sys
from pathlib import Path

WORKER_DIR = Path(__file__).resolve().parents[1] / "src" / "orchestrator" / "worker"

CHATTY = f"""
import sys
sys.path.insert(0, {str(WORKER_DIR)!r})
from vfworker_util import cap_output, log
cap_output(cap=10_000)
for i in range(2_000):  # 2,000 prints of 100 characters, half of them on stderr: 200,000 in all
    print("x" * 99, file=sys.stderr if i % 2 else sys.stdout)
log("still here")
"""


def test_an_environments_output_is_cut_off_at_the_cap_said_once_and_the_workers_lines_go_on(tmp_path):
    log = tmp_path / "env.log"
    with open(log, "wb") as out:
        done = subprocess.run([sys.executable, "-c", CHATTY], stdout=out, stderr=subprocess.STDOUT, timeout=60)
    assert done.returncode == 0
    lines = log.read_text().splitlines()
    prints = [line for line in lines if line == "x" * 99]
    assert len(prints) == 100  # 10,000 characters: the first 100 prints, stdout and stderr together
    said = [line for line in lines if "the environment's output passed" in line]
    assert len(said) == 1 and "the rest is cut off (said once; the run goes on)" in said[0]
    assert lines[-1] == "[env-worker] still here"
