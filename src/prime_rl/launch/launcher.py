"""Start inference, orchestrator and trainer as three processes sharing a run directory.

The launcher owns the lifecycle: every child runs in its own process group (so vLLM's
engine processes are stopped with it) and dies with the launcher (PR_SET_PDEATHSIG).
If a child exits non-zero, or inference exits at all while the others work, the
launcher stops the other two, names the failed process and shows the end of its log.
When trainer and orchestrator finish, it stops inference. Ctrl-C stops all three.

With a watchdog (``[watchdog]``), it also reads each process's heartbeat
(``prime_rl.heartbeat``) every poll: when no process has made progress for ``report_s`` it
prints what each one is doing or waiting for, and after ``timeout_s`` it stops the run with
``Stalled``, so that a run whose processes are all alive but stuck never hangs silently.

Every poll it also looks for the kernel's out-of-memory killer among the run's processes,
descendants included (``prime_rl.launch.oom``: the kernel log, the cgroup's OOM kill count,
or a SIGKILL while memory was low), walking their trees every few seconds for their memory.
An OOM kill stops the run with ``OutOfMemory``: one line naming the victim and the run's
biggest memory users, and exit code 137 (128 + SIGKILL, what container runtimes report for
an OOM kill, so a job script can requeue the run with ``--resume``). Every run ends with a
line saying its peak memory. Every process it starts gets the launcher's pid in
``PRIME_RL_LAUNCHER_PID`` (``prime_rl.procmem.run_root``: the root of the run's tree).

A process marked ``terminal`` (`prime-rl eval`'s eval process, whose output is the result)
writes to the launcher's stdout and stderr instead of a log file.

A process with a ``tmp_dir_env`` (every vLLM server: ``TMPDIR``, where vLLM binds its ZeroMQ
IPC sockets and writes its init file, and leaves them, even on a clean exit; a trainer under
torchrun, which leaves its `torchelastic_*` log folder there) gets a private directory of its
own in that variable, made when it starts and removed once it stopped, so a run leaves nothing
in /tmp (``private_tmp_dir``).

With tmux, the launcher opens a session with one pane per process that follows that
process's log (libtmux); the processes themselves stay children of the launcher, so
nothing escapes its control and the session is removed at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from prime_rl.cores import RUN_CORES_ENV, format_cores
from prime_rl.heartbeat import Beat, heartbeat_path, read_heartbeats
from prime_rl.keys import private_opener
from prime_rl.launch.oom import OomKill, RunMemory
from prime_rl.procmem import LAUNCHER_PID_ENV
from prime_rl.rundir import log_path
from prime_rl.observe.status import StatusOptions, StatusPrinter, record_event

if TYPE_CHECKING:
    from prime_rl.config import WatchdogConfig

STOP_GRACE_S = 15.0
OOM_EXIT_CODE = 137  # 128 + SIGKILL: what container runtimes report for an out-of-memory kill

# A UNIX socket's path holds at most 107 bytes (sun_path's 108, less the closing NUL), and vLLM
# names each IPC socket by a uuid4 in its directory (vllm.utils.network_utils.get_open_zmq_ipc_path):
# a private directory must leave 37 bytes of room for "/<uuid4>".
SOCKET_PATH_MAX = 107
SOCKET_NAME_ROOM = 37


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
    # The run does not depend on it (the dashboard): its exit is reported once, the run goes on.
    essential: bool = True
    # An environment variable the launcher sets to a private directory (0700) of this process's
    # own, made at its start and removed once it stopped (``private_tmp_dir``): for a vLLM
    # server, TMPDIR, whose sockets and init files would otherwise pile up in /tmp.
    tmp_dir_env: str | None = None
    # Cores the process starts on, fewer than the launcher's own: it takes back the launcher's
    # (``prime_rl.cores.RUN_CORES_ENV``) once it is ready (`deployment.cpu_vllm_first`).
    start_cores: frozenset[int] | None = None


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


def become_subreaper(on: bool = True) -> None:
    """Take the run's orphans: a descendant whose parent exits (a v1 harness program, in a
    session of its own, whose environment worker was killed) is reparented to the launcher,
    not to init, so ``Launcher.stop`` still finds and stops it (PR_SET_CHILD_SUBREAPER).
    ``Launcher.stop`` turns it off again: a process that runs a launcher and goes on (a test
    session) would otherwise adopt, and never reap, every orphan of its later children."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, int(on), 0, 0, 0)  # 36 = PR_SET_CHILD_SUBREAPER


