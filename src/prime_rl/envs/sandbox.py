"""A sandbox for model-written Python: each call is a fresh bubblewrap (``bwrap``) process tree.

    sandbox = Sandbox(SandboxLimits(wall_s=10, cpu_s=5, call_memory_mb=1024), max_concurrent=4)
    scratch = sandbox.new_scratch()                       # one per rollout, its only writable place
    result = await sandbox.run_python("print(2**100)", scratch)
    result.text()                                         # what the model sees; never empty
    sandbox.remove_scratch(scratch)

Model-written code never runs in the orchestrator: a tool call that loops, allocates 4 GiB,
fork-bombs, opens sockets or writes over the repo must cost one sandbox, not the run. What
each call gets (docs/sandbox.md has the measurements):

- **filesystem**: only what the interpreter needs, read-only: ``/usr``, ``/etc``, the ``/bin``,
  ``/lib*`` links (or dirs) and the interpreter's own directories (its venv and its install);
  a fresh ``/dev`` and ``/proc``; nothing else of the host (no ``/work``, ``/home``, ``/root``,
  ``/srv``, ``/opt``, ``/var``, host ``/tmp``). The rollout's scratch directory appears at
  ``/tmp/work`` (the working directory, ``$HOME`` and ``$TMPDIR``), the only writable place; the
  code itself is a read-only ``/tmp/main.py``. Fixed paths keep tracebacks the same.
- **user**: as root, the code runs as uid/gid 65534 (``nobody``) with no capabilities, in a
  user namespace of its own per call.
- **network**: a new network namespace with only its own loopback (nothing listens there).
- **limits of the whole call**: a cgroup per call (v2, or v1 memory + pids) caps the memory of
  every process of the call together, page cache, memfds and scratch writes included (past it
  the kernel's OOM killer stops the call's processes: ``memory limit of N MB for the whole call
  reached (killed)``), and its processes and threads; the scratch directory is a tmpfs capped
  at ``scratch_mb`` (and a file count). Per process: RLIMIT_CPU (SIGXCPU), RLIMIT_AS (Python
  raises ``MemoryError``), RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_FSIZE, no core files, ``nice``
  10, one BLAS thread; the wall clock kills the whole tree; stdout and stderr are each kept to
  about ``max_output_chars`` (head and tail).
- **limits of all calls together**: every call's cgroup sits in one cgroup of the sandbox, capped
  at ``total_memory_mb``. The scratch pages a call writes stay charged there after the call's
  own cgroup is gone, so the running calls and the scratch of every live rollout together never
  hold more (past it the largest process of a running call is killed: ``shared memory limit of
  N MB (all running calls and scratch files together) reached (killed)``).
- **lifetime**: a new PID namespace whose init dies with bwrap (``--die-with-parent``); a small
  launcher (``LAUNCHER``, a child subreaper) starts bwrap and returns only once that init is
  reaped; on a timeout or a cancellation it kills bwrap. Whatever is still in the call's cgroup
  afterwards is SIGKILLed and the cgroup removed. Nothing outlives a call, not even a zombie.
- **concurrency**: ``run_python`` is async (``asyncio.create_subprocess_exec``) and at most
  ``max_concurrent`` sandboxes run at once (per event loop); the others wait their turn.

A failing, crashing or killed program is a result (``SandboxResult.error``), never an
exception. Only ``check_available`` (called by the constructor) raises: ``SandboxUnavailable``
with a one-line message when bwrap, root (for the scratch tmpfs) or a usable cgroup hierarchy
is missing, or a trial sandbox cannot start. It fails closed: no call runs without its bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from prime_rl.procmem import cgroup_mounts, own_cgroups

SANDBOX_UID = 65534
"""The uid and gid sandboxed code runs as when the orchestrator runs as root (``nobody``)."""

WORK_DIR = "/tmp/work"
"""Where the scratch directory appears inside the sandbox (working directory, $HOME)."""

CODE_PATH = "/tmp/main.py"
"""Where the program appears inside the sandbox (read-only)."""

SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""The host paths every sandbox sees (read-only; a symlink such as ``/bin -> usr/bin`` is
recreated as the same symlink). With the interpreter's own directories, nothing else is bound."""

BWRAP_PROCS = 2
"""Processes of bwrap itself inside a call's cgroup (its monitor and the namespace's init)."""

SCRATCH_INODES = 4096
"""Files and directories one scratch tmpfs may hold (each costs kernel memory, not bytes)."""

