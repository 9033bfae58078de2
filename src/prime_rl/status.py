"""What a run is doing, from `RUN/metrics.jsonl` alone (no socket into the processes):

- ``read_metrics`` / ``MetricsFollower``: the rows, read whole or as they are appended, where
  a half-written last line waits for its end and a malformed line is counted, never raised;
- ``summarize`` + ``render``: the status the tmux session's `status` pane redraws
  (`python -m prime_rl.status RUN --follow`) and a headless run prints every
  `status.every_steps` steps: step / max_steps and ETA, the reward (per environment when
  several) as a sparkline with its 10-step mean, mismatch KL, staleness, masked fraction,
  tokens/s, where a step's time goes, and any process that failed;
- ``record_event``: the launcher's own rows (`"process": "launcher"`: the run started,
  finished, or a process failed), so the file tells how the run ended.

Imports neither torch nor vLLM, nor anything that draws: it runs beside the trio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from prime_rl.rundir import append_jsonl, metrics_path

if TYPE_CHECKING:
    from prime_rl.config import RLConfig

MEAN_WINDOW = 10  # steps of the reward's running mean
CHECK_S = 0.25  # how often the pane looks for new rows (it reads only the bytes appended since)
ORCHESTRATOR_PHASES = (("generate", "time/generate"), ("wait weights", "time/wait_weights"), ("reload", "time/reload"))
TRAINER_PHASES = (("train", "time/train"), ("wait batch", "time/wait_batch"), ("save weights", "time/save_weights"))
SPARK = "▁▂▃▄▅▆▇█"


# --------------------------------------------------------------------------- reading


@dataclass
class Metrics:
    rows: list[dict] = field(default_factory=list)
    bad_lines: int = 0  # lines that are not a JSON object (skipped)
    partial: bool = False  # the last line has no end yet (a row being written, or a crash mid-write)


def read_metrics(path: Path) -> Metrics:
    """Every complete row of a metrics file; a missing file is an empty one."""
    follower = MetricsFollower(path)
    follower.poll()
    return follower.metrics


class MetricsFollower:
    """Reads the rows appended since the last ``poll``; starts over when the file was rewritten
    (a resumed run drops the rows of the steps it repeats)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.metrics = Metrics()
        self._offset = 0
        self._pending = b""
        self._inode: int | None = None

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self._inode or stat.st_size < self._offset:
                    self.metrics, self._offset, self._pending, self._inode = Metrics(), 0, b"", stat.st_ino
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._pending = (self._pending + data).split(b"\n")
        new = []
        for line in lines:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict):
                new.append(row)
            else:
                self.metrics.bad_lines += 1
        self.metrics.rows.extend(new)
        self.metrics.partial = bool(self._pending.strip())
        return new


def record_event(run_dir: Path, event: str, started_unix: float, **fields) -> None:
    """One launcher row (`started`, `finished`, `failed`, `stalled`, `interrupted`); never
    raises: the run's outcome does not depend on it."""
    now = time.time()
    row = {"process": "launcher", "event": event, "time": round(now - started_unix, 3), "wall": round(now, 3), **fields}
    try:
        append_jsonl(metrics_path(run_dir), row)
    except OSError:
        pass


# --------------------------------------------------------------------------- the summary


@dataclass
class Status:
    step: int | None = None  # the newest step the orchestrator logged
    trained: int | None = None  # the newest step the trainer logged
    max_steps: int | None = None
    eta_s: float | None = None
    rewards: dict[str, list[float]] = field(default_factory=dict)  # "all", or per environment
    eval_reward: float | None = None
    mismatch_kl: float | None = None
    staleness: tuple[float, float] | None = None  # (mean, max) of the newest step
    masked_frac: float | None = None
    sampled_tokens_s: float | None = None
    trained_tokens_s: float | None = None
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # process -> phase -> seconds per step (recent mean)
    failed: list[str] = field(default_factory=list)  # "trainer: exited with code 1"
    ended: str | None = None  # "finished", "failed", ... once the launcher said so
    notes: list[str] = field(default_factory=list)


def last_run(rows: list[dict]) -> list[dict]:
    """The rows since the launcher's last `started` (a resumed run keeps its earlier rows but
    not its earlier endings); all rows when the launcher wrote none."""
    starts = [i for i, r in enumerate(rows) if r.get("process") == "launcher" and r.get("event") == "started"]
    if not starts:
        return rows
    begin = starts[-1]
    return [r for i, r in enumerate(rows) if i >= begin or r.get("process") != "launcher"]