def child_pids() -> set[int]:
    with contextlib.suppress(psutil.Error):
        return {child.pid for child in psutil.Process().children()}
    return set()


def reap_adopted(own: set[int]) -> None:
    """Collect the exit status of orphans adopted while the run ran that have exited since
    (zombies until their new parent waits for them). ``own``: children that are not orphans
    (the launched processes, waited for by Popen; those the process had before the run)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            if child.pid not in own:
                with contextlib.suppress(ChildProcessError, OSError, psutil.Error):
                    if child.status() == psutil.STATUS_ZOMBIE:
                        os.waitpid(child.pid, os.WNOHANG)


def strays(launched: set[int]) -> list[psutil.Process]:
    """The run's processes still alive outside the launched ones: descendants of the launcher
    (its orphans reparented to it included) that carry its pid in ``LAUNCHER_PID_ENV``, which
    every process of the run inherits (a tmux server the launcher started does not)."""
    mine = str(os.getpid())
    found = []
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process().children(recursive=True):
            if proc.pid in launched:
                continue
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(LAUNCHER_PID_ENV) == mine and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
    return found


def stop_strays(launched: set[int], grace_s: float = 2.0) -> list[str]:
    """SIGTERM the run's stray processes (``strays``), SIGKILL those left after ``grace_s``,
    and reap them; their command lines, shortened, for one line of output."""
    found, names = strays(launched), []
    for proc in found:
        with contextlib.suppress(psutil.Error):
            names.append(shlex.join(proc.cmdline())[:80])
            proc.terminate()
    _, alive = psutil.wait_procs(found, timeout=grace_s)  # reaps those that are our children now
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return names


def start_child(cores: frozenset[int] | None) -> None:
    """Child-side, before exec: ``die_with_parent``, on ``cores`` when given."""
    die_with_parent()
    if cores is not None:
        os.sched_setaffinity(0, cores)


def die_with_parent() -> None:
    """Child-side: get SIGTERM if the launcher dies, so no process outlives it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def private_tmp_dir(name: str) -> str:
    """A fresh directory (mode 0700) for one process's temporary files, short enough for a
    socket in it: under the temporary directory (TMPDIR, else /tmp: where vLLM's sockets went
    before), or /tmp when TMPDIR's path is too long; never under the run directory, whose path
    may be too long for a socket."""
    for base in (tempfile.gettempdir(), "/tmp"):
        path = tempfile.mkdtemp(prefix=f"prime-rl-{name}-", dir=base)
        if len(os.fsencode(path)) + SOCKET_NAME_ROOM <= SOCKET_PATH_MAX:
            return path
        os.rmdir(path)
    raise OSError(f"{path}: too long for a UNIX socket in it ({SOCKET_PATH_MAX} bytes at most)")


def remove_tmp_dir(name: str, path: str) -> None:
    """Remove a process's private directory once it stopped; a failure is one line, never an error."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        print(f"[prime-rl] warning: could not remove {name}'s temporary directory {path}", file=sys.stderr, flush=True)


def tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return f"(no log at {path})\n"


class Stalled(RuntimeError):
    """The watchdog's verdict: no process made progress for ``timeout_s``."""

    def __init__(self, idle_s: float, timeout_s: float):
        self.idle_s, self.timeout_s = idle_s, timeout_s
        super().__init__(f"no process made progress for {idle_s:.0f} s (watchdog.timeout_s = {timeout_s:g})")


class OutOfMemory(RuntimeError):
    """The kernel's out-of-memory killer took one of the run's processes; the message is the
    one line that says which, and what held the memory (``prime_rl.launch.oom``)."""

    def __init__(self, kill: OomKill, line: str, log: Path | None):
        self.kill, self.log = kill, log  # log: the victim's own, when it is a launched process
        super().__init__(line)


