"""The launcher names an out-of-memory kill in one line and reports the run's peak memory.

Pure tests of the kernel-log parsing, the verdict and the lines (hand-made inputs), then real
runs: the kernel OOM-kills a grandchild of a launched process inside a memory cgroup this test
makes with a small limit, and the launcher must say so and exit 137.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import remove_cgroup, new_tag, tagged_processes
from prime_rl.launch import oom
from prime_rl.launch.oom import (
    Census,
    KernelKill,
    KernelLog,
    KernelLogParser,
    LoadState,
    Member,
    OomKill,
    RunMemory,
    assign_roles,
    describe_oom,
    describe_peak,
    find_oom,
    parse_load_state,
)
from prime_rl.procmem import GB, MB, ProcInfo
from prime_rl.rundir import load_state_path, metrics_path, parse_row

KILL_MEMCG = ("3,6480,44144082490,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
              "oom_memcg=/process_api/x/jobs/run-7,task_memcg=/process_api/x/jobs/run-7,task=python,pid=15287,uid=0\n")
KILLED = ("3,6481,44144082497,-;Memory cgroup out of memory: Killed process 15287 (python) total-vm:73956kB, "
          "anon-rss:47532kB, file-rss:5836kB, shmem-rss:4kB, UID:0 pgtables:188kB oom_score_adj:1000\n")
SANDBOX_MEMCG = KILL_MEMCG.replace("/jobs/run-7", "/prime-rl-sandbox/sandbox-1-2/call-1-3")
GLOBAL_KILLED = ("3,7001,50144082497,-;Out of memory: Killed process 1234 (python3) total-vm:9000000kB, "
                 "anon-rss:8000000kB, file-rss:1000kB, shmem-rss:0kB, UID:0 pgtables:16000kB oom_score_adj:0\n")

BUDGET_FROM = "[orchestrator.load] memory_budget_gb = 12"


def census(members: dict[int, tuple[str, str, int]], unix: float = 100.0, available=None, total=None) -> Census:
    return Census(unix, {pid: Member(*m) for pid, m in members.items()}, available, total)


RUN = census({
    10: ("inference", "python3", int(3.1 * GB)),
    11: ("inference", "VLLM::EngineCore", 0),
    20: ("trainer", "python3", int(1.2 * GB)),
    30: ("orchestrator", "python3", int(0.6 * GB)),
    31: ("env worker 'my-env'", "python3", int(0.3 * GB)),
    **{4000 + i: ("episodes of 'my-env'", "python", int(0.049 * GB)) for i in range(200)},
})


# --------------------------------------------------------------------------- the kernel log


def test_a_kill_record_is_joined_to_the_cgroups_record_before_it():
    parser = KernelLogParser()
    assert parser.feed(KILL_MEMCG) is None
    assert parser.feed(KILLED) == KernelKill(15287, "python", (47532 + 5836 + 4) * 1024, "/process_api/x/jobs/run-7")
    assert parser.feed(KILLED).memcg is None, "each cgroups record serves one kill"


def test_the_machines_own_oom_and_odd_names_and_other_records():
    parser = KernelLogParser()
    assert parser.feed(GLOBAL_KILLED) == KernelKill(1234, "python3", (8000000 + 1000) * 1024, None)
    odd = KILLED.replace("(python)", "(my (odd) name)") + " SUBSYSTEM=memory\n"  # a continuation line
    assert parser.feed(odd).name == "my (odd) name"
    assert parser.feed("6,4287,33549784234,-;cache 67313664\n") is None
    assert parser.feed("4,6686,45022589620,-;python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL)\n") is None
    assert parser.feed("garbage without a separator") is None
    assert parser.feed("3,1,1,-;Memory cgroup out of memory: Killed process 77 (x)").rss is None, "no sizes: unknown"


def test_the_kernel_log_is_read_to_its_end_past_overwritten_records(monkeypatch):
    reads = iter([KILL_MEMCG.encode(), BrokenPipeError(), KILLED.encode(), BlockingIOError(), GLOBAL_KILLED.encode(),
                  BlockingIOError()])

    def fake_read(fd, n):
        item = next(reads)
        if isinstance(item, Exception):
            raise item
        return item

    log = KernelLog(-1)
    monkeypatch.setattr(os, "read", fake_read)
    first = log.read()
    second = log.read()
    monkeypatch.undo()
    assert [k.pid for k in first] == [15287] and first[0].memcg == "/process_api/x/jobs/run-7"
    assert [k.pid for k in second] == [1234]


def test_the_kernel_log_starts_at_its_end():
    log = KernelLog.open()  # as root (this machine) or with kernel.dmesg_restrict = 0
    if log is None:
        pytest.skip(f"{oom.KMSG} cannot be read here")
    try:
        assert log.read() == [], "kills logged before the run are not the run's"
    finally:
        log.close()


# --------------------------------------------------------------------------- the verdict


def test_a_logged_kill_of_a_process_the_census_saw_is_the_runs():
    parser = KernelLogParser()
    parser.feed(KILL_MEMCG.replace("15287", "4007"))
    found = parser.feed(KILLED.replace("15287", "4007"))
    after = census({pid: (m.role, m.name, m.rss) for pid, m in RUN.members.items() if pid != 4007}, unix=102.0)
    assert find_oom([found], False, RUN, after, {}) == OomKill(4007, "episodes of 'my-env'", "python", found.rss, "kernel log")
    assert find_oom([found], False, None, RUN, {}).pid == 4007, "the latest walk counts too"


def test_a_logged_kill_of_a_process_the_census_never_saw_is_not_the_runs():
    other = KernelKill(99999, "python", 10 * MB, "/process_api/someone-else")
    assert find_oom([other], False, RUN, RUN, {}) is None
    assert find_oom([other], True, RUN, census({}), {"trainer": 20}) is None, "the kernel log, readable, is the whole truth"


def test_a_kill_at_a_sandbox_calls_own_limit_is_ignored():
    parser = KernelLogParser()
    parser.feed(SANDBOX_MEMCG.replace("15287", "4001"))
    sandboxed = parser.feed(KILLED.replace("15287", "4001"))
    assert sandboxed.sandboxed and sandboxed.memcg.endswith("/prime-rl-sandbox/sandbox-1-2/call-1-3")
    assert find_oom([sandboxed], False, RUN, RUN, {}) is None
    parser.feed(KILL_MEMCG.replace("15287", "4001"))  # the same process, at the run's own limit
    assert find_oom([parser.feed(KILLED.replace("15287", "4001"))], False, RUN, RUN, {}).pid == 4001

    from prime_rl.envs.sandbox import CGROUP_PARENT

    assert oom.SANDBOX_CGROUP == CGROUP_PARENT, "the sandbox's cgroups are where the launcher looks for them"


def test_without_the_kernel_log_a_rising_count_names_the_sigkilled_process_else_the_largest_vanished():
    after = census({pid: (m.role, m.name, m.rss) for pid, m in RUN.members.items() if pid not in (20, 4003)})
    assert find_oom(None, True, RUN, after, {"trainer": 20}) == OomKill(20, "trainer", "python3", int(1.2 * GB), "cgroup count")
    zombie = census({**{pid: (m.role, m.name, m.rss) for pid, m in after.members.items()}, 20: ("trainer", "python3", 0)})
    assert find_oom(None, True, RUN, zombie, {}).pid == 20, "a zombie (0 resident bytes) counts as gone"
    assert find_oom(None, True, RUN, after, {}).pid == 20, "the largest that vanished"
    assert find_oom(None, True, RUN, RUN, {}) is None, "nothing of the run vanished: not the run's kill"
    assert find_oom(None, False, RUN, after, {}) is None, "processes that end are no evidence by themselves"


def test_a_sigkill_while_memory_was_low_is_most_likely_the_oom_killer():
    low = census({20: ("trainer", "python3", 5 * GB)}, available=int(0.04 * 16 * GB), total=16 * GB)
    plenty = census({20: ("trainer", "python3", 5 * GB)}, available=8 * GB, total=16 * GB)
    kill = find_oom(None, False, low, plenty, {"trainer": 20})
    assert (kill.pid, kill.role, kill.how, round(kill.memory_share, 2)) == (20, "trainer", "low memory", 0.04)
    assert find_oom(None, False, plenty, plenty, {"trainer": 20}) is None
    assert find_oom([], False, low, low, {"trainer": 20}) is None, "the kernel log shows no kill: someone's kill -9"
    assert find_oom(None, False, low, low, {}) is None


def test_a_count_rise_waits_for_the_sigkill_seen_a_moment_later(tmp_path, monkeypatch):
    counts = iter([0, 1, 1, 1, 1, 2, 2])
    monkeypatch.setattr(oom.KernelLog, "open", classmethod(lambda cls, path=oom.KMSG: None))
    monkeypatch.setattr(oom, "run_oom_kill_count", lambda: next(counts))
    monkeypatch.setattr(oom, "take_census", lambda launched, workers, now, in_process=(): census({20: ("trainer", "python3", GB)}, now))
    memory = RunMemory(tmp_path, 0.0)  # count 0
    launched = {"trainer": 20}
    assert memory.check(launched, 100.0) is None, "the count rose (1), but nothing of the run vanished"
    assert memory.check(launched, 100.5) is None, "a rise is no evidence against processes seen later"
    kill = memory.check(launched, 101.0, {"trainer": 20})
    assert (kill.pid, kill.role, kill.how) == (20, "trainer", "cgroup count"), "the SIGKILL a moment after the rise"
    assert memory.check(launched, 101.5, {"trainer": 20}) is None, "that rise is explained: no second verdict from it"
    assert memory.check(launched, 104.0) is None  # the count rises to 2 with nothing gone
    assert memory.check(launched, 106.5, {"trainer": 20}) is None, "a rise older than a census interval is stale"


# --------------------------------------------------------------------------- roles and load.json


def test_environment_workers_and_their_descendants_get_their_own_roles():
    tree = [ProcInfo(30, 1, "python3", 1, 1), ProcInfo(31, 30, "python3", 1, 1), ProcInfo(40, 31, "bash", 1, 1),
            ProcInfo(41, 40, "python", 1, 1), ProcInfo(32, 30, "python3", 1, 1)]
    assert assign_roles("orchestrator", tree, {31: "my-env", 999: "gone-env"}) == {
        30: "orchestrator", 31: "env worker 'my-env'", 40: "episodes of 'my-env'", 41: "episodes of 'my-env'",
        32: "orchestrator"}
    assert set(assign_roles("orchestrator", tree, {}).values()) == {"orchestrator"}
    # the orchestrator's other children: the programs of the environments it plays itself
    assert assign_roles("orchestrator", tree, {31: "my-env"}, ("mine",))[32] == "episodes of 'mine'"
    assert assign_roles("orchestrator", tree, {31: "my-env"}, ("mine",))[30] == "orchestrator"
    assert assign_roles("trainer", tree, {}, ("mine",))[32] == "trainer"
    looped = [ProcInfo(1, 2, "a", 1, 1), ProcInfo(2, 1, "b", 1, 1)]  # pids reused mid-walk: no endless walk
    assert assign_roles("trainer", looped, {}) == {1: "trainer", 2: "trainer"}


def load_json(**over) -> dict:
    return {"time_unix": 1000.0, "budget_bytes": 12 * 10**9, "budget_from": BUDGET_FROM, "used_bytes": 1,
            "available_bytes": 2, "envs": {"my-env": {"in_flight": 3, "waiting": 0, "oldest_unix": None,
                                                      "episode_bytes": 5, "worker_pid": 31}}, **over}


def test_load_state_is_read_leniently():
    assert parse_load_state(load_json(), 999.0) == LoadState(12 * 10**9, BUDGET_FROM, {31: "my-env"})
    assert parse_load_state(load_json(), 1001.0) is None, "a previous run's file"
    assert parse_load_state([1, 2], 0) is None
    assert parse_load_state(load_json(time_unix="x"), 0) is None
    assert parse_load_state(load_json(budget_bytes=None, budget_from=7), 0) == LoadState(None, None, {31: "my-env"})
    odd = parse_load_state(load_json(envs={"a": {"worker_pid": True}, "b": 3, "c": {"worker_pid": None}}), 0)
    assert odd.workers == {} and odd.in_process == ("c",)


def test_a_missing_or_damaged_load_json_leaves_the_workers_to_the_orchestrator(tmp_path):
    assert oom.read_load_state(tmp_path, 0) is None
    load_state_path(tmp_path).parent.mkdir()
    load_state_path(tmp_path).write_bytes(b"{\"time_unix\": 12, \"envs\": ")
    assert oom.read_load_state(tmp_path, 0) is None
    load_state_path(tmp_path).write_text(json.dumps(load_json()))
    assert oom.read_load_state(tmp_path, 0).workers == {31: "my-env"}


# --------------------------------------------------------------------------- the lines


def test_the_one_line_report():
    kill = OomKill(4007, "episodes of 'my-env'", "python", int(1.9 * GB), "kernel log")
    line = describe_oom(kill, RUN, LoadState(12 * 10**9, BUDGET_FROM))
    assert line == (
        "out of memory: the kernel's OOM killer killed an episode of 'my-env' (pid 4007, python, 1.9 GB); "
        "the run's biggest memory users then: episodes of 'my-env' 200 processes 9.8 GB, inference 3.1 GB, "
        "trainer 1.2 GB, orchestrator 0.6 GB, env worker 'my-env' 0.3 GB (run total 15.0 GB, budget 12.0 GB from "
        "[orchestrator.load] memory_budget_gb = 12); lower [orchestrator.load] memory_budget_gb or the batch, "
        "then continue with --resume")
    assert "\n" not in line


def test_totals_sum_what_each_process_alone_holds():
    shared = Census(0.0, {1: Member("episodes of 'e'", "python", 50 * MB, 20 * MB),
                          2: Member("episodes of 'e'", "python", 50 * MB, 20 * MB), 3: Member("trainer", "python3", 9 * MB)})
    assert shared.total == 49 * MB and shared.by_role() == {"episodes of 'e'": (2, 40 * MB), "trainer": (1, 9 * MB)}


def test_the_report_says_how_it_knows():
    inferred = describe_oom(OomKill(20, "trainer", "python3", None, "cgroup count"), None, LoadState())
    assert inferred.startswith("out of memory: the kernel's OOM killer killed trainer (pid 20, python3, size unknown) "
                               "(inferred from the cgroup's OOM kill count: /dev/kmsg cannot be read); lower")
    guessed = describe_oom(OomKill(20, "trainer", "python3", 5 * GB, "low memory", 0.04),
                           census({20: ("trainer", "python3", 5 * GB)}), LoadState())
    assert guessed.startswith("out of memory: trainer (pid 20, python3, 5.0 GB) was killed by SIGKILL while the "
                              "machine had 4% of its memory available: most likely the out-of-memory killer; ")
    assert "(run total 5.0 GB)" in guessed and ", budget" not in guessed
    worker = describe_oom(OomKill(31, "env worker 'my-env'", "python3", 300 * MB, "kernel log"), RUN, LoadState())
    assert "killed the environment worker of 'my-env' (pid 31, python3, 0.3 GB)" in worker
    assert "and 1 more" in oom.biggest_users(RUN, top=4)


def test_the_peak_line():
    at = time.mktime((2026, 12, 3, 14, 5, 9, 0, 0, -1))
    assert describe_peak(int(5.2 * GB), at, LoadState(12 * 10**9, BUDGET_FROM)) == (
        "peak memory: 5.2 GB (all of the run's processes, RSS less shared pages, at 14:05:09); budget 12.0 GB")
    assert describe_peak(40 * MB, at, LoadState()) == "peak memory: 40 MB (all of the run's processes, RSS less shared pages, at 14:05:09)"


def test_the_census_keeps_the_peak_and_when(tmp_path, monkeypatch):
    totals = iter([3 * GB, 7 * GB, 5 * GB])
    monkeypatch.setattr(oom.KernelLog, "open", classmethod(lambda cls, path=oom.KMSG: None))
    monkeypatch.setattr(oom, "run_oom_kill_count", lambda: None)
    monkeypatch.setattr(oom, "take_census", lambda launched, workers, now, in_process=(): census({1: ("trainer", "x", next(totals))}, now))
    memory = RunMemory(tmp_path, 0.0)
    for now in (100.0, 100.5, 102.0, 104.0):  # 100.5: no census is due yet
        assert memory.check({"trainer": 1}, now) is None
    assert memory.peak == (7 * GB, 102.0) and memory.peak_gb() == 7.0


# --------------------------------------------------------------------------- real runs


# The orchestrator starts an environment worker and says so in load.json, as the episode limiter
# does; the worker starts one episode, which waits until the launcher's census has seen it (so
# the kill is one of a process the census knows), joins the small cgroup and allocates past it.
ORCHESTRATOR = """
import json, os, pathlib, subprocess, sys, time
run, worker_code = pathlib.Path(sys.argv[1]), sys.argv[2]
worker = subprocess.Popen([sys.executable, "-c", worker_code, *sys.argv[3:]])
state = {"time_unix": time.time(), "budget_bytes": 12 * 10**9, "budget_from": %r, "used_bytes": 0,
         "available_bytes": 0, "envs": {"oom-env": {"in_flight": 1, "waiting": 0, "oldest_unix": None,
                                                    "episode_bytes": 0, "worker_pid": worker.pid}}}