def summarize(metrics: Metrics, max_steps: int | None = None, window: int = MEAN_WINDOW) -> Status:
    rows = last_run(metrics.rows)
    status = Status(max_steps=max_steps)
    orch, trainer = step_rows(rows, "orchestrator", "reward/mean"), step_rows(rows, "trainer", "loss/policy")
    if orch:
        status.step = orch[-1]["step"]
        status.rewards["all"] = [r["reward/mean"] for r in orch]
        envs = environments(orch)
        if len(envs) > 1:
            for env in envs:
                status.rewards[env] = [r[f"reward/{env}/mean"] for r in orch if f"reward/{env}/mean" in r]
        newest = orch[-1]
        if "staleness/mean" in newest:
            status.staleness = (newest["staleness/mean"], newest.get("staleness/max", newest["staleness/mean"]))
        status.sampled_tokens_s = newest.get("perf/tokens_per_s")
        recent = orch[-window:]
        status.phases["orchestrator"] = phase_means(recent, ORCHESTRATOR_PHASES)
    if trainer:
        newest = trainer[-1]
        status.trained = newest["step"]
        status.mismatch_kl = newest.get("loss/mismatch_kl")
        status.masked_frac = newest.get("loss/masked_frac")
        status.trained_tokens_s = newest.get("perf/tokens_per_s")
        recent = trainer[-window:]
        status.phases["trainer"] = phase_means(recent, TRAINER_PHASES)
    evals = [r for r in rows if r.get("process") == "orchestrator" and "eval/reward/mean" in r]
    if evals:
        status.eval_reward = evals[-1]["eval/reward/mean"]
    status.eta_s = eta(orch, trainer, max_steps)
    for row in rows:
        if row.get("process") != "launcher":
            continue
        if row.get("event") == "failed":
            status.failed.append(f"{row.get('failed', '?')}: {row.get('reason', 'failed')}")
        if row.get("event") in ("finished", "failed", "stalled", "interrupted"):
            status.ended = row["event"]
    if metrics.bad_lines:
        status.notes.append(f"{metrics.bad_lines} malformed line(s) skipped")
    return status