class Launcher:
    def __init__(
        self, run_dir: Path, specs: list[ProcessSpec], poll_s: float = 0.5, watchdog: WatchdogConfig | None = None
    ):
        self.run_dir = Path(run_dir)
        self.specs = specs
        self.poll_s = poll_s
        self.procs: dict[str, subprocess.Popen] = {}
        on = watchdog is not None and (watchdog.report_s > 0 or watchdog.timeout_s > 0)
        self.watchdog = watchdog if on else None
        self.started_unix = time.time()
        self.reported_unix: float | None = None
        self.printer: StatusPrinter | None = None  # a headless run's periodic status (prime_rl.observe.status)
        self.memory: RunMemory | None = None  # the census and the OOM check, from start() on
        self.tmp_dirs: dict[str, str] = {}  # each started process's private directory (tmp_dir_env)
        self.children_before: set[int] = set()  # children this process had before start(): not the run's orphans

    def start(self) -> None:
        self.started_unix = time.time()
        for spec in self.specs:  # a previous run's heartbeat would speak for this one
            with contextlib.suppress(OSError):
                heartbeat_path(self.run_dir, spec.name).unlink(missing_ok=True)
        self.memory = RunMemory(self.run_dir, self.started_unix)  # before any process: its kills are the run's
        self.children_before = child_pids()
        become_subreaper()
        for spec in self.specs:
            if spec.terminal:
                self.procs[spec.name] = self._popen(spec, stdout=None, stderr=None)  # inherit ours
                continue
            log = log_path(self.run_dir, spec.name)
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab", opener=private_opener) as out:  # an error line may quote a config's secret
                self.procs[spec.name] = self._popen(spec, stdout=out, stderr=subprocess.STDOUT)

    def _popen(self, spec: ProcessSpec, stdout, stderr) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_PID_ENV: str(os.getpid()), **spec.env}
        if spec.tmp_dir_env is not None:  # made here, not in the spec: a dry run makes none
            env[spec.tmp_dir_env] = self.tmp_dirs[spec.name] = private_tmp_dir(spec.name)
        if spec.start_cores is not None:
            env[RUN_CORES_ENV] = format_cores(os.sched_getaffinity(0))
        return subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=env,
            start_new_session=True,
            preexec_fn=functools.partial(start_child, spec.start_cores),
        )

    def wait(self) -> None:
        """Block until the run is done; raise ProcessFailed naming the first failure."""
        required = {s.name for s in self.specs if s.required}
        reported: set[str] = set()
        while True:
            self.check_memory()
            failed: list[tuple[ProcessSpec, int]] = []
            for spec in self.specs:
                code = self.procs[spec.name].poll()
                if code is None:
                    continue
                if not spec.essential:
                    if spec.name not in reported:
                        reported.add(spec.name)
                        print(f"[prime-rl] {spec.name} {describe_exit(code)} (see {log_path(self.run_dir, spec.name)}); "
                              "the run goes on without it", file=sys.stderr, flush=True)
                    continue
                if code != 0 or not spec.required:
                    failed.append((spec, code))
            if failed:
                # One killed by a signal is named first: the others' errors may follow from it
                # within milliseconds (memory mode: a worker's transfer fails as its trainer dies).
                spec, code = min(failed, key=lambda failure: failure[1] >= 0)
                if code == -signal.SIGKILL:  # the OOM killer's signal: raises OutOfMemory when it was
                    self.check_memory({spec.name: self.procs[spec.name].pid})
                raise ProcessFailed(spec.name, code, None if spec.terminal else log_path(self.run_dir, spec.name))
            # A node that only serves (a SLURM inference node) runs until it is stopped.
            if required and all(self.procs[name].poll() == 0 for name in required):
                return
            if self.watchdog is not None:
                self.watch()
            if self.printer is not None:
                self.printer.poll()
            time.sleep(self.poll_s)

    def check_memory(self, sigkilled: dict[str, int] | None = None) -> None:
        """One OOM check (and a census when one is due); raise OutOfMemory when the kernel's
        OOM killer took a process of the run. ``sigkilled``: launched processes that just
        exited by SIGKILL. A check that fails turns the census off, in one line: the run goes on."""
        if self.memory is None:
            return
        launched = {name: proc.pid for name, proc in self.procs.items()}
        try:
            kill = self.memory.check(launched, time.time(), sigkilled)
        except Exception as e:  # noqa: BLE001 - monitoring never stops a run
            self.memory = None
            print(f"[prime-rl] the memory census failed ({type(e).__name__}: {e}); the run goes on without it",
                  file=sys.stderr, flush=True)
            return
        if kill is None:
            return
        spec = next((s for s in self.specs if launched.get(s.name) == kill.pid), None)
        log = log_path(self.run_dir, spec.name) if spec is not None and not spec.terminal else None
        raise OutOfMemory(kill, self.memory.report(kill), log)

    def peak_fields(self) -> dict:
        """``peak_memory_gb`` for the launcher's ending events, when the census measured one."""
        peak = self.memory.peak_gb() if self.memory is not None else None
        return {"peak_memory_gb": peak} if peak is not None else {}

    def print_peak(self) -> None:
        line = self.memory.peak_line() if self.memory is not None else None
        if line is not None:
            print(f"[prime-rl] {line}", flush=True)

    def watch(self) -> None:
        """One watchdog check: print the report when one is due, raise Stalled at the timeout."""
        now = time.time()
        beats = read_heartbeats(self.run_dir, [s.name for s in self.specs])
        finished = {name for name, proc in self.procs.items() if proc.poll() == 0}
        serving = {s.name for s in self.specs if not s.required}
        verdict = judge(beats, finished, serving, self.started_unix, now, self.watchdog.report_s,
                        self.watchdog.timeout_s, self.reported_unix)
        if verdict.action == "ok":
            return
        print(f"[prime-rl] watchdog: no process made progress for {verdict.idle_s:.0f} s", flush=True)
        for line in verdict.lines:
            print(f"[prime-rl]   {line}", flush=True)
        self.reported_unix = now
        if verdict.action == "fail":
            raise Stalled(verdict.idle_s, self.watchdog.timeout_s)

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
        # What left the process groups behind: programs in sessions of their own (v1's harness programs)
        stopped = stop_strays({proc.pid for proc in self.procs.values()})
        if stopped:
            print(f"[prime-rl] stopped {len(stopped)} process(es) of the run outside its process groups "
                  f"(e.g. {stopped[0]})", file=sys.stderr, flush=True)
        reap_adopted({proc.pid for proc in self.procs.values()} | self.children_before)
        become_subreaper(False)
        # Only now that nothing of theirs runs: a live vLLM binds new sockets there (a handshake).
        for name, path in self.tmp_dirs.items():
            remove_tmp_dir(name, path)
        self.tmp_dirs.clear()
        if self.memory is not None:
            with contextlib.suppress(OSError):
                self.memory.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------- watchdog


