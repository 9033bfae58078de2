"""The run's memory as the launcher sees it: a census of its processes, the out-of-memory
kills among them, and the run's peak.

- **The census** (``take_census``, every ``CENSUS_S``): each launched process's tree
  (``prime_rl.procmem.process_tree``) with each process's role, its resident memory (RSS)
  and the part of it the process alone holds (``ProcInfo.anon``, RSS less shared pages).
  A role is the name of the launched process at the top of the tree (`inference`, `trainer`,
  `orchestrator`, ...), except that an environment worker is `env worker '<env>'` and
  everything it starts (a harness program per episode, sandboxed calls) `episodes of '<env>'`:
  the worker pids come from ``RUN/logs/load.json``, which the orchestrator's episode limiter
  rewrites every second (``orchestrator.load``; absent, damaged or a previous run's: the
  workers stay `orchestrator`). Its budget is quoted by the report.
- **The evidence** that the kernel's OOM killer took a process of the run, best first
  (``find_oom``, pure):
  (a) the kernel log, ``/dev/kmsg`` (root, or ``kernel.dmesg_restrict = 0``): a `Killed
      process PID` line whose pid the census saw in its latest or previous walk. A kill at the
      limit of a python-sandbox call (its ``oom_memcg`` under ``prime-rl-sandbox/``) is the
      sandbox's own bound at work (``prime_rl.envs.sandbox`` tells the model) and is ignored.
  (b) where the kernel log cannot be read: the OOM kill count of the run's memory cgroup
      (``procmem.oom_kill_count``, less the sandbox's own) rising; the victim is then a
      launched process that exited by SIGKILL, else the largest process the census saw that
      vanished since the walk before.
  (c) neither: a launched process killed by SIGKILL while the census saw the machine with
      less than ``LOW_MEMORY_SHARE`` of its memory available: "most likely" the OOM killer.
- **The report** (``describe_oom``): one line naming the victim (role, pid, name, RSS), the
  run's biggest memory users at the census before the kill, the run's total against the
  budget, and what to change. The launcher prints it, stops the run and exits 137.
- **The peak** (``RunMemory.peak_line``): the largest total the census measured and when.

Totals (per role, the run's, the peak) sum what each process alone holds, as the episode
limiter does against its budget: a sum of RSS would count a library that every harness program
maps once per program. A victim's own size is its RSS (what the kernel's kill record says). A
process born and killed between two walks
(under ``CENSUS_S``) is not in the census, so a kernel-log kill of it is not recognized as
the run's. Stdlib and psutil only: the launcher imports this module.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl import procmem
from prime_rl.procmem import GB, MB, ProcInfo
from prime_rl.rundir import load_state_path

CENSUS_S = 2.0
"""Seconds between two walks of the run's process trees (a walk reads /proc for every process)."""

LOW_MEMORY_SHARE = 0.10
"""Below this share of the machine's memory available, a SIGKILL is most likely the OOM killer's."""

SANDBOX_CGROUP = "prime-rl-sandbox"
"""``prime_rl.envs.sandbox.CGROUP_PARENT`` (a test checks they agree; importing the sandbox
would pull the environment SDK into the launcher)."""

KMSG = "/dev/kmsg"
KMSG_RECORDS_PER_POLL = 10_000  # a flood of kernel messages is read over several polls, never in one

TOP_USERS = 5
"""Roles the report names as the run's biggest memory users."""

BUDGET_SETTING = "[orchestrator.load] memory_budget_gb"


# --------------------------------------------------------------------------- the census


@dataclass(frozen=True)
class Member:
    """One process of the run as a walk saw it."""

    role: str
    name: str
    rss: int
    """Resident bytes (what the kernel's kill record reports of its victim)."""

    own: int | None = None
    """Resident bytes the process alone holds (``procmem.ProcInfo.anon``: RSS less shared
    pages); None: as ``rss``."""

    @property
    def held(self) -> int:
        return self.rss if self.own is None else self.own


