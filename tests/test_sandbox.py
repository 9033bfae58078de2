"""The python sandbox (bubblewrap): output, each limit (wall clock, CPU, memory per process and
per call, processes, open files, scratch bytes, output length), no network, no writes outside
the scratch directory, nothing of the host visible but the system and the interpreter,
concurrency without blocking the event loop, and nothing (process, cgroup, mount) left after a
call. The sandbox needs root (scratch tmpfs, per-call cgroups): elsewhere every running test
skips, saying why."""

import asyncio
import math
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest
from prime_rl.envs import sandbox as sandbox_module
from prime_rl.envs.sandbox import SANDBOX_UID, Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable

from helpers import REPO, sandbox_unavailable

AS_ROOT = os.geteuid() == 0
SHORT = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=1024, max_procs=16, max_output_chars=400)
BOUNDED = SandboxLimits(wall_s=8, cpu_s=4, call_memory_mb=128, scratch_mb=16, max_open_files=32, max_procs=16)
"""Small per-call bounds, so that the tests trying to exceed them stay cheap."""


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI promises a sandbox (scripts/test.sh installs bubblewrap)")
def test_ci_runs_the_sandbox_tests():
    """CI installs bubblewrap, so there the sandbox tests must run, not skip."""
    assert sandbox_unavailable() is None


@pytest.fixture(scope="module")
def sandbox():
    """The sandbox every running test uses; those tests skip, saying why, without bwrap."""
    if (why := sandbox_unavailable()) is not None:
        pytest.skip(f"no python sandbox here: {why}")
    return Sandbox(SHORT, max_concurrent=4)


@pytest.fixture(scope="module")
def bounded(sandbox):
    return Sandbox(BOUNDED, max_concurrent=2)


def scratch_of(sandbox: Sandbox):
    """A scratch directory of ``sandbox`` (which sets its size), removed afterwards."""
    path = sandbox.new_scratch()
    yield path
    sandbox.remove_scratch(path)
    assert not path.exists()


@pytest.fixture
def scratch(sandbox):
    yield from scratch_of(sandbox)


@pytest.fixture
def bounded_scratch(bounded):
    yield from scratch_of(bounded)


def processes() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (parent pid, real uid, name, state) of every process, read from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            status = Path(f"/proc/{entry}/status").read_text().splitlines()
            uid_line = next(line for line in status if line.startswith("Uid:"))
        except (OSError, StopIteration):  # gone meanwhile
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        found[int(entry)] = (int(fields[1]), int(uid_line.split()[1]), name, fields[0])
    return found


def suspects() -> set[str]:
    """Processes a sandbox could have left: this test process's descendants, processes of the
    sandbox uid (as root), and bwrap orphans of pid 1 (an unreaped sandbox init)."""
    table, me = processes(), os.getpid()
    found = {pid for pid, (_, uid, _, _) in table.items() if AS_ROOT and uid == SANDBOX_UID}
    found |= {pid for pid, (ppid, _, name, _) in table.items() if ppid == 1 and name == "bwrap"}
    parents = {me}
    while children := {pid for pid, (ppid, *_) in table.items() if ppid in parents and pid not in found | {me}}:
        found |= children
        parents = children
    return {f"{pid} {table[pid][2]} ({table[pid][3]})" for pid in found}


def call_cgroups() -> list[Path]:
    """The per-call cgroups that exist now, each in its sandbox's cgroup (none between calls)."""
    found = sandbox_module._FOUND_CGROUPS
    if not found or isinstance(found[0], str):
        return []
    parents = {found[0].memory_parent, found[0].pids_parent}
    return sorted(path for parent in parents for pattern in ("call-*", "*/call-*") for path in parent.glob(pattern))


def memory_of(cgroup: Path) -> int:
    """Bytes charged to a memory cgroup and its descendants (v2 or v1 name)."""
    name = "memory.current" if (cgroup / "memory.current").exists() else "memory.usage_in_bytes"
    return int((cgroup / name).read_text())