def phase_means(rows: list[dict], phases: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """Seconds per step of each phase some row logged, averaged over ``rows``."""
    means = {}
    for name, key in phases:
        if values := [r[key] for r in rows if key in r]:
            means[name] = sum(values) / len(values)
    return means


def step_rows(rows: list[dict], process: str, key: str) -> list[dict]:
    """``process``'s rows that carry ``key``, one per step, in step order."""
    return by_step(r for r in rows if r.get("process") == process and key in r)


def environments(rows: list[dict]) -> list[str]:
    """The environments whose mean reward (`reward/<env>/mean`) the rows carry."""
    return sorted({k.split("/")[1] for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2})


def by_step(rows) -> list[dict]:
    """Rows with an integer step, in step order (the newest row of a step wins)."""
    latest = {r["step"]: r for r in rows if isinstance(r.get("step"), int)}
    return [latest[step] for step in sorted(latest)]


def eta(orch: list[dict], trainer: list[dict], max_steps: int | None) -> float | None:
    """Seconds left: the steps still to train at the pace of the last ones (wall clock)."""
    rows = trainer or orch
    if max_steps is None or len(rows) < 2:
        return None
    recent = rows[-(MEAN_WINDOW + 1):]
    span = recent[-1]["wall"] - recent[0]["wall"] if all("wall" in r for r in (recent[0], recent[-1])) else 0
    per_step = span / (recent[-1]["step"] - recent[0]["step"]) if recent[-1]["step"] > recent[0]["step"] else 0
    left = max_steps - 1 - rows[-1]["step"]
    return left * per_step if per_step > 0 and left > 0 else None


# --------------------------------------------------------------------------- drawing in text


def sparkline(values: list[float], width: int = 40) -> str:
    """The newest ``width`` values as block characters, scaled to their own min..max."""
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARK[len(SPARK) // 2] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / (hi - lo) * len(SPARK)))] for v in values)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


def joined(*parts: tuple[object, str]) -> str:
    """The parts whose value is known, each formatted, on one line ("" when none is)."""
    return " · ".join(text.format(value) for value, text in parts if value is not None)


def render(status: Status, width: int = 30) -> list[str]:
    """The status as text lines (the pane, or a headless run's periodic summary)."""
    if status.step is None and status.trained is None:
        lines = ["waiting for the first step (no orchestrator row in metrics.jsonl yet)"]
    else:
        total = f" / {status.max_steps}" if status.max_steps is not None else ""
        done = (status.trained if status.trained is not None else status.step) + 1
        progress = f"step {done}{total}"
        if status.trained is not None and status.step is not None and status.step != status.trained:
            progress += f" (sampled {status.step + 1}, async)"
        if status.eta_s is not None and status.ended is None:
            progress += f" · ETA {duration(status.eta_s)}"
        lines = [progress]
        for name, values in status.rewards.items():
            window = values[-MEAN_WINDOW:]
            label = "reward" if name == "all" else f"  {name}"
            lines.append(f"{label:<12} {sparkline(values, width)}  {values[-1]:.3f} (mean of last {len(window)}: "
                         f"{sum(window) / len(window):.3f})")
        if status.eval_reward is not None:
            lines.append(f"{'eval reward':<12} {status.eval_reward:.3f}")
        lines.append(joined((status.mismatch_kl, "mismatch KL {:.2e}"), (status.staleness, "staleness {0[0]:.2f} (max {0[1]:g})"),
                            (status.masked_frac, "masked {:.1%}")))
        lines.append(joined((status.sampled_tokens_s, "sampled {:,.0f} tok/s"), (status.trained_tokens_s, "trained {:,.0f} tok/s")))
        for process, phases in status.phases.items():
            if phases:
                lines.append(f"{process + ' s/step':<19} " + " · ".join(f"{name} {value:.2f}" for name, value in phases.items()))
    lines = [line for line in lines if line]
    for failure in status.failed:
        lines.append(f"FAILED {failure}")
    if status.ended is not None and not status.failed:
        lines.append(f"run {status.ended}")
    lines += [f"note: {note}" for note in status.notes]
    return lines


# --------------------------------------------------------------------------- the launcher's views


@dataclass(frozen=True)
class StatusOptions:
    """How the launcher shows an RL run: the pane's redraw interval, the headless summary's
    period in steps (0 = never), the steps the run trains for (for the ETA)."""

    max_steps: int | None
    every_steps: int
    interval_s: float

    @classmethod
    def of(cls, config: RLConfig, quiet: bool = False) -> StatusOptions:
        """An RL run's (`[status]`; `--quiet` turns the headless summary off)."""
        every = 0 if quiet else config.status.every_steps
        return cls(max_steps=config.orchestrator.max_steps, every_steps=every, interval_s=config.status.interval_s)

    def pane_command(self, run_dir: Path, launcher_pid: int) -> str:
        """The tmux `status` pane: redraws until the launcher is gone."""
        steps = f" --max-steps {self.max_steps}" if self.max_steps is not None else ""
        return (f"{sys.executable} -m prime_rl.status {str(run_dir)!r} --follow --pid {launcher_pid} "
                f"--interval {self.interval_s:g}{steps}")


class StatusPrinter:
    """A headless run's summary on the launcher's stdout, each time the trainer has logged
    another ``every_steps`` steps, and once at the end."""

    def __init__(self, run_dir: Path, options: StatusOptions, out=None):
        self.follower = MetricsFollower(metrics_path(run_dir))
        self.options, self.out = options, out
        self.follower.poll()  # a resumed run's earlier steps are not news
        self.next_at = (self.done() // options.every_steps + 1) * options.every_steps if options.every_steps else None

    def done(self) -> int:
        trained = summarize(self.follower.metrics).trained
        return 0 if trained is None else trained + 1

    def poll(self) -> None:
        if self.next_at is None or not self.follower.poll():
            return
        if (done := self.done()) >= self.next_at:
            self.print()
            self.next_at = (done // self.options.every_steps + 1) * self.options.every_steps

    def print(self) -> None:
        if self.next_at is None:
            return
        self.follower.poll()
        lines = render(summarize(self.follower.metrics, self.options.max_steps))
        out = self.out or sys.stdout
        out.write("".join(f"[prime-rl] {'status: ' if i == 0 else '  '}{line}\n" for i, line in enumerate(lines)))
        out.flush()


# --------------------------------------------------------------------------- the pane


def follow(run_dir: Path, max_steps: int | None, interval_s: float, pid: int | None, out=sys.stdout) -> int:
    """Redraw the status when new rows arrive (looked for every ``CHECK_S``) and at least every
    ``interval_s`` (the clock and the ETA), until process ``pid`` (the launcher) is gone."""
    follower = MetricsFollower(metrics_path(run_dir))
    drawn_at = -math.inf
    while pid is None or psutil.pid_exists(pid):
        if follower.poll() or time.monotonic() - drawn_at >= interval_s:
            lines = render(summarize(follower.metrics, max_steps))
            out.write("\x1b[H\x1b[2J" + f"prime-rl status · {run_dir} · {time.strftime('%H:%M:%S')}\n" + "\n".join(lines) + "\n")
            out.flush()
            drawn_at = time.monotonic()
        time.sleep(min(CHECK_S, interval_s))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_rl.status", description="A run's status from RUN/metrics.jsonl.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--follow", action="store_true", help="redraw until --pid exits (the tmux pane)")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between redraws")
    parser.add_argument("--pid", type=int, default=None, help="stop following when this process (the launcher) exits")
    args = parser.parse_args(argv)
    if args.follow:
        try:
            return follow(args.run_dir, args.max_steps, args.interval, args.pid)
        except KeyboardInterrupt:
            return 0
    path = metrics_path(args.run_dir)
    if not path.is_file():
        print(f"{path}: no metrics yet (is it a run's output_dir?)", file=sys.stderr)
        return 2
    print("\n".join(render(summarize(read_metrics(path), args.max_steps))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