@dataclass(frozen=True)
class Census:
    """One walk of the run's process trees."""

    unix: float
    members: dict[int, Member]
    available: int | None = None
    """Bytes the machine (or the run's cgroup) could still give, when known."""

    machine_total: int | None = None

    @property
    def total(self) -> int:
        """Bytes the run's processes hold together: the sum of what each alone holds (a sum of
        RSS would count a library every harness program maps once per program)."""
        return sum(m.held for m in self.members.values())

    def by_role(self) -> dict[str, tuple[int, int]]:
        """role -> (processes, bytes held as in ``total``)."""
        roles: dict[str, tuple[int, int]] = {}
        for m in self.members.values():
            count, held = roles.get(m.role, (0, 0))
            roles[m.role] = (count + 1, held + m.held)
        return roles

    def low_memory(self) -> bool:
        return bool(self.available is not None and self.machine_total
                    and self.available < LOW_MEMORY_SHARE * self.machine_total)


@dataclass(frozen=True)
class LoadState:
    """What the launcher uses of ``RUN/logs/load.json``."""

    budget_bytes: int | None = None
    budget_from: str | None = None
    """Where the budget comes from (``[orchestrator.load] memory_budget_gb = 12``, ...)."""

    workers: dict[int, str] = field(default_factory=dict)
    """Environment worker pid -> environment name."""

    in_process: tuple[str, ...] = ()
    """Environments played in the orchestrator itself: the programs their episodes start are
    the orchestrator's children outside workers."""


def parse_load_state(data, since_unix: float) -> LoadState | None:
    """``load.json``'s content as a ``LoadState``; None when it is not one or was written
    before ``since_unix`` (a previous run's file: its pids are no longer the workers')."""
    if not isinstance(data, dict):
        return None
    written = data.get("time_unix")
    if not _number(written) or written < since_unix:
        return None
    budget = data.get("budget_bytes")
    budget = budget if type(budget) is int and budget > 0 else None
    source = data.get("budget_from") if isinstance(data.get("budget_from"), str) else None
    workers, in_process = {}, []
    envs = data.get("envs") if isinstance(data.get("envs"), dict) else {}
    for env, state in envs.items():
        if not isinstance(state, dict):
            continue
        pid = state.get("worker_pid")
        if type(pid) is int and pid > 0:
            workers[pid] = str(env)
        elif pid is None:
            in_process.append(str(env)[:100])
    return LoadState(budget, " ".join(source.split())[:200] if source else None, workers, tuple(in_process))


def read_load_state(run_dir: Path, since_unix: float) -> LoadState | None:
    try:
        return parse_load_state(json.loads(load_state_path(run_dir).read_bytes()), since_unix)
    except (OSError, ValueError, RecursionError):  # absent, half-written elsewhere, not JSON
        return None


def assign_roles(top: str, tree: list[ProcInfo], workers: dict[int, str], in_process: tuple[str, ...] = ()
                 ) -> dict[int, str]:
    """pid -> role for one launched process's tree: ``top`` (its name), except an environment
    worker (``workers``: pid -> env) and its descendants, and in the orchestrator's tree the
    other descendants, the episodes' programs of the environments it plays itself
    (``in_process``)."""
    parent = {p.pid: p.ppid for p in tree}
    root = tree[0].pid if tree else None
    beside = f"episodes of {', '.join(repr(env) for env in in_process)}" if top == "orchestrator" and in_process else top
    roles = {}
    for proc in tree:
        role, pid = (top if proc.pid == root else beside), proc.pid
        for _ in range(len(tree)):  # bounded: a pid reused mid-walk could make a cycle
            if pid in workers:
                env = workers[pid]
                role = f"env worker '{env}'" if pid == proc.pid else f"episodes of '{env}'"
                break
            if pid not in parent:
                break
            pid = parent[pid]
        roles[proc.pid] = role
    return roles


def take_census(launched: dict[str, int], workers: dict[int, str], now: float, in_process: tuple[str, ...] = ()
                ) -> Census:
    """Walk every launched process's tree (name -> pid)."""
    members = {}
    for name, pid in launched.items():
        tree = procmem.process_tree(pid)
        roles = assign_roles(name, tree, workers, in_process)
        for proc in tree:
            members[proc.pid] = Member(roles[proc.pid], proc.name, proc.rss, proc.anon)
    machine = procmem.machine_memory()
    return Census(now, members, machine.available if machine else None, machine.total if machine else None)