def scratch_mounts() -> set[str]:
    return {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines() if "/scratch-" in line}


@pytest.fixture(autouse=True)
def nothing_left_running():
    """After every test: no process a sandbox made is alive or unreaped (the kernel may take a
    moment to tear a PID namespace down, hence the short poll), no call cgroup is left and no
    scratch tmpfs stays mounted past its ``remove_scratch``."""
    before, mounts_before = suspects(), scratch_mounts()
    yield
    deadline = time.monotonic() + 3
    while (left := suspects() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(left) == []
    assert call_cgroups() == []
    assert scratch_mounts() <= mounts_before


def run(sandbox, code, scratch) -> SandboxResult:
    return asyncio.run(sandbox.run_python(code, scratch))


# --------------------------------------------------------------------------- output


@pytest.mark.timeout(30)
def test_print_and_the_sandboxed_environment(sandbox, scratch):
    code = "import os, sys, sympy\nprint(6 * 7)\nprint(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'])\nprint(os.getuid())"
    result = run(sandbox, code, scratch)
    lines = result.stdout.splitlines()
    assert result.ok and result.error is None and result.exit_code == 0 and result.stderr == ""
    assert lines[0] == "42" and lines[1] == "/tmp/work /tmp/work /tmp/work"
    assert lines[2] == str(SANDBOX_UID if AS_ROOT else os.getuid())
    assert result.text() == result.stdout.rstrip("\n")


@pytest.mark.timeout(30)
def test_errors_and_silence_reach_the_text(sandbox, scratch):
    crashed = run(sandbox, "print('before')\n1 / 0", scratch)
    assert crashed.exit_code == 1 and crashed.error is None and not crashed.ok
    assert crashed.stdout == "before\n" and crashed.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert 'File "/tmp/main.py", line 2' in crashed.stderr  # a fixed path, the same every rollout
    assert crashed.text().startswith("before\nTraceback")
    assert run(sandbox, "x = 1", scratch).text() == "(no output)"
    assert run(sandbox, "import sys; sys.exit(3)", scratch).text() == "(exit status 3)"


@pytest.mark.timeout(30)
def test_scratch_persists_between_calls_and_is_removed(sandbox, scratch):
    run(sandbox, "open('notes.txt', 'w').write('kept')\nimport os; os.makedirs('locked/deep'); os.chmod('locked', 0)", scratch)
    assert run(sandbox, "print(open('/tmp/work/notes.txt').read())", scratch).stdout == "kept\n"
    assert (scratch / "notes.txt").read_text() == "kept"
    other = sandbox.new_scratch()
    assert run(sandbox, "import os; print(os.listdir('.'))", other).stdout == "[]\n"  # scratches are separate
    sandbox.remove_scratch(other)
    with pytest.raises(ValueError, match="not a scratch directory"):
        sandbox.remove_scratch(REPO)


@pytest.mark.timeout(30)
def test_output_is_truncated_head_and_tail(sandbox, scratch):
    result = run(sandbox, "for i in range(100000): print(i)\nimport sys; print('the end', file=sys.stderr)", scratch)
    assert result.ok and len(result.stdout) < 500  # 400 characters kept + the marker
    assert result.stdout.startswith("0\n1\n2\n") and result.stdout.rstrip().endswith("99998\n99999")
    assert "characters cut] ..." in result.stdout
    assert result.stderr == "the end\n"


# --------------------------------------------------------------------------- limits


@pytest.mark.timeout(30)
def test_infinite_loop_is_stopped_by_the_cpu_limit(sandbox, scratch):
    start = time.monotonic()
    result = run(sandbox, "print('looping', flush=True)\nwhile True: pass", scratch)
    assert time.monotonic() - start < SHORT.wall_s + 2
    assert result.error in ("CPU time limit of 2 s exceeded", "timed out after 4 s (wall-clock limit)")
    assert result.stdout == "looping\n" and "Error: " in result.text()


@pytest.mark.timeout(30)
def test_sleeping_program_is_stopped_by_the_wall_clock(sandbox, scratch):
    start = time.monotonic()
    result = run(sandbox, "import time, subprocess\nsubprocess.Popen(['sleep', '60'])\nprint('napping')\ntime.sleep(60)", scratch)
    assert SHORT.wall_s <= time.monotonic() - start < SHORT.wall_s + 3
    assert result.error == "timed out after 4 s (wall-clock limit)" and result.exit_code is None
    assert result.stdout == "napping\n"  # what it printed before the kill survives (unbuffered)


@pytest.mark.timeout(30)
def test_background_children_do_not_outlive_the_program(sandbox, scratch):
    start = time.monotonic()
    result = run(sandbox, "import subprocess\nsubprocess.Popen(['sleep', '60'], start_new_session=True)\nprint('bye')", scratch)
    assert result.ok and result.stdout == "bye\n" and time.monotonic() - start < 3  # no wait for the orphan


@pytest.mark.timeout(30)
def test_large_allocation_hits_the_memory_limit(sandbox, scratch):
    result = run(sandbox, "x = bytearray(4 * 2**30)\nprint('allocated')", scratch)
    assert result.error == "memory limit of 1024 MB reached (MemoryError)" and result.exit_code == 1
    assert "allocated" not in result.stdout and result.text().endswith("Error: memory limit of 1024 MB reached (MemoryError)")
    numpy = run(sandbox, "import numpy\nnumpy.ones((2**19, 2**10))", scratch)  # 4 GiB of float64
    assert numpy.error == "memory limit of 1024 MB reached (MemoryError)"


FORK_BOMB = """
import os, time
refused = False
while True:
    try:
        os.fork()
    except OSError:
        if not refused:
            print('fork refused', flush=True)
        refused = True
        time.sleep(0.01)
"""


@pytest.mark.timeout(60)
def test_fork_bomb_is_contained_and_cleaned_up(sandbox, scratch):
    start = time.monotonic()
    result = run(sandbox, FORK_BOMB, scratch)
    assert time.monotonic() - start < SHORT.wall_s + 3
    assert result.error == "timed out after 4 s (wall-clock limit)"
    assert "fork refused" in result.stdout  # RLIMIT_NPROC said no
    # the autouse fixture then checks that none of the bomb's processes is left
    after = run(sandbox, "print('still works')", scratch)  # the limit was that sandbox's own
    assert after.ok and after.stdout == "still works\n"


@pytest.mark.timeout(30)
def test_file_size_limit(sandbox, scratch):
    small = Sandbox(SandboxLimits(wall_s=5, max_file_mb=1))
    result = run(small, "open('big', 'wb').write(b'x' * 2 * 2**20)", scratch)
    assert result.error == "file size limit of 1 MB exceeded"


# --------------------------------------------------------------------------- limits of the whole call
# Each test below tries to exceed one bound of BOUNDED; the numbers are those of docs/sandbox.md.

FORK_HOLDERS = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(60 * 2**20)
        for i in range(0, len(block), 4096):  # touch every page: resident, not just reserved
            block[i] = 1
        time.sleep(1)
        os._exit(0)
    children.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print('held', codes.count(0), 'killed', codes.count(-9))
"""


@pytest.mark.timeout(30)
def test_forked_children_share_one_memory_bound(bounded, scratch):
    # 4 x 60 MB stays under each process's RLIMIT_AS (1024 MB) but not under the call's 128 MB
    result = run(bounded, FORK_HOLDERS, scratch)
    assert result.error == "memory limit of 128 MB for the whole call reached (killed)"
    held, killed = (int(n) for n in result.stdout.split()[1::2])
    assert held <= 2 and killed == 4 - held, result.stdout  # two 60 MB children at most fit


MEMFDS = """
import os
for i in range(4):
    os.write(os.memfd_create(f'block{i}'), b'x' * (60 * 2**20))  # never mapped: not in RLIMIT_AS
    print('memfd', i + 1, flush=True)
print('held 240 MB')
"""


@pytest.mark.timeout(30)
def test_memfd_pages_count_in_the_call_memory(bounded, scratch):
    result = run(bounded, MEMFDS, scratch)
    assert result.error == "memory limit of 128 MB for the whole call reached (killed)"
    assert "held 240 MB" not in result.stdout and "memfd 3" not in result.stdout, result.stdout


FILL_SCRATCH = """
import sys
written = 0
try:
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        with open(f'part{{i}}-{call}', 'wb') as f:
            for _ in range(6):
                f.write(b'x' * 2**20)
                written += 2**20
finally:
    print('wrote MB', written >> 20, flush=True)
"""


@pytest.mark.timeout(30)
def test_scratch_bytes_are_capped_in_total(bounded, bounded_scratch):
    # 12 MB per call in files of 6 MB (each under max_file_mb): the 16 MB cap is the rollout's
    scratch = bounded_scratch
    first, second = (run(bounded, FILL_SCRATCH.format(call=n), scratch) for n in (1, 2))
    assert first.ok and first.stdout == "wrote MB 12\n"
    assert second.error == "scratch space limit of 16 MB reached" and "No space left on device" in second.stderr
    assert int(second.stdout.split()[-1]) == 4  # what was left of the 16 MB, not another 12
    assert sum(path.stat().st_size for path in scratch.iterdir()) <= 16 * 2**20


FILL_40MB = FILL_SCRATCH.format(call=0).replace("range(6)", "range(20)")  # 2 files of 20 MB


@pytest.mark.timeout(30)
def test_scratch_of_all_rollouts_is_bounded_together(sandbox):
    # 4 rollouts, one call each writing 40 MB (under each 48 MB tmpfs and each call's 96 MB): 160
    # MB in all, kept after the calls end, over the 128 MB of everything together. Before the
    # shared bound all 4 held it (the probe: 8 x 180 MB stayed in host memory, charged to call
    # cgroups already removed).
    limits = SandboxLimits(wall_s=8, cpu_s=4, call_memory_mb=96, scratch_mb=48, total_memory_mb=128, max_procs=16)
    shared = Sandbox(limits, max_concurrent=2)
    scratches = [shared.new_scratch() for _ in range(4)]
    try:
        results = [run(shared, FILL_40MB, s) for s in scratches]
        group = shared._group.memory_dir
        held = memory_of(group)
        written = sum(path.stat().st_size for s in scratches for path in s.iterdir())
    finally:
        for s in scratches:
            shared.remove_scratch(s)
    assert results[0].ok and results[0].stdout == "wrote MB 40\n"
    message = "shared memory limit of 128 MB (all running calls and scratch files together) reached (killed)"
    assert results[-1].error == message and results[-1].text().endswith(f"Error: {message}")
    assert held <= 128 * 2**20 and written <= 128 * 2**20, (held, written, [r.text() for r in results])
    assert memory_of(group) < 16 * 2**20  # the scratch pages went with their tmpfs
    del shared  # the sandbox's cgroup goes with it
    assert not group.exists()


def our_cgroups() -> set[Path]:
    """The sandbox and call cgroups of this process, in every hierarchy."""
    parent = sandbox_module._FOUND_CGROUPS[0]
    return {p for d in {parent.memory_parent, parent.pids_parent} for p in d.rglob(f"*-{os.getpid()}-*")}


def test_a_cgroup_that_cannot_be_limited_is_a_one_line_error_and_left_nowhere(sandbox, scratch, monkeypatch):
    run(sandbox, "pass", scratch)  # the cgroups found, and the module's sandbox has its own
    write, before = sandbox_module._write, our_cgroups()

    def refuse_memory_limits(path: Path, value: str, optional: bool = False) -> None:
        if path.name in ("memory.max", "memory.limit_in_bytes"):
            raise PermissionError(13, "Permission denied")
        write(path, value, optional)

    monkeypatch.setattr(sandbox_module, "_write", refuse_memory_limits)
    fresh = Sandbox(SHORT)
    for _ in range(2):  # the sandbox's own cgroup, tried again on the next call
        result = run(fresh, "print(1)", scratch)
        assert result.error == "sandbox failed to start: cannot make its cgroup: [Errno 13] Permission denied"
        assert fresh._group is None and our_cgroups() == before
    monkeypatch.setattr(sandbox_module, "_write", write)
    assert run(fresh, "print(1)", scratch).ok  # and once it can be made, it is


OPEN_FILES = """
import os, resource
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # raise the soft limit as far as allowed
fds = []
try:
    while len(fds) < 5000:
        fds.append(os.open('/dev/null', os.O_RDONLY))
finally:
    print('hard', hard, 'opened', len(fds), flush=True)
"""


@pytest.mark.timeout(30)
def test_open_files_are_bounded(bounded, scratch):
    result = run(bounded, OPEN_FILES, scratch)
    assert result.error == "open files limit of 32 per process reached"
    assert result.stdout.split()[:2] == ["hard", "32"] and int(result.stdout.split()[3]) < 32


FORK_TO_THE_LIMIT = """
import os, time

def hold():  # every process stays until the test has read the cgroup (it writes 'seen' in the scratch)
    deadline = time.monotonic() + 5
    while not os.path.exists('seen') and time.monotonic() < deadline:
        time.sleep(0.01)

count = 1
try:
    while count < 200:
        if os.fork() == 0:
            hold()
            os._exit(0)
        count += 1
except OSError:
    pass
print('processes', count, flush=True)
hold()
"""


@pytest.mark.timeout(30)
def test_processes_are_bounded_by_the_call_cgroup(bounded, scratch):
    names = ("pids.max", "pids.current", "memory.max", "memory.limit_in_bytes")  # v2 or v1 names

    async def main():
        call = asyncio.create_task(bounded.run_python(FORK_TO_THE_LIMIT, scratch))
        while not (cgroups := call_cgroups()) and not call.done():
            await asyncio.sleep(0.01)
        # Read the cgroup until the program has forked all it could (or 5 s passed: the
        # assertions below then show what it held); it holds every process until told.
        deadline, seen = time.monotonic() + 5, {}
        while seen.get("pids.current") != seen.get("pids.max") or not seen:
            seen = {name: (c / name).read_text().strip() for c in cgroups for name in names if (c / name).exists()}
            if call.done() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        (scratch / "seen").touch()
        return await call, seen

    result, seen = asyncio.run(main())
    assert result.ok and result.stdout == "processes 16\n"  # RLIMIT_NPROC: 16, the program included
    assert seen["pids.max"] == "18" and seen["pids.current"] == "18"  # the cgroup: + bwrap's 2
    assert int(seen.get("memory.max") or seen["memory.limit_in_bytes"]) == 128 * 2**20


def test_limits_must_be_finite_and_positive():
    for name, value in [("wall_s", math.nan), ("wall_s", math.inf), ("wall_s", -1.0), ("cpu_s", math.inf),
                        ("cpu_s", 2.5), ("memory_mb", math.nan), ("call_memory_mb", math.inf),
                        ("max_procs", True), ("max_open_files", 0), ("scratch_mb", math.inf),
                        ("max_file_mb", "64"), ("max_output_chars", math.nan), ("total_memory_mb", math.inf)]:  # fmt: skip
        with pytest.raises(ValueError, match=f"SandboxLimits.{name} must be"):
            SandboxLimits(**{name: value})
    with pytest.raises(ValueError, match="scratch_mb .* must be below call_memory_mb"):
        SandboxLimits(call_memory_mb=64, scratch_mb=64)
    with pytest.raises(ValueError, match=r"total_memory_mb \(512\) must be at least call_memory_mb \(1024\)"):
        SandboxLimits(total_memory_mb=512)


def test_missing_bounds_fail_closed(monkeypatch):
    monkeypatch.setattr("prime_rl.envs.sandbox._AVAILABLE", set())
    monkeypatch.setattr("prime_rl.envs.sandbox.shutil.which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr("prime_rl.envs.sandbox._FOUND_CGROUPS", ["no cgroup hierarchy with the memory and pids controllers is mounted"])
    monkeypatch.setattr("prime_rl.envs.sandbox.os.geteuid", lambda: 0)
    with pytest.raises(SandboxUnavailable, match="bounds each call with a cgroup, but no cgroup hierarchy.*delegated cgroup v2"):
        Sandbox.check_available()
    monkeypatch.setattr("prime_rl.envs.sandbox.os.geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root: each rollout's scratch directory is a size-capped tmpfs"):
        Sandbox.check_available()


# --------------------------------------------------------------------------- isolation

NETWORK = """
import socket
for host, port in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print(host, "connected")
    except OSError as e:
        print(host, "failed", type(e).__name__)
"""


@pytest.mark.timeout(30)
def test_no_network(sandbox, scratch):
    with socket.socket() as server:  # a real listener on the host's loopback
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run(sandbox, NETWORK.format(port=port), scratch)
    assert result.ok and result.stdout.count("failed") == 3 and "connected" not in result.stdout
    assert "127.0.0.1 failed ConnectionRefusedError" in result.stdout  # its own empty loopback


@pytest.mark.timeout(30)
def test_no_writes_outside_the_scratch_dir(sandbox, scratch):
    targets = ["/tmp/x", "/var/tmp/x", "/dev/shm/x", "/run/x", str(REPO / "sandbox-was-here"), "/etc/passwd", "/tmp/main.py"]
    code = "import sys\nfor path in sys.argv[1:] or %r:\n" % targets + (
        "    try:\n        open(path, 'a').write('x')\n        print(path, 'WRITTEN')\n"
        "    except OSError as e:\n        print(path, 'refused', e.strerror)\n"
    )
    result = run(sandbox, code, scratch)
    assert result.ok and "WRITTEN" not in result.stdout and result.stdout.count("refused") == len(targets)
    assert not (REPO / "sandbox-was-here").exists() and not Path("/tmp/x").exists()


@pytest.mark.timeout(30)
def test_host_tmp_and_home_are_hidden(sandbox, scratch):
    # an interpreter (a venv of a checkout) under /tmp is bound back in: only its own path shows
    reexposed = {Path(sys.prefix).resolve().parts[2]} if Path(sys.prefix).resolve().parts[1:2] == ("tmp",) else set()
    with tempfile.NamedTemporaryFile(prefix="host-secret-") as host_file:
        result = run(sandbox, "import os\nprint(sorted(os.listdir('/tmp')))\nprint(os.path.exists('/run'))\n"
                     f"print(os.path.exists({host_file.name!r}))", scratch)
    assert result.stdout.splitlines()[:3] == [str(sorted({"main.py", "work"} | reexposed)), "False", "False"]


@pytest.mark.timeout(30)
def test_only_the_system_and_the_interpreter_are_visible(sandbox, scratch):
    # world-readable host files a sandbox has no need for: the repo, other runs' outputs, ...
    probe_dir = Path(tempfile.mkdtemp(prefix="prime-rl-sandbox-visible-", dir=REPO.parent))
    (probe_dir / "metrics.jsonl").write_text("{}")
    probe_dir.chmod(0o755)
    paths = [REPO / ".git" / "config", REPO / "pyproject.toml", REPO / "outputs", probe_dir / "metrics.jsonl",
             "/home", "/srv", "/opt", "/mnt", "/media", "/var", "/root/.bashrc", "/sys", "/boot"]  # fmt: skip
    code = f"import os, sys\nfor path in {[str(p) for p in paths]!r}:\n    print(path, os.path.exists(path))\n"
    code += f"print(sorted(os.listdir({str(REPO)!r})))\nimport numpy, sympy\nprint(sys.prefix)"
    try:
        result = run(sandbox, code, scratch)
    finally:
        (probe_dir / "metrics.jsonl").unlink()
        probe_dir.rmdir()
    lines = result.stdout.splitlines()
    assert result.ok, result.text()
    assert lines[: len(paths)] == [f"{path} False" for path in paths]
    venv = Path(sys.prefix).resolve()  # the venv itself is bound, never the checkout around it
    assert lines[len(paths)] == (str([venv.name]) if venv.parent == REPO else "[]")
    assert lines[-1] == sys.prefix


@pytest.mark.skipif(not AS_ROOT, reason="needs root to make a file the sandbox user must not read")
@pytest.mark.timeout(30)
def test_cannot_read_other_users_files(sandbox, scratch):
    # the only host folder the sandbox both sees and may enter is its scratch directory
    secret = scratch / "secret.txt"
    secret.write_text("root only")
    secret.chmod(0o600)
    code = ("for path in ['/tmp/work/secret.txt', '/etc/shadow', '/root/.bashrc', '/proc/1/environ']:\n"
            "    try:\n        print(path, 'READ', open(path).read()[:20])\n"
            "    except OSError as e:\n        print(path, 'refused', e.strerror)\n")
    result = run(sandbox, code, scratch)
    assert result.ok and "READ" not in result.stdout, result.stdout
    assert "/tmp/work/secret.txt refused Permission denied" in result.stdout


# --------------------------------------------------------------------------- concurrency


@pytest.mark.timeout(60)
def test_concurrent_calls_keep_the_event_loop_responsive(sandbox):
    scratches = [sandbox.new_scratch() for _ in range(8)]

    async def main():
        ticks, stop = [], asyncio.Event()

        async def ticker():
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        tick_task = asyncio.create_task(ticker())
        start = time.monotonic()
        results = await asyncio.gather(*(
            sandbox.run_python(f"import time\nsum(range(10**6))\ntime.sleep(1)\nprint({i} ** 2)", s)
            for i, s in enumerate(scratches)
        ))  # fmt: skip
        elapsed = time.monotonic() - start
        stop.set()
        await tick_task
        return results, elapsed, max(b - a for a, b in zip(ticks, ticks[1:]))

    try:
        results, elapsed, worst_gap = asyncio.run(main())
    finally:
        for s in scratches:
            sandbox.remove_scratch(s)
    assert [r.stdout for r in results] == [f"{i ** 2}\n" for i in range(8)]
    assert elapsed >= 2.0  # 8 one-second programs, 4 at a time: two waves at least
    assert worst_gap < 0.5  # the loop never stalled while sandboxes started and ran


@pytest.mark.timeout(30)
def test_cancelled_call_kills_its_sandbox(sandbox, scratch):
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sandbox.run_python("import time\ntime.sleep(60)", scratch), 0.5)

    asyncio.run(main())  # the autouse fixture checks nothing survived


# --------------------------------------------------------------------------- misc


def test_result_text_and_limits_validation():
    timed_out = SandboxResult("", "", None, "timed out after 10 s (wall-clock limit)")
    assert timed_out.text() == "Error: timed out after 10 s (wall-clock limit)"
    assert SandboxResult("out\n", "err\n", 1).text() == "out\nerr"
    with pytest.raises(ValueError, match="wall_s must be positive"):
        SandboxLimits(wall_s=0)


def test_missing_bwrap_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr("prime_rl.envs.sandbox._AVAILABLE", set())
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match=r"needs bubblewrap \(bwrap\).*apt-get install bubblewrap"):
        Sandbox.check_available()
