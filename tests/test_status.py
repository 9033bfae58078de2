"""The run's status from RUN/metrics.jsonl (``prime_rl.observe.status``): reading a file being
written, the summary and its text, the headless printer, and the launcher's `status` pane
and event rows with stand-in processes."""

import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, new_tag, tagged_processes
from prime_rl.launch.resume import ResumeRefused, drop_metrics_from
from prime_rl.rundir import append_jsonl, metrics_path
from prime_rl.observe import status as status_module
from prime_rl.launch.launcher import ProcessSpec
from prime_rl.launch.launcher import run as launcher_run
from prime_rl.observe.status import (
    Metrics, MetricsFollower, StatusOptions, StatusPrinter, main, read_metrics, render, sparkline, summarize,
)

RECORDED = REPO / "tests" / "fixtures" / "metrics" / "reverse-text.jsonl"  # a real trio run's first 10 steps (tiny model)


def rows_of(step: int, reward: float, wall: float, **extra) -> list[dict]:
    """An orchestrator and a trainer row of ``step``, with the keys the real processes log."""
    return [
        {"process": "orchestrator", "step": step, "time": wall, "wall": wall, "reward/mean": reward,
         "staleness/mean": 0.5, "staleness/max": 1, "perf/tokens_per_s": 100.0, "time/generate": 2.0,
         "time/wait_weights": 0.5, "time/reload": 0.25, **extra},
        {"process": "trainer", "step": step, "time": wall, "wall": wall, "loss/policy": 0.1, "loss/mismatch_kl": 2e-4,
         "loss/masked_frac": 0.125, "perf/tokens_per_s": 1000.0, "time/train": 1.0, "time/wait_batch": 1.5},
    ]