# --------------------------------------------------------------------------- the kernel log


@dataclass(frozen=True)
class KernelKill:
    """A `Killed process` line of the kernel log."""

    pid: int
    name: str
    rss: int | None
    """Resident bytes when killed (anon + file + shmem), when the line says."""

    memcg: str | None = None
    """The cgroup whose limit was reached (``oom_memcg``); None for the machine's own OOM."""

    @property
    def sandboxed(self) -> bool:
        """At the limit of a python-sandbox call (or of its sandbox): the sandbox's bound at work."""
        return self.memcg is not None and f"/{SANDBOX_CGROUP}/" in self.memcg


_KILLED = re.compile(r"out of memory(?: \([^)]*\))?: Killed process (\d+) \((.*)\)", re.IGNORECASE)
_RSS = re.compile(r"\b(?:anon|file|shmem)-rss:(\d+)kB")


class KernelLogParser:
    """Turns kernel log records into ``KernelKill``s, pure. The kernel writes an `oom-kill:`
    record (the cgroups) just before the `Killed process` one; the two are joined by pid."""

    def __init__(self):
        self.memcg: dict[int, str] = {}

    def feed(self, record: str) -> KernelKill | None:
        """One /dev/kmsg record (`PRIORITY,SEQ,USEC,FLAGS;MESSAGE` + continuation lines)."""
        message = record.partition(";")[2].split("\n", 1)[0]
        if message.startswith("oom-kill:"):
            fields = dict(kv.split("=", 1) for kv in message[len("oom-kill:"):].split(",") if "=" in kv)
            if fields.get("pid", "").isdigit() and "oom_memcg" in fields:
                if len(self.memcg) > 100:  # other programs' kills whose `Killed` line we never saw
                    self.memcg.clear()
                self.memcg[int(fields["pid"])] = fields["oom_memcg"]
            return None
        found = _KILLED.search(message)
        if found is None:
            return None
        pid = int(found.group(1))
        sizes = [int(kb) * 1024 for kb in _RSS.findall(message)]
        return KernelKill(pid, found.group(2), sum(sizes) if sizes else None, self.memcg.pop(pid, None))