@dataclass(frozen=True)
class Verdict:
    action: str  # "ok" (nothing to say), "report" (print the lines), "fail" (print them, stop the run)
    idle_s: float  # seconds since the newest progress of any process (or the launch)
    lines: tuple[str, ...] = ()


def judge(
    beats: dict[str, Beat | None], finished: set[str], serving: set[str], started_unix: float, now: float,
    report_s: float, timeout_s: float, reported_unix: float | None,
) -> Verdict:
    """The watchdog's decision, pure: ``beats`` per process (None: no heartbeat), the ones that
    ``finished`` (exited 0) and the ones ``serving`` (inference: vLLM writes no heartbeat), the
    launch time, the last report's time. Progress is the newest ``progress_unix`` of any process,
    the launch counting as progress; 0 turns ``report_s`` or ``timeout_s`` off."""
    newest = max([started_unix] + [b.progress_unix for b in beats.values() if b is not None])
    idle = max(0.0, now - newest)
    if timeout_s > 0 and idle >= timeout_s:
        return Verdict("fail", idle, status_lines(beats, finished, serving, now))
    report_due = reported_unix is None or now - reported_unix >= report_s
    if report_s > 0 and idle >= report_s and report_due:
        return Verdict("report", idle, status_lines(beats, finished, serving, now))
    return Verdict("ok", idle)


def status_lines(beats: dict[str, Beat | None], finished: set[str], serving: set[str], now: float) -> tuple[str, ...]:
    """One line per process: what it waits for, or its last progress, or that it has no heartbeat."""
    return tuple(f"{name}: {status(beat, name in finished, name in serving, now)}" for name, beat in beats.items())


def status(beat: Beat | None, finished: bool, serving: bool, now: float) -> str:
    if finished:
        return "finished"
    if beat is None:
        return "serving (no heartbeat)" if serving else "no heartbeat"
    detail = f"; {beat.detail}" if beat.detail else ""  # what is in flight (the orchestrator's episodes)
    if beat.waiting_for is not None:
        since = time.strftime("%H:%M:%S", time.localtime(beat.waiting_since))
        return f"waiting for {beat.waiting_for} since {since} ({now - beat.waiting_since:.0f} s){detail}"
    return f'last progress "{beat.progress}" {now - beat.progress_unix:.0f} s ago{detail}'


# --------------------------------------------------------------------------- tmux


CLOSE_TIMEOUT_S = 5.0  # how long closing the tmux view waits for its panes and server to exit


