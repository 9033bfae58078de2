"""Launcher lifecycle with stand-in processes: failure naming, Ctrl-C, no orphans."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import new_tag, sigint_as_from_a_terminal, tagged_processes
from prime_rl.launch import launcher
from prime_rl.launch.launcher import ProcessSpec, TmuxView, tmux_session_name
from prime_rl.rundir import log_path
from prime_rl.observe.status import StatusOptions

# A parent that starts a grandchild in its own process group, like vLLM's API server.
SERVE_FOREVER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('serving', flush=True); time.sleep(600)"


def driver(run_dir, specs: str) -> str:
    return "\n".join([
        "import sys",
        "from pathlib import Path",
        "from prime_rl.launch.launcher import ProcessSpec, run",
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


def test_of_two_failures_seen_at_once_the_process_killed_by_a_signal_is_named(tmp_path):
    """Memory mode: a vLLM transfer fails the moment its trainer is killed, and the orchestrator
    exits with that error; the launcher names the killed trainer, the cause."""
    tag, go = new_tag(), tmp_path / "go"
    wait_go = f"import os, pathlib, signal, sys, time\nwhile not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\n"
    specs = f"""[
        ProcessSpec("orchestrator", [sys.executable, "-c", {wait_go + "sys.exit(1)"!r}]),
        ProcessSpec("trainer", [sys.executable, "-c", {wait_go + "os.kill(os.getpid(), signal.SIGKILL)"!r}]),
        ProcessSpec("starter", [sys.executable, "-c", {f"import pathlib, time; time.sleep(1); pathlib.Path({str(go)!r}).touch(); time.sleep(600)"!r}], required=False),
    ]"""
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    proc = subprocess.run([sys.executable, "-c", driver(tmp_path, specs)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "trainer failed: it was killed by SIGKILL" in proc.stderr, proc.stderr
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
    launcher = subprocess.Popen([sys.executable, "-c", driver(tmp_path, specs)], env=env, stderr=subprocess.PIPE, text=True,
                                preexec_fn=sigint_as_from_a_terminal)
    assert wait_until(lambda: len(tagged_processes(tag)) >= 5)  # driver + 3 children + grandchild
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) == 130
    assert "interrupted" in launcher.stderr.read()
    assert wait_until(lambda: tagged_processes(tag) == [], timeout=10), tagged_processes(tag)


# A parent that starts a program in a session of its own and exits, as an environment worker
# killed mid-episode leaves a v1 harness program (SubprocessRuntime: start_new_session=True).
ORPHAN_A_SESSION = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
                    "start_new_session=True); print('started', flush=True)")


def test_a_program_in_a_session_of_its_own_is_stopped_with_the_run_even_once_orphaned(tmp_path):
    """Neither the process groups nor PR_SET_PDEATHSIG reach it: the launcher, the run's child
    subreaper, gets it when its parent exits and stops it at the end, saying so in one line."""
    tag = new_tag()
    specs = f"""[
        ProcessSpec("inference", [sys.executable, "-c", {SERVE_FOREVER!r}], required=False),
        ProcessSpec("orchestrator", [sys.executable, "-c", {ORPHAN_A_SESSION!r}]),
        ProcessSpec("trainer", [sys.executable, "-c", "import time; time.sleep(2)"]),
    ]"""
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    proc = subprocess.run([sys.executable, "-c", driver(tmp_path, specs)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stopped 1 process(es) of the run outside its process groups (e.g. " in proc.stderr, proc.stderr
    assert tagged_processes(tag) == []


def test_a_launcher_run_in_process_adopts_orphans_only_while_it_runs(tmp_path):
    """A process that runs a launcher and goes on (this test session) must not stay a child
    subreaper: it would adopt, and never reap, every orphan of its later children. The run's
    adopted orphans that exited are reaped at the stop."""
    import ctypes

    def subreaper() -> bool:
        flag = ctypes.c_int(0)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        return bool(flag.value)

    orphaning = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'pass'])"  # exits before its child
    run = launcher.Launcher(tmp_path, [ProcessSpec("orchestrator", [sys.executable, "-c", orphaning])])
    run.start()
    assert subreaper()
    run.wait()
    time.sleep(0.5)  # the orphan exits, a zombie of ours until reaped
    run.stop()
    assert not subreaper()
    import psutil

    assert [c for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE] == []


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
    # A name tmux refuses as it is (`.`): the launcher opens the session under a safe name.
    named = "use_tmux=True, session_name='prime-rl-qwen0.6b'"
    script = driver(tmp_path / "run", specs).replace("use_tmux=False, session_name='unused'", named)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tmux attach -t prime-rl-qwen0_6b-786ceb`" in done.stdout and "headless" not in done.stderr, done.stderr
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


# --------------------------------------------------------------------------- tmux names, pane commands

SESSION_NAMES = ["prime-rl-qwen0.6b", "prime-rl-a:b", "prime-rl-my run", "prime-rl-it's \"q\"", "prime-rl-" + "x" * 300,
                 "prime-rl-ünï", "prime-rl-a\nb", "prime-rl-$(id)", ""]


# --------------------------------------------------------------------------- a server's private temporary directory


def socket_server(record: Path, then: str) -> str:
    """A stand-in vLLM: binds a UNIX socket in $VLLM_RPC_BASE_PATH, as vLLM binds its IPC ones
    (named by a uuid4), removes none, records where (written whole: a rename), then ``then``."""
    return "\n".join([
        "import json, os, socket, stat, uuid",
        "base = os.environ['VLLM_RPC_BASE_PATH']",
        "server = socket.socket(socket.AF_UNIX)",
        "server.bind(os.path.join(base, str(uuid.uuid4())))",
        "seen = {'base': base, 'mode': stat.S_IMODE(os.stat(base).st_mode), 'sockets': os.listdir(base)}",
        f"open({str(record)!r} + '.tmp', 'w').write(json.dumps(seen))",
        f"os.replace({str(record)!r} + '.tmp', {str(record)!r})",
        then,
    ])


def waiter(record: Path, then: str) -> str:
    """A trainer that says whether it got a directory too once the server recorded its socket, then ``then``."""
    return "\n".join([
        "import os, pathlib, time",
        f"record, deadline = pathlib.Path({str(record)!r}), time.monotonic() + 60",
        "while not record.exists() and time.monotonic() < deadline:",
        "    time.sleep(0.05)",
        "print('trainer directory:', os.environ.get('VLLM_RPC_BASE_PATH'), flush=True)",
        then,
    ])


@pytest.mark.parametrize("ending", ["stopped", "killed"])
def test_a_servers_sockets_go_with_the_private_directory_it_was_given(tmp_path, ending):
    """A process with ``tmp_dir_env`` (every vLLM server) finds a fresh directory there (0700,
    directly under the temporary directory, short enough for a socket), made at its start and
    removed once it stopped, with the sockets it left: at the end of the run (``stopped``) and
    when it dies by SIGKILL mid-run (``killed``). Other processes get none."""
    record = tmp_path / f"{ending}.json"
    # stopped: the server serves until the trainer finished; killed: it dies while the trainer works
    serve, die = "import time; time.sleep(600)", "import signal; os.kill(os.getpid(), signal.SIGKILL)"
    server, trainer = (serve, "pass") if ending == "stopped" else (die, serve)
    specs = f"""[
        ProcessSpec("inference", [sys.executable, "-c", {socket_server(record, server)!r}], required=False,
                    tmp_dir_env="VLLM_RPC_BASE_PATH"),
        ProcessSpec("trainer", [sys.executable, "-c", {waiter(record, trainer)!r}]),
    ]"""
    tag = new_tag()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"} | {"PRIME_RL_TEST_TAG": tag}
    proc = subprocess.run([sys.executable, "-c", driver(tmp_path, specs)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == (0 if ending == "stopped" else 1), proc.stderr
    seen = json.loads(record.read_text())
    base = Path(seen["base"])
    assert base.parent == Path(tempfile.gettempdir()) and base.name.startswith("prime-rl-inference-"), base
    assert seen["mode"] == 0o700 and len(seen["sockets"]) == 1
    assert len(os.fsencode(base)) + launcher.SOCKET_NAME_ROOM <= launcher.SOCKET_PATH_MAX
    assert not base.exists(), "the directory, and the socket in it, go with the server"
    assert "trainer directory: None" in (tmp_path / "logs" / "trainer.log").read_text()
    assert tagged_processes(tag) == []


def test_a_temporary_directory_too_long_for_a_socket_gives_way_to_tmp(tmp_path, monkeypatch):
    """Under a TMPDIR so long that a socket path in it would pass the 107 bytes a UNIX socket
    holds, the directory is made in /tmp instead."""
    long = tmp_path / ("t" * 90)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    path = Path(launcher.private_tmp_dir("inference"))
    try:
        assert path.parent == Path("/tmp") and list(long.iterdir()) == []
    finally:
        path.rmdir()


def test_a_directory_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch, capsys):
    stuck = tmp_path / "prime-rl-inference-x"
    stuck.mkdir()
    monkeypatch.setattr(launcher.shutil, "rmtree", lambda path, ignore_errors=False: None)
    launcher.remove_tmp_dir("inference", str(stuck))
    err = capsys.readouterr().err
    assert err == f"[prime-rl] warning: could not remove inference's temporary directory {stuck}\n"


def test_tmux_session_names_are_ones_tmux_accepts():
    import libtmux.common

    for name in SESSION_NAMES:
        safe = tmux_session_name(name)
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", safe), (name, safe)
        libtmux.common.session_check_name(safe)  # raises BadSessionName on `.` and `:`
        assert tmux_session_name(safe) == safe, "run() sanitizes again what a caller already did"
    assert tmux_session_name("prime-rl-ok_run-1") == "prime-rl-ok_run-1", "a safe short name is kept"
    assert tmux_session_name("prime-rl-qwen0.6b") != tmux_session_name("prime-rl-qwen0_6b"), "no two runs share a session"
    node = tmux_session_name("prime-rl-" + "y" * 300, "node1.cluster")
    assert node.endswith("-node1_cluster") and len(node) <= 64 and tmux_session_name(node) == node


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_tmux_takes_every_sanitized_name(tmp_path):
    """The real tmux, on a socket of the test's own: each name opens a session found by that name."""
    socket = str(tmp_path / "tmux.sock")
    try:
        for name in SESSION_NAMES:
            safe = tmux_session_name(name)
            subprocess.run(["tmux", "-S", socket, "new-session", "-d", "-s", safe, "sleep 30"], check=True, timeout=10)
            found = subprocess.run(["tmux", "-S", socket, "has-session", "-t", f"={safe}"], timeout=10)
            assert found.returncode == 0, safe
    finally:
        subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True, timeout=10)


