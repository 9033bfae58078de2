"""What the machine holds and what a run's processes use: memory figures read from Linux.

Read by the orchestrator's episode limiter (``orchestrator.load``: how many episodes fit in
the memory budget) and by the launcher (``prime_rl.launch.oom``: the run's biggest memory
users when the kernel's out-of-memory killer strikes, and the run's peak). Linux only
(/proc and cgroups); elsewhere every figure is None and the callers fall back to no bound.

- ``machine_memory``: the memory the machine (or the cgroup the run is confined to, when
  its limit is lower) has in all and could still give: /proc/meminfo's ``MemAvailable``
  (free memory plus page cache the kernel can reclaim), capped by the cgroup's limit less
  its usage. In a container /proc/meminfo shows the host, so the cgroup is what binds there.
- ``process_tree``: a process and all its descendants, each with its resident memory (RSS)
  and the part of it the process alone holds (``ProcInfo.anon``), which is what sums.
- ``oom_kill_count``: the kernel's count of processes the OOM killer took in our cgroup
  (cgroup v2 ``memory.events``, v1 ``memory.oom_control``), readable without privileges;
  None where no memory cgroup is found.
- The cgroup lookups (``cgroup_mounts``, ``own_cgroups``) are shared with the sandbox, which
  makes cgroups of its own under ours (``prime_rl.envs.sandbox``).

Stdlib and psutil only: no torch, no vLLM (contracts package).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

LAUNCHER_PID_ENV = "PRIME_RL_LAUNCHER_PID"
"""Set by the launcher in every process it starts: the root of the run's process tree, whose
memory is the run's (``run_root``)."""

GB = 1e9
MB = 1e6


@dataclass(frozen=True)
class MachineMemory:
    total: int
    """Bytes the run could hold at most: the machine's memory, or its cgroup's limit when lower."""

    available: int
    """Bytes that could still be given now (MemAvailable, or the cgroup's limit less its usage when lower)."""


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    name: str
    """The process's name (``comm``): `python3`, `uv`, `vllm`..."""

    rss: int
    """Resident bytes."""

    anon: int
    """Resident bytes the process alone holds: RSS less its file-backed and shared pages
    (``/proc/<pid>/statm``). A sum of these over processes is what they hold together (a
    sum of RSS counts a library every process maps once per process: 1.7x the memory in use
    with 280 harness programs measured here), and anonymous memory is what the OOM killer
    weighs."""

    running: bool = False
    """Runnable now (state R): on a CPU, or waiting for one."""


def cgroup_mounts() -> dict[str, Path]:
    """Mount points by kind: ``cgroup2``, and each v1 controller (``memory``, ``pids``)."""
    mounts: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, point, kind, options, *_ = line.split()
            if kind == "cgroup2":
                mounts.setdefault("cgroup2", Path(point))
            elif kind == "cgroup":
                for controller in {"memory", "pids"} & set(options.split(",")):
                    mounts.setdefault(controller, Path(point))
    return mounts


def own_cgroups(pid: int | str = "self") -> dict[str, str]:
    """A process's cgroup path in each hierarchy, by controller ("" for cgroup2), from /proc/<pid>/cgroup."""
    own: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def memory_cgroup() -> tuple[int, Path] | None:
    """(version, directory) of our memory cgroup: cgroup v2 where it has the memory controller,
    else the v1 memory hierarchy; None when neither is found."""
    mounts, own = cgroup_mounts(), own_cgroups()
    if "cgroup2" in mounts and "" in own:
        path = mounts["cgroup2"] / own[""].lstrip("/")
        if (path / "memory.current").exists():
            return 2, path
    if "memory" in mounts:
        path = mounts["memory"] / own.get("memory", "/").lstrip("/")
        if (path / "memory.usage_in_bytes").exists():
            return 1, path
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _meminfo() -> dict[str, int]:
    found: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(value.split()[0]) * 1024
    return found


def machine_memory() -> MachineMemory | None:
    """What the machine has and could still give (see the module docstring); None off Linux."""
    info = _meminfo()
    if "MemTotal" not in info or "MemAvailable" not in info:
        return None
    total, available = info["MemTotal"], info["MemAvailable"]
    found = memory_cgroup()
    if found is not None:
        version, path = found
        limit = _read_int(path / ("memory.max" if version == 2 else "memory.limit_in_bytes"))
        usage = _read_int(path / ("memory.current" if version == 2 else "memory.usage_in_bytes"))
        if limit is not None and limit < total and usage is not None:
            # The cgroup's usage counts page cache, which it reclaims before it kills: a
            # lower bound of what could still be given, which is the safe side.
            total, available = limit, min(available, max(0, limit - usage))
    return MachineMemory(total, available)


def oom_kill_count() -> int | None:
    """Processes of our memory cgroup the OOM killer took so far (see the module docstring)."""
    found = memory_cgroup()
    if found is None:
        return None
    version, path = found
    try:
        text = (path / ("memory.events" if version == 2 else "memory.oom_control")).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def process_tree(root: int) -> list[ProcInfo]:
    """``root`` and all its descendants with their RSS (processes that exit meanwhile are
    left out); empty when ``root`` is gone."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return []
    found = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            with proc.oneshot():
                memory = proc.memory_info()
                found.append(ProcInfo(proc.pid, proc.ppid(), proc.name(), memory.rss, max(0, memory.rss - memory.shared),
                                      proc.status() == psutil.STATUS_RUNNING))
    return found


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; a cgroup's CPU quota is not read)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def run_root() -> int:
    """The root of this run's process tree: the launcher that started us, else ourselves (a
    process started on its own, as in tests)."""
    value = os.environ.get(LAUNCHER_PID_ENV, "")
    if value.isdigit() and psutil.pid_exists(int(value)):
        return int(value)
    return os.getpid()
