"""Heartbeats and the launcher's watchdog: a run whose processes are all alive but stuck is
reported, then stopped with a one-line reason, never left hanging silently."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import new_tag, tagged_processes

from prime_rl.config import RLConfig, WatchdogConfig
from prime_rl.heartbeat import Beat, Heartbeat, heartbeat_path, read_heartbeat, read_heartbeats
from prime_rl.launch.launcher import judge
from prime_rl.settings import ConfigError, load_config

# --------------------------------------------------------------------------- the heartbeat file


def test_heartbeat_round_trip(tmp_path):
    hb = Heartbeat(tmp_path, "trainer", min_interval_s=0)
    path = tmp_path / "logs" / "trainer.heartbeat.json"
    assert heartbeat_path(tmp_path, "trainer") == path
    started = read_heartbeat(path)
    assert (started.pid, started.progress, started.waiting_for, started.waiting_since) == (os.getpid(), "started", None, None)
    before = time.time()
    hb.progress("trained step 5")
    beat = read_heartbeats(tmp_path, ["trainer", "orchestrator"])
    assert beat["orchestrator"] is None
    assert beat["trainer"].progress == "trained step 5" and before <= beat["trainer"].progress_unix <= time.time()
    assert set(json.loads(path.read_text())) == {"pid", "progress", "progress_unix", "waiting_for", "waiting_since", "detail"}


def test_waiting_nests_and_restores_the_previous_state(tmp_path):
    hb = Heartbeat(tmp_path, "orchestrator")
    read = lambda: read_heartbeats(tmp_path, ["orchestrator"])["orchestrator"]  # noqa: E731
    with hb.waiting("weights step 3"):
        outer = read()
        assert outer.waiting_for == "weights step 3" and outer.waiting_since is not None
        with pytest.raises(KeyError), hb.waiting("inference at http://127.0.0.1:8000"):
            assert read().waiting_for == "inference at http://127.0.0.1:8000"
            raise KeyError("the wait failed")
        restored = read()
        assert (restored.waiting_for, restored.waiting_since) == ("weights step 3", outer.waiting_since)
    assert (read().waiting_for, read().waiting_since) == (None, None)


def test_progress_in_a_row_is_throttled_and_the_next_wait_carries_it(tmp_path):
    hb = Heartbeat(tmp_path, "orchestrator", min_interval_s=60)
    read = lambda: read_heartbeat(heartbeat_path(tmp_path, "orchestrator")).progress  # noqa: E731
    hb.progress("rollout 0")  # the first after a write of another kind: written
    assert read() == "rollout 0"
    hb.progress("rollout 1")  # a burst: held back
    assert read() == "rollout 0"
    with hb.waiting("weights step 1"):
        assert read() == "rollout 1"
    hb.progress("sent batch 1")  # the first after the wait: written
    assert read() == "sent batch 1"


def test_a_failed_write_never_raises_and_is_said_once(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    hb = Heartbeat(blocker, "trainer", min_interval_s=0)  # RUN/logs cannot be made inside a file
    hb.progress("trained step 0")
    with hb.waiting("batch of step 1"):
        pass
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot write" in err and "trainer.heartbeat.json" in err, err


def test_disabled_heartbeat_writes_nothing(tmp_path):
    hb = Heartbeat(tmp_path, "trainer", enabled=False)
    with hb.waiting("x"):
        hb.progress("y")
    assert not heartbeat_path(tmp_path, "trainer").exists()


GOOD = {"pid": 1, "progress": "p", "progress_unix": 1.0e9, "waiting_for": None, "waiting_since": None}


@pytest.mark.parametrize("content", [
    json.dumps(GOOD)[:25],  # half-written
    b"\x00\xff garbage",
    "[1, 2]",
    json.dumps({**GOOD, "extra": 1}),
    json.dumps({k: v for k, v in GOOD.items() if k != "pid"}),
    json.dumps({**GOOD, "progress_unix": "soon"}),
    json.dumps({**GOOD, "progress_unix": float("inf")}),  # json writes Infinity
    json.dumps({**GOOD, "waiting_for": "x"}),  # waiting without a since
    json.dumps({**GOOD, "waiting_since": 1.0e9}),
    json.dumps({**GOOD, "waiting_for": "x", "waiting_since": 1e300}),  # no clock reads that
])
def test_reader_tolerates_broken_files(tmp_path, content):
    path = heartbeat_path(tmp_path, "trainer")
    path.parent.mkdir(parents=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert read_heartbeat(path) is None
    path.write_text(json.dumps(GOOD))
    assert read_heartbeat(path) == Beat(1, "p", 1.0e9)


# --------------------------------------------------------------------------- the decision

T0 = 1_000_000.0  # the launch, unix seconds
NAMES = ("inference", "orchestrator", "trainer")


def beats(orchestrator: Beat | None, trainer: Beat | None) -> dict[str, Beat | None]:
    return {"inference": None, "orchestrator": orchestrator, "trainer": trainer}


def decide(b, now, report_s=120, timeout_s=1800, reported=None, finished=()):
    return judge(b, set(finished), {"inference"}, T0, now, report_s, timeout_s, reported)


def test_no_report_while_some_process_progresses():
    b = beats(Beat(1, "sent batch 4", T0 + 10), Beat(2, "trained step 3", T0 + 500))
    verdict = decide(b, now=T0 + 600)  # the orchestrator is quiet, the trainer is not
    assert (verdict.action, verdict.idle_s, verdict.lines) == ("ok", 100, ())


def test_the_launch_counts_as_progress():
    assert decide(beats(None, None), now=T0 + 119).action == "ok"
    assert decide(beats(None, None), now=T0 + 120).action == "report"


def test_report_names_what_each_process_waits_for():
    since = T0 + 30
    b = beats(Beat(1, "sent batch 5", T0 + 20, "weights step 5", since), Beat(2, "trained step 4", T0 + 10))
    verdict = decide(b, now=T0 + 150)
    clock = time.strftime("%H:%M:%S", time.localtime(since))
    assert verdict.action == "report" and verdict.idle_s == 130
    assert verdict.lines == (
        "inference: serving (no heartbeat)",
        f"orchestrator: waiting for weights step 5 since {clock} (120 s)",
        'trainer: last progress "trained step 4" 140 s ago',
    )


def test_report_says_what_the_orchestrator_has_in_flight():
    """Not only "started": the episodes in flight per environment and the oldest's start."""
    detail = "64 episodes in flight in environment 'v1-reverse' (oldest since 10:04:12); 3 groups waiting to start"
    b = beats(Beat(1, "started", T0, "step 0's 32 groups", T0 + 5, detail), None)
    verdict = decide(b, now=T0 + 150)
    clock = time.strftime("%H:%M:%S", time.localtime(T0 + 5))
    assert verdict.lines[1] == f"orchestrator: waiting for step 0's 32 groups since {clock} (145 s); {detail}"