# (run directory name, whether Python's repr quoting, as the panes had, lets the shell run it)
HOSTILE_DIRS = [("it's $(touch PWNED)", True), ("it's `touch PWNED`", True), ('a"b`touch PWNED`', False),
                ("x'; touch PWNED; echo '", False), ("$HOME ${PWD} \\ !", False), ("-n5", False),
                ("line\nbreak; touch PWNED", False)]


def pane_commands(run_dir: Path) -> list[tuple[str, list[str]]]:
    """(the shell line tmux runs, the argv it must mean) for a log pane and the status pane."""
    log = log_path(run_dir, "trainer")
    status = StatusOptions(max_steps=5, every_steps=0, interval_s=2.0)
    return [
        (TmuxView._follow(log), ["tail", "-n", "+1", "-F", f"--pid={os.getpid()}", "--", str(log)]),
        (status.pane_command(run_dir, 4321), [sys.executable, "-m", "prime_rl.observe.status", "--follow", "--pid", "4321",
                                              "--interval", "2", "--max-steps", "5", "--", str(run_dir)]),
    ]


def words_the_shell_sees(line: str, cwd: Path) -> list[str]:
    """Run ``line`` through `sh -c` with its words printed instead of executed (`printf`), so
    any substitution in it really runs, in ``cwd``."""
    out = subprocess.run(["sh", "-c", "printf '%s\\0' " + line], cwd=cwd, capture_output=True, timeout=10, check=True)
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("name, repr_runs_it", HOSTILE_DIRS)
def test_pane_commands_quote_every_word_for_the_shell(tmp_path, name, repr_runs_it):
    run_dir = tmp_path / name
    for line, argv in pane_commands(run_dir):
        assert words_the_shell_sees(line, tmp_path) == argv, line
        assert "\n" not in line or "'" in line
    assert not (tmp_path / "PWNED").exists(), "the shell ran a substitution from the run directory's name"
    if repr_runs_it:  # the test's teeth: with repr quoting, as before, the shell runs the name
        words_the_shell_sees(f"tail {str(log_path(run_dir, 'trainer'))!r}", tmp_path)
        assert (tmp_path / "PWNED").exists()


