"""Start inference, orchestrator and trainer as three processes sharing a run directory.

The launcher owns the lifecycle: every child runs in its own process group (so vLLM's
engine processes are stopped with it) and dies with the launcher (PR_SET_PDEATHSIG).
If a child exits non-zero, or inference exits at all while the others work, the
launcher stops the other two, names the failed process and shows the end of its log.
When trainer and orchestrator finish, it stops inference. Ctrl-C stops all three.

A process marked ``terminal`` (`prime-rl eval`'s eval process, whose output is the result)
writes to the launcher's stdout and stderr instead of a log file.

With tmux, the launcher opens a session with one pane per process that follows that
process's log (libtmux); the processes themselves stay children of the launcher, so
nothing escapes its control and the session is removed at the end.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.rundir import log_path

STOP_GRACE_S = 15.0


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # The run is done when every `required` process has exited 0; the others (inference)
    # serve until then and their exit before that is a failure.
    required: bool = True
    # Write to the launcher's own stdout/stderr instead of RUN/logs/<name>.log: for a process
    # whose output is the result (`prime-rl eval`'s progress bar and tables). Its stdin stays
    # closed and it still runs in its own process group, so Ctrl-C reaches the launcher only.
    terminal: bool = False


class ProcessFailed(RuntimeError):
    def __init__(self, name: str, code: int, log: Path | None):
        self.name, self.code, self.log = name, code, log
        super().__init__(f"{name} {describe_exit(code)}")


def describe_exit(code: int) -> str:
    """`exited with code 1`, or `was killed by SIGKILL` for a negative Popen return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _die_with_parent() -> None:
    """Child-side: get SIGTERM if the launcher dies, so no process outlives it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return f"(no log at {path})\n"


class Launcher:
    def __init__(self, run_dir: Path, specs: list[ProcessSpec], poll_s: float = 0.5):
        self.run_dir = Path(run_dir)
        self.specs = specs
        self.poll_s = poll_s
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        for spec in self.specs:
            if spec.terminal:
                self.procs[spec.name] = self._popen(spec, stdout=None, stderr=None)  # inherit ours
                continue
            log = log_path(self.run_dir, spec.name)
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as out:
                self.procs[spec.name] = self._popen(spec, stdout=out, stderr=subprocess.STDOUT)

    @staticmethod
    def _popen(spec: ProcessSpec, stdout, stderr) -> subprocess.Popen:
        return subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def wait(self) -> None:
        """Block until the run is done; raise ProcessFailed naming the first failure."""
        required = {s.name for s in self.specs if s.required}
        while True:
            for spec in self.specs:
                code = self.procs[spec.name].poll()
                if code is None:
                    continue
                if code != 0 or not spec.required:
                    raise ProcessFailed(spec.name, code, None if spec.terminal else log_path(self.run_dir, spec.name))
            # A node that only serves (a SLURM inference node) runs until it is stopped.
            if required and all(self.procs[name].poll() == 0 for name in required):
                return
            time.sleep(self.poll_s)

    def stop(self) -> None:
        """SIGTERM every process group, then SIGKILL what is left after the grace period."""
        for proc in self.procs.values():
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Also reaps grandchildren (vLLM's engine core) whose leader already exited.
        for proc in self.procs.values():
            _signal_group(proc.pid, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------- tmux


class TmuxView:
    """One tmux session, one pane per process following its log."""

    def __init__(self, session_name: str, run_dir: Path, names: list[str]):
        import libtmux

        self.server = libtmux.Server()
        if self.server.has_session(session_name):
            self.server.kill_session(session_name)
        logs = [log_path(run_dir, n) for n in names]
        for log in logs:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.touch()
        self.session = self.server.new_session(
            session_name=session_name, window_name="prime-rl", attach=False, window_command=self._follow(logs[0])
        )
        window = self.session.active_window
        pane = window.active_pane
        for log in logs[1:]:  # split the newest pane so panes stay in process order
            pane = pane.split(shell=self._follow(log))
        window.select_layout("even-vertical")
        for pane, name in zip(window.panes, names):
            pane.cmd("select-pane", "-T", name)
        window.set_option("pane-border-status", "top")
        self.name = session_name

    @staticmethod
    def _follow(log: Path) -> str:
        """A pane's command: follow the log while the launcher lives. When the launcher dies,
        even by SIGKILL (a SLURM step's end), the panes end, and with them the session and
        the tmux server: nothing outlives the run."""
        return f"tail -n +1 -F --pid={os.getpid()} {str(log)!r}"

    def close(self) -> None:
        try:
            if self.server.has_session(self.name):
                self.server.kill_session(self.name)
        except Exception:  # noqa: BLE001 - the tmux server may already be gone
            pass


def tmux_available() -> bool:
    return shutil.which("tmux") is not None


# --------------------------------------------------------------------------- entry


def run(
    run_dir: Path, specs: list[ProcessSpec], use_tmux: bool, session_name: str, exit_code_from: str | None = None,
    follow: tuple[str, ...] = (),
) -> int:
    """Run the processes to completion; returns the launcher's exit code: 0, 130 after Ctrl-C,
    else 1, or the failed process's own exit code when it is ``exit_code_from`` (`prime-rl
    eval` passes on its eval process's 2 = config error, 1 = runtime failure). ``follow``
    names more logs for tmux panes: ones a process's own children write (environment workers,
    `RUN/logs/env-<name>.log`)."""
    launcher = Launcher(run_dir, specs)
    view = None
    logged = [s.name for s in specs if not s.terminal]
    if use_tmux:
        view = TmuxView(session_name, run_dir, logged + list(follow))
        print(f"[prime-rl] tmux session {session_name!r}: attach with `tmux attach -t {session_name}`", flush=True)
    elif logged:
        names = logged[0] if len(logged) == 1 else f"{{{','.join(logged)}}}"
        print(f"[prime-rl] logs: {run_dir / 'logs'}/{names}.log", flush=True)

    def on_term(signum, frame):  # SIGTERM behaves like Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        launcher.start()
        launcher.wait()
        print("[prime-rl] run finished", flush=True)
        return 0
    except ProcessFailed as e:
        print(f"[prime-rl] {e.name} failed: it {describe_exit(e.code)}; stopping the other processes", file=sys.stderr, flush=True)
        if e.log is not None:  # a terminal process's last lines are already on screen
            print(f"[prime-rl] last lines of {e.log}:\n{tail(e.log)}", file=sys.stderr, flush=True)
        return e.code if e.name == exit_code_from and e.code > 0 else 1
    except KeyboardInterrupt:
        print("[prime-rl] interrupted; stopping all processes", file=sys.stderr, flush=True)
        return 130
    finally:
        launcher.stop()
        if view is not None:
            view.close()
        signal.signal(signal.SIGTERM, previous)