CGROUP_PARENT = "prime-rl-sandbox"
"""The cgroup made in our own cgroup to hold one child cgroup per ``Sandbox`` (capped at its
``total_memory_mb``), which holds one per running call."""

HUGE_PAGE = 2 << 20
"""The largest single charge a memory cgroup sees (a transparent huge page), in bytes."""

NICE = 10
CHECK_TIMEOUT_S = 60.0
CLEANUP_TIMEOUT_S = 5.0
READ_CHUNK = 65536
INSTALL_HINT = "apt-get install bubblewrap"
CGROUP_HINT = (
    "run as root on a machine with cgroup v2 (memory and pids controllers) or v1 memory and pids "
    "hierarchies, or in a delegated cgroup v2 subtree (e.g. systemd-run --scope -p Delegate=yes)"
)

LAUNCHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
count = int(sys.argv[1])
procs_files, command = sys.argv[2 : 2 + count], sys.argv[2 + count :]
child = os.fork()
if child == 0:
    try:
        for procs in procs_files:  # the call's cgroups, joined before bwrap starts
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        os.execv(command[0], command)
    except OSError as e:
        sys.stderr.write(f"sandbox: cannot start {command[0]}: {e}\\n")
    os._exit(127)
alive = True
def stop(*_):
    if alive:
        os.kill(child, signal.SIGKILL)
signal.signal(signal.SIGTERM, stop)
status = 1
while True:
    try:
        pid, wait_status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if pid == child:
        alive, code = False, os.waitstatus_to_exitcode(wait_status)
        status = code if code >= 0 else 128 - code
sys.exit(status)
"""
"""The process between us and bwrap (``python -I -S -c LAUNCHER N PROCS... bwrap ...``). Its
child joins the call's cgroups (the N ``cgroup.procs`` files) and execs bwrap, so everything the
call starts is inside them while the launcher itself stays out (the OOM killer never picks it).
bwrap exits as soon as its sandbox's init reports the program's exit status, before that init
is reaped; the orphan would then be a zombie of the host's pid 1, which in a container may never
reap it. As a child subreaper the launcher gets the init back, reaps it (so it returns only once
the whole PID namespace is gone) and exits with bwrap's status. SIGTERM makes it SIGKILL bwrap
(whose ``--die-with-parent`` takes the namespace down) and reap as before."""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here with all its bounds; the message says what is missing."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock seconds before the whole process tree is killed."""

    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU) of each process before it gets SIGXCPU (then SIGKILL a second later)."""

    memory_mb: int = 1024
    """Address space (RLIMIT_AS) of each process, in MiB; past it Python raises MemoryError."""

    call_memory_mb: int = 1024
    """Memory of the whole call in MiB (its cgroup): every process's pages, page cache, memfds and
    the scratch bytes it writes; past it the kernel kills the call's largest process."""

    max_procs: int = 32
    """Processes and threads the program may have at once, itself included (RLIMIT_NPROC and the
    call's cgroup ``pids.max``, which adds bwrap's own two)."""

    max_open_files: int = 64
    """Open files of each process (RLIMIT_NOFILE); a call holds at most ``max_procs`` times this."""

    max_file_mb: int = 64
    """Largest file the program may write, in MiB (RLIMIT_FSIZE)."""

    scratch_mb: int = 64
    """Bytes the scratch directory may hold in all, in MiB (a tmpfs of that size, which keeps
    them between the calls of a rollout); keep it below ``call_memory_mb``, which they count in."""

    total_memory_mb: int = 8192
    """Memory of everything the sandbox holds together, in MiB: its running calls and the
    scratch bytes of every live rollout (one cgroup above all its calls, which keeps the charge
    of scratch pages once a call's own cgroup is gone). Past it the kernel kills the largest
    process of a running call. At least ``call_memory_mb``; the default leaves room for 4 full
    calls of 1024 MiB and 64 full scratch directories of 64 MiB."""

    max_output_chars: int = 4000
    """stdout and stderr are each cut to about this many characters (head and tail kept)."""

    def __post_init__(self) -> None:
        # nan and inf would pass a `> 0` check and then mean "no limit": refuse them
        for name in SandboxLimits.__dataclass_fields__:
            value = getattr(self, name)
            whole = name != "wall_s"
            valid = isinstance(value, int if whole else (int, float)) and not isinstance(value, bool)
            if not (valid and math.isfinite(value) and value > 0):
                kind = "a positive whole number" if whole else "positive and finite"
                raise ValueError(f"SandboxLimits.{name} must be {kind}, got {value!r}")
        if self.scratch_mb >= self.call_memory_mb:  # scratch pages count in the call's memory
            raise ValueError(f"SandboxLimits.scratch_mb ({self.scratch_mb}) must be below call_memory_mb ({self.call_memory_mb})")
        if self.total_memory_mb < self.call_memory_mb:  # a call must fit in the bound of all of them
            raise ValueError(
                f"SandboxLimits.total_memory_mb ({self.total_memory_mb}) must be at least call_memory_mb ({self.call_memory_mb})"
            )


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit status (128 + N when signal N ended it); None when it was killed
    for running past the wall clock or never started."""

    error: str | None = None
    """Why the run failed beyond its own output: `timed out after 10 s (wall-clock limit)`,
    `CPU time limit of 5 s exceeded`, `memory limit of 1024 MB reached (MemoryError)`,
    `memory limit of 1024 MB for the whole call reached (killed)`, `shared memory limit of 8192 MB
    (all running calls and scratch files together) reached (killed)`, `scratch space limit of 64 MB
    reached`, `open files limit of 64 per process reached`, `killed by signal 9 (SIGKILL)`,
    `sandbox failed to start: ...`. None for a program that exited by itself (even with a
    traceback and a non-zero status)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    def text(self) -> str:
        """What the model sees: stdout, then stderr, then ``Error: <error>`` (or the exit status
        of a program that failed silently); ``(no output)`` when there is nothing else."""
        parts = [part.rstrip("\n") for part in (self.stdout, self.stderr) if part.strip()]
        if self.error:
            parts.append(f"Error: {self.error}")
        elif self.exit_code and not self.stderr.strip():
            parts.append(f"(exit status {self.exit_code})")
        return "\n".join(parts) if parts else "(no output)"