def test_a_view_tmux_cannot_open_leaves_the_run_headless(tmp_path, monkeypatch, capsys):
    """A tmux failure after the run directory is set up (it is marked by then) must not stop
    the run: one line says so and the run goes on headless."""
    class Broken:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("server exited unexpectedly\n(details)")

        @staticmethod
        def discard(name):
            pass

    monkeypatch.setattr(launcher, "TmuxView", Broken)
    specs = [ProcessSpec("trainer", [sys.executable, "-c", "print('trained')"])]
    assert launcher.run(tmp_path, specs, use_tmux=True, session_name="prime-rl-qwen0.6b") == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        "[prime-rl] tmux could not open session 'prime-rl-qwen0_6b-786ceb' (server exited unexpectedly (details)); running headless"
    ]
    assert "logs:" in out and "run finished" in out
    assert (tmp_path / "logs" / "trainer.log").read_text() == "trained\n"


@pytest.mark.parametrize("name", ["it's $(touch PWNED)", "a b`touch PWNED`", "line\ntouch PWNED"])
def test_the_slurm_job_script_never_runs_a_run_directory_name(tmp_path, name):
    """The sbatch script names the run directory in shell words (quoted) and in a comment and
    `#SBATCH` lines, where no quoting helps: a line break there is refused in one line."""
    from prime_rl.config import RLConfig
    from prime_rl.settings import ConfigError
    from prime_rl.launch.slurm import render, session_name

    run_dir = tmp_path / name
    config = RLConfig.model_validate({"model": "Qwen/Qwen3-0.6B", "batch_size": 64, "slurm": {"gpus_per_node": 8}})
    if "\n" in name:
        with pytest.raises(ConfigError, match="trainer.output_dir: .* holds a line break") as refused:
            render(config, run_dir, run_dir / "slurm" / "rl.json", python="/venv/python", workdir=tmp_path)
        assert len(str(refused.value).splitlines()) == 1
        return
    script = render(config, run_dir, run_dir / "slurm" / "rl.json", python="/venv/python", workdir=tmp_path)
    node_line = next(line for line in script.splitlines() if line.startswith("NODE=("))
    assert words_the_shell_sees(node_line.removeprefix("NODE=(").removesuffix(")"), tmp_path)[-1].startswith(str(run_dir))
    assert not (tmp_path / "PWNED").exists()
    assert re.fullmatch(r"[A-Za-z0-9_-]+", session_name(run_dir, "gpu1.cluster"))