def write(path: Path, rows: list[dict], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_a_recorded_run_with_a_truncated_line_and_a_failed_process_renders(tmp_path):
    """A real run's rows, then the launcher's failure row and a line cut mid-write."""
    path = metrics_path(tmp_path)
    shutil.copy(RECORDED, path)
    recorded = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    append_jsonl(path, {"process": "launcher", "event": "failed", "failed": "trainer", "reason": "exited with code 1",
                        "time": 99.0, "wall": 0.0})
    with open(path, "a") as f:
        f.write('{"process": "orchestrator", "step": 99, "rew')
    metrics = read_metrics(path)
    assert metrics.partial and metrics.bad_lines == 0 and len(metrics.rows) == len(recorded) + 1

    status = summarize(metrics, max_steps=40)
    orchestrator = [r for r in recorded if r["process"] == "orchestrator" and "reward/mean" in r]
    assert status.step == orchestrator[-1]["step"] and status.rewards["all"] == [r["reward/mean"] for r in orchestrator]
    text = "\n".join(render(status))
    last = max(r["step"] for r in recorded if r["process"] == "trainer")
    assert text.startswith(f"step {last + 1} / 40"), text
    assert "reward " in text and "mismatch KL" in text and "staleness" in text and "masked" in text, text
    assert "trained" in text and "tok/s" in text and "orchestrator s/step generate" in text, text
    assert "trainer s/step      train" in text, text
    assert text.splitlines()[-1] == "FAILED trainer: exited with code 1", text


def test_the_follower_waits_for_a_half_written_line_and_starts_over_after_a_rewind(tmp_path):
    path = metrics_path(tmp_path)
    follower = MetricsFollower(path)
    assert follower.poll() == []  # no file yet
    write(path, rows_of(0, 0.5, 10.0), tail='{"process": "orchestrator", "st')
    assert [r["step"] for r in follower.poll()] == [0, 0] and follower.metrics.partial
    with open(path, "a") as f:
        f.write('ep": 1, "reward/mean": 0.75}\nnot json\n')
    assert follower.poll() == [{"process": "orchestrator", "step": 1, "reward/mean": 0.75}]
    assert not follower.metrics.partial and follower.metrics.bad_lines == 1
    assert summarize(follower.metrics).notes == ["1 malformed line(s) skipped"]
    # --resume-step 1 refuses a complete line that is not a row (damage to show, not to delete)
    with pytest.raises(ResumeRefused, match=rf"^--resume: {path} line 4 is not a metrics row: not JSON"):
        drop_metrics_from(path, 1)
    assert follower.poll() == [] and follower.metrics.bad_lines == 1, "the refusal changed nothing"
    # without it, the resume rewrites the file without the rows of steps >= 1 (a new file)
    path.write_text(path.read_text().replace("not json\n", ""))
    assert drop_metrics_from(path, 1) == 1
    follower.poll()
    assert [r["step"] for r in follower.metrics.rows] == [0, 0] and follower.metrics.bad_lines == 0


def test_several_environments_get_a_reward_line_each_and_the_eta_follows_the_pace(tmp_path):
    rows = []
    for step in range(3):  # a step every 10 s; 7 steps left of 10 -> 70 s
        rows += rows_of(step, 0.5, 10.0 * step, **{"reward/a/mean": 0.25 * step, "reward/b/mean": 1.0})
    rows.append({"process": "orchestrator", "step": 2, "time": 25.0, "wall": 25.0, "eval/reward/mean": 0.875})
    write(metrics_path(tmp_path), rows)
    status = summarize(read_metrics(metrics_path(tmp_path)), max_steps=10)
    assert status.rewards == {"all": [0.5, 0.5, 0.5], "a": [0.0, 0.25, 0.5], "b": [1.0, 1.0, 1.0]}
    assert status.eta_s == pytest.approx(70.0) and status.eval_reward == 0.875
    assert status.phases == {"orchestrator": {"generate": 2.0, "wait weights": 0.5, "reload": 0.25},
                             "trainer": {"train": 1.0, "wait batch": 1.5}}
    lines = render(status, width=10)
    assert lines[0] == "step 3 / 10 · ETA 1 min 10 s"
    assert lines[2] == "  a          ▁▅█  0.500 (mean of last 3: 0.250)", lines
    assert "eval reward  0.875" in lines
    assert lines[-2:] == ["orchestrator s/step generate 2.00 · wait weights 0.50 · reload 0.25",
                          "trainer s/step      train 1.00 · wait batch 1.50"], lines
    assert "mismatch KL 2.00e-04 · staleness 0.50 (max 1) · masked 12.5%" in lines


def test_sparkline_scales_to_its_own_range():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▅▅"
    assert sparkline(list(range(100)), width=4) == "▁▃▆█"
    assert sparkline([]) == ""


def test_an_empty_run_waits_and_an_earlier_attempts_ending_is_forgotten(tmp_path):
    path = metrics_path(tmp_path)
    assert render(summarize(read_metrics(path))) == ["waiting for the first step (no orchestrator row in metrics.jsonl yet)"]
    rows = rows_of(0, 0.5, 1.0) + [
        {"process": "launcher", "event": "started", "time": 0, "wall": 0},
        {"process": "launcher", "event": "failed", "failed": "orchestrator", "reason": "was killed by SIGKILL"},
        {"process": "launcher", "event": "started", "time": 0, "wall": 5},  # --resume
    ]
    write(path, rows)
    status = summarize(read_metrics(path))
    assert status.failed == [] and status.ended is None and status.step == 0


def test_a_headless_run_prints_the_status_every_n_trained_steps(tmp_path):
    path = metrics_path(tmp_path)
    write(path, rows_of(0, 0.5, 0.0))  # a resumed run's earlier step: not printed
    out = io.StringIO()
    printer = StatusPrinter(tmp_path, StatusOptions(max_steps=30, every_steps=10, interval_s=3), out=out)
    for step in range(1, 25):
        for row in rows_of(step, 0.5 + step / 100, float(step)):
            append_jsonl(path, row)
        printer.poll()
    printed = [line for line in out.getvalue().splitlines() if "status:" in line]
    assert printed == ["[prime-rl] status: step 10 / 30 · ETA 20 s", "[prime-rl] status: step 20 / 30 · ETA 10 s"], out.getvalue()
    quiet = io.StringIO()
    StatusPrinter(tmp_path, StatusOptions(max_steps=30, every_steps=0, interval_s=3), out=quiet).print()
    assert quiet.getvalue() == ""


def stand_in_trainer(run_dir: Path, release: Path) -> str:
    """Logs three steps as the real processes would, then waits for ``release``, then fails."""
    rows = [r for step in range(3) for r in rows_of(step, 0.25 * step, time.time() + step)]
    return "\n".join([
        "import json, pathlib, sys, time",
        "from prime_rl.rundir import append_jsonl",
        f"for row in {rows!r}:",
        f"    append_jsonl(pathlib.Path({str(metrics_path(run_dir))!r}), row)",
        f"release, deadline = pathlib.Path({str(release)!r}), time.monotonic() + 120",
        "while not release.exists() and time.monotonic() < deadline:",
        "    time.sleep(0.1)",
        "sys.exit(3)",
    ])


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_tmux_session_gains_a_status_pane_that_ends_with_the_run(tmp_path):
    tag = new_tag()
    env = {**os.environ, "PRIME_RL_TEST_TAG": tag, "TMUX_TMPDIR": str(tmp_path)}  # a tmux server of the test's own
    env.pop("TMUX", None)
    run_dir, release = tmp_path / "run", tmp_path / "release"
    script = "\n".join([
        "import sys",
        "from pathlib import Path",
        "from prime_rl.launch.launcher import ProcessSpec, run",
        "from prime_rl.observe.status import StatusOptions",
        f"specs = [ProcessSpec('trainer', [sys.executable, '-c', {stand_in_trainer(run_dir, release)!r}])]",
        f"sys.exit(run(Path({str(run_dir)!r}), specs, use_tmux=True, session_name='s',"
        " status=StatusOptions(max_steps=3, every_steps=1, interval_s=0.2)))",
    ])
    launcher = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pane = ""
        deadline = time.monotonic() + 60
        while "step 3 / 3" not in pane and time.monotonic() < deadline:
            time.sleep(0.2)
            titles = subprocess.run(["tmux", "list-panes", "-t", "s", "-F", "#{pane_title}"], env=env, capture_output=True, text=True)
            if titles.stdout.split() == ["trainer", "status"]:
                pane = subprocess.run(["tmux", "capture-pane", "-p", "-t", "s:0.1"], env=env, capture_output=True, text=True).stdout
        assert "prime-rl status" in pane and "step 3 / 3" in pane, pane
        assert "reward       ▁▅█  0.500 (mean of last 3: 0.250)" in pane, pane
    finally:
        release.touch()
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1 and "trainer failed: it exited with code 3" in err, err
    assert tagged_processes(tag) == [], "the status pane ends with the run"
    events = [r for r in read_metrics(metrics_path(run_dir)).rows if r["process"] == "launcher"]
    assert [(e["event"], e.get("failed")) for e in events] == [("started", None), ("failed", "trainer")]
    assert render(summarize(read_metrics(metrics_path(run_dir))))[-1] == "FAILED trainer: exited with code 3"


# --------------------------------------------------------------------------- odd rows never take a view (or the run) down

ODD_ROWS = {
    "non-finite": [{"reward/mean": float("nan")}, {"reward/mean": float("inf"), "staleness/mean": float("nan")},
                   {"reward/mean": -float("inf"), "perf/tokens_per_s": float("inf")}],
    "huge": [{"reward/mean": 1e308, "perf/tokens_per_s": 10**400, "time/generate": 10**400},
             {"reward/mean": -1e308, "staleness/mean": 10**400, "staleness/max": 1e308}],
    "wrong-types": [{"reward/mean": "0.5", "staleness/mean": [1], "perf/tokens_per_s": {"a": 1}, "time/generate": True},
                    {"reward/mean": None, "staleness/mean": "x", "staleness/max": "y", "wall": "noon"}],
}
ODD_LINES = ["[" * 100_000 + "]" * 100_000, '{"process": "trainer", "step": 1' + "0" * 400 + ', "loss/policy": 1}',
             '{"process": "orchestrator", "step": true, "reward/mean": 1}', '{"process": "trainer", "step": 2.5}', "[1]",
             '{"process": "launcher", "event": "failed", "failed": ' + "[" * 900 + "]" * 900 + ', "reason": 7}']


@pytest.mark.parametrize("kind", ODD_ROWS)
def test_odd_values_and_lines_are_left_out_of_the_status_never_raised(tmp_path, kind, capsys):
    rows = rows_of(0, 0.5, 10.0)
    for step, odd in enumerate(ODD_ROWS[kind], start=1):
        orch, trainer = rows_of(step, 0.5, 10.0 + step)
        rows += [orch | odd, trainer | {k: v for k, v in odd.items() if not k.startswith("reward/")}]
    write(metrics_path(tmp_path), rows, tail="\n".join(ODD_LINES) + "\n")
    status = summarize(read_metrics(metrics_path(tmp_path)), max_steps=10)
    lines = render(status)
    assert lines[0].startswith(f"step {len(ODD_ROWS[kind]) + 1} / 10"), lines
    assert f"note: {len(ODD_LINES) - 1} malformed line(s) skipped" in lines, lines
    assert lines[-2] == "FAILED ?: failed" or "FAILED ?: failed" in lines, lines  # neither field was a string
    assert all(isinstance(v, float) and math.isfinite(v) for v in status.rewards["all"])
    if kind != "huge":
        assert any(line.startswith("note: ") and "reward/mean value(s) not a finite number" in line for line in lines), lines
    StatusPrinter(tmp_path, StatusOptions(max_steps=10, every_steps=1, interval_s=1)).print()
    assert "[prime-rl] status: step" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 0 and "malformed line(s) skipped" in capsys.readouterr().out


def test_sparkline_and_eta_survive_the_extremes_of_a_float():
    assert sparkline([1e308, -1e308, 0.0]) == "█▁▅"
    rows = [{"process": "trainer", "step": s, "wall": w, "loss/policy": 0.1} for s, w in ((0, -1e308), (1, 1e308))]
    assert summarize(Metrics(rows=rows), max_steps=10).eta_s is None  # the span overflows: no ETA, no error


@pytest.mark.parametrize("break_it", ["render", "unreadable"])
def test_a_view_that_fails_says_so_once_and_the_run_still_records_how_it_ended(tmp_path, monkeypatch, capsys, break_it):
    """The headless printer inside the launcher: a view failing (a bug meeting odd rows, or the
    file unreadable) is turned off with one line; the run goes on and writes its `failed` row."""
    run_dir = tmp_path / "run"
    if break_it == "render":
        monkeypatch.setattr(status_module, "render", lambda *a, **k: 1 / 0)
    else:
        monkeypatch.setattr(status_module.MetricsFollower, "poll", lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    trainer = "\n".join([
        "import pathlib, sys, time",
        "from prime_rl.rundir import append_jsonl",
        f"path = pathlib.Path({str(metrics_path(run_dir))!r})",
        f"for row in {rows_of(0, 0.5, 1.0) + rows_of(1, 0.5, 2.0)!r}:",
        "    append_jsonl(path, row)",
        f"time.sleep({1.2 if break_it == 'render' else 0})  # the launcher polls (every 0.5 s): it shows the status first",
        "sys.exit(3)",
    ])
    specs = [ProcessSpec("trainer", [sys.executable, "-c", trainer])]
    code = launcher_run(run_dir, specs, use_tmux=False, session_name="s", status=StatusOptions(3, 1, 1.0))
    err = capsys.readouterr().err
    assert code == 1 and "trainer failed: it exited with code 3" in err, err
    assert err.count("status summary failed and is off (the run goes on): ") == 1, err
    monkeypatch.undo()
    events = [r for r in read_metrics(metrics_path(run_dir)).rows if r["process"] == "launcher"]
    assert [(e["event"], e.get("failed")) for e in events] == [("started", None), ("failed", "trainer")]


@pytest.mark.parametrize("break_it", ["render", "folder"])
def test_the_status_pane_keeps_redrawing_whatever_goes_wrong(tmp_path, monkeypatch, break_it):
    if break_it == "render":
        write(metrics_path(tmp_path), rows_of(0, float("nan"), 1.0))
        monkeypatch.setattr(status_module, "render", lambda *a, **k: [][0])
        expected = "status unavailable: list index out of range"
    else:
        metrics_path(tmp_path).mkdir(parents=True)  # reading it fails with IsADirectoryError
        expected = f"cannot read {metrics_path(tmp_path)}: Is a directory"
    alive = iter([True, True, False])
    monkeypatch.setattr(status_module.psutil, "pid_exists", lambda pid: next(alive))
    out = io.StringIO()
    assert status_module.follow(tmp_path, 10, interval_s=0.01, pid=1, out=out) == 0
    assert out.getvalue().count(expected) == 2, out.getvalue()