class KernelLog:
    """``/dev/kmsg`` from the moment it was opened on, read without blocking."""

    def __init__(self, fd: int):
        self.fd, self.parser = fd, KernelLogParser()

    @classmethod
    def open(cls, path: str = KMSG) -> KernelLog | None:
        """None where the kernel log cannot be read (not root and ``dmesg_restrict``, a container)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            os.lseek(fd, 0, os.SEEK_END)  # the kills before the run are not the run's
        except OSError:
            os.close(fd)
            return None
        return cls(fd)

    def read(self) -> list[KernelKill]:
        """The kills logged since the last read."""
        kills = []
        for _ in range(KMSG_RECORDS_PER_POLL):
            try:
                record = os.read(self.fd, 8192)
            except BlockingIOError:  # nothing new
                break
            except BrokenPipeError:  # records overwritten before we read them: go on with the next
                continue
            except OSError:
                break
            if not record:
                break
            kill = self.parser.feed(record.decode("utf-8", "replace"))
            if kill is not None:
                kills.append(kill)
        return kills

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def run_oom_kill_count() -> int | None:
    """The OOM kills of the run's memory cgroup, less the python sandbox's own: cgroup v2 counts
    a child cgroup's kills in its parents' too (v1 counts a cgroup's own only)."""
    count = procmem.oom_kill_count()
    found = procmem.memory_cgroup()
    if count is None or found is None or found[0] != 2:
        return count
    with contextlib.suppress(OSError):
        for line in (found[1] / SANDBOX_CGROUP / "memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return count - int(value)
    return count


# --------------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class OomKill:
    """A process of the run the OOM killer took, and how we know."""

    pid: int | None
    role: str
    name: str
    rss: int | None
    how: str
    """``kernel log``, ``cgroup count`` or ``low memory`` (see the module docstring)."""

    memory_share: float | None = None
    """With ``low memory``: the share of the machine's memory that was available."""


def find_oom(kills: list[KernelKill] | None, count_rose: bool, before: Census | None, after: Census | None,
             sigkilled: dict[str, int]) -> OomKill | None:
    """The run's process the OOM killer took, or None, pure. ``kills``: the kernel log's since
    the last check (None where it cannot be read); ``count_rose``: the cgroup's OOM kill count
    rose; ``before`` / ``after``: the two latest censuses; ``sigkilled``: launched processes
    (name -> pid) that just exited by SIGKILL."""
    if kills is not None:
        for kill in kills:
            member = _member(kill.pid, after, before)
            if member is not None and not kill.sandboxed:
                return OomKill(kill.pid, member.role, kill.name, kill.rss or member.rss, "kernel log")
        return None  # the kernel log is the whole truth where it can be read
    launched = next(iter(sigkilled.items()), None)
    if count_rose:
        if launched is not None:  # an exit by SIGKILL is certain; a vanished process may just have ended
            name, pid = launched
            member = _member(pid, after, before)
            return OomKill(pid, name, member.name if member else name, member.rss if member else None, "cgroup count")
        gone = _vanished(before, after)
        if gone:
            pid, member = gone[0]
            return OomKill(pid, member.role, member.name, member.rss, "cgroup count")
    low = [c for c in (before, after) if c is not None and c.low_memory()]
    if launched is not None and low:
        name, pid = launched
        member = _member(pid, after, before)
        share = min(c.available / c.machine_total for c in low)
        return OomKill(pid, name, member.name if member else name, member.rss if member else None, "low memory", share)
    return None


def _member(pid: int, *censuses: Census | None) -> Member | None:
    for census in censuses:
        if census is not None and pid in census.members:
            return census.members[pid]
    return None


def _vanished(before: Census | None, after: Census | None) -> list[tuple[int, Member]]:
    """Processes of ``before`` that ``after`` no longer sees, largest first. A killed process
    not yet reaped (a zombie) shows 0 resident bytes: it counts as gone (and one that was a
    zombie already in ``before`` was gone then)."""
    if before is None or after is None:
        return []
    alive = {pid for pid, m in after.members.items() if m.rss > 0}
    gone = [(pid, m) for pid, m in before.members.items() if m.rss > 0 and pid not in alive]
    return sorted(gone, key=lambda item: -item[1].rss)


# --------------------------------------------------------------------------- the lines


def size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / MB:.0f} MB"


def victim(kill: OomKill) -> str:
    """`an episode of 'my-env' (pid 4242, python, 1.9 GB)`."""
    role = kill.role
    if role.startswith("episodes of "):
        role = "an episode of " + role.removeprefix("episodes of ")
    elif role.startswith("env worker "):
        role = "the environment worker of " + role.removeprefix("env worker ")
    details = ", ".join(x for x in (f"pid {kill.pid}" if kill.pid else "", kill.name, size(kill.rss)) if x)
    return f"{role} ({details})"


def biggest_users(census: Census, top: int = TOP_USERS) -> str:
    """`episodes of 'my-env' 212 processes 9.8 GB, inference 3.1 GB, ...`, largest first."""
    roles = sorted(census.by_role().items(), key=lambda item: -item[1][1])
    parts = []
    for role, (count, held) in roles[:top]:
        processes = f" {count} process{'es' if count != 1 else ''}" if role.startswith("episodes of ") else ""
        parts.append(f"{role}{processes} {size(held)}")
    return ", ".join(parts) + (f" and {len(roles) - top} more" if len(roles) > top else "")


def describe_oom(kill: OomKill, census: Census | None, load: LoadState) -> str:
    """The one line the launcher prints (after `[prime-rl] `)."""
    if kill.how == "low memory":
        available = f"{kill.memory_share:.0%}" if kill.memory_share is not None else "little"
        what = (f"{victim(kill)} was killed by SIGKILL while the machine had {available} of its memory "
                "available: most likely the out-of-memory killer")
    else:
        what = f"the kernel's OOM killer killed {victim(kill)}"
        if kill.how == "cgroup count":
            what += f" (inferred from the cgroup's OOM kill count: {KMSG} cannot be read)"
    budget = ""
    if load.budget_bytes:
        budget = f", budget {size(load.budget_bytes)}" + (f" from {load.budget_from}" if load.budget_from else "")
    users = ""
    if census is not None and census.members:
        users = f"; the run's biggest memory users then: {biggest_users(census)} (run total {size(census.total)}{budget})"
    elif budget:
        users = f" ({budget.removeprefix(', ')})"
    return f"out of memory: {what}{users}; lower {BUDGET_SETTING} or the batch, then continue with --resume"


def describe_peak(total: int, unix: float, load: LoadState) -> str:
    budget = f"; budget {size(load.budget_bytes)}" if load.budget_bytes else ""
    at = time.strftime("%H:%M:%S", time.localtime(unix))
    return f"peak memory: {size(total)} (all of the run's processes, RSS less shared pages, at {at}){budget}"


# --------------------------------------------------------------------------- the launcher's side


class RunMemory:
    """The census and the OOM check of one run, called by the launcher every poll."""

    def __init__(self, run_dir: Path, started_unix: float):
        self.run_dir, self.started_unix = Path(run_dir), started_unix
        self.kernel_log = KernelLog.open()
        self.count = None if self.kernel_log is not None else run_oom_kill_count()
        self.recent: deque[Census] = deque(maxlen=2)
        self.load = LoadState()
        self.peak: tuple[int, float] | None = None  # (bytes, unix)
        self.unexplained_unix: float | None = None  # the count rose, no victim found yet

    def check(self, launched: dict[str, int], now: float, sigkilled: dict[str, int] | None = None) -> OomKill | None:
        """Read the evidence, walk the trees when a census is due (or the count just rose:
        the walk before the kill against the one after) and judge."""
        kills = self.kernel_log.read() if self.kernel_log is not None else None
        rose = False
        if kills is None and (count := run_oom_kill_count()) is not None:
            rose = self.count is not None and count > self.count
            self.count = count
        due = not self.recent or now - self.recent[-1].unix >= CENSUS_S
        if due or rose:
            self.take_census(launched, now)
        # A rise whose victim was not found stays evidence for a launched process's SIGKILL seen
        # a moment later (never for processes that vanish later: those may just have ended).
        lingering = self.unexplained_unix is not None and now - self.unexplained_unix < CENSUS_S
        before = self.recent[0] if len(self.recent) > 1 else None
        kill = find_oom(kills, rose or (lingering and bool(sigkilled)), before, self.recent[-1] if self.recent else None,
                        sigkilled or {})
        if rose and kill is None:
            self.unexplained_unix = now
        elif kill is not None:
            self.unexplained_unix = None
        return kill

    def take_census(self, launched: dict[str, int], now: float) -> Census:
        load = read_load_state(self.run_dir, self.started_unix)
        if load is not None:
            self.load = load
        census = take_census(launched, self.load.workers, now, in_process=self.load.in_process)
        self.recent.append(census)
        if census.total and (self.peak is None or census.total > self.peak[0]):
            self.peak = (census.total, now)
        return census

    def report(self, kill: OomKill) -> str:
        """The one line for ``kill``, with the census that last saw the victim alive (a walk
        after the kill may see it as a zombie, holding nothing)."""
        census = next((c for c in reversed(self.recent) if kill.pid in c.members and c.members[kill.pid].rss), None)
        return describe_oom(kill, census or (self.recent[-1] if self.recent else None), self.load)

    def peak_gb(self) -> float | None:
        return round(self.peak[0] / GB, 3) if self.peak is not None else None

    def peak_line(self) -> str | None:
        return describe_peak(*self.peak, self.load) if self.peak is not None else None

    def close(self) -> None:
        if self.kernel_log is not None:
            self.kernel_log.close()


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