def test_a_required_process_without_heartbeat_and_a_finished_one():
    verdict = decide(beats(None, Beat(2, "trained step 9", T0)), now=T0 + 200, finished={"trainer"})
    assert verdict.lines[1:] == ("orchestrator: no heartbeat", "trainer: finished")


def test_report_repeats_at_most_every_report_s():
    b = beats(None, Beat(2, "trained step 0", T0))
    assert decide(b, now=T0 + 200, reported=T0 + 130).action == "ok"
    assert decide(b, now=T0 + 250, reported=T0 + 130).action == "report"


def test_fail_at_the_timeout_and_never_with_timeout_zero():
    b = beats(Beat(1, "sent batch 0", T0 + 5, "weights step 1", T0 + 6), None)
    failed = decide(b, now=T0 + 1805, reported=T0 + 1800)  # a recent report does not delay the failure
    assert failed.action == "fail" and failed.idle_s == 1800 and len(failed.lines) == 3
    assert decide(b, now=T0 + 1e6, timeout_s=0, reported=None).action == "report"
    assert decide(b, now=T0 + 1e6, report_s=0, timeout_s=0).action == "ok"
    assert decide(b, now=T0 + 500, report_s=0, timeout_s=600).action == "ok"


# --------------------------------------------------------------------------- the real launcher