(run / "logs" / "load.json.tmp").write_text(json.dumps(state))
os.replace(run / "logs" / "load.json.tmp", run / "logs" / "load.json")
time.sleep(60)
sys.exit("no out-of-memory kill came")
""" % BUDGET_FROM
WORKER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
time.sleep(60)
"""
EPISODE = """
import os, pathlib, sys, time
here, cgroup = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(here / "victim.tmp").write_text(str(os.getpid()))
os.replace(here / "victim.tmp", here / "victim.pid")
deadline = time.monotonic() + 30
while not (here / "censused").exists():
    if time.monotonic() > deadline:
        sys.exit("the census never saw this episode")
    time.sleep(0.02)
(cgroup / "cgroup.procs").write_text(str(os.getpid()))
pathlib.Path("/proc/self/oom_score_adj").write_text("1000")
print("allocating past the cgroup's limit", flush=True)
chunks = [bytearray(8 << 20) for _ in range(64)]  # 512 MiB, eight times the cgroup's limit
print("the cgroup's limit did not hold", flush=True)
time.sleep(60)
"""

# The launcher in its own process (bounded by a timeout), whose census tells the episode once it
# has seen it in its role: a test hook around `take_census`, nothing of it in the package.
DRIVER = """
import pathlib, sys
from prime_rl.launch import launcher, oom
from prime_rl.launch.launcher import ProcessSpec
from prime_rl.observe.status import StatusOptions
run, here, cgroup, mode, role = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
real_census = oom.take_census

def take_census(launched, workers, now, in_process=()):
    census = real_census(launched, workers, now, in_process)
    victim = here / "victim.pid"
    if victim.exists() and census.members.get(int(victim.read_text()), oom.Member("", "", 0)).role == role:
        (here / "censused").touch()
    return census

oom.take_census = take_census
if mode == "count":  # as where /dev/kmsg cannot be read: the cgroup's count is the evidence
    oom.KernelLog.open = classmethod(lambda cls, path=oom.KMSG: None)
    events = pathlib.Path(cgroup) / ("memory.events" if (pathlib.Path(cgroup) / "memory.events").exists() else "memory.oom_control")
    oom.run_oom_kill_count = lambda: next((int(l.split()[1]) for l in events.read_text().splitlines() if l.startswith("oom_kill ")), None)
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
episode = [sys.executable, "-c", %r, str(here), cgroup]
victim, idle = (episode, sleeper) if role == "trainer" else (sleeper, episode)  # one victim: the trainer or an episode
specs = [ProcessSpec("inference", sleeper, required=False), ProcessSpec("trainer", victim),
         ProcessSpec("orchestrator", [sys.executable, "-c", %r, str(run), %r, *idle[2:]])]
sys.exit(launcher.run(run, specs, use_tmux=False, session_name="unused",
                      status=StatusOptions(max_steps=None, every_steps=0, interval_s=1.0)))
""" % (EPISODE, ORCHESTRATOR, WORKER)


