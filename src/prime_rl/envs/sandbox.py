"""A sandbox for model-written Python: each call is a fresh bubblewrap (``bwrap``) process tree.

    sandbox = Sandbox(SandboxLimits(wall_s=10, cpu_s=5, memory_mb=1024), max_concurrent=4)
    scratch = sandbox.new_scratch()                       # one per rollout, its only writable place
    result = await sandbox.run_python("print(2**100)", scratch)
    result.text()                                         # what the model sees; never empty
    sandbox.remove_scratch(scratch)

Model-written code never runs in the orchestrator: a tool call that loops, allocates 4 GiB,
fork-bombs, opens sockets or writes over the repo must cost one sandbox, not the run. What
each call gets (docs/sandbox.md has the measurements):

- **filesystem**: the host's ``/`` read-only; ``/tmp``, ``/var/tmp`` and ``/run`` (host sockets,
  other runs' files) hidden by empty read-only tmpfs; a fresh ``/dev`` and ``/proc``. The
  rollout's scratch directory appears at ``/tmp/work`` (the working directory, ``$HOME`` and
  ``$TMPDIR``), the only writable place; the code itself is a read-only ``/tmp/main.py``. Fixed
  paths keep tracebacks the same from one rollout to the next.
- **user**: as root, the code runs as uid/gid 65534 (``nobody``) with no capabilities, so
  root-only files stay unreadable; directories the interpreter lives under that ``nobody``
  cannot enter (``/root`` for a pyenv Python) are replaced by a tmpfs holding only the
  interpreter's own directories. Not root: bwrap runs in an unprivileged user namespace as the
  caller, and the caller's ``$HOME`` is hidden the same way. Either way each call has its own
  user namespace, so RLIMIT_NPROC counts that call's processes only (not other sandboxes').
- **network**: a new network namespace with only its own loopback (nothing listens there).
- **limits**: wall clock (the whole tree is killed), RLIMIT_CPU (SIGXCPU), RLIMIT_AS (Python
  raises ``MemoryError``), RLIMIT_NPROC, RLIMIT_FSIZE, no core files, ``nice`` 10, one BLAS
  thread; stdout and stderr are each kept to about ``max_output_chars`` (head and tail).
- **lifetime**: a new PID namespace whose init dies with bwrap (``--die-with-parent``); when
  the init dies the kernel kills every process of the namespace. A small launcher (``LAUNCHER``,
  a child subreaper) starts bwrap and returns only once that init is reaped; on a timeout or a
  cancellation it kills bwrap (its whole group is SIGKILLed if it does not answer). Nothing
  outlives a call, not even a zombie.
- **concurrency**: ``run_python`` is async (``asyncio.create_subprocess_exec``) and at most
  ``max_concurrent`` sandboxes run at once (per event loop); the others wait their turn.

A failing, crashing or killed program is a result (``SandboxResult.error``), never an
exception. Only ``check_available`` (called by the constructor) raises: ``SandboxUnavailable``
with a one-line message when bwrap is missing or cannot start a sandbox on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SANDBOX_UID = 65534
"""The uid and gid sandboxed code runs as when the orchestrator runs as root (``nobody``)."""

WORK_DIR = "/tmp/work"
"""Where the scratch directory appears inside the sandbox (working directory, $HOME)."""

CODE_PATH = "/tmp/main.py"
"""Where the program appears inside the sandbox (read-only)."""

MASKED_DIRS = ("/tmp", "/var/tmp", "/run")
"""Host directories replaced by an empty read-only tmpfs in every sandbox."""

NICE = 10
CHECK_TIMEOUT_S = 60.0
READ_CHUNK = 65536
INSTALL_HINT = "apt-get install bubblewrap"

LAUNCHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
child = os.fork()
if child == 0:
    try:
        os.execv(sys.argv[1], sys.argv[1:])
    except OSError as e:
        sys.stderr.write(f"bwrap: cannot execute {sys.argv[1]}: {e}\\n")
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
"""The process between us and bwrap (``python -I -S -c LAUNCHER bwrap ...``). bwrap exits as
soon as its sandbox's init reports the program's exit status, before that init is reaped; the
orphan would then be a zombie of the host's pid 1, which in a container may never reap it. As a
child subreaper the launcher gets the init back, reaps it (so it returns only once the whole
PID namespace is gone) and exits with bwrap's status. SIGTERM makes it SIGKILL bwrap (whose
``--die-with-parent`` takes the namespace down) and reap as before."""


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot start a sandbox here; the message says what to install."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock seconds before the whole process tree is killed."""

    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU) before the program gets SIGXCPU (then SIGKILL a second later)."""

    memory_mb: int = 1024
    """Address space (RLIMIT_AS) of each process, in MiB; past it Python raises MemoryError."""

    max_procs: int = 32
    """Processes and threads the program may have at once, itself included (RLIMIT_NPROC)."""

    max_file_mb: int = 64
    """Largest file the program may write, in MiB (RLIMIT_FSIZE)."""

    max_output_chars: int = 4000
    """stdout and stderr are each cut to about this many characters (head and tail kept)."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_procs", "max_file_mb", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")


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
    `killed by signal 9 (SIGKILL)`, `sandbox failed to start: ...`. None for a program that
    exited by itself (even with a traceback and a non-zero status)."""

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
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()
        if check:
            self.check_available(python)
        self._tools = {name: shutil.which(name) or name for name in _required_tools(self.as_root)}

    # ----------------------------------------------------------------------- availability

    @staticmethod
    def check_available(python: str = sys.executable) -> None:
        """Raise ``SandboxUnavailable`` unless a trial sandbox runs ``print('ok')`` here
        (once per process and interpreter; later calls are free)."""
        if python in _AVAILABLE:
            return
        missing = [tool for tool in _required_tools(os.geteuid() == 0) if shutil.which(tool) is None]
        if "bwrap" in missing:
            raise SandboxUnavailable(f"the python sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL_HINT}")
        if missing:
            raise SandboxUnavailable(f"the python sandbox needs {', '.join(missing)} (util-linux/coreutils), not found on PATH")
        probe = Sandbox(python=python, check=False)
        scratch = probe.new_scratch()
        code_fd = _code_fd("print('ok')")
        try:
            done = subprocess.run(
                probe._command(scratch, code_fd), pass_fds=(code_fd,), capture_output=True,
                timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SandboxUnavailable(f"bwrap could not start a trial python sandbox: {e}") from e
        finally:
            os.close(code_fd)
            _remove_tree(probe.scratch_root)
        if done.returncode != 0 or done.stdout.strip() != b"ok":
            why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise SandboxUnavailable(
                f"bwrap cannot run python in a sandbox here ({why[:300]}); it needs root or unprivileged "
                f"user namespaces, and {python} readable by uid {SANDBOX_UID}"
            )
        _AVAILABLE.add(python)

    # ----------------------------------------------------------------------- scratch

    def new_scratch(self) -> Path:
        """A new empty directory, writable by the sandboxed code (one per rollout)."""
        path = Path(tempfile.mkdtemp(prefix="scratch-", dir=self.scratch_root))
        if self.as_root:
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
        return path

    def remove_scratch(self, path: str | Path) -> None:
        """Delete a directory ``new_scratch`` made, whatever the code left in it."""
        path = Path(path)
        if path.parent != self.scratch_root:
            raise ValueError(f"Sandbox.remove_scratch: {path} is not a scratch directory of {self.scratch_root}")
        _remove_tree(path)

    @property
    def scratch_root(self) -> Path:
        """Where scratch directories live: the given root, else a private temporary directory
        made on first use and removed when the sandbox object is collected or Python exits."""
        if self._scratch_root is None:
            self._scratch_root = Path(tempfile.mkdtemp(prefix="prime-rl-sandbox-"))
            weakref.finalize(self, _remove_tree, self._scratch_root)
        self._scratch_root.mkdir(parents=True, exist_ok=True)
        return self._scratch_root

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
        limit = self.limits.max_output_chars
        stdout, stderr = _Capture(limit), _Capture(limit)
        code_fd = _code_fd(code)
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command(scratch, code_fd), pass_fds=(code_fd,), start_new_session=True,
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
        return self._result(stdout, stderr, None if timed_out else process.returncode, timed_out)

    def _result(self, stdout: _Capture, stderr: _Capture, exit_code: int | None, timed_out: bool) -> SandboxResult:
        ending = stderr.end.decode("utf-8", errors="replace")
        return SandboxResult(stdout.text(), stderr.text(), exit_code, self._diagnose(ending, exit_code, timed_out))

    def _diagnose(self, stderr_end: str, exit_code: int | None, timed_out: bool) -> str | None:
        """The one-line error of a run, from how it ended and the end of its stderr (see
        ``SandboxResult.error``)."""
        limits = self.limits
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
        if last.startswith(("bwrap:", "setpriv:", "unshare:", "prlimit:", "nice:")):
            return f"sandbox failed to start: {last}"
        if "MemoryError" in last:
            return f"memory limit of {limits.memory_mb} MB reached (MemoryError)"
        if "[Errno 27]" in last:  # Python ignores SIGXFSZ: the write fails with EFBIG instead
            return f"file size limit of {limits.max_file_mb} MB exceeded"
        return None

    # ----------------------------------------------------------------------- the command

    def _command(self, scratch: Path, code_fd: int) -> list[str]:
        """The launcher, then bwrap's argv: namespaces and mounts, then (as root) the drop to
        ``nobody`` in a user namespace of its own, then the rlimits, ``nice`` and the interpreter."""
        launcher = [sys.executable, "-I", "-S", "-c", LAUNCHER]
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
        args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        masks = _outermost([Path(d) for d in MASKED_DIRS if os.path.isdir(d) and not os.path.islink(d)] + self._hidden_dirs())
        for mask in masks:
            args += ["--tmpfs", str(mask)]
        for path in _outermost(self._interpreter_dirs()):
            mask = next((m for m in masks if path.is_relative_to(m)), None)
            if mask is not None:  # re-expose the interpreter inside the tmpfs that hides its parents
                for parent in reversed(path.relative_to(mask).parents[:-1]):
                    args += ["--perms", "0755", "--dir", str(mask / parent)]
                args += ["--ro-bind", str(path), str(path)]
        args += ["--bind", str(scratch), WORK_DIR, "--chdir", WORK_DIR]
        args += ["--perms", "0444", "--ro-bind-data", str(code_fd), CODE_PATH]
        for mask in ["/dev", *map(str, masks)]:
            args += ["--remount-ro", mask]
        return args

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
            f"--nproc={limits.max_procs}", f"--fsize={limits.max_file_mb * mib}", "--core=0",
        ]  # fmt: skip

    def _interpreter_dirs(self) -> list[Path]:
        """The directories the interpreter needs: its environment (a venv) and its install."""
        python = Path(self.python).absolute()
        dirs = {python.parent.parent, python.resolve().parent.parent}
        if python == Path(sys.executable).absolute():
            dirs |= {Path(sys.prefix), Path(sys.base_prefix)}
        return [d.resolve() for d in dirs]

    def _hidden_dirs(self) -> list[Path]:
        """Directories to hide behind a tmpfs: as root, the outermost ancestor of the
        interpreter that ``nobody`` cannot enter; otherwise the caller's home."""
        if not self.as_root:
            try:
                home = Path.home().resolve()
            except (KeyError, RuntimeError):  # no $HOME and no passwd entry: nothing to hide
                return []
            return [home] if home != Path("/") and home.is_dir() else []
        hidden = []
        for path in self._interpreter_dirs():
            for ancestor in reversed(path.parents):
                if ancestor != Path("/") and not _enterable_by_sandbox(ancestor):
                    hidden.append(ancestor)
                    break
        return hidden


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


def _enterable_by_sandbox(path: Path) -> bool:
    st = path.stat()
    if st.st_uid == SANDBOX_UID:
        return bool(st.st_mode & 0o100)
    if st.st_gid == SANDBOX_UID:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)


def _outermost(paths: list[Path]) -> list[Path]:
    """The paths not inside another one of them, sorted, without duplicates."""
    unique = sorted(set(paths), key=lambda p: (len(p.parts), str(p)))
    return [p for i, p in enumerate(unique) if not any(p.is_relative_to(q) for q in unique[:i])]


def _remove_tree(path: Path) -> None:
    """``rmtree`` that also removes what the sandbox made unreadable (``chmod 000`` dirs) and
    never follows a symlink it left."""

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