def waiter(run_dir, name: str, what: str) -> str:
    """A process that says it waits for ``what`` and then hangs."""
    return "\n".join([
        "import time",
        "from prime_rl.heartbeat import Heartbeat",
        f"with Heartbeat({str(run_dir)!r}, {name!r}).waiting({what!r}):",
        "    time.sleep(600)",
    ])


def test_launcher_reports_then_stops_a_stalled_run(tmp_path):
    tag = new_tag()
    hang = "import time; time.sleep(600)"
    driver = "\n".join([
        "import sys",
        "from pathlib import Path",
        "from prime_rl.config import WatchdogConfig",
        "from prime_rl.launch.launcher import ProcessSpec, run",
        "specs = [",
        f"    ProcessSpec('inference', [sys.executable, '-c', {hang!r}], required=False),",
        f"    ProcessSpec('orchestrator', [sys.executable, '-c', {waiter(tmp_path, 'orchestrator', 'weights step 1')!r}]),",
        f"    ProcessSpec('trainer', [sys.executable, '-c', {waiter(tmp_path, 'trainer', 'batch of step 0 from tcp://127.0.0.1:5555')!r}]),",
        "]",
        f"sys.exit(run(Path({str(tmp_path)!r}), specs, use_tmux=False, session_name='unused',",
        "             watchdog=WatchdogConfig(report_s=1, timeout_s=3)))",
    ])
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - t0 < 30
    since = r"since \d\d:\d\d:\d\d \(\d+ s\)"
    assert "inference: serving (no heartbeat)" in proc.stdout
    assert re.search(rf"orchestrator: waiting for weights step 1 {since}", proc.stdout), proc.stdout
    assert re.search(rf"trainer: waiting for batch of step 0 from tcp://127.0.0.1:5555 {since}", proc.stdout), proc.stdout
    reason = [line for line in proc.stderr.splitlines() if "watchdog" in line]
    assert len(reason) == 1 and re.search(r"no process made progress for [34] s", reason[0]), proc.stderr
    pids = [b.pid for b in read_heartbeats(tmp_path, ["orchestrator", "trainer"]).values()]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert tagged_processes(tag) == []


# --------------------------------------------------------------------------- the config


def load(tmp_path, text: str) -> RLConfig:
    path = tmp_path / "rl.toml"
    path.write_text(text)
    return load_config(RLConfig, [path], [])


def test_watchdog_config_defaults():
    assert (RLConfig().watchdog.report_s, RLConfig().watchdog.timeout_s) == (120, 1800)
    assert WatchdogConfig(report_s=0, timeout_s=0).timeout_s == 0


@pytest.mark.parametrize("text, expected", [
    ("[watchdog]\nreport = 5\n", "unknown key `report` in [watchdog]"),
    ("[watchdog]\ntimeout_s = -1\n", "watchdog.timeout_s: Input should be greater than or equal to 0"),
    ("[watchdog]\nreport_s = inf\n", "watchdog.report_s"),
    ("[watchdog]\ntimeout_s = nan\n", "watchdog.timeout_s"),
    ("[watchdog]\nreport_s = 60\ntimeout_s = 30\n", "report_s (60) must not exceed timeout_s (30)"),
])
def test_watchdog_config_refuses_bad_values(tmp_path, text, expected):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    assert expected in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_watchdog_config_accepts_report_only(tmp_path):
    cfg = load(tmp_path, "[watchdog]\nreport_s = 60\ntimeout_s = 0\n")
    assert (cfg.watchdog.report_s, cfg.watchdog.timeout_s) == (60, 0)