def kmsg_readable() -> bool:
    log = KernelLog.open()
    if log is not None:
        log.close()
    return log is not None


def run_until_oom(tmp_path: Path, cgroup: Path, mode: str, role: str = "episodes of 'oom-env'",
                  ) -> tuple[subprocess.CompletedProcess, int, str]:
    """Run the driver until the victim (in ``role``) is OOM-killed; ``mode``: `kmsg` or `count`."""
    tag = new_tag()
    run, here = tmp_path / "run", tmp_path / "here"
    here.mkdir()
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    done = subprocess.run([sys.executable, "-c", DRIVER, str(run), str(here), str(cgroup), mode, role],
                          capture_output=True, text=True, env=env, timeout=120)
    assert (here / "censused").exists(), done.stderr
    return done, int((here / "victim.pid").read_text()), tag


def check_the_run_stopped(done, victim: int, tag: str, cgroup: Path, tmp_path: Path) -> str:
    assert done.returncode == 137, done.stderr
    lines = [line for line in done.stderr.splitlines() if "out of memory" in line]
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith(f"[prime-rl] out of memory: the kernel's OOM killer killed an episode of 'oom-env' (pid {victim}, ")
    users = line.split("the run's biggest memory users then: ", 1)[1]
    for role in ("episodes of 'oom-env' 1 process ", "inference ", "trainer ", "orchestrator ", "env worker 'oom-env' "):
        assert role in users, line
    assert f"budget 12.0 GB from {BUDGET_FROM}); lower [orchestrator.load] memory_budget_gb" in line
    assert "failed: it" not in done.stderr, "the OOM line replaces the generic failure"
    assert "episodes of 'oom-env' 1 process 0 MB" not in line, "the users as the census saw them before the kill"
    assert re.search(r"^\[prime-rl\] peak memory: (\d+ MB|\d+\.\d GB) \(all of the run's processes, RSS less shared pages, at \d\d:\d\d:\d\d\); "
                     r"budget 12.0 GB$", done.stdout, re.MULTILINE), done.stdout
    deadline = time.monotonic() + 10  # the worker and the episode are reparented; their reaper may lag
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tagged_processes(tag) == []
    rows = [parse_row(line) for line in metrics_path(tmp_path / "run").read_text().splitlines()]
    ending = rows[-1]
    assert (ending["event"], ending["pid"], ending["victim"]) == ("out_of_memory", victim, "episodes of 'oom-env'")
    assert 0 < ending["peak_memory_gb"] < 2
    remove_cgroup(cgroup)
    assert not cgroup.exists()
    return line