class TmuxView:
    """One tmux session, one pane per process following its log."""

    def __init__(self, session_name: str, run_dir: Path, names: list[str], extra: tuple[tuple[str, str], ...] = ()):
        """A pane per process log of ``names``, then one per ``extra`` (title, command)."""
        import libtmux

        self.server = libtmux.Server()
        if self.server.has_session(session_name):
            self.server.kill_session(session_name)
        logs = [log_path(run_dir, n) for n in names]
        for log in logs:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.touch()
        commands = [self._follow(log) for log in logs] + [command for _, command in extra]
        self.session = self.server.new_session(  # sized for 4 readable panes until a client attaches
            session_name=session_name, window_name="prime-rl", attach=False, window_command=commands[0], x=160, y=50
        )
        window = self.session.active_window
        pane = window.active_pane
        for command in commands[1:]:  # split the newest pane so panes stay in process order
            pane = pane.split(shell=command)
        window.select_layout("even-vertical")
        for pane, name in zip(window.panes, names + [title for title, _ in extra]):
            pane.cmd("select-pane", "-T", name)
        window.set_option("pane-border-status", "top")
        self.name = session_name

    @staticmethod
    def discard(session_name: str) -> None:
        """Kill the session ``session_name`` if it exists (what a failed ``__init__`` made)."""
        import libtmux

        server = libtmux.Server()
        if server.has_session(session_name):
            server.kill_session(session_name)

    @staticmethod
    def _follow(log: Path) -> str:
        """A pane's command: follow the log while the launcher lives. When the launcher dies,
        even by SIGKILL (a SLURM step's end), the panes end, and with them the session and
        the tmux server: nothing outlives the run."""
        # shlex, never repr: a run directory named `it's $(touch X)` is one word to the shell
        # tmux runs the pane in, not a quote to close and a command to substitute.
        # `--`: a relative run directory named `-n5` stays a file name.
        return shlex.join(["tail", "-n", "+1", "-F", f"--pid={os.getpid()}", "--", str(log)])

    def close(self) -> None:
        """End the session, and return once its panes' processes are gone, and the tmux
        server too where this session was its last (it exits on its own then): nothing of
        the run is left the moment the launcher returns (bounded: ``CLOSE_TIMEOUT_S``)."""
        panes, server = [], []
        try:
            if self.server.has_session(self.name):
                panes = _processes(int(pane.pane_pid) for pane in self.session.panes)
                server = _processes([int(self.server.cmd("display-message", "-p", "#{pid}").stdout[0])])
                self.server.kill_session(self.name)
                if self.server.sessions:  # a tmux server of the user's, with other sessions: it stays
                    server = []
        except Exception:  # noqa: BLE001 - the tmux server may already be gone
            pass
        psutil.wait_procs(panes + server, timeout=CLOSE_TIMEOUT_S)


