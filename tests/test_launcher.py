"""Launcher lifecycle with stand-in processes: failure naming, Ctrl-C, no orphans."""

import os
import signal
import subprocess
import sys
import time

from helpers import new_tag, tagged_processes

# A parent that starts a grandchild in its own process group, like vLLM's API server.
SERVE_FOREVER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('serving', flush=True); time.sleep(600)"


def driver(run_dir, specs: str) -> str:
    return "\n".join([
        "import sys",
        "from pathlib import Path",
        "from prime_rl.launcher import ProcessSpec, run",
        f"specs = {' '.join(specs.split())}",
        f"sys.exit(run(Path({str(run_dir)!r}), specs, use_tmux=False, session_name='unused'))",
    ])


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def fail_once_serving(run_dir) -> str:
    """A trainer that fails once inference has said 'serving' in its log (a ready file, not a
    sleep: the failure must come after inference is up however slow the machine is)."""
    log = run_dir / "logs" / "inference.log"
    return "\n".join([
        "import pathlib, sys, time",
        f"log, deadline = pathlib.Path({str(log)!r}), time.monotonic() + 60",
        "while not (log.exists() and 'serving' in log.read_text()) and time.monotonic() < deadline:",
        "    time.sleep(0.05)",
        "print('loss exploded', flush=True)",
        "sys.exit(3)",
    ])


def test_failure_stops_the_others_and_names_the_failed_process(tmp_path):
    tag = new_tag()
    specs = f"""[
        ProcessSpec("inference", [sys.executable, "-c", {SERVE_FOREVER!r}], required=False),
        ProcessSpec("orchestrator", [sys.executable, "-c", "import time; time.sleep(600)"]),
        ProcessSpec("trainer", [sys.executable, "-c", {fail_once_serving(tmp_path)!r}]),
    ]"""
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    proc = subprocess.run([sys.executable, "-c", driver(tmp_path, specs)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "trainer failed: it exited with code 3" in proc.stderr
    assert "loss exploded" in proc.stderr, "the end of the failed process's log is shown"
    assert (tmp_path / "logs" / "inference.log").read_text().startswith("serving")
    assert tagged_processes(tag) == []


def test_success_when_required_processes_finish_and_server_is_stopped(tmp_path):
    tag = new_tag()
    specs = f"""[
        ProcessSpec("inference", [sys.executable, "-c", {SERVE_FOREVER!r}], required=False),
        ProcessSpec("orchestrator", [sys.executable, "-c", "print('done')"]),
        ProcessSpec("trainer", [sys.executable, "-c", "import time; time.sleep(1)"]),
    ]"""
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    proc = subprocess.run([sys.executable, "-c", driver(tmp_path, specs)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert tagged_processes(tag) == []


def test_ctrl_c_stops_everything(tmp_path):
    tag = new_tag()
    specs = f"""[
        ProcessSpec("inference", [sys.executable, "-c", {SERVE_FOREVER!r}], required=False),
        ProcessSpec("orchestrator", [sys.executable, "-c", "import time; time.sleep(600)"]),
        ProcessSpec("trainer", [sys.executable, "-c", "import time; time.sleep(600)"]),
    ]"""
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    launcher = subprocess.Popen([sys.executable, "-c", driver(tmp_path, specs)], env=env, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: len(tagged_processes(tag)) >= 5)  # driver + 3 children + grandchild
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) == 130
    assert "interrupted" in launcher.stderr.read()
    assert wait_until(lambda: tagged_processes(tag) == [], timeout=10), tagged_processes(tag)


def test_children_die_with_a_killed_launcher(tmp_path):
    tag = new_tag()
    specs = """[
        ProcessSpec("inference", [sys.executable, "-c", "import time; time.sleep(600)"], required=False),
        ProcessSpec("orchestrator", [sys.executable, "-c", "import time; time.sleep(600)"]),
        ProcessSpec("trainer", [sys.executable, "-c", "import time; time.sleep(600)"]),
    ]"""
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    launcher = subprocess.Popen([sys.executable, "-c", driver(tmp_path, specs)], env=env)
    assert wait_until(lambda: len(tagged_processes(tag)) >= 4)
    launcher.kill()
    launcher.wait(timeout=10)
    assert wait_until(lambda: tagged_processes(tag) == [], timeout=10), tagged_processes(tag)


def test_with_tmux_nothing_of_the_run_is_left_the_moment_the_launcher_returns(tmp_path):
    """The launcher ends its tmux session itself and waits for its panes (`tail --pid`) and,
    where that session was the server's last, the tmux server: a check right after it
    returns finds nothing (a SLURM node's check once saw the session alive a second longer).
    A tmux server of the user's with other sessions keeps running."""
    tag = new_tag()
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag, "TMUX_TMPDIR": str(tmp_path)}  # a tmux server of the test's own
    env.pop("TMUX", None)
    specs = '[ProcessSpec("trainer", [sys.executable, "-c", "print(1)"])]'
    script = driver(tmp_path / "run", specs).replace("use_tmux=False, session_name='unused'", "use_tmux=True, session_name='t'")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert tagged_processes(tag) == []

    subprocess.run(["tmux", "new-session", "-d", "-s", "users", "sleep 600"], env=env, check=True)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        left = tagged_processes(tag)
        assert left and all("tail" not in cmd for _, cmd in left), left  # the user's server and session stay
        sessions = subprocess.run(["tmux", "ls", "-F", "#{session_name}"], env=env, capture_output=True, text=True).stdout
        assert sessions.split() == ["users"]
    finally:
        subprocess.run(["tmux", "kill-server"], env=env)