def test_the_kernel_oom_killing_a_grandchild_stops_the_run_with_one_line(tmp_path, small_memory_cgroup):
    if not kmsg_readable():
        pytest.skip(f"{oom.KMSG} cannot be read here (the cgroup-count test covers the launcher's other evidence)")
    _, cgroup = small_memory_cgroup
    done, victim, tag = run_until_oom(tmp_path, cgroup, "kmsg")
    line = check_the_run_stopped(done, victim, tag, cgroup, tmp_path)
    assert "inferred" not in line, "the kernel log named the victim"


def test_without_the_kernel_log_the_cgroups_count_finds_the_kill(tmp_path, small_memory_cgroup):
    _, cgroup = small_memory_cgroup
    done, victim, tag = run_until_oom(tmp_path, cgroup, "count")
    line = check_the_run_stopped(done, victim, tag, cgroup, tmp_path)
    assert "(inferred from the cgroup's OOM kill count: /dev/kmsg cannot be read)" in line


def test_a_run_that_finishes_reports_its_peak(tmp_path, capsys):
    """One process holds 200 MB until the census has seen it; the peak says at least that."""
    from prime_rl.launch import launcher
    from prime_rl.launch.launcher import ProcessSpec
    from prime_rl.observe.status import StatusOptions

    ready = tmp_path / "censused"
    hold = "\n".join([
        "import json, pathlib, time",
        f"run, ready = pathlib.Path({str(tmp_path)!r}), pathlib.Path({str(ready)!r})",
        "(run / 'logs' / 'load.json').write_text(json.dumps({'time_unix': time.time(), 'budget_bytes': 12 * 10**9}))",
        "held = bytearray(200 * 10**6)",
        "for i in range(0, len(held), 4096): held[i] = 1",  # touched: resident
        "deadline = time.monotonic() + 30",
        "while not ready.exists() and time.monotonic() < deadline: time.sleep(0.02)",
    ])
    real_census = oom.take_census

    def take_census(launched, workers, now, in_process=()):
        found = real_census(launched, workers, now, in_process)
        if found.total >= 200 * 10**6:
            ready.touch()
        return found

    specs = [ProcessSpec("trainer", [sys.executable, "-c", hold])]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(oom, "take_census", take_census)
        code = launcher.run(tmp_path, specs, use_tmux=False, session_name="unused",
                            status=StatusOptions(max_steps=None, every_steps=0, interval_s=1.0))
    out = capsys.readouterr().out
    assert code == 0 and ready.exists()
    finished = [parse_row(line) for line in metrics_path(tmp_path).read_text().splitlines()][-1]
    assert finished["event"] == "finished" and 0.2 <= finished["peak_memory_gb"] < 1
    peak = re.search(r"^\[prime-rl\] peak memory: (\d\.\d) GB \(all of the run's processes, RSS less shared pages, at \d\d:\d\d:\d\d\); "
                     r"budget 12\.0 GB$", out, re.MULTILINE)
    assert peak and float(peak.group(1)) == round(finished["peak_memory_gb"], 1), out



def test_a_launched_process_killed_for_memory_gets_the_oom_line_and_its_log_tail(tmp_path, small_memory_cgroup):
    """The trainer itself is the victim: its SIGKILL is reported as out of memory, not as a failure."""
    _, cgroup = small_memory_cgroup
    done, victim, tag = run_until_oom(tmp_path, cgroup, "kmsg" if kmsg_readable() else "count", role="trainer")
    assert done.returncode == 137, done.stderr
    lines = [line for line in done.stderr.splitlines() if "out of memory" in line]
    assert len(lines) == 1 and f"killed trainer (pid {victim}, python" in lines[0], done.stderr
    assert "trainer failed" not in done.stderr
    assert f"last lines of {tmp_path / 'run' / 'logs' / 'trainer.log'}:\nallocating past" in done.stderr, done.stderr
    deadline = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tagged_processes(tag) == []
    remove_cgroup(cgroup)
    assert not cgroup.exists()