# --------------------------------------------------------------------------- the sandbox


class Sandbox:
    """Runs Python programs in bubblewrap sandboxes (see the module docstring)."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        max_concurrent: int = 4,
        scratch_root: str | Path | None = None,
        python: str = sys.executable,
        check: bool = True,
    ):
        if max_concurrent < 1:
            raise ValueError(f"Sandbox: max_concurrent must be at least 1, got {max_concurrent}")
        self.limits = limits
        self.max_concurrent = max_concurrent
        self.python = python
        self.as_root = os.geteuid() == 0
        self._scratch_root = Path(scratch_root) if scratch_root is not None else None
        if self._scratch_root is not None:  # a root we were given stays, its scratch mounts do not
            weakref.finalize(self, _unmount_under, self._scratch_root.absolute())
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()
        self._group: _Cgroup | None = None
        self._group_finalizer: weakref.finalize | None = None
        if check:
            self.check_available(python)
        self._tools = {name: shutil.which(name) or name for name in _required_tools(self.as_root)}

    # ----------------------------------------------------------------------- availability

    @staticmethod
    def check_available(python: str = sys.executable) -> None:
        """Raise ``SandboxUnavailable`` unless every bound can be set up here and a trial
        sandbox runs ``print('ok')`` (once per process and interpreter; later calls are free)."""
        if python in _AVAILABLE:
            return
        missing = [tool for tool in _required_tools(os.geteuid() == 0) if shutil.which(tool) is None]
        if "bwrap" in missing:
            raise SandboxUnavailable(f"the python sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL_HINT}")
        if missing:
            raise SandboxUnavailable(f"the python sandbox needs {', '.join(missing)} (util-linux/coreutils), not found on PATH")
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "the python sandbox needs root: each rollout's scratch directory is a size-capped tmpfs it mounts"
            )
        cgroups = _find_cgroups()
        if isinstance(cgroups, str):
            raise SandboxUnavailable(f"the python sandbox bounds each call with a cgroup, but {cgroups}; {CGROUP_HINT}")
        probe = Sandbox(python=python, check=False)
        try:
            done = probe._trial_run(cgroups)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SandboxUnavailable(f"bwrap could not start a trial python sandbox: {e}") from e
        finally:
            _remove_tree(probe.scratch_root)
            probe._remove_group()
        if done.returncode != 0 or done.stdout.strip() != b"ok":
            why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise SandboxUnavailable(
                f"bwrap cannot run python in a sandbox here ({why[:300]}); it needs root or unprivileged "
                f"user namespaces, and {python} readable by uid {SANDBOX_UID}"
            )
        _AVAILABLE.add(python)

    def _trial_run(self, cgroups: _Cgroups) -> subprocess.CompletedProcess:
        """``print('ok')`` in a full sandbox: scratch tmpfs, sandbox and call cgroups and all."""
        scratch = self.new_scratch()
        call = self._calls_parent(cgroups).new_call(self.limits)
        code_fd = _code_fd("print('ok')")
        try:
            return subprocess.run(
                self._command(scratch, code_fd, call), pass_fds=(code_fd,), capture_output=True,
                timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            os.close(code_fd)
            call.remove()

    # ----------------------------------------------------------------------- scratch

    def new_scratch(self) -> Path:
        """A new empty directory, writable by the sandboxed code (one per rollout): a tmpfs of
        ``scratch_mb`` (and ``SCRATCH_INODES`` files) owned by the sandbox user."""
        path = Path(tempfile.mkdtemp(prefix="scratch-", dir=self.scratch_root))
        try:
            _mount_scratch(path, self.limits.scratch_mb << 20)
        except OSError:
            path.rmdir()
            raise
        return path

    def remove_scratch(self, path: str | Path) -> None:
        """Unmount and delete a directory ``new_scratch`` made, whatever the code left in it."""
        path = Path(path)
        if path.parent != self.scratch_root:
            raise ValueError(f"Sandbox.remove_scratch: {path} is not a scratch directory of {self.scratch_root}")
        _remove_tree(path)

    @property
    def scratch_root(self) -> Path:
        """Where scratch directories live: the given root, else a private temporary directory
        made on first use and removed (its mounts first) when the sandbox object is collected
        or Python exits."""
        if self._scratch_root is None:
            self._scratch_root = Path(tempfile.mkdtemp(prefix="prime-rl-sandbox-"))
            weakref.finalize(self, _remove_tree, self._scratch_root)
        self._scratch_root.mkdir(parents=True, exist_ok=True)
        return self._scratch_root

    # ----------------------------------------------------------------------- the shared bound

    def _calls_parent(self, cgroups: _Cgroups) -> _Cgroups:
        """Where this sandbox's calls get their cgroups: its own cgroup, capped at
        ``total_memory_mb``, made on first use and removed with the sandbox object (or at exit).
        The pages a call writes to a scratch tmpfs stay charged after its cgroup is removed, and
        a charge counts in every ancestor: here they keep counting against this one bound, where
        under the shared ``CGROUP_PARENT`` nothing bounded them across rollouts."""
        if self._group is None:
            self._group = cgroups.new_sandbox(self.limits)
            self._group_finalizer = weakref.finalize(self, self._group.remove)
        return self._group.children()

    def _remove_group(self) -> None:
        if self._group_finalizer is not None:
            self._group_finalizer()
        self._group = self._group_finalizer = None

    # ----------------------------------------------------------------------- running

    async def run_python(self, code: str, scratch: str | Path) -> SandboxResult:
        """Run ``code`` with the sandbox's interpreter in ``scratch``; never raises for what
        the program does (its failure is in the result)."""
        async with self._slot():
            return await self._run(code, Path(scratch))

    def _slot(self) -> asyncio.Semaphore:
        # one semaphore per event loop: an asyncio primitive must not cross loops (tests run
        # several `asyncio.run`s); the orchestrator has a single loop, so the bound is global there
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.max_concurrent)
        return self._slots[loop]

    async def _run(self, code: str, scratch: Path) -> SandboxResult:
        """One call in its own cgroup, which is emptied and removed however the call ends."""
        cgroups = _find_cgroups()
        if isinstance(cgroups, str):
            return SandboxResult("", "", None, f"sandbox failed to start: {cgroups}")
        try:
            call = self._calls_parent(cgroups).new_call(self.limits)
        except OSError as e:
            return SandboxResult("", "", None, f"sandbox failed to start: cannot make its cgroup: {e}")
        try:
            return await self._run_in(call, code, scratch)
        finally:
            call.remove()

    async def _run_in(self, call: _Cgroup, code: str, scratch: Path) -> SandboxResult:
        limit = self.limits.max_output_chars
        stdout, stderr = _Capture(limit), _Capture(limit)
        code_fd = _code_fd(code)
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command(scratch, code_fd, call), pass_fds=(code_fd,), start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
        except OSError as e:
            return SandboxResult("", "", None, f"sandbox failed to start: {e}")
        finally:
            os.close(code_fd)
        readers = asyncio.gather(stdout.drain(process.stdout), stderr.drain(process.stderr))
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), self.limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
        except BaseException:  # cancelled (the tool's own timeout, shutdown): nothing may outlive us
            await _end(process, readers)
            raise
        await _end(process, readers)
        exit_code = None if timed_out else process.returncode
        ending = stderr.end.decode("utf-8", errors="replace")
        killed = None
        if call.oom_killed():  # at the call's own limit, or at the sandbox's that it shares
            killed = "call" if call.reached_own_limit(self.limits.call_memory_mb << 20) else "shared"
        error = self._diagnose(ending, exit_code, timed_out, killed)
        return SandboxResult(stdout.text(), stderr.text(), exit_code, error)

    def _diagnose(self, stderr_end: str, exit_code: int | None, timed_out: bool, oom_killed: str | None) -> str | None:
        """The one-line error of a run, from how it ended, its cgroup's OOM kills (``call``: at
        its own limit, ``shared``: at the sandbox's, which other calls and scratch fill too)
        and the end of its stderr (see ``SandboxResult.error``)."""
        limits = self.limits
        if oom_killed == "call":  # whatever else happened after, this is what the program has to fix
            return f"memory limit of {limits.call_memory_mb} MB for the whole call reached (killed)"
        if oom_killed == "shared":
            return f"shared memory limit of {limits.total_memory_mb} MB (all running calls and scratch files together) reached (killed)"
        if timed_out:
            return f"timed out after {limits.wall_s:g} s (wall-clock limit)"
        if exit_code is None or exit_code == 0:
            return None
        if exit_code < 0 or exit_code > 128:  # the sandbox (or bwrap itself) died of a signal
            number = -exit_code if exit_code < 0 else exit_code - 128
            if number == signal.SIGXCPU:
                return f"CPU time limit of {limits.cpu_s} s exceeded"
            if number == signal.SIGXFSZ:
                return f"file size limit of {limits.max_file_mb} MB exceeded"
            return f"killed by signal {number} ({_signal_name(number)})"
        last = stderr_end.strip().splitlines()[-1] if stderr_end.strip() else ""
        if last.startswith(("sandbox:", "bwrap:", "setpriv:", "unshare:", "prlimit:", "nice:")):
            return f"sandbox failed to start: {last}"
        if "MemoryError" in last:
            return f"memory limit of {limits.memory_mb} MB reached (MemoryError)"
        if "[Errno 27]" in last:  # Python ignores SIGXFSZ: the write fails with EFBIG instead
            return f"file size limit of {limits.max_file_mb} MB exceeded"
        if "[Errno 28]" in last:  # ENOSPC: the scratch tmpfs is full
            return f"scratch space limit of {limits.scratch_mb} MB reached"
        if "[Errno 24]" in last:  # EMFILE
            return f"open files limit of {limits.max_open_files} per process reached"
        return None

    # ----------------------------------------------------------------------- the command

    def _command(self, scratch: Path, code_fd: int, call: _Cgroup) -> list[str]:
        """The launcher (with the call's cgroups to join), then bwrap's argv: namespaces and
        mounts, then (as root) the drop to ``nobody`` in a user namespace of its own, then the
        rlimits, ``nice`` and the interpreter."""
        launcher = [sys.executable, "-I", "-S", "-c", LAUNCHER, str(len(call.procs_files)), *call.procs_files]
        bwrap = [self._tools["bwrap"], *self._namespace_args(), *self._mount_args(scratch, code_fd), *self._env_args(), "--"]
        program = [self._tools["nice"], "-n", str(NICE), self.python, "-I", "-u", CODE_PATH]
        return [*launcher, *bwrap, *self._privilege_drop(), *self._limit_args(), *program]

    def _namespace_args(self) -> list[str]:
        args = ["--die-with-parent", "--new-session"]
        args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.as_root:  # unprivileged bwrap: its own user namespace, none further inside
            args += ["--unshare-user", "--disable-userns"]
        return args

    def _mount_args(self, scratch: Path, code_fd: int) -> list[str]:
        """A new root holding only the system paths, the interpreter and ``/tmp`` (a tmpfs with
        the scratch dir and the code), all read-only but the scratch dir."""
        args = []
        for path in SYSTEM_PATHS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        system = [Path(p) for p in SYSTEM_PATHS]
        for path in _outermost(self._interpreter_dirs()):
            if any(path.is_relative_to(p) for p in system):
                continue  # a system interpreter: already there
            for parent in reversed(path.parents[:-1]):  # e.g. /root, /root/.pyenv: made 0755, empty
                if parent != Path("/tmp"):
                    args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", str(path), str(path)]
        args += ["--bind", str(scratch), WORK_DIR, "--chdir", WORK_DIR]
        args += ["--perms", "0444", "--ro-bind-data", str(code_fd), CODE_PATH]
        return args + ["--remount-ro", "/dev", "--remount-ro", "/tmp", "--remount-ro", "/"]

    def _env_args(self) -> list[str]:
        path = f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin"
        env = {"PATH": path, "HOME": WORK_DIR, "TMPDIR": WORK_DIR, "LANG": "C.UTF-8", "MPLBACKEND": "Agg"}
        env |= {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")}
        args = ["--clearenv"]
        for name, value in env.items():
            args += ["--setenv", name, value]
        return args

    def _privilege_drop(self) -> list[str]:
        if not self.as_root:
            return []
        ids = str(SANDBOX_UID)
        return [
            self._tools["setpriv"], f"--reuid={ids}", f"--regid={ids}", "--clear-groups",
            "--bounding-set=-all", "--inh-caps=-all",
            # a user namespace per call: RLIMIT_NPROC then counts this call's processes only
            self._tools["unshare"], "--user", f"--map-user={ids}", f"--map-group={ids}",
        ]  # fmt: skip

    def _limit_args(self) -> list[str]:
        limits, mib = self.limits, 1 << 20
        return [
            self._tools["prlimit"], f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb * mib}",
            f"--nproc={limits.max_procs}", f"--nofile={limits.max_open_files}",
            f"--fsize={limits.max_file_mb * mib}", "--core=0",
        ]  # fmt: skip

    def _interpreter_dirs(self) -> list[Path]:
        """The directories the interpreter needs: its environment (a venv, the directory
        itself, never the checkout around it) and its install."""
        python = Path(self.python).absolute()
        dirs = {python.parent.parent, python.resolve().parent.parent}
        if python == Path(sys.executable).absolute():
            dirs |= {Path(sys.prefix), Path(sys.base_prefix)}
        return [d.resolve() for d in dirs]


# --------------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class _Cgroup:
    """The cgroup(s) of one call or one sandbox: one cgroup2 directory, or a v1 memory and a v1
    pids one."""

    version: int
    memory_dir: Path
    pids_dir: Path

    @property
    def dirs(self) -> list[Path]:
        return list(dict.fromkeys([self.memory_dir, self.pids_dir]))

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed a process of the call (v2 ``memory.events``, v1
        ``memory.oom_control``: both have an ``oom_kill N`` line)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            for line in (self.memory_dir / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value) > 0
        return False

    def reached_own_limit(self, limit_bytes: int) -> bool:
        """Whether the call's memory came up to its own limit, rather than an ancestor's (v2
        ``memory.events`` ``max``, counted where the limit was hit and upwards; v1 the peak of
        memory and of memory + swap, within a huge page of the limit: the v1 ``failcnt`` files
        stay 0 on the 6.18 kernel measured)."""
        with contextlib.suppress(OSError, ValueError):
            if self.version == 1:
                names = ("memory.max_usage_in_bytes", "memory.memsw.max_usage_in_bytes")
                peaks = [int(f.read_text()) for f in (self.memory_dir / n for n in names) if f.exists()]
                return max(peaks, default=0) + HUGE_PAGE >= limit_bytes
            for line in (self.memory_dir / "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value) > 0
        return False

    def children(self) -> _Cgroups:
        """This cgroup as the parent of others (the calls of a sandbox)."""
        return _Cgroups(self.version, self.memory_dir, self.pids_dir)

    def remove(self) -> None:
        """SIGKILL whatever is left in the cgroups (child cgroups first), then remove them.
        Usually nothing is (the launcher reaped the PID namespace), so this costs a read and an
        rmdir."""
        names = set()
        for directory in self.dirs:
            with contextlib.suppress(OSError):
                names |= {child.name for child in directory.iterdir() if child.is_dir()}
        for name in sorted(names):  # a sandbox's calls still running at exit
            _Cgroup(self.version, self.memory_dir / name, self.pids_dir / name).remove()
        deadline = time.monotonic() + CLEANUP_TIMEOUT_S
        if self.version == 2 and (self.memory_dir / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.memory_dir / "cgroup.kill").write_text("1")
        for directory in self.dirs:
            while time.monotonic() < deadline:
                try:
                    pids = [int(pid) for pid in (directory / "cgroup.procs").read_text().split()]
                    if not pids:
                        directory.rmdir()
                        break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: the last ones are still exiting
                    pids = []
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.005)


@dataclass(frozen=True)
class _Cgroups:
    """Where the calls' cgroups go: ``CGROUP_PARENT`` in our own cgroup of each hierarchy (so
    whoever accounts for us, a VM or a container, still sees the calls)."""

    version: int
    memory_parent: Path
    pids_parent: Path

    def new_call(self, limits: SandboxLimits) -> _Cgroup:
        """A fresh cgroup for one call, its limits set before anything joins it."""
        return self._new_child("call", limits.call_memory_mb, limits.max_procs + BWRAP_PROCS)

    def new_sandbox(self, limits: SandboxLimits) -> _Cgroup:
        """A fresh cgroup for the calls of one sandbox, capped at ``total_memory_mb`` (no
        process of its own: v2 lets only such a cgroup pass controllers to its children)."""
        return self._new_child("sandbox", limits.total_memory_mb, None)

    def _new_child(self, kind: str, memory_mb: int, pids: int | None) -> _Cgroup:
        name = f"{kind}-{os.getpid()}-{next(_CGROUP_NUMBERS)}"
        child = _Cgroup(self.version, self.memory_parent / name, self.pids_parent / name)
        try:  # a failure half-way (the v1 pids dir, a limit refused) leaves nothing behind
            for directory in child.dirs:
                directory.mkdir()
            memory = str(memory_mb << 20)
            if self.version == 2:
                _write(child.memory_dir / "memory.max", memory)
                _write(child.memory_dir / "memory.swap.max", "0", optional=True)
            else:  # memsw (memory + swap) may only be set once the memory limit is
                _write(child.memory_dir / "memory.limit_in_bytes", memory)
                _write(child.memory_dir / "memory.memsw.limit_in_bytes", memory, optional=True)
            if pids is not None:
                _write(child.pids_dir / "pids.max", str(pids))
            else:  # a parent of calls: they need memory and pids too
                _write(child.memory_dir / "cgroup.subtree_control", "+memory +pids", optional=True)
        except OSError:
            child.remove()
            raise
        return child


_CGROUP_NUMBERS = itertools.count()
_FOUND_CGROUPS: list[_Cgroups | str] = []
"""The cached answer of ``_find_cgroups`` (the hierarchy does not change under us)."""


def _find_cgroups() -> _Cgroups | str:
    """Our cgroup v2 subtree if it has the memory and pids controllers, else the v1 memory and
    pids hierarchies; the parent of the calls' cgroups is made there. A string says why neither
    can be used."""
    if not _FOUND_CGROUPS:
        mounts, own = cgroup_mounts(), own_cgroups()
        found: _Cgroups | str = "no cgroup hierarchy with the memory and pids controllers is mounted"
        if "cgroup2" in mounts and "" in own:
            found = _cgroup2_parent(mounts["cgroup2"] / own[""].lstrip("/"))
        if isinstance(found, str) and "memory" in mounts and "pids" in mounts:
            try:
                memory = _make_parent(mounts["memory"] / own.get("memory", "/").lstrip("/"))
                pids = _make_parent(mounts["pids"] / own.get("pids", "/").lstrip("/"))
                found = _Cgroups(1, memory, pids)
            except OSError as e:
                found = f"cgroup v1 is not writable here ({e})"
        _FOUND_CGROUPS.append(found)
    return _FOUND_CGROUPS[0]


def _cgroup2_parent(own: Path) -> _Cgroups | str:
    """``CGROUP_PARENT`` under our cgroup2 cgroup with memory and pids enabled for its children
    (v2 allows that only when the parent has them and has no processes of its own)."""
    try:
        if not {"memory", "pids"} <= set((own / "cgroup.controllers").read_text().split()):
            return f"the cgroup2 cgroup {own} lacks the memory or pids controller"
        enabled = set((own / "cgroup.subtree_control").read_text().split())
        if not {"memory", "pids"} <= enabled:
            _write(own / "cgroup.subtree_control", "+memory +pids")
        parent = _make_parent(own)
        _write(parent / "cgroup.subtree_control", "+memory +pids")
    except OSError as e:
        return f"cannot delegate memory and pids below the cgroup2 cgroup {own} ({e})"
    return _Cgroups(2, parent, parent)


def _make_parent(own: Path) -> Path:
    parent = own / CGROUP_PARENT
    parent.mkdir(exist_ok=True)
    return parent


def _write(path: Path, value: str, optional: bool = False) -> None:
    if optional and not path.exists():
        return
    path.write_text(value)


# --------------------------------------------------------------------------- scratch mounts

_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def _mount_scratch(path: Path, size_bytes: int) -> None:
    """Mount a tmpfs of ``size_bytes`` (and ``SCRATCH_INODES`` files) at ``path``, owned by the
    sandbox user: the cap on what one rollout can write (its pages are also charged to the
    memory cgroup of the call that writes them)."""
    options = f"size={size_bytes},nr_inodes={SCRATCH_INODES},mode=0700,uid={SANDBOX_UID},gid={SANDBOX_UID}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot mount the scratch tmpfs: {os.strerror(errno)}", str(path))


def _unmount_under(root: Path) -> None:
    """Detach every mount at or below ``root`` (deepest first), e.g. the scratch tmpfs."""
    libc = ctypes.CDLL(None, use_errno=True)
    for point in sorted(_mount_points_under(root), key=lambda p: len(p.parts), reverse=True):
        libc.umount2(os.fsencode(point), _MNT_DETACH)


def _mount_points_under(root: Path) -> list[Path]:
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            raw = line.split()[4]  # the mount point, spaces and such as octal escapes
            point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))
            if point == root or point.is_relative_to(root):
                points.append(point)
    return points


# --------------------------------------------------------------------------- helpers

_AVAILABLE: set[str] = set()
"""Interpreters a trial sandbox ran in this process."""


def _required_tools(as_root: bool) -> list[str]:
    return ["bwrap", "prlimit", "nice", *(["setpriv", "unshare"] if as_root else [])]


def _code_fd(code: str) -> int:
    """A memory file holding the program, for bwrap's ``--ro-bind-data`` (the host never
    writes into the scratch directory, which the sandbox controls: no symlink games)."""
    fd = os.memfd_create("main.py")
    os.write(fd, code.encode("utf-8", errors="replace"))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _kill_group(pid: int) -> None:
    """SIGKILL the launcher's process group (launcher and bwrap); bwrap's PID namespace (the
    program's whole tree) follows through ``--die-with-parent``."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _end(process: asyncio.subprocess.Process, readers: asyncio.Future, timeout_s: float = 5.0) -> None:
    """Stop the sandbox unless it exited, reap it and let its pipes close (they do once its
    PID namespace is gone), so that no process, pipe or transport outlives the call. The
    launcher is asked first (SIGTERM: it kills bwrap and reaps the namespace's init); if it
    does not answer in time, or we are cancelled again meanwhile, its group is SIGKILLed."""
    try:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it exited just now
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except asyncio.TimeoutError:
                _kill_group(process.pid)
        await asyncio.wait_for(asyncio.gather(process.wait(), readers), timeout_s)
    except asyncio.TimeoutError:  # pipes held open past reason: stop reading
        readers.cancel()
    except BaseException:  # cancelled again while cleaning up: kill, stop reading, stay cancelled
        _kill_group(process.pid)
        readers.cancel()
        raise


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def _outermost(paths: list[Path]) -> list[Path]:
    """The paths not inside another one of them, sorted, without duplicates."""
    unique = sorted(set(paths), key=lambda p: (len(p.parts), str(p)))
    return [p for i, p in enumerate(unique) if not any(p.is_relative_to(q) for q in unique[:i])]


def _remove_tree(path: Path) -> None:
    """``rmtree`` that first unmounts what is mounted below ``path``, also removes what the
    sandbox made unreadable (``chmod 000`` dirs) and never follows a symlink it left."""

    def retry(function: Callable[..., Any], failed: str, _: Any) -> None:
        target = Path(failed)
        if target.is_symlink() or not target.exists():
            target.parent.chmod(0o700)
            function(failed)
        elif target.is_dir():
            target.chmod(0o700)
            shutil.rmtree(target, onerror=retry)
        else:
            target.parent.chmod(0o700)
            function(failed)

    _unmount_under(path.absolute())  # a scratch tmpfs: rmtree would empty it, then fail on it
    if path.exists():
        shutil.rmtree(path, onerror=retry)


class _Capture:
    """One output stream, read to its end but kept to ``limit`` bytes: the head and the tail
    (a looping print must cost neither memory nor the program's last lines)."""

    def __init__(self, limit: int):
        self.limit, self.total = limit, 0
        self.head, self.tail = bytearray(), bytearray()
        self.end = b""
        """The stream's last kilobyte whatever the limit: how the program ended is read there."""

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        while chunk := await stream.read(READ_CHUNK):
            self.total += len(chunk)
            self.end = (self.end + chunk)[-1024:]
            room = self.limit - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail = (self.tail + chunk)[-(self.limit // 2) :]

    def text(self) -> str:
        if self.total <= self.limit:
            return bytes(self.head).decode("utf-8", errors="replace")
        head = bytes(self.head[: self.limit - len(self.tail)])
        cut = self.total - len(head) - len(self.tail)
        decode = lambda data: data.decode("utf-8", errors="replace")  # noqa: E731
        return f"{decode(head)}\n... [{cut} characters cut] ...\n{decode(bytes(self.tail))}"