def _processes(pids) -> list:
    """psutil handles of the processes among ``pids`` that still exist."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


def tmux_available() -> bool:
    return shutil.which("tmux") is not None


SESSION_NAME_MAX = 64  # tmux sets no limit; this keeps `tmux ls` and the attach line readable
NODE_SUFFIX_MAX = 24


def tmux_session_name(name: str, suffix: str = "") -> str:
    """``name`` (then ``-suffix``: a SLURM node) as a tmux session name of at most
    ``SESSION_NAME_MAX`` characters. tmux and libtmux refuse `.` and `:`, and a space or quote
    would need quoting in the `tmux attach -t` line we print, so every character outside
    ``[A-Za-z0-9_-]`` becomes `_`. A name that had to change or be shortened ends in 6 hex
    digits of its hash, so two run directories (`qwen0.6b`, `qwen0_6b`) never share a session
    (the launcher replaces a session of its own name). The suffix is only made safe, so a user
    can still write it by hand. A name this returns comes back unchanged."""
    budget = SESSION_NAME_MAX - (1 + NODE_SUFFIX_MAX if suffix else 0)
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    if safe != name or not 0 < len(safe) <= budget:
        digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:6]
        safe = f"{safe[:budget - 7] or 'prime-rl'}-{digest}"
    return safe + (f"-{re.sub(r'[^A-Za-z0-9_-]', '_', suffix)[:NODE_SUFFIX_MAX]}" if suffix else "")


def open_view(session_name: str, run_dir: Path, names: list[str], extra: tuple[tuple[str, str], ...]) -> TmuxView | None:
    """The tmux view, or None (the run goes on headless, said in one line) when tmux cannot
    open it: the run directory is marked and set up by now, and a view must never be what
    stops a run (nor leave a half-made session behind)."""
    try:
        view = TmuxView(session_name, run_dir, names, extra)
    except Exception as e:  # noqa: BLE001 - libtmux raises its own errors, tmux's and OSError
        with contextlib.suppress(Exception):
            TmuxView.discard(session_name)
        reason = " ".join(str(e).split()) or type(e).__name__
        print(f"[prime-rl] tmux could not open session {session_name!r} ({reason}); running headless", file=sys.stderr, flush=True)
        return None
    print(f"[prime-rl] tmux session {session_name!r}: attach with `tmux attach -t {session_name}`", flush=True)
    return view


# --------------------------------------------------------------------------- entry


def run(
    run_dir: Path, specs: list[ProcessSpec], use_tmux: bool, session_name: str, exit_code_from: str | None = None,
    follow: tuple[str, ...] = (), watchdog: WatchdogConfig | None = None, status: StatusOptions | None = None,
) -> int:
    """Run the processes to completion; returns the launcher's exit code: 0, 130 after Ctrl-C,
    137 when the kernel's out-of-memory killer took one of the run's processes (128 + SIGKILL,
    what container runtimes report for an OOM kill, so a job script can requeue the run with
    `--resume`), else 1, or the failed process's own exit code when it is ``exit_code_from``
    (`prime-rl eval` passes on its eval process's 2 = config error, 1 = runtime failure). ``follow``
    names more logs for tmux panes: ones a process's own children write (environment workers,
    `RUN/logs/env-<name>.log`). ``watchdog``: report and stop a run whose processes all stall.
    ``status`` (an RL run): a `status` pane in tmux, or headless the status every N steps, and
    the launcher's events (started, finished, failed) as rows of RUN/metrics.jsonl."""
    launcher = Launcher(run_dir, specs, watchdog=watchdog)
    view = None
    logged = [s.name for s in specs if not s.terminal]
    if use_tmux:
        extra = (("status", status.pane_command(run_dir, os.getpid())),) if status is not None else ()
        view = open_view(tmux_session_name(session_name), run_dir, logged + list(follow), extra)
    if view is None and logged:
        names = logged[0] if len(logged) == 1 else f"{{{','.join(logged)}}}"
        print(f"[prime-rl] logs: {run_dir / 'logs'}/{names}.log", flush=True)
    if status is not None and view is None and status.every_steps:
        launcher.printer = StatusPrinter(run_dir, status)

    def event(name: str, **fields) -> None:
        if status is not None:
            record_event(run_dir, name, launcher.started_unix, **fields)

    def on_term(signum, frame):  # SIGTERM behaves like Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        launcher.start()
        event("started")
        launcher.wait()
        event("finished", **launcher.peak_fields())
        if launcher.printer is not None:
            launcher.printer.print()
        print("[prime-rl] run finished", flush=True)
        return 0
    except OutOfMemory as e:
        event("out_of_memory", victim=e.kill.role, pid=e.kill.pid, evidence=e.kill.how, reason=str(e),
              **launcher.peak_fields())
        print(f"[prime-rl] {e}", file=sys.stderr, flush=True)
        if e.log is not None:
            print(f"[prime-rl] last lines of {e.log}:\n{tail(e.log)}", file=sys.stderr, flush=True)
        return OOM_EXIT_CODE
    except ProcessFailed as e:
        event("failed", failed=e.name, reason=describe_exit(e.code), **launcher.peak_fields())
        print(f"[prime-rl] {e.name} failed: it {describe_exit(e.code)}; stopping the other processes", file=sys.stderr, flush=True)
        if e.log is not None:  # a terminal process's last lines are already on screen
            print(f"[prime-rl] last lines of {e.log}:\n{tail(e.log)}", file=sys.stderr, flush=True)
        return e.code if e.name == exit_code_from and e.code > 0 else 1
    except Stalled as e:
        event("stalled", reason=str(e), **launcher.peak_fields())
        print(f"[prime-rl] watchdog: {e}; stopping all processes", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        event("interrupted", **launcher.peak_fields())
        print("[prime-rl] interrupted; stopping all processes", file=sys.stderr, flush=True)
        return 130
    finally:
        launcher.stop()  # first: nothing of the run may outlive a failure below
        with contextlib.suppress(Exception):  # monitoring never fails a run
            launcher.print_peak()
        if view is not None:
            view.close()
        signal.signal(signal.SIGTERM, previous)
